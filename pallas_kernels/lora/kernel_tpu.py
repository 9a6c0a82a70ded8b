"""The batched LoRA matmul's Pallas TPU (Mosaic) kernel: the tile bitmask is
scalar-prefetched into SMEM; blocks follow Mosaic's tiling (token tiles of 8k rows,
output tiles of 128k lanes or the whole width). The body is tiles.accumulate_slots."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.lora.tiles import accumulate_slots, pad_slots, tile_bitmask
from pallas_kernels.padding import pad_to


def _body(words_ref, slots_ref, x_ref, a_ref, b_ref, o_ref, *, num_slots):
    accumulate_slots(words_ref[pl.program_id(0)], slots_ref, x_ref, a_ref, b_ref, o_ref,
                     num_slots=num_slots)


def _out_tile(d_out: int) -> int:
    if d_out % 128:
        return d_out
    return next(t for t in (512, 256, 128) if d_out % t == 0)


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def lora_matmul_tpu(x, lora_a, lora_b, slots, *, block_t: int = 128, interpret=False):
    """As ref.lora_matmul_ref, on TPU (Mosaic) or in interpret mode; returns x.dtype."""
    num_tokens, d_in = x.shape
    num_slots, _, rank = lora_a.shape
    d_out = lora_b.shape[-1]
    bt = min(block_t, -(-num_tokens // 8) * 8)
    padded = -(-num_tokens // bt) * bt
    x_p, slots_p = pad_to(x, 0, padded), pad_slots(slots, padded)
    bo = _out_tile(d_out)
    out = pl.pallas_call(
        functools.partial(_body, num_slots=num_slots),
        out_shape=jax.ShapeDtypeStruct((padded, d_out), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded // bt, d_out // bo),
            in_specs=[
                pl.BlockSpec((bt, 1), lambda i, j, w: (i, 0)),
                pl.BlockSpec((bt, d_in), lambda i, j, w: (i, 0)),
                pl.BlockSpec((num_slots, d_in, rank), lambda i, j, w: (0, 0, 0)),
                pl.BlockSpec((num_slots, rank, bo), lambda i, j, w: (0, 0, j)),
            ],
            out_specs=pl.BlockSpec((bt, bo), lambda i, j, w: (i, j)),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(tile_bitmask(slots_p, bt, num_slots), slots_p[:, None], x_p, lora_a, lora_b)
    return out[:num_tokens].astype(x.dtype)
