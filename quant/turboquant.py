"""TurboQuant (Zandieh et al.): rotate, then Lloyd-Max each coordinate; QJL for inner products.

For x in R^d with norm n = ||x|| and u = x / n:

- mode="mse": y = Pi u with Pi a Haar-random orthogonal matrix; every coordinate of y is
  quantized to the b-bit Lloyd-Max codebook of a unit-sphere coordinate (quant/lloyd_max).
  x_hat = n * Pi^T c[idx]. Near-optimal MSE, but inner products shrink (by 2/pi at b=1).
- mode="prod": the MSE quantizer at b - 1 bits, then QJL on the residual r = u - u_mse:
  store sign(S r) (S Gaussian d x d) and ||r||, and
  x_hat = n * (u_mse + sqrt(pi/2) / d * ||r|| * S^T sign(S r)). Unbiased inner products.
  At b = 1 the MSE stage has 0 bits (its codebook is {0}) and only QJL is stored.

Fractional rates, two ways:

- TurboQuant(d, b + 0.5) puts the first d/2 *rotated* coordinates at b + 1 bits and the
  other d/2 at b bits. After a Haar rotation every coordinate carries the same share of
  the energy, so the error is the mean of the two rates' errors whatever x looks like.
- TurboQuantSplit(d, b + 0.5, outliers) is the paper's scheme (TurboQuant, Zandieh et
  al., 2025, Section 4.3): the d/2 outlier channels of the *unrotated* vector and the d/2
  regular ones are two independent TurboQuant instances (own rotation, own norm) at b + 1
  and b bits. When the outlier channels hold a share f of ||x||^2 the error is
  f * D(b + 1) + (1 - f) * D(b) instead of the mean, so it pays wherever energy is skewed
  across channels (keys of LLMs: model/kv_formats.py says which channels it picks).

Two options of the mse mode, for vectors whose energy is not spread like a random one's
(LLM keys: one channel holds about a third of ||k||^2 on the default model, see
model/kv_formats.py):

- sparse=n keeps the n largest-magnitude channels of each vector outside the rotation
  (their index uint8 and value bfloat16, stored as its bits in a uint16: dense-and-sparse
  quantization as in KVQuant, Hooper et al., 2024). The rest, with those channels zeroed,
  is rotated and quantized, so its error scales with the rest's norm instead of the
  outliers'.
- rescale=True stores the scale n / ||c[idx]|| in place of n = ||x|| (of the rest, with
  sparse channels), so the rotated part's reconstruction keeps that norm (x_hat as a whole
  only nearly: the rest's reconstruction also has some error on the sparse channels). The
  Lloyd-Max reconstruction is shorter by sqrt(1 - D), about 1 - D/2 (D its distortion):
  optimal for the vector's MSE, but it shrinks every attention score by that factor, and
  the softmax flattens. Readers are unchanged: x_hat = scale * Pi^T c[idx] either way.

Attention trick: <q, x_hat> = n * (<Pi q, c[idx]> + sqrt(pi/2)/d * ||r|| * <S q, sign>),
so score() rotates and projects the query once instead of de-rotating every key.

Run `python -m quant.turboquant --table` for measured distortion and bias at d = 128.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from quant.lloyd_max import sphere_codebook, sphere_codebook_mse
from quant.packing import pack_bits, unpack_bits

MODES = ("mse", "prod")
_MAX_BITS = 8


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["idx", "norm", "qjl", "rnorm", "sparse_idx", "sparse_val"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class TurboCodes:
    """Quantized vectors [...] of dimension d.

    idx: uint8 [..., idx_bytes], bit-packed codebook indices (the high-rate channel group
      first for fractional rates; zero bytes in prod mode at 1 bit);
    norm: float32 [...], ||x||;
    qjl: uint8 [..., d/8], packed sign bits of S r (bit 1 = +1), prod mode only, else None;
    rnorm: float32 [...], ||r|| of the unit vector's residual, prod mode only, else None;
    sparse_idx: uint8 [..., n], the channels kept outside the rotation (sparse=n), else None;
    sparse_val: uint16 [..., n], their values' bfloat16 bits (`sparse_values` reads them),
      else None: XLA:CPU scatters a float narrower than 32 bits by converting the whole
      operand, so KV pages would copy a pool of them at every write (or convert it).
    With sparse channels, norm is that of the rest (or its rescaled scale).
    """

    idx: jax.Array
    norm: jax.Array
    qjl: jax.Array | None = None
    rnorm: jax.Array | None = None
    sparse_idx: jax.Array | None = None
    sparse_val: jax.Array | None = None

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(self))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["rotation", "projection", "centroids"],
    meta_fields=["layout", "mode", "sparse", "rescale"],
)
@dataclasses.dataclass(frozen=True)
class _Params:
    """What the jitted kernels below need. Arrays are arguments (not baked-in constants),
    so instances with the same (dim, bits, mode) share compiled programs whatever the seed."""

    rotation: jax.Array  # Pi, f32 [d, d]
    projection: jax.Array  # S, f32 [d, d]
    centroids: tuple[jax.Array, ...]  # per channel group, f32 [2**bits]
    layout: tuple[tuple[int, int, int], ...]  # per channel group: (start, size, bits)
    mode: str
    sparse: int = 0  # channels per vector kept outside the rotation
    rescale: bool = False  # store n / ||c[idx]||: the rotated part keeps its norm n


@functools.lru_cache(maxsize=64)
def _random_matrices(dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(Pi, S) for a seed: Pi Haar orthogonal (QR of a Gaussian, sign fixed), S Gaussian."""
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    pi = q * np.sign(np.diag(r))  # the sign fix makes the distribution exactly Haar
    return pi, rng.standard_normal((dim, dim))


def _options(tq) -> str:
    """The repr tail of a quantizer's non-default sparse / rescale options."""
    return (f", sparse={tq.sparse}" if tq.sparse else "") + (", rescale=True" if tq.rescale else "")


class TurboQuant:
    """TurboQuant(dim, bits, mode="mse" | "prod", seed=0, sparse=0, rescale=False).

    dim: vector length d (>= 2). bits: bits per coordinate, a multiple of 0.5 in
    [1, 8]; prod mode spends 1 of them on QJL, so its bits must be 1 or >= 2.
    Every group of coordinates must pack into whole bytes (size * bits % 8 == 0; any
    d that is a multiple of 16 works). seed fixes Pi and S. sparse (channels kept
    outside the rotation, 0 <= sparse < d <= 256) and rescale: mse mode only, see the
    module docstring.
    """

    def __init__(self, dim: int, bits: float, mode: str = "mse", seed: int = 0, sparse: int = 0,
                 rescale: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(dim, (int, np.integer)) or dim < 2:
            raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
        if not (isinstance(bits, (int, float)) and float(bits * 2).is_integer() and 1 <= bits <= _MAX_BITS):
            raise ValueError(f"bits must be a multiple of 0.5 in [1, {_MAX_BITS}], got {bits!r}")
        mse_bits = float(bits) - (1 if mode == "prod" else 0)
        if 0 < mse_bits < 1:
            raise ValueError(f"prod mode needs bits = 1 or >= 2 (1 bit goes to QJL), got {bits}")
        if not mse_bits.is_integer() and dim % 2:
            raise ValueError(f"fractional bits split the channels in half: dim must be even, got {dim}")
        if mode == "prod" and dim % 8:
            raise ValueError(f"prod mode packs d sign bits into bytes: dim must divide by 8, got {dim}")
        if not isinstance(sparse, (int, np.integer)) or not 0 <= sparse < dim:
            raise ValueError(f"sparse must be an integer in [0, dim={dim}), got {sparse!r}")
        if (sparse or rescale) and mode != "mse":
            raise ValueError("sparse and rescale are options of mode='mse'")
        if sparse and dim > 256:
            raise ValueError(f"sparse channels are indexed by uint8: dim must be <= 256, got {dim}")
        self.dim, self.bits, self.mode, self.seed = int(dim), float(bits), mode, int(seed)
        self.sparse, self.rescale = int(sparse), bool(rescale)

        if mse_bits.is_integer():
            layout = ((0, self.dim, int(mse_bits)),)
        else:
            half = self.dim // 2
            layout = ((0, half, math.ceil(mse_bits)), (half, self.dim - half, math.floor(mse_bits)))
        for _, size, b in layout:
            if (size * b) % 8:
                raise ValueError(
                    f"dim {dim} at {bits} bits: {size} channels x {b} bits is not a whole number of bytes"
                )
        pi, s = _random_matrices(self.dim, self.seed)
        self._params = _Params(
            rotation=jnp.asarray(pi, jnp.float32),
            projection=jnp.asarray(s, jnp.float32),
            centroids=tuple(jnp.asarray(sphere_codebook(self.dim, b), jnp.float32) for _, _, b in layout),
            layout=layout,
            mode=mode,
            sparse=self.sparse,
            rescale=self.rescale,
        )

    @property
    def rotation(self) -> jax.Array:
        """Pi, float32 [d, d] (y = Pi x, i.e. y = x @ Pi.T for row vectors)."""
        return self._params.rotation

    @property
    def projection(self) -> jax.Array:
        """S, float32 [d, d], the QJL Gaussian projection (used in prod mode)."""
        return self._params.projection

    def __repr__(self) -> str:
        return f"TurboQuant(dim={self.dim}, bits={self.bits:g}, mode={self.mode!r}, seed={self.seed}{_options(self)})"

    def _check(self, x: jax.Array, what: str) -> jax.Array:
        x = jnp.asarray(x)
        if x.ndim < 1 or x.shape[-1] != self.dim or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{what}: expected a float [..., {self.dim}] array, got {x.dtype}{x.shape}")
        return x.astype(jnp.float32)

    def _check_codes(self, codes: TurboCodes) -> TurboCodes:
        if (not isinstance(codes, TurboCodes) or (codes.qjl is None) != (self.mode == "mse")
                or (codes.sparse_idx is None) != (self.sparse == 0)):
            raise ValueError(f"codes were not made by this {self.mode}-mode TurboQuant: {self!r}")
        return codes

    def quantize(self, x: jax.Array) -> TurboCodes:
        """Float [..., d] -> TurboCodes (leading shape [...])."""
        return _quantize(self._params, self._check(x, "TurboQuant.quantize"))

    def dequantize(self, codes: TurboCodes) -> jax.Array:
        """TurboCodes -> x_hat float32 [..., d]."""
        return _dequantize(self._params, self._check_codes(codes))

    def score(self, q: jax.Array, codes: TurboCodes) -> jax.Array:
        """<q, x_hat> for queries q [..., d] against codes with leading shape [..., N].

        The leading axes broadcast (q [B, H, d] with keys [B, H, N] -> [B, H, N]; q [M, d]
        with keys [N] -> [M, N]). Returns float32 [..., N].
        """
        return _score(self._params, self._check(q, "TurboQuant.score"), self._check_codes(codes))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["outlier", "regular"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SplitCodes:
    """TurboQuantSplit's codes of vectors [...]: outlier: TurboCodes of the outlier channels
    (idx uint8 [..., n_out * b_hi / 8], norm f32 [...]); regular: TurboCodes of the rest."""

    outlier: TurboCodes
    regular: TurboCodes

    @property
    def nbytes(self) -> int:
        return self.outlier.nbytes + self.regular.nbytes


class TurboQuantSplit:
    """TurboQuantSplit(dim, bits, outliers, seed=0, sparse=0, rescale=False): the paper's
    fractional rate.

    bits = b + 0.5 (b in 1..7); outliers: dim / 2 distinct channel indices in [0, dim),
    quantized by an mse-mode TurboQuant(dim / 2, b + 1, seed) after being gathered in the
    given order; the other channels (ascending) by TurboQuant(dim / 2, b, seed + 1). Each
    half keeps its own norm. dim must divide by 16 so both halves pack into whole bytes.
    sparse and rescale go to both halves (each keeps its own `sparse` largest channels).
    """

    def __init__(self, dim: int, bits: float, outliers, seed: int = 0, sparse: int = 0,
                 rescale: bool = False):
        if not isinstance(dim, (int, np.integer)) or dim < 16 or dim % 16:
            raise ValueError(f"TurboQuantSplit needs dim divisible by 16, got {dim!r}")
        if not (isinstance(bits, (int, float)) and 1 < bits < _MAX_BITS and bits % 1 == 0.5):
            raise ValueError(f"TurboQuantSplit bits must be b + 0.5 with b in 1..{_MAX_BITS - 1}, got {bits!r}")
        out = tuple(int(c) for c in outliers)
        if len(out) != dim // 2 or len(set(out)) != len(out) or not all(0 <= c < dim for c in out):
            raise ValueError(f"outliers must be {dim // 2} distinct channels in [0, {dim}), got {outliers!r}")
        self.dim, self.bits, self.seed = int(dim), float(bits), int(seed)
        self.outliers = out
        self.regular = tuple(c for c in range(self.dim) if c not in set(out))
        self.hi = TurboQuant(self.dim // 2, math.ceil(bits), "mse", seed, sparse, rescale)
        self.lo = TurboQuant(self.dim // 2, math.floor(bits), "mse", seed + 1, sparse, rescale)
        self.sparse, self.rescale = self.hi.sparse, self.hi.rescale
        # x_hat = concat(hi, lo)[..., inverse] puts every channel back where it came from.
        self._order = np.asarray(out + self.regular)
        self.inverse = tuple(int(i) for i in np.argsort(self._order))

    def __repr__(self) -> str:
        return (f"TurboQuantSplit(dim={self.dim}, bits={self.bits:g}, "
                f"outliers={self.outliers}, seed={self.seed}{_options(self)})")

    def quantize(self, x: jax.Array) -> SplitCodes:
        """Float [..., d] -> SplitCodes (leading shape [...])."""
        x = jnp.asarray(x)
        if x.ndim < 1 or x.shape[-1] != self.dim or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"TurboQuantSplit.quantize: expected a float [..., {self.dim}] array, "
                             f"got {x.dtype}{x.shape}")
        half = self.dim // 2
        x = x[..., self._order]
        return SplitCodes(self.hi.quantize(x[..., :half]), self.lo.quantize(x[..., half:]))

    def dequantize(self, codes: SplitCodes) -> jax.Array:
        """SplitCodes -> x_hat float32 [..., d]."""
        if not isinstance(codes, SplitCodes):
            raise ValueError(f"codes were not made by this TurboQuantSplit: {self!r}")
        both = jnp.concatenate([self.hi.dequantize(codes.outlier), self.lo.dequantize(codes.regular)], -1)
        return both[..., np.asarray(self.inverse)]


def _rotated_centroids(p: _Params, idx: jax.Array) -> jax.Array:
    """Packed indices [..., idx_bytes] -> c[idx] in the rotated basis, f32 [..., d]."""
    parts, offset = [], 0
    for (_, size, bits), c in zip(p.layout, p.centroids):
        if bits == 0:  # prod mode at 1 bit: the MSE stage is the single centroid 0
            parts.append(jnp.zeros((*idx.shape[:-1], size), jnp.float32))
            continue
        nbytes = size * bits // 8
        parts.append(c[unpack_bits(idx[..., offset : offset + nbytes], bits, size).astype(jnp.int32)])
        offset += nbytes
    return jnp.concatenate(parts, axis=-1)


def _signs(p: _Params, codes: TurboCodes) -> jax.Array:
    return unpack_bits(codes.qjl, 1, p.rotation.shape[0]).astype(jnp.float32) * 2.0 - 1.0


def _qjl_scale(p: _Params) -> float:
    return math.sqrt(math.pi / 2) / p.rotation.shape[0]


def sparse_values(bits: jax.Array) -> jax.Array:
    """TurboCodes.sparse_val (bfloat16 bits, uint16) -> their values, float32 (exact). In
    32-bit integer operations, which every backend's kernels lower."""
    if bits.dtype != jnp.uint16:  # a float's values would be cast, not reinterpreted
        raise ValueError(f"sparse values are stored as their bfloat16 bits (uint16), got {bits.dtype}")
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)


def _sparse_split(p: _Params, x: jax.Array):
    """x [..., d] -> (the rest: x with its p.sparse largest-magnitude channels zeroed,
    their indices uint8 [..., n], their values' bfloat16 bits uint16 [..., n])."""
    _, idx = jax.lax.top_k(jnp.abs(x), p.sparse)
    picked = jnp.any(idx[..., :, None] == jnp.arange(x.shape[-1]), axis=-2)
    val = jax.lax.bitcast_convert_type(jnp.take_along_axis(x, idx, axis=-1).astype(jnp.bfloat16), jnp.uint16)
    return jnp.where(picked, 0.0, x), idx.astype(jnp.uint8), val


def _sparse_dense(p: _Params, codes: TurboCodes) -> jax.Array:
    """The sparse channels as a dense f32 [..., d] (zeros elsewhere)."""
    onehot = codes.sparse_idx[..., :, None].astype(jnp.int32) == jnp.arange(p.rotation.shape[0])
    return jnp.sum(jnp.where(onehot, sparse_values(codes.sparse_val)[..., None], 0.0), axis=-2)


@jax.jit
def _quantize(p: _Params, x: jax.Array) -> TurboCodes:
    sparse_idx = sparse_val = None
    if p.sparse:
        x, sparse_idx, sparse_val = _sparse_split(p, x)
    norm = jnp.linalg.norm(x, axis=-1)
    safe = jnp.where(norm > 0, norm, 1.0)[..., None]
    # Codes of the rotated unit vector (x R^T) / norm, found by comparing x R^T with
    # boundary * norm: no division, whose rounding on GPUs depends on the fusion (see
    # quant.formats.e2m1_encode_scaled), and full float32 for the rotation (not TF32).
    y = jnp.dot(x, p.rotation.T, precision=jax.lax.Precision.HIGHEST)
    packed, length2 = [], 0.0
    for (start, size, bits), c in zip(p.layout, p.centroids):
        if bits == 0:
            continue
        boundaries = 0.5 * (c[:-1] + c[1:])
        codes = jnp.sum(y[..., start : start + size, None] > boundaries * safe[..., None], axis=-1, dtype=jnp.int32)
        packed.append(pack_bits(codes, bits))
        length2 = length2 + jnp.sum(c[codes] ** 2, axis=-1)
    idx = jnp.concatenate(packed, axis=-1) if packed else jnp.zeros((*x.shape[:-1], 0), jnp.uint8)
    if p.mode == "mse":
        scale = norm / jnp.sqrt(length2) if p.rescale else norm  # every codebook lacks 0: length2 > 0
        return TurboCodes(idx, scale, sparse_idx=sparse_idx, sparse_val=sparse_val)
    r = x / safe - _rotated_centroids(p, idx) @ p.rotation
    signs = (r @ p.projection.T) >= 0
    return TurboCodes(idx, norm, pack_bits(signs, 1), jnp.linalg.norm(r, axis=-1))


@jax.jit
def _dequantize(p: _Params, codes: TurboCodes) -> jax.Array:
    u = _rotated_centroids(p, codes.idx) @ p.rotation
    if p.mode == "prod":
        u = u + _qjl_scale(p) * codes.rnorm[..., None] * (_signs(p, codes) @ p.projection)
    x = codes.norm[..., None] * u
    return x + _sparse_dense(p, codes) if p.sparse else x


@jax.jit
def _score(p: _Params, q: jax.Array, codes: TurboCodes) -> jax.Array:
    s = jnp.einsum("...d,...nd->...n", q @ p.rotation.T, _rotated_centroids(p, codes.idx))
    if p.mode == "prod":
        sq = jnp.einsum("...d,...nd->...n", q @ p.projection.T, _signs(p, codes))
        s = s + _qjl_scale(p) * codes.rnorm * sq
    s = s * codes.norm
    if p.sparse:  # + sum_j q[idx_j] * val_j
        s = s + jnp.einsum("...d,...nd->...n", q, _sparse_dense(p, codes))
    return s


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d))
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def measure(dim: int, bits: float, mode: str, n: int = 10_000, seed: int = 0) -> dict[str, float]:
    """Monte-Carlo distortion and bias of TurboQuant(dim, bits, mode) on unit vectors.

    mse: mean ||x - x_hat||^2 over n uniform unit x.
    ip_distortion: mean (<y, x> - <y, x_hat>)^2 over n independent unit pairs.
    slope: least-squares slope of <y, x_hat> (via score) against <y, x> over n pairs
      y = cos(t) x + sin(t) x_perp, t ~ U[0, pi], so the true values span [-1, 1].
    """
    tq = TurboQuant(dim, bits, mode, seed)
    rng = np.random.default_rng(seed + 1)
    x = _unit(rng, n, dim)
    y = _unit(rng, n, dim)
    x_hat = np.asarray(tq.dequantize(tq.quantize(jnp.asarray(x, jnp.float32))), np.float64)
    mse = float(np.mean(np.sum((x - x_hat) ** 2, axis=-1)))
    ip = float(np.mean((np.sum(y * x, -1) - np.sum(y * x_hat, -1)) ** 2))

    perp = y - np.sum(y * x, -1, keepdims=True) * x
    perp /= np.linalg.norm(perp, axis=-1, keepdims=True)
    t = rng.uniform(0.0, np.pi, n)[:, None]
    query = np.cos(t) * x + np.sin(t) * perp
    true = np.cos(t[:, 0])
    codes = tq.quantize(jnp.asarray(x, jnp.float32))
    # One key per query: q [n, d] against codes with leading shape [n, 1] -> [n, 1].
    codes = jax.tree.map(lambda a: np.asarray(a)[:, None], codes)
    est = np.asarray(tq.score(query.astype(np.float32), codes))
    slope = float(np.polyfit(true, est[:, 0].astype(np.float64), 1)[0])
    return {"mse": mse, "ip_distortion": ip, "slope": slope}


def prod_distortion_bound(dim: int, bits: float) -> float:
    """The paper's bound sqrt(3) * pi^2 / d * 4^-b on inner-product distortion (unit y)."""
    return math.sqrt(3) * math.pi**2 / dim * 4.0**-bits


def _table(dim: int, n: int, seed: int) -> None:
    print(f"TurboQuant at d={dim}, {n} random unit vectors / pairs, seed {seed}")
    print(
        f"{'bits':>4} | {'mse':>8} {'lloyd-max':>9} {'diff':>6} {'slope':>6} | "
        f"{'prod ip*d':>9} {'bound*d':>8} {'slope':>6}"
    )
    for b in (1, 2, 3, 4):
        m = measure(dim, b, "mse", n, seed)
        p = measure(dim, b, "prod", n, seed)
        exact = sphere_codebook_mse(dim, b)
        print(
            f"{b:>4} | {m['mse']:8.4f} {exact:9.4f} {m['mse'] / exact - 1:+6.1%} {m['slope']:6.3f} | "
            f"{p['ip_distortion'] * dim:9.3f} {prod_distortion_bound(dim, b) * dim:8.3f} {p['slope']:6.3f}"
        )
    print(f"2/pi = {2 / math.pi:.4f}; bound = sqrt(3)*pi^2/d*4^-b; ip*d = d * E(<y,x> - <y,x_hat>)^2")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m quant.turboquant", description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="print measured distortion and bias")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--n", type=int, default=20_000, help="vectors and pairs per row (>= 10000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.table:
        parser.error("nothing to do: pass --table")
    if args.n < 2:
        parser.error("--n must be >= 2")
    _table(args.dim, args.n, args.seed)


if __name__ == "__main__":
    main()
