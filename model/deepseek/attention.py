"""CSA2 attention through pallas_kernels.sparse_attention, with a gradient.

The entry has no VJP (its TPU kernel is forward only), so the model wraps it: the forward
is the entry (the Pallas kernel on TPU, the XLA reference elsewhere), the backward is the
VJP of the entry's own jnp reference. When the entry grows a backward, delete this file's
custom_vjp and call the entry directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import sparse_attention
from pallas_kernels.sparse_attention.ref import sparse_attention_ref


def _segments(rows_and_indices):
    return tuple((rows, rows, idx) for rows, idx in rows_and_indices)


@jax.custom_vjp
def _attend(q, rows, indices, window_rows, window_indices, sinks):
    out, _ = sparse_attention(q, rows, rows, indices, window=(window_rows, window_rows, window_indices),
                              sinks=sinks)
    return out


def _attend_fwd(q, rows, indices, window_rows, window_indices, sinks):
    return _attend(q, rows, indices, window_rows, window_indices, sinks), (
        q, rows, indices, window_rows, window_indices, sinks)


def _attend_bwd(res, ct):
    q, rows, indices, window_rows, window_indices, sinks = res

    def ref(q, rows, window_rows, sinks):
        segments = _segments([(rows, indices), (window_rows, window_indices)])
        return sparse_attention_ref(q, segments, sinks, sm_scale=q.shape[-1] ** -0.5)[0]

    _, vjp = jax.vjp(ref, q, rows, window_rows, sinks)
    dq, drows, dwindow, dsinks = vjp(ct)
    return dq, drows, None, dwindow, None, dsinks


_attend.defvjp(_attend_fwd, _attend_bwd)


def csa_attention(q, rows, indices, window_rows, window_indices, sinks):
    """Attention of each query over its selected compressed rows and its window rows, K = V.

    q: [B, T, Hq, D]; rows: [B, R, D] compressed rows (None for SWA-only layers);
    indices: int32 [B, T, k] row ids, -1 = empty; window_rows: [B, S, D];
    window_indices: int32 [B, T, W], -1 = empty; sinks: f32 [Hq].
    Returns [B, T, Hq, D] in q.dtype. Sequences are flattened into one row table for the
    entry (row ids offset by b * rows-per-sequence).
    """
    b, t, hq, d = q.shape

    def flat(table, idx):
        n = table.shape[1]
        offset = (jnp.arange(b, dtype=jnp.int32) * n)[:, None, None]
        idx = jnp.where(idx >= 0, idx + offset, -1).reshape(b * t, -1)
        return table.reshape(b * n, 1, d).astype(q.dtype), idx.astype(jnp.int32)

    wr, wi = flat(window_rows, window_indices)
    if rows is None:  # SWA only: the window is the only segment (an empty selection costs nothing)
        rows, indices = window_rows[:, :1], jnp.full((b, t, 1), -1, jnp.int32)
    cr, ci = flat(rows, indices)
    out = _attend(q.reshape(b * t, hq, d), cr, ci, wr, wi, sinks.astype(jnp.float32))
    return out.reshape(b, t, hq, d)
