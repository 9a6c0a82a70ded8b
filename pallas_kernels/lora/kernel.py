"""Pallas kernels of the batched LoRA matmul, one body for TPU (Mosaic) and GPU (Triton).

The grid walks (token tile, output tile). A token tile carries a bitmask of the adapter
slots its tokens use (computed by the wrapper): the body runs the shrink
(x @ A[slot]) and expand (@ B[slot]) only for those slots, each on the tile's rows of
that slot (the other rows are zeroed before the shrink), and accumulates in the output
block. So a step whose tokens use one adapter costs one small matmul pair per tile,
whatever the number of slots; a tile mixing adapters (decode rows of different
requests) pays one pair per adapter present, as Punica's BGMV gathers per token.

TPU: the bitmask is scalar-prefetched into SMEM; blocks follow Mosaic's tiling (token
tiles of 8k rows, output tiles of 128k lanes or the whole width). GPU: Triton needs
power-of-two blocks and dot operands of at least 16, so the wrapper pads the input
width, rank and slot count to powers of two (at least 16) and the output width to a
multiple of the output tile; padding is zeros and changes nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

MAX_SLOTS = 31  # the tile bitmask is one int32


def _pad_to(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def tile_bitmask(slots, block_t: int, num_slots: int):
    """int32 [T / block_t]: bit l set when a token of the tile uses slot l."""
    tiles = slots.reshape(-1, block_t, 1) == jnp.arange(num_slots, dtype=slots.dtype)
    bits = jnp.left_shift(jnp.int32(1), jnp.arange(num_slots, dtype=jnp.int32))
    return jnp.sum(jnp.where(jnp.any(tiles, axis=1), bits, 0), axis=-1).astype(jnp.int32)


def _body(word, slots_ref, x_ref, a_ref, b_ref, o_ref, *, num_slots):
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    x = x_ref[...]
    slots = slots_ref[...]  # [block_t, 1]
    for slot in range(num_slots):
        @pl.when(jnp.bitwise_and(jnp.right_shift(word, slot), 1) == 1)
        def _():
            mine = (slots == slot).astype(x.dtype) * x
            shrink = jnp.dot(mine, a_ref[slot], preferred_element_type=jnp.float32)
            o_ref[...] += jnp.dot(shrink.astype(b_ref.dtype), b_ref[slot],
                                  preferred_element_type=jnp.float32)


def _tpu_body(words_ref, slots_ref, x_ref, a_ref, b_ref, o_ref, *, num_slots):
    _body(words_ref[pl.program_id(0)], slots_ref, x_ref, a_ref, b_ref, o_ref, num_slots=num_slots)


def _out_tile_tpu(d_out: int) -> int:
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
    x_p, slots_p = _pad_to(x, 0, padded), _pad_to(slots + 1, 0, padded) - 1  # pad rows: slot -1
    bo = _out_tile_tpu(d_out)
    out = pl.pallas_call(
        functools.partial(_tpu_body, num_slots=num_slots),
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


def _gpu_body(word_ref, slots_ref, x_ref, a_ref, b_ref, o_ref, *, num_slots):
    _body(word_ref[0], slots_ref, x_ref, a_ref, b_ref, o_ref, num_slots=num_slots)


@functools.partial(jax.jit, static_argnames=("block_t", "block_out", "interpret", "num_warps"))
def lora_matmul_gpu(x, lora_a, lora_b, slots, *, block_t: int = 16, block_out: int = 64,
                    interpret=False, num_warps: int = 4):
    """As ref.lora_matmul_ref, on GPU (Triton) or in interpret mode; returns x.dtype."""
    num_tokens, d_in = x.shape
    num_slots, _, rank = lora_a.shape
    d_out = lora_b.shape[-1]
    padded = -(-num_tokens // block_t) * block_t
    d_in_p, rank_p, slots_n = _pow2(d_in, 16), _pow2(rank, 16), _pow2(num_slots)
    d_out_p = -(-d_out // block_out) * block_out
    x_p = _pad_to(_pad_to(x, 0, padded), 1, d_in_p)
    slots_p = _pad_to(slots + 1, 0, padded) - 1
    a = _pad_to(_pad_to(_pad_to(lora_a, 0, slots_n), 1, d_in_p), 2, rank_p)
    b = _pad_to(_pad_to(_pad_to(lora_b, 0, slots_n), 1, rank_p), 2, d_out_p)
    out = pl.pallas_call(
        functools.partial(_gpu_body, num_slots=num_slots),
        out_shape=jax.ShapeDtypeStruct((padded, d_out_p), jnp.float32),
        grid=(padded // block_t, d_out_p // block_out),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((block_t, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((block_t, d_in_p), lambda i, j: (i, 0)),
            pl.BlockSpec((slots_n, d_in_p, rank_p), lambda i, j: (0, 0, 0)),
            pl.BlockSpec((slots_n, rank_p, block_out), lambda i, j: (0, 0, j)),
        ],
        out_specs=pl.BlockSpec((block_t, block_out), lambda i, j: (i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
    )(tile_bitmask(slots_p, block_t, num_slots), slots_p[:, None], x_p, a, b)
    return out[:num_tokens, :d_out].astype(x.dtype)
