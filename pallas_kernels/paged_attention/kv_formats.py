"""KV page formats: the one owner of how low-bit KV pages are quantized, stored, gathered,
decoded and read tile by tile by the paged decode kernel.

A format is a small frozen (hashable, static) object. Its page container is a pytree
whose leaves all start [num_pages, page_size, num_kv_heads, ...], so a pool is copied,
moved or swapped leaf by leaf (`jax.tree.map(lambda a: a.at[dst].set(a[src]), pool)`).
The kernel DMAs those leaves page by page and decodes codes to f32 tile by tile in VMEM,
so no dequantized cache is ever materialised. The XLA paths use the same object:

| method                                  | what                                             |
|-----------------------------------------|--------------------------------------------------|
| quantize(x [..., D])                    | the container (leading [...])                    |
| dequantize(pages)                       | f32 [..., D], equal bit for bit to quant's own   |
| allocate(num_pages, page_size, H, D)    | an empty (zero) pool                             |
| write(pages, rows, page_ids, slots)     | quantize rows and scatter them into every leaf   |
| gather(pages, page_ids)                 | the container of pages `page_ids`                |
| rows(pages, part)                       | tile(part) in bulk: f32 [..., D / parts] (below) |
| prepare_q / finish_out                  | the query into the tiles' basis, the output back |
| bytes_per_token(H, D)                   | bytes one token takes in one pool (K or V)       |
| check / leaves / extras / tile / parts  | the kernels' view (kernel_tpu.py; the Triton     |
|                                         | kernel tiles with expand=repeat_blocks)          |

| kv_format   | container                 | leaves (page axis first)                         |
|-------------|---------------------------|--------------------------------------------------|
| (plain)     | array                     | [P, ps, H, D]                                    |
| "int8"      | quant.RowQuantized        | codes int8 [P, ps, H, D], scales f32 [P, ps, H]  |
| "fp8"       | quant.RowQuantized        | codes uint8 [P, ps, H, D] (E4M3 bits), scales f32|
| "nvfp4"     | quant.NVFP4               | packed uint8 [.., D/2], scales uint8 [.., D/16]  |
|             |                           |   (E4M3 bits)                                    |
| "mxfp4"     | quant.MXFP4               | packed uint8 [.., D/2], scales ue8m0 [.., D/32]  |
| TurboQuant  | quant.TurboCodes          | idx uint8 [.., D*b/8], norm f32 [P, ps, H]       |
| TQ split    | quant.SplitCodes          | outlier / regular: TurboCodes of D/2 channels    |
|             |   (sparse=n)              |   + sparse_idx uint8, sparse_val [.., n] uint16  |
|             |                           |     (bfloat16 bits)                              |

NVFP4's tensor scale. NVIDIA's recipe scales a whole tensor by amax / (448 * 6), but KV
rows arrive a few at a time and no tensor amax exists, so pages are quantized with the
scale fixed at 1 (block scales saturate at 448: |x| up to 2688 is representable) and
store it as None: quant.NVFP4(packed, scales, None) has no scalar leaf to break a leaf
map over the page axis, and "None" means 1 here. A container from
quant.nvfp4_quantize(x) with a real scalar tensor scale is read as well (the entry takes
either); write() only produces None.

The kernel's basis. A tile is not always a slice of x_hat: scores are
<split_parts(prepare_q(q), parts)[j], tile j of k> summed over parts j, outputs
finish_out(merge_parts(sum_t p_t tile j of v_t)). `rows(pages, part)` is the tile of
every row at once, for the XLA paths: x_hat's channels part::parts for int8 / fp8 /
MXFP4 and NVFP4 without a tensor scale (a scalar one is folded into the query and the
output), TurboQuant codes times norms in the rotated basis (below), which spares the XLA
path a d x d matmul per row, the dominant cost of dequantize. Keeping parts apart also
spares XLA:CPU the lane interleave back to head_dim order, which it runs (with every
broadcast feeding it) element by element; dequantize does interleave, to x_hat.

Decoding on XLA:CPU. float8 converts run as a slow software routine there, and a gather
or scatter of a float8 / bfloat16 array is computed in f32 over the whole operand (the
whole pool, each step). So gather and write move such leaves as their unsigned-integer
bits. Even that bitcast copies a donated leaf whole (XLA:CPU does not elide it), so the
pools this module allocates keep E4M3 leaves (fp8 codes, NVFP4 block scales) as their
uint8 bits from the start, as TurboQuant's sparse values are bfloat16 bits; containers
with float8_e4m3fn leaves, as quant's own quantizers make them, are read and written as
well, their new rows stored as the same bits. The decoders build f32 from the bits with
integer ops: E4M3 through quant.e4m3_decode_arith, E2M1 through quant.e2m1_decode_arith,
UE8M0 by placing the code in f32's exponent field; TurboQuant's straddling 3-bit codes
unpack by byte groups (quant/packing.py). All are tested bit-exact against quant's
decoders.

Channel parts. Sub-byte codes are packed along head_dim (code 2i in the low nibble of
byte i, 2i+1 in the high one; quant/packing.py). Un-interleaving them in the kernel would
need a lane reshape, so the kernel instead works on `parts` = codes-per-byte channel
slices: part j holds channels j, j + parts, j + 2 parts, ..., which are exactly
(byte >> j*bits) & mask of every byte. The query is split the same way once, outside the
kernel (scores are sums over channels, so the order does not matter), and the output
parts are interleaved back at the end.

TurboQuant (mse mode) keeps x = ||x|| * Pi^T c[idx], Pi orthogonal. Keys:
<q, k_hat> = ||k|| <q, Pi^T c[idx]> = ||k|| <Pi q, c[idx]>, so the query is rotated once
(q Pi^T as a row vector) and the kernel scores it against codebook values times the norm;
no key is ever de-rotated. Values: sum_t p_t v_hat_t = Pi^T sum_t p_t ||v_t|| c[idx_t],
so the kernel accumulates c[idx] * ||v|| in the rotated basis and the output is rotated
back once at the end (Pi^T o, i.e. o Pi for a row vector). The codebook is a kernel input
in SMEM and the lookup is a select chain over its 2^b scalars (Pallas kernels cannot
capture a table).

TurboQuantSplit (the KV cache's turboquant-3.5 / -2.5) is two such instances over
channel halves, at b + 1 and b bits. Its query is gathered per half and rotated by each
half's Pi, then concatenated [outlier | regular]; with parts = 8, part j of that is the
outlier coordinates j::8 followed by the regular ones j::8, which are exactly code j of
every 8-code group of each half's pack_bits stream. A group of 8 b-bit codes is b bytes
and code j lies in its bytes (b*j) // 8 and, when it straddles, the next one; those
strided bytes are picked with a 0/1 matmul (like the block scales below), so widths
that straddle bytes (3) read as well as 2 and 4.

Sparse channels (TurboQuantSplit(sparse=n), the KV cache's formats): each half also keeps
its n largest channels exact, x_hat = scale * Pi^T c[idx] + sum_j val_j e_{idx_j}. In
the rotated basis the second term is sum_j val_j Pi[:, idx_j], so a tile adds val_j times
the rows of Pi in its part at column idx_j, and keys and values alike stay in the basis
the rest of the kernel works in. In the kernel that lookup is a select chain over the
half's d/2 columns (the rotation's entries are trace-time constants; a kernel cannot
capture an array); the XLA path gathers the columns. A NaN or inf element of a row becomes
its half's sparse channel, which quant's dequantize keeps to that channel but the rotated
basis spreads over the half (as it spread the whole non-finite half before).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from quant.blockscaled import MXFP4, NVFP4, mxfp4_quantize, nvfp4_quantize
from quant.formats import e2m1_decode_arith, e4m3_decode_arith
from quant.kv_rows import RowQuantized, quantize_rows
from quant.lloyd_max import sphere_codebook
from quant.turboquant import SplitCodes, TurboCodes, TurboQuant, TurboQuantSplit, sparse_values

# get(i) -> leaf i of one KV head of the current page: [page_size, n] for 4-D leaves,
# [page_size, 1] for 3-D (per-token) leaves.
Getter = Callable[[int], jax.Array]

NAMES = ("int8", "fp8", "nvfp4", "mxfp4")
TURBO_BITS = (1, 2, 4)  # widths whose codes never straddle a byte


def split_parts(x, parts):
    """[..., D] -> [parts, ..., D // parts]; part j holds channels j::parts."""
    if parts == 1:
        return x[None]
    y = x.reshape(*x.shape[:-1], x.shape[-1] // parts, parts)
    return jnp.moveaxis(y, -1, 0)


def merge_parts(x):
    """Inverse of split_parts: [parts, ..., Dp] -> [..., parts * Dp]."""
    if x.shape[0] == 1:
        return x[0]
    y = jnp.moveaxis(x, 0, -1)
    return y.reshape(*y.shape[:-2], -1)


def _expand_blocks(scales, width, cols_per_block):
    """f32 [page_size, nb] -> [page_size, width]: column i gets scales[:, i // cols_per_block].

    A 0/1 matmul built from iota: a lane repeat without a reshape, exact at HIGHEST.
    """
    nb = scales.shape[1]
    block = lax.broadcasted_iota(jnp.int32, (nb, width), 0)
    col = lax.broadcasted_iota(jnp.int32, (nb, width), 1)
    onehot = (col // cols_per_block == block).astype(jnp.float32)
    return jnp.dot(scales, onehot, precision=lax.Precision.HIGHEST)


def repeat_blocks(scales, width, cols_per_block):
    """_expand_blocks as a broadcast and a reshape, for Triton, whose dots need K >= 16
    (nb is a handful of blocks) but whose reshapes are free."""
    page_size, nb = scales.shape
    wide = jnp.broadcast_to(scales[:, :, None], (page_size, nb, cols_per_block))
    return wide.reshape(page_size, width)


def _decode_codes(codes):
    """A tile of int8 or float8_e4m3fn codes as f32, converted; of E4M3 codes' uint8 bits
    decoded with integer ops (quant.e4m3_decode_arith), which every backend lowers."""
    return e4m3_decode_arith(codes) if codes.dtype == jnp.uint8 else codes.astype(jnp.float32)


def _ue8m0_to_f32(codes):
    """uint8 UE8M0 codes -> 2**(c - 127) as f32 via the bit pattern (quant.ue8m0_decode's
    values, inline: that one is jitted around a table-free but non-kernel pow2)."""
    c = codes.astype(jnp.int32)
    normal = lax.bitcast_convert_type(c << 23, jnp.float32)
    return jnp.where(c == 0, 2.0**-127, jnp.where(c == 255, jnp.nan, normal))


def _bits_dtype(dtype):
    """The unsigned type a leaf of `dtype` is moved as, or None.

    XLA:CPU computes a gather or scatter of float8 / bfloat16 in f32 over the whole
    operand, converting the pool there and back each time. Moved as their bits they cost
    one copy of the leaf for each bitcast instead (XLA:CPU does not elide them): a
    16-row write into a 12 MB float8_e4m3fn leaf took 2 ms this way against 6 ms (bf16:
    19 ms). Hence the pools' E4M3 leaves are uint8 bits already (the module docstring)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.dtype(f"uint{8 * dtype.itemsize}")
    return None


def to_bits(a):
    """a as its unsigned-integer bits when it is a float narrower than 32 bits (see
    _bits_dtype), else a itself: indexing and scatters move such bits unchanged, where
    XLA:CPU's float path would also canonicalize NaN payloads."""
    bits = _bits_dtype(a.dtype)
    return a if bits is None else lax.bitcast_convert_type(a, bits)


def from_bits(a, dtype):
    """Inverse of to_bits: bits back as `dtype` (a no-op when a already is)."""
    return a if a.dtype == jnp.dtype(dtype) else lax.bitcast_convert_type(a, dtype)


def stored_as(x, dtype):
    """New rows x as a leaf of `dtype` keeps them: reinterpreted when one dtype is the
    other's bits (to_bits: E4M3 codes as uint8 into a float8_e4m3fn leaf, or back), else
    cast (float32 rows into bfloat16 pages)."""
    dtype = jnp.dtype(dtype)
    if _bits_dtype(dtype) == x.dtype or _bits_dtype(x.dtype) == dtype:
        return lax.bitcast_convert_type(x, dtype)
    return x.astype(dtype)


def gather(pages, page_ids):
    """The pages `page_ids` (int, any shape) of a container: every page-axis leaf indexed
    on its first axis (leading shape [*page_ids.shape, page_size, H]); ids must be in
    range. A scalar leaf (a real NVFP4 tensor scale) is kept as is."""

    def one(a):
        if a.ndim < 3:
            return a
        return from_bits(to_bits(a)[page_ids], a.dtype)

    return jax.tree.map(one, pages)


def _scatter_rows(pool, index, rows):
    """pool [P, page_size, ...] with rows [U, ...] at flat slots index [U] (slots past the
    pool dropped), in place when donated; a float8 or bfloat16 pool is moved as its bits, a
    copy of the whole leaf (see _bits_dtype).

    A scatter of a single row is expanded by XLA:CPU into a dynamic-update-slice whose
    fusion into the pool's readers makes copy insertion copy the whole pool; a second,
    always dropped row keeps it a real scatter (model/kv_cache.py scatter_rows says more).
    """
    n, page_size, *rest = pool.shape
    flat = to_bits(pool).reshape(n * page_size, *rest)
    rows = to_bits(stored_as(rows, pool.dtype))
    if index.shape[0] == 1:
        index = jnp.concatenate([index, jnp.full((1,), n * page_size, index.dtype)])
        rows = jnp.concatenate([rows, rows])
    flat = flat.at[index].set(rows, mode="drop")
    return from_bits(flat.reshape(pool.shape), pool.dtype)


class _Format:
    """What every format derives from quantize and leaves: allocation, writes, gathers, bytes."""

    def allocate(self, num_pages, page_size, num_kv_heads, head_dim, dtype=jnp.float32):
        """An all-zero pool of num_pages pages (rows of `dtype` are what will be written;
        it only matters for plain pages)."""
        rows = jax.ShapeDtypeStruct((num_pages, page_size, num_kv_heads, head_dim), dtype)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(self.quantize, rows))

    def bytes_per_token(self, num_kv_heads, head_dim, dtype=jnp.float32) -> int:
        """Bytes one token takes in one pool (K or V), all kv heads, every leaf."""
        rows = jax.ShapeDtypeStruct((1, num_kv_heads, head_dim), dtype)
        shapes = jax.tree.leaves(jax.eval_shape(self.quantize, rows))
        return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in shapes)

    def gather(self, pages, page_ids):
        return gather(pages, page_ids)

    def write(self, pages, new_rows, page_ids, slots):
        """Quantize float rows [..., H, D] and store row i at (page_ids[i], slots[i]) of every
        leaf; page_ids, slots int [...] (the rows' leading shape). A page id outside
        [0, num_pages) is dropped: pass num_pages for padding. Returns the new container
        (updated in place when the pool is donated)."""
        new = self.quantize(new_rows)
        num_pages, page_size = self.leaves(pages)[0].shape[:2]
        valid = (page_ids >= 0) & (page_ids < num_pages)
        index = jnp.where(valid, page_ids * page_size + slots, num_pages * page_size).reshape(-1)
        return jax.tree.map(
            lambda pool, x: _scatter_rows(pool, index, x.reshape(-1, *pool.shape[2:])), pages, new
        )


@dataclasses.dataclass(frozen=True)
class Plain(_Format):
    """Unquantized pages: one array leaf, read as is."""

    parts: int = 1
    label: str = "plain"

    def quantize(self, x):
        return x

    def dequantize(self, pages):
        return pages

    def rows(self, pages, part):
        return pages

    def check(self, pages, head_dim, name):
        pass

    def leaves(self, pages):
        return (pages,)

    def extras(self):
        return ()

    def tile(self, get: Getter, part, extras, expand=_expand_blocks):
        return get(0)

    def prepare_q(self, k_pages, q):
        return q

    def finish_out(self, v_pages, out):
        return out


@dataclasses.dataclass(frozen=True)
class Rows(_Format):
    """int8 / fp8 codes with one f32 scale per (token, head): tile = codes * scale."""

    label: str
    parts: int = 1

    def quantize(self, x):
        """quant.quantize_rows' container; fp8 codes as their uint8 bits (the module docstring)."""
        q = quantize_rows(x, self.label)
        return RowQuantized(to_bits(q.codes), q.scales)

    def check(self, pages, head_dim, name):
        if not isinstance(pages, RowQuantized):
            raise ValueError(f"{name} for kv_format={self.label!r} must be a quant.RowQuantized")
        want = jnp.int8 if self.label == "int8" else (jnp.uint8, jnp.float8_e4m3fn)
        _check_leaf(f"{name}.codes", pages.codes, 4, head_dim, dtype=want)
        _check_leaf(f"{name}.scales", pages.scales, 3, None, pages.codes.shape[:3], jnp.float32)

    def leaves(self, pages):
        return (pages.codes, pages.scales)

    def extras(self):
        return ()

    def tile(self, get: Getter, part, extras, expand=_expand_blocks):
        return _decode_codes(get(0)) * get(1)

    def dequantize(self, pages):
        """quant.dequantize_rows' values; fp8 decoded from its bits."""
        codes = pages.codes
        values = codes.astype(jnp.float32) if codes.dtype == jnp.int8 else e4m3_decode_arith(codes)
        return values * pages.scales[..., None]

    def rows(self, pages, part):
        return self.dequantize(pages)

    def prepare_q(self, k_pages, q):
        return q

    def finish_out(self, v_pages, out):
        return out


@dataclasses.dataclass(frozen=True)
class BlockFP4(_Format):
    """NVFP4 (E4M3 scale per 16) or MXFP4 (UE8M0 scale per 32): E2M1 two per byte."""

    label: str
    parts: int = 2

    @property
    def block(self):
        return 16 if self.label == "nvfp4" else 32

    def quantize(self, x):
        if self.label == "mxfp4":
            return mxfp4_quantize(x)
        q = nvfp4_quantize(x, 1.0)  # tensor scale None, scales as their bits: the module docstring
        return NVFP4(q.packed, to_bits(q.scales), None)

    def check(self, pages, head_dim, name):
        kind = NVFP4 if self.label == "nvfp4" else MXFP4
        if not isinstance(pages, kind):
            raise ValueError(f"{name} for kv_format={self.label!r} must be a quant.{kind.__name__}")
        if head_dim % self.block:
            raise ValueError(f"{self.label} needs head_dim % {self.block} == 0, got {head_dim}")
        _check_leaf(f"{name}.packed", pages.packed, 4, head_dim // 2, dtype=jnp.uint8)
        scale_dtypes = (jnp.uint8, jnp.float8_e4m3fn) if self.label == "nvfp4" else (jnp.uint8,)
        lead = pages.packed.shape[:3]
        _check_leaf(f"{name}.scales", pages.scales, 4, head_dim // self.block, lead, scale_dtypes)
        if self.label == "nvfp4" and _tensor_scale(pages) is not None:
            if jnp.shape(pages.tensor_scale) != ():
                raise ValueError(
                    f"{name}.tensor_scale must be a scalar or None, got {jnp.shape(pages.tensor_scale)}"
                )

    def leaves(self, pages):
        return (pages.packed, pages.scales)

    def extras(self):
        return ()

    def tile(self, get: Getter, part, extras, expand=_expand_blocks):
        codes = get(0).astype(jnp.int32) >> (4 * part)
        raw = get(1)
        scales = _decode_codes(raw) if self.label == "nvfp4" else _ue8m0_to_f32(raw)
        width = codes.shape[1]
        return e2m1_decode_arith(codes) * expand(scales, width, self.block // 2)

    def _part(self, pages, part, tensor_scale):
        """Part `part` (the low or high nibbles: channels part::2) times its block scale
        (times tensor_scale when given), f32 [..., D / 2]. The scale multiplies each value
        once, as in quant's decoders, so merged parts are theirs bit for bit."""
        packed = pages.packed.astype(jnp.int32)
        values = e2m1_decode_arith(packed >> (4 * part))
        if self.label == "nvfp4":
            scales = e4m3_decode_arith(pages.scales)
            if tensor_scale is not None:
                scales = scales * tensor_scale
        else:
            scales = _ue8m0_to_f32(pages.scales)
        lead, nb = scales.shape[:-1], scales.shape[-1]
        per_byte = jnp.broadcast_to(scales[..., None], (*lead, nb, self.block // 2))
        return values * per_byte.reshape(*lead, nb * self.block // 2)

    def dequantize(self, pages):
        """quant.nvfp4_dequantize / mxfp4_dequantize's values (a None tensor scale is 1)."""
        ts = _tensor_scale(pages)
        return merge_parts(jnp.stack([self._part(pages, j, ts) for j in range(2)]))

    def rows(self, pages, part):
        return self._part(pages, part, None)

    def prepare_q(self, k_pages, q):
        scale = _tensor_scale(k_pages)
        if scale is None:
            return q
        return (q.astype(jnp.float32) * scale).astype(q.dtype)

    def finish_out(self, v_pages, out):
        scale = _tensor_scale(v_pages)
        return out if scale is None else out * scale


def _tensor_scale(pages):
    """NVFP4's tensor scale, or None (MXFP4, or NVFP4 pages with the scale fixed at 1)."""
    return getattr(pages, "tensor_scale", None)


@dataclasses.dataclass(frozen=True)
class Turbo(_Format):
    """TurboQuant mse-mode codes (integer bits in TURBO_BITS); see the module docstring."""

    tq: TurboQuant  # hashed by identity: one compiled program per quantizer instance
    label: str = "turboquant"

    @property
    def bits(self):
        return int(self.tq.bits)

    @property
    def parts(self):
        return 8 // self.bits

    def quantize(self, x):
        return self.tq.quantize(x)

    def check(self, pages, head_dim, name):
        if self.tq.dim != head_dim:
            raise ValueError(f"TurboQuant dim {self.tq.dim} != head_dim {head_dim}")
        if not isinstance(pages, TurboCodes) or pages.qjl is not None:
            raise ValueError(f"{name} for a TurboQuant kv_format must be mse-mode quant.TurboCodes")
        _check_leaf(f"{name}.idx", pages.idx, 4, head_dim * self.bits // 8, dtype=jnp.uint8)
        _check_leaf(f"{name}.norm", pages.norm, 3, None, pages.idx.shape[:3], jnp.float32)

    def leaves(self, pages):
        return (pages.idx, pages.norm)

    def extras(self):
        return (jnp.asarray(sphere_codebook(self.tq.dim, self.bits), jnp.float32),)

    def tile(self, get: Getter, part, extras, expand=_expand_blocks):
        (codebook,) = extras
        codes = (get(0).astype(jnp.int32) >> (self.bits * part)) & ((1 << self.bits) - 1)
        return _lookup(codes, codebook, 1 << self.bits) * get(1)

    def dequantize(self, pages):
        return self.tq.dequantize(pages)

    def rows(self, pages, part):
        """||x|| c[code] of channels part::parts in the rotated basis: tile(part) in bulk."""
        codebook = jnp.asarray(sphere_codebook(self.tq.dim, self.bits), jnp.float32)
        codes = (pages.idx.astype(jnp.int32) >> (self.bits * part)) & ((1 << self.bits) - 1)
        return codebook[codes] * pages.norm[..., None]

    def prepare_q(self, k_pages, q):
        rot = jnp.dot(q.astype(jnp.float32), self.tq.rotation.T, precision=lax.Precision.HIGHEST)
        return rot.astype(q.dtype)

    def finish_out(self, v_pages, out):
        return jnp.dot(out, self.tq.rotation, precision=lax.Precision.HIGHEST)


def _group_byte(packed, bits, k):
    """uint8 [page_size, bits * g] -> f32 [page_size, g]: byte k of every group of `bits`
    bytes (a strided lane gather as a 0/1 matmul, exact at HIGHEST for bytes)."""
    n, g = packed.shape[1], packed.shape[1] // bits
    row = lax.broadcasted_iota(jnp.int32, (n, g), 0)
    col = lax.broadcasted_iota(jnp.int32, (n, g), 1)
    onehot = (row == col * bits + k).astype(jnp.float32)
    return jnp.dot(packed.astype(jnp.float32), onehot, precision=lax.Precision.HIGHEST)


def group_codes(packed, bits, j):
    """pack_bits codes of width `bits` (1..8), uint8 [page_size, n * bits / 8] -> int32
    [page_size, n / 8]: the codes of channels j, j + 8, j + 16, ... (code j of each group)."""
    first, shift = divmod(bits * j, 8)
    word = _group_byte(packed, bits, first)
    if shift + bits > 8:  # straddles into the group's next byte
        word = word + 256.0 * _group_byte(packed, bits, first + 1)
    return (word.astype(jnp.int32) >> shift) & ((1 << bits) - 1)


def _lookup(codes, codebook, size):
    """codebook[codes] as a select chain over its `size` scalars (Pallas kernels cannot
    capture a table)."""
    values = jnp.zeros(codes.shape, jnp.float32)
    for i in range(size):
        values = jnp.where(codes == i, codebook[i], values)
    return values


@dataclasses.dataclass(frozen=True)
class TurboSplit(_Format):
    """quant.TurboQuantSplit codes (outlier / regular channel halves, each with its sparse
    channels when the quantizer has sparse > 0); see the module docstring."""

    tq: TurboQuantSplit  # hashed by identity: one compiled program per quantizer instance
    label: str = "turboquant_split"
    parts: int = 8

    def quantize(self, x):
        return self.tq.quantize(x)

    def _halves(self, pages):
        return ((pages.outlier, self.tq.hi), (pages.regular, self.tq.lo))

    def check(self, pages, head_dim, name):
        if self.tq.dim != head_dim:
            raise ValueError(f"TurboQuantSplit dim {self.tq.dim} != head_dim {head_dim}")
        if not isinstance(pages, SplitCodes):
            raise ValueError(f"{name} for a TurboQuantSplit kv_format must be quant.SplitCodes")
        lead, n = None, self.tq.sparse
        for half, (codes, inst) in zip(("outlier", "regular"), self._halves(pages)):
            if (not isinstance(codes, TurboCodes) or codes.qjl is not None
                    or (codes.sparse_idx is None) != (n == 0)):
                raise ValueError(f"{name}.{half} must be mse-mode quant.TurboCodes "
                                 f"{f'with {n} sparse channels' if n else 'without sparse channels'}")
            _check_leaf(f"{name}.{half}.idx", codes.idx, 4, inst.dim * int(inst.bits) // 8,
                        lead, jnp.uint8)
            lead = codes.idx.shape[:3]
            _check_leaf(f"{name}.{half}.norm", codes.norm, 3, None, lead, jnp.float32)
            if n:
                _check_leaf(f"{name}.{half}.sparse_idx", codes.sparse_idx, 4, n, lead, jnp.uint8)
                _check_leaf(f"{name}.{half}.sparse_val", codes.sparse_val, 4, n, lead, jnp.uint16)

    def leaves(self, pages):
        out = []
        for codes, _ in self._halves(pages):
            out += [codes.idx, codes.norm]
            if self.tq.sparse:
                out += [codes.sparse_idx, codes.sparse_val]
        return tuple(out)

    def extras(self):
        return tuple(jnp.asarray(sphere_codebook(inst.dim, int(inst.bits)), jnp.float32)
                     for inst in (self.tq.hi, self.tq.lo))

    def tile(self, get: Getter, part, extras, expand=_expand_blocks):
        halves, per_half = [], 4 if self.tq.sparse else 2
        for i, inst in enumerate((self.tq.hi, self.tq.lo)):
            bits, first = int(inst.bits), per_half * i
            codes = group_codes(get(first), bits, part)
            half = _lookup(codes, extras[i], 1 << bits) * get(first + 1)
            if self.tq.sparse:
                rot = np.asarray(inst.rotation)[part :: self.parts].tolist()  # [d/2/parts][d/2] floats
                idx, val = get(first + 2).astype(jnp.int32), sparse_values(get(first + 3))
                for j in range(self.tq.sparse):
                    column = jnp.concatenate([_lookup(idx[:, j : j + 1], row, len(row)) for row in rot], axis=1)
                    half = half + val[:, j : j + 1] * column
            halves.append(half)
        return jnp.concatenate(halves, axis=1)

    def dequantize(self, pages):
        return self.tq.dequantize(pages)

    def rows(self, pages, part):
        """tile(part) in bulk: [outlier | regular] code `part` of every 8-code group, each
        ||x|| c[code] in its half's rotated basis (plus its sparse channels' Pi columns)."""
        halves = []
        for codes, inst in self._halves(pages):
            bits = int(inst.bits)
            first, shift = divmod(bits * part, 8)
            packed = codes.idx.astype(jnp.int32)
            word = packed[..., first::bits]  # byte `first` of every group of `bits` bytes
            if shift + bits > 8:  # straddles into the group's next byte
                word = word | (packed[..., first + 1::bits] << 8)
            codebook = jnp.asarray(sphere_codebook(inst.dim, bits), jnp.float32)
            half = codebook[(word >> shift) & ((1 << bits) - 1)] * codes.norm[..., None]
            if self.tq.sparse:  # + val_j * Pi[part rows, idx_j]: [..., n, d/2/parts] summed over n
                # An index past the half (only in bytes no write made) adds nothing, as in tile().
                columns = inst.rotation[part :: self.parts].T.at[codes.sparse_idx.astype(jnp.int32)].get(
                    mode="fill", fill_value=0.0)
                half = half + jnp.sum(sparse_values(codes.sparse_val)[..., None] * columns, axis=-2)
            halves.append(half)
        return jnp.concatenate(halves, axis=-1)

    def prepare_q(self, k_pages, q):
        q32 = q.astype(jnp.float32)
        rot = [jnp.dot(q32[..., list(channels)], inst.rotation.T, precision=lax.Precision.HIGHEST)
               for channels, inst in ((self.tq.outliers, self.tq.hi), (self.tq.regular, self.tq.lo))]
        return jnp.concatenate(rot, axis=-1).astype(q.dtype)

    def finish_out(self, v_pages, out):
        half = self.tq.dim // 2
        hi = jnp.dot(out[..., :half], self.tq.hi.rotation, precision=lax.Precision.HIGHEST)
        lo = jnp.dot(out[..., half:], self.tq.lo.rotation, precision=lax.Precision.HIGHEST)
        channels = jnp.concatenate([hi, lo], axis=-1)
        return channels[..., list(self.tq.inverse)]


PLAIN = Plain()
FORMAT_TYPES = (Rows, BlockFP4, Turbo, TurboSplit)


def resolve(kv_format: Any):
    """The entry's kv_format (a name in NAMES, a TurboQuant, a TurboQuantSplit, or a format
    object already resolved) -> its format object."""
    if isinstance(kv_format, FORMAT_TYPES):
        return kv_format
    if isinstance(kv_format, TurboQuantSplit):
        return TurboSplit(kv_format)
    if isinstance(kv_format, TurboQuant):
        if kv_format.mode != "mse" or kv_format.bits not in TURBO_BITS or kv_format.sparse:
            raise ValueError(
                f"TurboQuant kv_format must be mode='mse' with bits in {TURBO_BITS} and no sparse "
                f"channels (those are read for a TurboQuantSplit), got {kv_format}"
            )
        return Turbo(kv_format)
    if kv_format in ("int8", "fp8"):
        return Rows(kv_format)
    if kv_format in ("nvfp4", "mxfp4"):
        return BlockFP4(kv_format)
    raise ValueError(f"kv_format must be one of {NAMES} or a quant.TurboQuant, got {kv_format!r}")


def _check_leaf(name, x, ndim, last, lead=None, dtype=None):
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D with a leading page axis, got shape {shape}")
    if lead is not None and tuple(shape[:3]) != tuple(lead):
        raise ValueError(f"{name} leading shape {tuple(shape[:3])} != codes' {tuple(lead)}")
    if last is not None and shape[-1] != last:
        raise ValueError(f"{name} last axis must be {last}, got {shape[-1]}")
    dtypes = () if dtype is None else tuple(map(jnp.dtype, dtype if isinstance(dtype, tuple) else (dtype,)))
    if dtypes and x.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(d.name for d in dtypes)}, got {x.dtype}")
