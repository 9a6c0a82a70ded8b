"""Packed weight formats: what a quantized projection keeps in memory, and how a tile of it
turns back into floats.

Every format is group-wise affine along the input (contraction) axis of a [in, out]
weight, which is the model's layout:

    w[k, n] = (code[k, n] - zero) * scale[k // group, n] + offset[k // group, n]

- GGUF's legacy blocks keep their bits (Q8_0, Q4_0, Q4_1, Q5_0: 32 weights per block with
  a float16 scale, plus a float16 minimum for Q4_1), and so do its K-quants (Q4_K, Q5_K,
  Q6_K: 256-weight super-blocks with float16 scales over 6- or 8-bit sub-scales, which
  `PackedWeight.float_scales` multiplies out per group at each matmul). A block of a GGUF
  row is a group of one output column here: the file's [out, blocks] byte rows are split
  into planes (codes, scales, minimums) and transposed to [in, out], so Q8_0 / Q4_0 / Q4_1
  keep exactly the file's bytes. Q5_0's 5-bit codes take a byte (q - 16 as int8, Q8_0's
  representation: 8.5 bits per weight for the file's 5.5); K-quants widen sub-scales, and
  Q5_K / Q6_K codes, to bytes.
- kvfold's weight-only formats quantize any float checkpoint: int8 with one float32 scale
  per output channel, int4 with a float16 scale and minimum per group of 128 (or the
  largest of 64 / 32 that divides the input width), fp8 E4M3 with a float32 scale per
  output channel. w8a8 stores what int8 stores, and its matmul also rounds each token's
  activations to int8 (absmax / 127; SmoothQuant's W8A8 without the smoothing), which lets
  a CPU run an int8 x int8 matmul: faster there, less accurate (see `quantize_activations`).

Any packed weight can also round its activations: with `int8_activations` (set by
weights_dtype "gguf_a8" on a GGUF file's blocks) every matmul first rounds x to int8 per
activation block (`round_activation_blocks`), as llama.cpp rounds activations to its Q8
blocks before multiplying GGUF blocks; the CPU kernel then runs integer dot products.

Two 4-bit codes share a byte the way GGUF packs them: within each group, byte j holds row
j in its low nibble and row j + group / 2 in its high nibble. `dequantize` works on any
row slice that covers whole groups (the kernels decode their tiles the same way with int32
ops, pallas_kernels/quant_matmul/tiles.py).

On a CPU the stored code rows are interleaved four at a time (`interleave`, which
pallas_kernels.quant_matmul.prepare applies at load): rows 4i .. 4i + 3 of a column become
the four bytes of one 32-bit word, the lane of an integer dot-product instruction, so the
CPU kernel multiplies the codes as they lie in memory. The bytes and the resident size are
the same; `PackedWeight.interleaved` says which order the codes are in.

Bit-exactness with the gguf package's dequantizer: the scale is float16 and the codes
have at most 8 bits, so (code - zero) * scale is exact in float32 and a fused
multiply-add rounds the same as the separate ops.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Format:
    """One packed format.

    bits: 4 or 8 bits per code. group: weights per scale along the input axis (None: one
    scale per output channel; int4 picks its group per weight). zero: subtracted from a
    code before scaling. offset: whether a per-group additive term (GGUF's minimum) is
    stored. codes_dtype / scale_dtype: storage dtypes. gguf: the GGUF tensor type it
    mirrors, or None. super_block: for GGUF's K-quants, the weights sharing one float16
    scale (and minimum); `scale` / `offset` then hold each group's integer sub-scale (and
    sub-minimum), and `PackedWeight.super` the float16 pair.
    """

    name: str
    bits: int
    group: int | None
    zero: int
    offset: bool
    codes_dtype: str
    scale_dtype: str
    gguf: str | None = None
    super_block: int | None = None


FORMATS = {f.name: f for f in (
    Format("q8_0", 8, 32, 0, False, "int8", "float16", "Q8_0"),
    Format("q4_0", 4, 32, 8, False, "uint8", "float16", "Q4_0"),
    Format("q4_1", 4, 32, 0, True, "uint8", "float16", "Q4_1"),
    Format("q5_0", 8, 32, 0, False, "int8", "float16", "Q5_0"),  # codes q - 16: q8_0's layout
    Format("int8", 8, None, 0, False, "int8", "float32"),
    Format("int4", 4, 128, 0, True, "uint8", "float16"),
    Format("fp8", 8, None, 0, False, "float8_e4m3fn", "float32"),
    Format("w8a8", 8, None, 0, False, "int8", "float32"),
    # GGUF's K-quants (from GGUF files only: the gguf package has no quantizer for them).
    # Q4_K keeps its 4-bit codes (its 6-bit sub-scales widened to a byte each: 4.625 bits
    # per weight for the file's 4.5); Q5_K's 5-bit and Q6_K's 6-bit codes take a byte.
    Format("q4_k", 4, 32, 0, True, "uint8", "uint8", "Q4_K", 256),
    Format("q5_k", 8, 32, 0, True, "int8", "uint8", "Q5_K", 256),
    Format("q6_k", 8, 16, 0, False, "int8", "int8", "Q6_K", 256),
)}
ACTIVATION_INT8 = frozenset({"w8a8"})  # formats whose matmul also rounds x per token to int8
GGUF_FORMATS = {f.gguf: f for f in FORMATS.values() if f.gguf}
_GGUF_BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A projection weight [in, out] kept packed.

    codes: [in, out] int8 / float8 for 8-bit formats, uint8 [in // 2, out] for 4-bit ones.
    scale: [in // group, out] (float16 or float32). offset: same shape, or None.
    fmt: a FORMATS key; group: weights per scale along `in`; shape: (in, out). These
    three are static (part of the pytree structure, so they key the jit cache). super:
    the K-quants' float16 super-block scales (Format.super_block), else None.
    int8_activations (static; weights_dtype "gguf_a8" sets it on GGUF blocks): every
    matmul first rounds x to int8 per activation block (`round_activation_blocks`).
    interleaved (static): the codes' rows are in `interleave`'s order; `row_codes()` gives
    them back row by row.
    """

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    super: jax.Array | None = None  # K-quants: float16 [2 (d, dmin) or 1 (d), in // 256, out]
    # GGUF block formats (weights_dtype "gguf_a8"): the matmul rounds x to int8 per
    # activation block first (`round_activation_blocks`), as llama.cpp computes GGUF blocks
    int8_activations: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # codes in `interleave`'s order (the CPU kernel's), not row by row
    interleaved: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def format(self) -> Format:
        return FORMATS[self.fmt]

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed arrays."""
        arrays = (self.codes, self.scale, self.offset, self.super)
        return sum(int(a.nbytes) for a in arrays if a is not None)

    def float_scales(self) -> tuple[jax.Array, jax.Array | None]:
        """(scale, offset) per group as `dequantize` takes them: the stored ones, or for a
        K-quant float32 d * sub-scale and -(dmin * sub-minimum) (exact products of a float16
        and a 6- or 8-bit integer, so the values match the gguf package's bit for bit)."""
        if self.super is None:
            return self.scale, self.offset
        per = FORMATS[self.fmt].super_block // self.group
        d = jnp.repeat(self.super[0].astype(jnp.float32), per, axis=0)
        scale = d * self.scale.astype(jnp.float32)
        if self.offset is None:
            return scale, None
        dmin = jnp.repeat(self.super[1].astype(jnp.float32), per, axis=0)
        return scale, -(dmin * self.offset.astype(jnp.float32))

    def row_codes(self) -> jax.Array:
        """The stored codes row by row ([in * bits / 8, out]), whatever their order."""
        return deinterleave_rows(self.codes) if self.interleaved else self.codes

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The [in, out] float weight the codes represent."""
        scale, offset = self.float_scales()
        return dequantize(self.row_codes(), scale, offset, self.fmt, self.group).astype(dtype)

    def columns(self, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
        """Float columns ids of the weight, as [len(ids), in] rows (an embedding lookup
        when the weight is a tied [hidden, vocab] embedding)."""
        scale, offset = self.float_scales()
        offset = None if offset is None else offset[:, ids]
        if self.interleaved:  # a column's words are [rows / 4, 4] bytes
            stored = self.codes.shape[0]
            codes = self.codes.reshape(stored // 4, -1, 4)[:, ids].transpose(0, 2, 1).reshape(stored, len(ids))
        else:
            codes = self.codes[:, ids]
        w = dequantize(codes, scale[:, ids], offset, self.fmt, self.group)
        return w.T.astype(dtype)


def interleave_rows(codes):
    """Stored codes [rows, n] (numpy or jax, rows a multiple of 4) with every four rows
    interleaved: rows 4i .. 4i + 3 of column c become bytes 4c .. 4c + 3 of row block i, so
    a row block is n 32-bit words, one per column (same shape, same bytes)."""
    rows, n = codes.shape
    return codes.reshape(rows // 4, 4, n).transpose(0, 2, 1).reshape(rows, n)


def deinterleave_rows(codes):
    """interleave_rows undone: the codes row by row."""
    rows, n = codes.shape
    return codes.reshape(rows // 4, n, 4).transpose(0, 2, 1).reshape(rows, n)


def block_rows(fmt: str, group: int) -> int:
    """Stored code rows per block of the CPU kernel and of an activation block: 16 rows of
    one group, or a smaller group's rows (a 4-bit row holds two inputs)."""
    group_rows = group // 2 if FORMATS[fmt].bits == 4 else group
    return group_rows if group_rows % 16 else 16


def can_interleave(w: PackedWeight) -> bool:
    """Whether `interleave` applies: a 4- or 8-bit integer format (not fp8) whose blocks
    (`block_rows`) are whole words of four rows."""
    return (not w.interleaved and FORMATS[w.fmt].codes_dtype in ("int8", "uint8")
            and block_rows(w.fmt, w.group) % 4 == 0)


def interleave(w: PackedWeight) -> PackedWeight:
    """w with its codes in the CPU kernel's order (`interleave_rows`; ValueError unless
    `can_interleave`): the same values and bytes, every path reads them."""
    if not can_interleave(w):
        raise ValueError(f"a {w.fmt} weight with groups of {w.group} cannot be interleaved "
                         f"({'it already is' if w.interleaved else 'its blocks are not whole 4-row words'})")
    return dataclasses.replace(w, codes=interleave_rows(w.codes), interleaved=True)


def unpack_codes(codes: jax.Array, bits: int, group: int) -> jax.Array:
    """Integer (or fp8) codes [rows, n] from stored codes covering whole groups."""
    if bits == 8:
        return codes
    half, n = codes.shape
    lo = (codes & 0x0F).reshape(half * 2 // group, group // 2, n)
    hi = (codes >> 4).reshape(half * 2 // group, group // 2, n)
    return jnp.concatenate([lo, hi], axis=1).reshape(half * 2, n)


def dequantize(codes, scale, offset, fmt: str, group: int) -> jax.Array:
    """Float32 [rows, n] weights from stored codes, scales and offsets covering whole groups
    (codes rows = rows * bits / 8, scale rows = rows / group)."""
    f = FORMATS[fmt]
    q = unpack_codes(codes, f.bits, group).astype(jnp.float32)
    rows, n = q.shape
    q = q.reshape(rows // group, group, n)
    if f.zero:
        q = q - f.zero
    w = q * scale.astype(jnp.float32)[:, None, :]
    if offset is not None:
        w = w + offset.astype(jnp.float32)[:, None, :]
    return w.reshape(rows, n)


def pick_group(fmt: str, d_in: int) -> int:
    """Weights per scale for a weight with d_in inputs (ValueError when none fits)."""
    f = FORMATS[fmt]
    if f.group is None:
        return d_in
    candidates = (f.group, 64, 32) if fmt == "int4" else (f.group,)
    for g in candidates:
        if d_in % g == 0:
            return g
    raise ValueError(f"{fmt} needs the input width to be a multiple of {candidates[-1]}, got {d_in}")


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token int8 codes [T, in] and float32 scales [T, 1] of x [T, in] (absmax / 127),
    as a w8a8 matmul rounds its activations."""
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


# -- float -> packed -------------------------------------------------------------------

def _pack_nibbles(q: np.ndarray, group: int) -> np.ndarray:
    """uint8 [in // 2, out] from codes [in, out] in [0, 16), GGUF's order within a group."""
    d_in, n = q.shape
    q = q.reshape(d_in // group, 2, group // 2, n).astype(np.uint8)
    return (q[:, 0] | (q[:, 1] << 4)).reshape(d_in // 2, n)


def quantize(w, fmt: str) -> PackedWeight:
    """Pack a float [in, out] weight into `fmt` (a FORMATS key).

    GGUF formats use the gguf package's own quantizer (so a tensor packed here is
    byte-for-byte what llama.cpp's converter writes); int8 / fp8 scale by the channel's
    absmax, int4 spreads 16 levels from the group's minimum to its maximum.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}")
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize: expected a 2-D [in, out] weight, got shape {w.shape}")
    f = FORMATS[fmt]
    d_in, d_out = w.shape
    if f.super_block:
        quantizable = ", ".join(n for n, g in FORMATS.items() if not g.super_block)
        raise ValueError(f"{fmt} comes only from GGUF files (the gguf package has no quantizer for it); "
                         f"packed formats for float weights: {quantizable}")
    if f.gguf:
        import gguf

        if d_in % _GGUF_BLOCK:
            raise ValueError(f"{fmt} needs the input width to be a multiple of 32, got {d_in}")
        qtype = gguf.GGMLQuantizationType[f.gguf]
        raw = gguf.quants.quantize(np.ascontiguousarray(w.T), qtype)  # [out, bytes]
        return from_gguf(raw, f.gguf, (d_in, d_out))
    group = pick_group(fmt, d_in)
    wg = w.reshape(d_in // group, group, d_out)
    absmax = np.abs(wg).max(axis=1)  # [groups, out]
    if fmt in ("int8", "w8a8"):
        scale = absmax / 127.0
        codes = np.round(wg / np.where(scale > 0, scale, 1.0)[:, None]).clip(-127, 127).astype(np.int8)
        codes = codes.reshape(d_in, d_out)
    elif fmt == "fp8":
        scale = absmax / 448.0
        codes = jnp.asarray(wg / np.where(scale > 0, scale, 1.0)[:, None], jnp.float8_e4m3fn)
        codes = codes.reshape(d_in, d_out)
    else:  # int4: 16 levels from the group's minimum to its maximum (a zero point, as AWQ / GPTQ)
        low = wg.min(axis=1)
        offset = low.astype(np.float16)
        scale = ((wg.max(axis=1) - offset.astype(np.float32)) / 15.0).astype(np.float16)
        s = scale.astype(np.float32)
        q = np.round((wg - offset.astype(np.float32)[:, None]) / np.where(s > 0, s, 1.0)[:, None]).clip(0, 15)
        codes = _pack_nibbles(q.reshape(d_in, d_out), group)
        return PackedWeight(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(offset), fmt, group,
                            (d_in, d_out))
    return PackedWeight(jnp.asarray(codes), jnp.asarray(scale.astype(f.scale_dtype)), None,
                        fmt, group, (d_in, d_out))


def activation_block_size(fmt: str, group: int) -> int:
    """Inputs per activation block (`activation_blocks`): `block_rows` stored code rows; a
    stored row of a 4-bit format holds two inputs."""
    rows = block_rows(fmt, group)
    return 2 * rows if FORMATS[fmt].bits == 4 else rows


def activation_blocks(fmt: str, group: int, d_in: int) -> np.ndarray:
    """The input rows that share one activation scale when a matmul rounds x per block, int
    [blocks, rows]: 16 stored code rows of one group (or a smaller group's rows), which for
    a 4-bit format hold 32 input rows, j and j + group / 2 (GGUF's nibble order). The CPU
    kernel (pallas_kernels/quant_matmul/cpu_kernel.cc) multiplies one such block of codes
    by one block of int8 activations."""
    size = activation_block_size(fmt, group)
    if FORMATS[fmt].bits != 4:
        return np.arange(d_in).reshape(-1, size)
    half = group // 2
    stored = np.arange(d_in // 2)
    low = (stored // half * group + stored % half).reshape(-1, size // 2)
    return np.concatenate([low, low + half], axis=1)


def round_activation_blocks(x: jax.Array, fmt: str, group: int) -> jax.Array:
    """x [T, in] rounded as an int8-activation matmul of `fmt` rounds it, float32: per token
    and activation block (`activation_blocks`), round(x / d) * d with d = max |x| / 127
    over the block (float32, ties to even; an all-zero block stays zero). llama.cpp rounds
    activations the same way, per 32 inputs, before its dot products with GGUF blocks."""
    x = x.astype(jnp.float32)
    t, d_in = x.shape
    rows = activation_block_size(fmt, group)
    if FORMATS[fmt].bits == 4:  # [T, groups, low / high half, blocks in a half, rows / 2 inputs]
        xb, axes = x.reshape(t, d_in // group, 2, group // rows, rows // 2), (2, 4)
    else:
        xb, axes = x.reshape(t, d_in // rows, rows), (2,)
    d = jnp.max(jnp.abs(xb), axis=axes, keepdims=True) / 127.0
    q = jnp.where(d > 0, jnp.round(xb / jnp.where(d > 0, d, 1.0)), 0.0)
    return (q * d).reshape(t, d_in)


def concat_columns(parts: list[PackedWeight]) -> PackedWeight:
    """One PackedWeight [in, sum of outs] from parts of one format and input width (a
    weight packed a slice of output channels at a time)."""
    first = parts[0]
    key = lambda p: (p.fmt, p.group, p.shape[0], p.int8_activations, p.interleaved)  # noqa: E731
    if any(key(p) != key(first) for p in parts):
        raise ValueError("concat_columns: parts differ in format, group, input width, activations or code order")
    if len(parts) == 1:
        return first
    cat = lambda arrays, axis=1: jnp.concatenate(arrays, axis=axis)  # noqa: E731
    codes = (interleave_rows(cat([p.row_codes() for p in parts])) if first.interleaved
             else cat([p.codes for p in parts]))
    return PackedWeight(codes, cat([p.scale for p in parts]),
                        None if first.offset is None else cat([p.offset for p in parts]),
                        first.fmt, first.group, (first.shape[0], sum(p.shape[1] for p in parts)),
                        None if first.super is None else cat([p.super for p in parts], 2), first.int8_activations,
                        first.interleaved)


# -- GGUF blocks -> packed -------------------------------------------------------------

def from_gguf(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> PackedWeight:
    """A PackedWeight [in, out] from a GGUF tensor's bytes.

    raw: uint8 [out, in // 32 * block_bytes], the tensor's rows as gguf's reader maps them
    (one row per output channel, blocks along the input axis). qtype: a GGUF_FORMATS key.
    The values are not changed: the blocks are split into their fields and laid out
    [in, out] (Q5_0's two code fields joined into one int8 code a weight).
    """
    if qtype not in GGUF_FORMATS:
        raise ValueError(f"GGUF tensor type {qtype} cannot stay packed; packed types: "
                         f"{', '.join(GGUF_FORMATS)}")
    f = GGUF_FORMATS[qtype]
    if f.super_block:
        return _from_gguf_k(np.asarray(raw, np.uint8), f, shape)
    d_in, d_out = shape
    raw = np.asarray(raw, np.uint8)
    blocks = d_in // _GGUF_BLOCK
    q5 = qtype == "Q5_0"  # float16 d, uint32 of 5th bits, then 16 bytes of low nibbles
    head = 6 if q5 else 4 if f.offset else 2
    block_bytes = head + (_GGUF_BLOCK // 2 if q5 else _GGUF_BLOCK * f.bits // 8)
    if raw.shape != (d_out, blocks * block_bytes):
        raise ValueError(f"GGUF {qtype} tensor of shape [in={d_in}, out={d_out}] needs "
                         f"{d_out} rows of {blocks * block_bytes} bytes, got {raw.shape}")
    b = raw.reshape(d_out, blocks, block_bytes)
    scale = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].T  # [blocks, out]
    offset = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].T if f.offset else None
    qs = b[:, :, head:]  # [out, blocks, 32 or 16]
    if q5:  # weight j: nibble j % 16 (the low ones first), bit j of qh; uint8 q - 16 wraps to int8
        qh = np.ascontiguousarray(b[:, :, 2:6]).view("<u4") >> np.arange(_GGUF_BLOCK, dtype=np.uint32)
        qs = (np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | ((qh & 1) << 4).astype(np.uint8)) - np.uint8(16)
    codes = qs.view(np.int8) if f.bits == 8 else qs
    codes = np.ascontiguousarray(codes.transpose(1, 2, 0)).reshape(-1, d_out)  # [in * bits / 8, out]
    return PackedWeight(jnp.asarray(codes), jnp.asarray(np.ascontiguousarray(scale)),
                        None if offset is None else jnp.asarray(np.ascontiguousarray(offset)),
                        f.name, _GGUF_BLOCK, (d_in, d_out))


K_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit sub-scales and sub-minimums of a Q4_K / Q5_K super-block, from its 12
    packed bytes [..., 12] (llama.cpp's get_scale_min_k4)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _from_gguf_k(raw: np.ndarray, f: Format, shape: tuple[int, int]) -> PackedWeight:
    """A K-quant tensor's super-blocks [out, in // 256 * block bytes] split into codes,
    integer sub-scales (and sub-minimums) and float16 super-scales, laid out [in, out]."""
    d_in, d_out = shape
    sb = d_in // 256
    size = K_BLOCK_BYTES[f.gguf]
    if d_in % 256 or raw.shape != (d_out, sb * size):
        raise ValueError(f"GGUF {f.gguf} tensor of shape [in={d_in}, out={d_out}] needs an input width "
                         f"divisible by 256 and {d_out} rows of {sb * size} bytes, got {raw.shape}")
    b = raw.reshape(d_out, sb, size)
    f16 = lambda a: np.ascontiguousarray(a).view(np.float16)[..., 0]  # noqa: E731
    if f.gguf == "Q6_K":
        ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208].view(np.int8), f16(b[..., 208:210])
        lo = (ql.reshape(d_out, sb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
        hi = (qh.reshape(d_out, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
        q = (lo.reshape(d_out, sb, 8, 32) | (hi.reshape(d_out, sb, 8, 32) << 4)).astype(np.int8) - 32
        sub, offset, sup = sc, None, d[None]
    else:
        d, dmin, (sc, mn) = f16(b[..., 0:2]), f16(b[..., 2:4]), _k_scale_min(b[..., 4:16])
        qs = b[..., -128:]
        q = (qs.reshape(d_out, sb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
        q = q.reshape(d_out, sb, 8, 32)
        if f.gguf == "Q5_K":
            qh = b[..., 16:48].reshape(d_out, sb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            q = (q | ((qh & 1) << 4)).astype(np.int8)
        sub, offset, sup = sc, mn, np.stack([d, dmin])
    q = q.reshape(d_out, d_in).T  # [in, out]
    codes = _pack_nibbles(q, f.group) if f.bits == 4 else np.ascontiguousarray(q)
    t = lambda a: np.ascontiguousarray(np.asarray(a).reshape(d_out, -1).T)  # noqa: E731  [groups, out]
    return PackedWeight(jnp.asarray(codes), jnp.asarray(t(sub).astype(f.scale_dtype)),
                        None if offset is None else jnp.asarray(t(offset).astype(f.scale_dtype)),
                        f.name, f.group, (d_in, d_out),
                        jnp.asarray(np.ascontiguousarray(np.moveaxis(sup, 1, -1))))
