"""Ragged paged attention in plain jnp: scatter the new K/V into the pages, then masked
dense attention of every query token over its sequence's gathered pages."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_attention.ref import attention_over_rows
from pallas_kernels.variant import SOFTMAX


def token_layout(cu_q_lens, kv_lens, num_tokens):
    """Per query token: (seq id, absolute position). Tokens past cu_q_lens[-1] are
    padding: seq id = num_seqs, position -1."""
    num_seqs = kv_lens.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.sum(token[:, None] >= cu_q_lens[None, 1:], axis=1).astype(jnp.int32)
    valid = seq < num_seqs
    s = jnp.minimum(seq, num_seqs - 1)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    pos = kv_lens[s] - q_lens[s] + token - cu_q_lens[s]
    return jnp.where(valid, seq, num_seqs), jnp.where(valid, pos, -1)


def write_new_kv(k_pages, v_pages, k, v, block_tables, seq, pos):
    """k_pages/v_pages with token t's k[t], v[t] stored at its position's page slot."""
    num_pages, page_size = k_pages.shape[:2]
    valid = pos >= 0
    s = jnp.minimum(seq, block_tables.shape[0] - 1)
    p = jnp.maximum(pos, 0)
    page = block_tables[s, p // page_size]
    valid &= (page >= 0) & (page < num_pages)  # a bad entry never wraps into another page
    page = jnp.where(valid, page, num_pages)  # out of bounds: dropped
    slot = p % page_size
    k_pages = k_pages.at[page, slot].set(k, mode="drop")
    v_pages = v_pages.at[page, slot].set(v, mode="drop")
    return k_pages, v_pages


def ragged_paged_attention_ref(
    q,
    k,
    v,
    k_pages,
    v_pages,
    block_tables,
    cu_q_lens,
    kv_lens,
    sinks=None,
    *,
    sm_scale,
    sliding_window=None,
    variant=SOFTMAX,
):
    """Same contract as pallas_kernels.ragged_paged_attention (arguments validated)."""
    num_tokens = q.shape[0]
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    num_seqs, max_pages = block_tables.shape
    seq, q_pos = token_layout(cu_q_lens, kv_lens, num_tokens)
    k_pages, v_pages = write_new_kv(k_pages, v_pages, k, v, block_tables, seq, q_pos)
    tables = block_tables[jnp.minimum(seq, num_seqs - 1)]  # [T, max_pages]
    span = max_pages * page_size
    k_rows = k_pages[tables].reshape(num_tokens, span, num_kv_heads, head_dim)
    v_rows = v_pages[tables].reshape(num_tokens, span, num_kv_heads, head_dim)
    kv_pos = jnp.broadcast_to(jnp.arange(span, dtype=jnp.int32), (num_tokens, span))
    mask = (kv_pos <= q_pos[:, None]) & (q_pos[:, None] >= 0)
    if sliding_window is not None:
        mask &= kv_pos > q_pos[:, None] - sliding_window
    out, lse = attention_over_rows(
        q, k_rows, v_rows, mask, q_pos, kv_pos, sm_scale=sm_scale, variant=variant, sinks=sinks
    )
    padding = (seq == num_seqs)[:, None]  # contract: out 0, lse -inf (no sink)
    out = jnp.where(padding[..., None], 0, out).astype(q.dtype)
    lse = jnp.where(padding, -jnp.inf, lse)
    return out, lse, k_pages, v_pages
