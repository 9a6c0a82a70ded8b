"""What the TPU and GPU kernels of the batched LoRA matmul share: the per-tile slot
bitmask, the kernel body and zero padding (each kernel module compiles for its own
platform alone, so neither imports the other).

The grid walks (token tile, output tile). A token tile carries a bitmask of the adapter
slots its tokens use (computed by the wrapper): the body runs the shrink
(x @ A[slot]) and expand (@ B[slot]) only for those slots, each on the tile's rows of
that slot (the other rows are zeroed before the shrink), and accumulates in the output
block. So a step whose tokens use one adapter costs one small matmul pair per tile,
whatever the number of slots; a tile mixing adapters (decode rows of different
requests) pays one pair per adapter present, as Punica's BGMV gathers per token.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.padding import pad_to

MAX_SLOTS = 31  # the tile bitmask is one int32


def pad_slots(slots, size: int):
    """slots padded to `size` with -1 (no adapter)."""
    return pad_to(slots + 1, 0, size) - 1


def tile_bitmask(slots, block_t: int, num_slots: int):
    """int32 [T / block_t]: bit l set when a token of the tile uses slot l."""
    tiles = slots.reshape(-1, block_t, 1) == jnp.arange(num_slots, dtype=slots.dtype)
    bits = jnp.left_shift(jnp.int32(1), jnp.arange(num_slots, dtype=jnp.int32))
    return jnp.sum(jnp.where(jnp.any(tiles, axis=1), bits, 0), axis=-1).astype(jnp.int32)


def accumulate_slots(word, slots_ref, x_ref, a_ref, b_ref, o_ref, *, num_slots: int):
    """The kernel body: o = sum over the slots set in `word` of
    ((x masked to the slot's rows) @ A[slot]) @ B[slot], accumulated in float32."""
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
