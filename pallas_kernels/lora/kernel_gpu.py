"""The batched LoRA matmul's Pallas GPU (Triton) kernel. Triton needs power-of-two
blocks and dot operands of at least 16, so the wrapper pads the input width, rank and
slot count to powers of two (at least 16) and the output width to a multiple of the
output tile; the padding is zeros and changes nothing. The body is
tiles.accumulate_slots; each program reads its tile's bitmask as a one-element block."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lora.tiles import accumulate_slots, pad_slots, tile_bitmask
from pallas_kernels.padding import pad_to


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _body(word_ref, slots_ref, x_ref, a_ref, b_ref, o_ref, *, num_slots):
    accumulate_slots(word_ref[0], slots_ref, x_ref, a_ref, b_ref, o_ref, num_slots=num_slots)


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
    x_p = pad_to(pad_to(x, 0, padded), 1, d_in_p)
    slots_p = pad_slots(slots, padded)
    a = pad_to(pad_to(pad_to(lora_a, 0, slots_n), 1, d_in_p), 2, rank_p)
    b = pad_to(pad_to(pad_to(lora_b, 0, slots_n), 1, rank_p), 2, d_out_p)
    out = pl.pallas_call(
        functools.partial(_body, num_slots=num_slots),
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
