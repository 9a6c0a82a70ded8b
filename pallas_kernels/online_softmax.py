"""The (m, l, acc) running state every attention kernel carries over KV tiles.

Rows are query rows (heads, or tokens x heads); all state is f32. Masked entries never
contribute, and a row that saw no key keeps m = -inf, l = 0, acc = 0, which finalize()
turns into out = 0 and lse = -inf (or lse = sink with an attention sink).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.variant import AttentionVariant

NEG_INF = float("-inf")


def update(variant: AttentionVariant, m, l, s, mask):
    """One KV tile. s, mask: [rows, cols]; m, l: [rows, 1].

    Returns (m_new, l_new, alpha, p): the caller does acc = alpha * acc + p @ v.
    """
    if not variant.uses_softmax:
        p = jnp.where(mask, variant.weight_fn(s), 0.0)
        return m, l + jnp.sum(p, axis=-1, keepdims=True), jnp.ones_like(l), p
    m_tile = jnp.max(jnp.where(mask, s, NEG_INF), axis=-1, keepdims=True)
    m_new = jnp.maximum(m, m_tile)
    # A row with no visible key so far has m_new = -inf; subtract 0 instead so that
    # exp() sees -inf - 0 = -inf and never -inf - -inf = nan.
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
    return m_new, l_new, alpha, p


def finalize(variant: AttentionVariant, m, l, acc, sinks=None):
    """-> (out [rows, D] f32, lse [rows, 1] f32). sinks: [rows, 1] f32 logits or None."""
    if not variant.uses_softmax:
        return acc, jnp.log(l)
    if sinks is not None:
        m_new = jnp.maximum(m, sinks)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.exp(sinks - m_new)
        acc = alpha * acc
        m = m_new
    safe_l = jnp.where(l == 0.0, 1.0, l)
    out = acc / safe_l
    lse = jnp.where(l == 0.0, NEG_INF, m + jnp.log(safe_l))
    return out, lse


def init_state(rows: int, head_dim: int):
    return (
        jnp.full((rows, 1), NEG_INF, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )


def dot_precision(dtype):
    """Full f32 precision for f32 operands (the TPU default would use bf16 passes)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def grouped_scores(q, k_of_head, num_kv_heads, prec):
    """q @ k^T per KV head. q: [num_kv_heads * rows, D], rows grouped by KV head (query
    heads are head-major, so the rows of KV head h are the block h); k_of_head(h): [C, D].
    Returns f32 [num_kv_heads * rows, C]."""
    rows = q.shape[0] // num_kv_heads
    parts = [
        jax.lax.dot_general(
            q[h * rows : (h + 1) * rows],
            k_of_head(h),
            (((1,), (1,)), ((), ())),
            precision=prec,
            preferred_element_type=jnp.float32,
        )
        for h in range(num_kv_heads)
    ]
    return jnp.concatenate(parts, axis=0) if num_kv_heads > 1 else parts[0]


def grouped_pv(p, v_of_head, num_kv_heads, prec):
    """p @ v per KV head, the counterpart of grouped_scores. p: f32 [num_kv_heads * rows, C];
    v_of_head(h): [C, D]. Returns f32 [num_kv_heads * rows, D]."""
    rows = p.shape[0] // num_kv_heads
    parts = []
    for h in range(num_kv_heads):
        v_h = v_of_head(h)
        parts.append(
            jax.lax.dot_general(
                p[h * rows : (h + 1) * rows].astype(v_h.dtype),
                v_h,
                (((1,), (0,)), ((), ())),
                precision=prec,
                preferred_element_type=jnp.float32,
            )
        )
    return jnp.concatenate(parts, axis=0) if num_kv_heads > 1 else parts[0]
