"""Block-sparse (BSR) attention in plain jnp: expand the block pattern to a dense mask."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_attention.ref import attention_over_rows
from pallas_kernels.variant import SOFTMAX


def bsr_to_block_mask(indptr, indices, num_col_blocks):
    """bool [num_row_blocks, num_col_blocks]: block (i, j) is read iff j is listed in
    indices[indptr[i]:indptr[i+1]]. Entries past indptr[-1] are ignored."""
    num_row_blocks = indptr.shape[0] - 1
    entry = jnp.arange(indices.shape[0], dtype=jnp.int32)
    row = jnp.sum(entry[:, None] >= indptr[None, 1:], axis=1)
    live = entry < indptr[-1]
    row = jnp.where(live, row, num_row_blocks)  # out of bounds: dropped
    return jnp.zeros((num_row_blocks, num_col_blocks), bool).at[row, indices].set(True, mode="drop")


def block_sparse_attention_ref(
    q, k, v, indptr, indices, sinks=None, *, block_r, block_c, sm_scale, variant=SOFTMAX
):
    """Same contract as pallas_kernels.block_sparse_attention (arguments validated)."""
    num_q, num_kv = q.shape[0], k.shape[0]
    blocks = bsr_to_block_mask(indptr, indices, num_kv // block_c)
    mask = jnp.repeat(jnp.repeat(blocks, block_r, axis=0), block_c, axis=1)
    kv_pos = jnp.broadcast_to(jnp.arange(num_kv, dtype=jnp.int32), (num_q, num_kv))
    k_rows = jnp.broadcast_to(k[None], (num_q, *k.shape))
    v_rows = jnp.broadcast_to(v[None], (num_q, *v.shape))
    return attention_over_rows(
        q,
        k_rows,
        v_rows,
        mask,
        jnp.arange(num_q, dtype=jnp.int32),
        kv_pos,
        sm_scale=sm_scale,
        variant=variant,
        sinks=sinks,
    )
