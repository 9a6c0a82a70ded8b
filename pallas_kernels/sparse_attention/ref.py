"""Sparse (selected-row) attention in plain jnp: the truth for the sparse kernels."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_attention.ref import attention_over_rows
from pallas_kernels.variant import SOFTMAX


def sparse_attention_ref(q, segments, sinks=None, *, sm_scale, variant=SOFTMAX):
    """q [T, Hq, D]; segments: tuple of (k_rows [N, Hkv, D], v_rows [N, Hkv, D],
    indices int32 [T, n] with -1 = empty). Attends to the concatenation of all segments'
    selected rows. Positions seen by variant: q_pos = token index, kv_pos = row id."""
    ks, vs, masks, pos = [], [], [], []
    for k_rows, v_rows, indices in segments:
        rows = jnp.maximum(indices, 0)
        ks.append(k_rows[rows])
        vs.append(v_rows[rows])
        masks.append(indices >= 0)
        pos.append(indices)
    q_pos = jnp.arange(q.shape[0], dtype=jnp.int32)
    return attention_over_rows(
        q,
        jnp.concatenate(ks, 1),
        jnp.concatenate(vs, 1),
        jnp.concatenate(masks, 1),
        q_pos,
        jnp.concatenate(pos, 1),
        sm_scale=sm_scale,
        variant=variant,
        sinks=sinks,
    )
