"""Block-scaled low-bit formats along the last axis: NVFP4, MXFP4, FP8 E4M3 + UE8M0.

Each quantized container is a NamedTuple (so a pytree: it can be jitted, scanned and
stored in a KV pool). Rows are the last axis; every leading axis is batch.

| format     | block | element          | block scale            | extra            |
|------------|-------|------------------|------------------------|------------------|
| NVFP4      | 16    | E2M1, 2 per byte | E4M3                   | f32 tensor scale |
| MXFP4      | 32    | E2M1, 2 per byte | UE8M0 (uint8)          |                  |
| FP8 block  | 32    | E4M3, 1 byte     | UE8M0 (uint8)          |                  |

Scale rules (each the one its source uses):
- NVFP4 (NVIDIA's two-level recipe): tensor_scale = amax(x) / (448 * 6); block scale =
  e4m3(amax(block) * (1 / (6 * tensor_scale))), float32 operations in that order (what the
  CPU attention kernel's KV write repeats); elements e2m1(x / (block_scale * tensor_scale)).
- MXFP4 (OCP MX v1.0): shared exponent floor(log2(amax(block))) - 2, 2 being E2M1's
  largest exponent; elements that land above 6 saturate, as the spec prescribes.
- FP8 block (DeepSeek's ue8m0 scale_fmt): scale = 2**ceil(log2(amax(block) / 448)),
  rounded up so no element saturates.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from quant.formats import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    e2m1_encode_scaled,
    e4m3_decode,
    e4m3_encode,
    pow2,
    pow2_exponent,
    ue8m0_decode,
    ue8m0_encode,
)
from quant.packing import pack_nibbles, unpack_nibbles

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
FP8_BLOCK = 32
_E2M1_EMAX = 2  # 6 = 1.5 * 2**2


class NVFP4(NamedTuple):
    """packed: uint8 [..., d/2]; scales: float8_e4m3fn [..., d/16] (or their uint8 bits, as KV
    page pools keep them); tensor_scale: f32 []."""

    packed: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array


class MXFP4(NamedTuple):
    """packed: uint8 [..., d/2]; scales: uint8 UE8M0 codes [..., d/32]."""

    packed: jax.Array
    scales: jax.Array


class FP8Block(NamedTuple):
    """values: float8_e4m3fn [..., d] (or their uint8 bits, as the CSA2 window ring keeps them);
    scales: uint8 UE8M0 codes [..., d/32]."""

    values: jax.Array
    scales: jax.Array


def _check(x: jax.Array, block: int, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a float [..., d] array, got {x.dtype}{x.shape}")
    if x.shape[-1] % block:
        raise ValueError(f"{name}: last axis {x.shape[-1]} must be a multiple of the block size {block}")
    return x


def _blocks(x: jax.Array, block: int) -> jax.Array:
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblock(blocks: jax.Array) -> jax.Array:
    return blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])


def nvfp4_quantize(x: jax.Array, tensor_scale: float | jax.Array | None = None) -> NVFP4:
    """Float [..., d] (d % 16 == 0) -> NVFP4.

    tensor_scale: None computes amax(x) / (448 * 6) (1.0 for an all-zero tensor). Pass a
    fixed value (1.0) where rows are written one at a time and no tensor amax exists, as
    in a KV cache; block scales then saturate at 448, i.e. |x| up to 2688 is representable.
    """
    x = _check(x, NVFP4_BLOCK, "nvfp4_quantize")
    if tensor_scale is None:
        return _nvfp4_quantize(x, None)
    if isinstance(tensor_scale, (int, float)) and not tensor_scale > 0:
        raise ValueError(f"nvfp4_quantize: tensor_scale must be > 0, got {tensor_scale}")
    ts = jnp.asarray(tensor_scale, jnp.float32)
    if ts.ndim:
        raise ValueError(f"nvfp4_quantize: tensor_scale must be a scalar, got shape {ts.shape}")
    return _nvfp4_quantize(x, ts)


@jax.jit
def _nvfp4_quantize(x: jax.Array, ts: jax.Array | None) -> NVFP4:
    blocks = _blocks(x, NVFP4_BLOCK)
    if ts is None:
        ts = jnp.max(jnp.abs(blocks)) / (E4M3_MAX * E2M1_MAX)
        ts = jnp.where(ts > 0, ts, 1.0)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    # A multiplication by the reciprocal, whether ts is traced or a constant XLA folds (it
    # turns a division by a constant into one), so that eager, jitted and the CPU attention
    # kernel's KV write (pallas_kernels/ragged_paged_attention/cpu_kernel.cc) agree.
    scales = e4m3_encode(amax * (1.0 / (E2M1_MAX * ts)))
    codes = e2m1_encode_scaled(blocks, (e4m3_decode(scales) * ts)[..., None])
    return NVFP4(pack_nibbles(_unblock(codes)), scales, ts)


@functools.partial(jax.jit, static_argnames="dtype")
def nvfp4_dequantize(q: NVFP4, dtype=jnp.float32) -> jax.Array:
    """NVFP4 -> [..., d] in dtype."""
    vals = e2m1_decode(unpack_nibbles(q.packed))
    blocks = vals.reshape(*vals.shape[:-1], -1, NVFP4_BLOCK)
    scale = (e4m3_decode(q.scales) * q.tensor_scale)[..., None]
    return _unblock(blocks * scale).astype(dtype)


def mxfp4_quantize(x: jax.Array) -> MXFP4:
    """Float [..., d] (d % 32 == 0) -> MXFP4 (OCP MX: floor exponent, saturating)."""
    return _mxfp4_quantize(_check(x, MXFP4_BLOCK, "mxfp4_quantize"))


@jax.jit
def _mxfp4_quantize(x: jax.Array) -> MXFP4:
    blocks = _blocks(x, MXFP4_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    exp = jnp.clip(pow2_exponent(amax, round_up=False) - _E2M1_EMAX, -127, 127)
    codes = e2m1_encode(blocks * pow2(-exp)[..., None])
    return MXFP4(pack_nibbles(_unblock(codes)), ue8m0_encode(exp))


@functools.partial(jax.jit, static_argnames="dtype")
def mxfp4_dequantize(q: MXFP4, dtype=jnp.float32) -> jax.Array:
    """MXFP4 -> [..., d] in dtype."""
    vals = e2m1_decode(unpack_nibbles(q.packed))
    blocks = vals.reshape(*vals.shape[:-1], -1, MXFP4_BLOCK)
    return _unblock(blocks * ue8m0_decode(q.scales)[..., None]).astype(dtype)


def fp8_block_quantize(x: jax.Array) -> FP8Block:
    """Float [..., d] (d % 32 == 0) -> FP8 E4M3 values with a UE8M0 scale per 32 channels."""
    return _fp8_block_quantize(_check(x, FP8_BLOCK, "fp8_block_quantize"))


@jax.jit
def _fp8_block_quantize(x: jax.Array) -> FP8Block:
    blocks = _blocks(x, FP8_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    exp = jnp.clip(pow2_exponent(amax / E4M3_MAX, round_up=True), -127, 127)
    values = e4m3_encode(blocks * pow2(-exp)[..., None])
    return FP8Block(_unblock(values), ue8m0_encode(exp))


@functools.partial(jax.jit, static_argnames="dtype")
def fp8_block_dequantize(q: FP8Block, dtype=jnp.float32) -> jax.Array:
    """FP8Block -> [..., d] in dtype."""
    vals = e4m3_decode(q.values)
    blocks = vals.reshape(*vals.shape[:-1], -1, FP8_BLOCK)
    return _unblock(blocks * ue8m0_decode(q.scales)[..., None]).astype(dtype)


# Bytes one row of `dim` values takes, block scales included, per-tensor scalars excluded.
_ROW_BYTES = {
    "nvfp4": (NVFP4_BLOCK, lambda d: d // 2 + d // NVFP4_BLOCK),
    "mxfp4": (MXFP4_BLOCK, lambda d: d // 2 + d // MXFP4_BLOCK),
    "fp8_ue8m0": (FP8_BLOCK, lambda d: d + d // FP8_BLOCK),
    "bf16": (1, lambda d: 2 * d),
}
FORMATS = tuple(_ROW_BYTES)


def bytes_per_row(fmt: str, dim: int) -> int:
    """Storage bytes for one row of `dim` values in `fmt` (one of FORMATS), scales included.

    NVFP4 512 -> 288, MXFP4 128 -> 68, fp8_ue8m0 512 -> 528, bf16 512 -> 1024.
    """
    if fmt not in _ROW_BYTES:
        raise ValueError(f"unknown format {fmt!r}; allowed: {', '.join(FORMATS)}")
    block, size = _ROW_BYTES[fmt]
    if dim <= 0 or dim % block:
        raise ValueError(f"{fmt}: dim must be a positive multiple of {block}, got {dim}")
    return size(dim)


def stored_bytes_per_row(q: NVFP4 | MXFP4 | FP8Block) -> float:
    """Measured bytes per row of a quantized array: nbytes of its per-row leaves / rows.

    The NVFP4 tensor scale (one f32 per tensor) is amortized to zero and left out.
    """
    if not isinstance(q, (NVFP4, MXFP4, FP8Block)):
        raise ValueError(f"expected NVFP4, MXFP4 or FP8Block, got {type(q).__name__}")
    rows_leaves = (q.values, q.scales) if isinstance(q, FP8Block) else (q.packed, q.scales)
    rows = math.prod(rows_leaves[0].shape[:-1])
    return sum(leaf.nbytes for leaf in rows_leaves) / rows
