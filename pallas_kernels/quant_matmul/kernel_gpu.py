"""The quantized matmul's Pallas GPU (Triton) kernel.

Grid (token tiles, output tiles); each program walks the K tiles in a loop, loading one
K tile of the packed weight (whole groups) and the matching x planes, dequantizing it in
registers and accumulating its product in float32 (a GPU grid has no sequential axis to
accumulate over). The body is tiles.tile_product.

Triton needs power-of-two loads and dot operands of at least 16. Tokens are padded to the
token tile (a power of two, at least 16); a K tile is a power of two dividing the input
width (at least 16 x columns per plane; grouped formats' groups are powers of two) and an
output tile a power of two dividing the output width. Only an input width (per-channel
formats) or output width that is not a multiple of 16 pads the weight, a copy per call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.padding import pad_to
from pallas_kernels.quant_matmul.tiles import as_bytes, num_planes, planes, tile_product

MIN_DOT = 16  # Triton's smallest dot dimension


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _largest_pow2_tile(size: int, most: int, step: int) -> int:
    """The largest power of two <= max(most, step) that is a multiple of `step` and divides
    `size` (step, a power of two, divides size)."""
    tile = step
    while tile * 2 <= most and size % (tile * 2) == 0:
        tile *= 2
    return tile


def _body(*refs, fmt, num_x, has_offset, cols, srows, num_k):
    xs, (codes_ref, scale_ref) = refs[:num_x], refs[num_x:num_x + 2]
    offset_ref = refs[num_x + 2] if has_offset else None
    o_ref = refs[-1]
    per_channel = srows == 0

    def step(k, acc):
        x = [x_ref[:, pl.ds(k * cols, cols)] for x_ref in xs]
        codes = codes_ref[pl.ds(k * cols, cols), :]
        rows = slice(None) if per_channel else pl.ds(k * srows, srows)
        offset = None if offset_ref is None else offset_ref[rows, :]
        return acc + tile_product(x, codes, scale_ref[rows, :], offset, fmt=fmt)

    acc = lax.fori_loop(0, num_k, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "group", "block_t", "block_k", "block_n",
                                             "interpret", "num_warps", "num_stages"))
def quant_matmul_gpu(x, codes, scale, offset=None, *, fmt: str, group: int, block_t: int = 64,
                     block_k: int = 128, block_n: int = 64, interpret=False, num_warps: int = 4,
                     num_stages: int = 2):
    """As ref.quant_matmul_ref, on GPU (Triton) or in interpret mode; returns x.dtype.

    x [T, in] float; codes, scale, offset: a PackedWeight's arrays (offset None when the
    format has none); fmt, group: its static fields. block_t / block_k / block_n: the
    largest token, K (weight rows) and output tiles to use.
    """
    num_tokens, d_in = x.shape
    d_out, out_dtype = codes.shape[1], x.dtype
    per_channel = scale.shape[0] == 1 and offset is None
    p = num_planes(fmt)
    if not per_channel and group & (group - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two group, got {group}")
    bt = min(block_t, _pow2(num_tokens, MIN_DOT))
    padded = -(-num_tokens // bt) * bt
    x = pad_to(x.astype(jnp.float32), 0, padded)
    codes = as_bytes(codes)
    if per_channel and d_in % (MIN_DOT * p):
        # Only 8-bit per-channel formats get here (4-bit ones are grouped).
        d_in = -(-d_in // MIN_DOT) * MIN_DOT
        x, codes = pad_to(x, 1, d_in), pad_to(codes, 0, d_in)
    d_out_p = -(-d_out // MIN_DOT) * MIN_DOT
    codes, scale = pad_to(codes, 1, d_out_p), pad_to(scale, 1, d_out_p)
    offset = None if offset is None else pad_to(offset, 1, d_out_p)
    bk = _largest_pow2_tile(d_in, block_k, MIN_DOT * p if per_channel else max(group, MIN_DOT * p))
    bn = _largest_pow2_tile(d_out_p, block_n, MIN_DOT)
    xs = planes(x, fmt, group)
    cols = bk // p
    arrays = [codes, scale] + ([] if offset is None else [offset])
    in_specs = [pl.BlockSpec((bt, d_in // p), lambda i, j: (i, 0)) for _ in xs]
    in_specs += [pl.BlockSpec((a.shape[0], bn), lambda i, j: (0, j)) for a in arrays]
    body = functools.partial(_body, fmt=fmt, num_x=len(xs), has_offset=offset is not None,
                             cols=cols, srows=0 if per_channel else bk // group,
                             num_k=d_in // bk)
    out = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((padded, d_out_p), out_dtype),
        grid=(padded // bt, d_out_p // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bt, bn), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*xs, *arrays)
    return out[:num_tokens, :d_out]
