"""The quantized matmul's Pallas TPU (Mosaic) kernel.

Grid (token tiles, output tiles, K tiles), K last and sequential: each step loads one K
tile of the packed weight (codes, scale and offset rows of whole groups) and the matching
x planes into VMEM, dequantizes the tile and adds its product to a float32 VMEM
accumulator, written out in x.dtype after the last K tile. The body is
tiles.tile_product.

Blocks follow Mosaic's tiling, so the weight is never padded (a pad would copy it every
call): a K tile is the whole input width unless a tile of 1024 / 2048 / 512 / 256 rows
divides it with its code bytes a multiple of 128 rows and its scale rows a multiple of
the scale dtype's sublane tile; an output tile is the whole width unless it is a multiple
of 128. Tokens are padded to the token tile (a multiple of 8, of 16 for a 16-bit x).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.padding import pad_to
from pallas_kernels.quant_matmul.tiles import as_bytes, num_planes, planes, tile_product

MAX_TILE_WEIGHTS = 512 * 512  # weights dequantized per step: their float32 copies live in VMEM


def _sublanes(dtype) -> int:
    """Rows of one VMEM tile of `dtype` (8 for 32-bit, 16 for 16-bit, 32 for 8-bit)."""
    return 32 // jnp.dtype(dtype).itemsize


def _k_tile(d_in: int, group: int, fmt: str, scale_dtype) -> int:
    per_channel = group == d_in
    for bk in (1024, 2048, 512, 256):
        if bk >= d_in or d_in % bk or (bk // num_planes(fmt)) % 128:
            continue
        if per_channel or (bk % group == 0 and (bk // group) % _sublanes(scale_dtype) == 0):
            return bk
    return d_in


def _out_tile(d_out: int, bk: int) -> int:
    if d_out % 128:
        return d_out
    fits = [t for t in (512, 256, 128) if d_out % t == 0 and t * bk <= MAX_TILE_WEIGHTS]
    return fits[0] if fits else 128


def _body(*refs, fmt, num_x, has_offset):
    xs, (codes_ref, scale_ref) = refs[:num_x], refs[num_x:num_x + 2]
    offset_ref = refs[num_x + 2] if has_offset else None
    o_ref, acc_ref = refs[-2:]

    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    offset = None if offset_ref is None else offset_ref[...]
    acc_ref[...] += tile_product([x[...] for x in xs], codes_ref[...], scale_ref[...], offset,
                                 fmt=fmt)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "group", "block_t", "block_k", "block_n",
                                             "interpret"))
def quant_matmul_tpu(x, codes, scale, offset=None, *, fmt: str, group: int, block_t: int = 256,
                     block_k: int | None = None, block_n: int | None = None, interpret=False):
    """As ref.quant_matmul_ref, on TPU (Mosaic) or in interpret mode; returns x.dtype.

    x [T, in] float; codes, scale, offset: a PackedWeight's arrays (offset None when the
    format has none); fmt, group: its static fields. block_k / block_n override the tile
    choice (rows of the weight per K tile, a multiple of the group; output columns per
    tile): tests use small ones in interpret mode, where Mosaic's tiling does not apply.
    """
    num_tokens, d_in = x.shape
    d_out = codes.shape[1]
    bk = block_k or _k_tile(d_in, group, fmt, scale.dtype)
    bn = block_n or _out_tile(d_out, bk)
    rows = max(8, _sublanes(x.dtype))  # the output block is x.dtype
    bt = min(block_t, -(-num_tokens // rows) * rows)
    padded = -(-num_tokens // bt) * bt
    xs = planes(pad_to(x.astype(jnp.float32), 0, padded), fmt, group)
    per_channel = scale.shape[0] == 1
    cols = bk // num_planes(fmt)  # x plane columns and code rows of one K tile
    srows = 1 if per_channel else bk // group
    scale_map = (lambda i, j, k: (0, j)) if per_channel else (lambda i, j, k: (k, j))
    arrays = [as_bytes(codes), scale] + ([] if offset is None else [offset])
    in_specs = [pl.BlockSpec((bt, cols), lambda i, j, k: (i, k)) for _ in xs]
    in_specs += [pl.BlockSpec((cols, bn), lambda i, j, k: (k, j))]
    in_specs += [pl.BlockSpec((srows, bn), scale_map) for _ in arrays[1:]]
    out = pl.pallas_call(
        functools.partial(_body, fmt=fmt, num_x=len(xs), has_offset=offset is not None),
        out_shape=jax.ShapeDtypeStruct((padded, d_out), x.dtype),
        grid=(padded // bt, d_out // bn, d_in // bk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bt, bn), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((bt, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(*xs, *arrays)
    return out[:num_tokens]
