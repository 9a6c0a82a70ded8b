"""KIVI: tuning-free asymmetric 2/4-bit KV cache quantization (Liu et al., 2024).

Keys have outlier *channels*, values do not, hence:
- keys: per channel, in groups of `group_size` (32) consecutive tokens: min/max over the
  group's tokens for each channel;
- values: per token, in groups of `group_size` consecutive channels;
- asymmetric min-max: scale = (max - min) / (2**bits - 1), code = round((x - min) / scale),
  x_hat = code * scale + min, so |x - x_hat| <= scale / 2 (plus float rounding);
- codes packed along the channel axis (int4: 2 per byte, int2: 4 per byte, see packing);
  scales and minimums stored as float32;
- the most recent tokens stay in full precision (the residual window).

Window rule (one boundary for K and V): of T tokens, the oldest
n_quant = floor(max(T - window, 0) / group_size) * group_size are quantized and the rest
are kept exact, so the residual holds between window and window + group_size - 1 tokens
once T >= window (all T tokens before that). KIVI's decode loop does the same: it flushes
whole groups out of the residual.

Shapes: K and V are [..., T, D] (token axis -2, channel axis -1; leading axes are batch
and heads).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from quant.packing import pack_bits, unpack_bits

KIVI_BITS = (2, 4)
DEFAULT_GROUP = 32
DEFAULT_WINDOW = 128


def _pytree(data: list[str], meta: list[str]):
    return functools.partial(jax.tree_util.register_dataclass, data_fields=data, meta_fields=meta)


@_pytree(["codes", "scale", "zero"], ["bits", "group_size"])
@dataclasses.dataclass(frozen=True)
class KiviKeys:
    """codes: uint8 [..., T, D*bits/8]; scale, zero (the group min): f32 [..., T/group, D]."""

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array
    bits: int
    group_size: int


@_pytree(["codes", "scale", "zero"], ["bits", "group_size"])
@dataclasses.dataclass(frozen=True)
class KiviValues:
    """codes: uint8 [..., T, D*bits/8]; scale, zero (the group min): f32 [..., T, D/group]."""

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array
    bits: int
    group_size: int


@_pytree(["keys", "values", "k_recent", "v_recent"], ["window"])
@dataclasses.dataclass(frozen=True)
class KiviKV:
    """A whole sequence's K/V: quantized prefix [..., n_quant, D] plus exact recent tokens."""

    keys: KiviKeys
    values: KiviValues
    k_recent: jax.Array
    v_recent: jax.Array
    window: int

    @property
    def nbytes(self) -> int:
        """Bytes actually stored (codes, scales, minimums and the full-precision window)."""
        return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(self))


def _check(x: jax.Array, bits: int, group_size: int, axis_len: int, axis_name: str, fn: str) -> None:
    if not isinstance(bits, int) or bits not in KIVI_BITS:
        raise ValueError(f"{fn}: bits must be one of {KIVI_BITS}, got {bits!r}")
    if x.ndim < 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{fn}: expected a float [..., T, D] array, got {x.dtype}{x.shape}")
    if group_size <= 0 or axis_len % group_size:
        raise ValueError(f"{fn}: {axis_name} length {axis_len} must be a multiple of group_size {group_size}")


def _minmax(x: jax.Array, axis: int, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    lo = jnp.min(x, axis=axis, keepdims=True)
    hi = jnp.max(x, axis=axis, keepdims=True)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round((x - lo) / safe), 0, levels).astype(jnp.uint8)
    return codes, scale, lo


def kivi_quantize_keys(k: jax.Array, bits: int, group_size: int = DEFAULT_GROUP) -> KiviKeys:
    """Float keys [..., T, D] (T % group_size == 0) -> KiviKeys (per-channel groups)."""
    k = jnp.asarray(k)
    _check(k, bits, group_size, k.shape[-2], "token axis", "kivi_quantize_keys")
    return _quantize_keys(k, bits, group_size)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def _quantize_keys(k: jax.Array, bits: int, group_size: int) -> KiviKeys:
    *lead, t, d = k.shape
    grouped = k.astype(jnp.float32).reshape(*lead, t // group_size, group_size, d)
    codes, scale, lo = _minmax(grouped, -2, bits)
    packed = pack_bits(codes.reshape(*lead, t, d), bits)
    return KiviKeys(packed, scale[..., 0, :], lo[..., 0, :], bits, group_size)


@functools.partial(jax.jit, static_argnames="dtype")
def kivi_dequantize_keys(q: KiviKeys, dtype=jnp.float32) -> jax.Array:
    """KiviKeys -> [..., T, D] in dtype."""
    *lead, n_groups, d = q.scale.shape
    codes = unpack_bits(q.codes, q.bits, d).astype(jnp.float32)
    codes = codes.reshape(*lead, n_groups, q.group_size, d)
    x = codes * q.scale[..., None, :] + q.zero[..., None, :]
    return x.reshape(*lead, n_groups * q.group_size, d).astype(dtype)


def kivi_quantize_values(v: jax.Array, bits: int, group_size: int = DEFAULT_GROUP) -> KiviValues:
    """Float values [..., T, D] (D % group_size == 0) -> KiviValues (per-token groups)."""
    v = jnp.asarray(v)
    _check(v, bits, group_size, v.shape[-1], "channel axis", "kivi_quantize_values")
    return _quantize_values(v, bits, group_size)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def _quantize_values(v: jax.Array, bits: int, group_size: int) -> KiviValues:
    *lead, t, d = v.shape
    grouped = v.astype(jnp.float32).reshape(*lead, t, d // group_size, group_size)
    codes, scale, lo = _minmax(grouped, -1, bits)
    packed = pack_bits(codes.reshape(*lead, t, d), bits)
    return KiviValues(packed, scale[..., 0], lo[..., 0], bits, group_size)


@functools.partial(jax.jit, static_argnames="dtype")
def kivi_dequantize_values(q: KiviValues, dtype=jnp.float32) -> jax.Array:
    """KiviValues -> [..., T, D] in dtype."""
    *lead, t, n_groups = q.scale.shape
    d = n_groups * q.group_size
    codes = unpack_bits(q.codes, q.bits, d).astype(jnp.float32)
    codes = codes.reshape(*lead, t, n_groups, q.group_size)
    x = codes * q.scale[..., None] + q.zero[..., None]
    return x.reshape(*lead, t, d).astype(dtype)


def kivi_num_quantized(num_tokens: int, window: int = DEFAULT_WINDOW, group_size: int = DEFAULT_GROUP) -> int:
    """How many of the oldest tokens the window rule quantizes (a multiple of group_size)."""
    return max(num_tokens - window, 0) // group_size * group_size


def kivi_compress(
    k: jax.Array,
    v: jax.Array,
    bits: int,
    window: int = DEFAULT_WINDOW,
    group_size: int = DEFAULT_GROUP,
) -> KiviKV:
    """A sequence's keys and values [..., T, D] -> KiviKV under the window rule.

    The recent tokens keep k's and v's dtype; T may be anything (the window absorbs
    the remainder of the last incomplete group).
    """
    k, v = jnp.asarray(k), jnp.asarray(v)
    if k.shape != v.shape or k.ndim < 2:
        raise ValueError(f"kivi_compress: K {k.shape} and V {v.shape} must both be [..., T, D]")
    if window < 0:
        raise ValueError(f"kivi_compress: window must be >= 0, got {window}")
    n = kivi_num_quantized(k.shape[-2], window, group_size)
    keys = kivi_quantize_keys(k[..., :n, :], bits, group_size)
    values = kivi_quantize_values(v[..., :n, :], bits, group_size)
    return KiviKV(keys, values, k[..., n:, :], v[..., n:, :], window)


@jax.jit
def kivi_decompress(kv: KiviKV) -> tuple[jax.Array, jax.Array]:
    """KiviKV -> (K, V), each [..., T, D] in the recent window's dtype."""
    dtype = kv.k_recent.dtype
    k = jnp.concatenate([kivi_dequantize_keys(kv.keys, dtype), kv.k_recent], axis=-2)
    v = jnp.concatenate([kivi_dequantize_values(kv.values, dtype), kv.v_recent], axis=-2)
    return k, v
