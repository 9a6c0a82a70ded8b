"""Ragged paged attention in plain jnp: scatter the new K/V into the pages, then masked
dense attention of every query token over its sequence's gathered (and, for low-bit
pages, dequantized) pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.kv_formats import stored_as
from pallas_kernels.paged_attention.ref import attention_over_rows
from pallas_kernels import tree_mask
from pallas_kernels.variant import SOFTMAX
from quant.blockscaled import NVFP4, nvfp4_quantize


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


def write_new_kv(k_pages, v_pages, k, v, block_tables, seq, pos, kv_format=None):
    """k_pages/v_pages with token t's k[t], v[t] stored at its position's page slot
    (quantized with kv_format's `quantize` for low-bit pages)."""
    leaves = [k_pages] if kv_format is None else kv_format.leaves(k_pages)
    num_pages, page_size = leaves[0].shape[:2]
    num_seqs, max_pages = block_tables.shape
    valid = (pos >= 0) & (pos < max_pages * page_size)
    s = jnp.minimum(seq, num_seqs - 1)
    p = jnp.clip(pos, 0, max_pages * page_size - 1)
    page = block_tables[s, p // page_size]
    valid &= (page >= 0) & (page < num_pages)  # a bad entry never wraps into another page
    page = jnp.where(valid, page, num_pages)  # out of bounds: dropped
    slot = p % page_size

    def write(pages, new):
        if kv_format is None:
            return pages.at[page, slot].set(new.astype(pages.dtype), mode="drop")
        if not isinstance(pages, NVFP4) or pages.tensor_scale is None:
            # the format's own write: narrow float leaves scattered as their bits, which
            # XLA:CPU otherwise converts whole (the pool) to f32 and back on every write
            return kv_format.write(pages, new, page, slot)
        # every page-axis leaf gets the token's row; a scalar (NVFP4's tensor scale) stays
        return jax.tree.map(
            lambda a, r: a.at[page, slot].set(stored_as(r, a.dtype), mode="drop") if a.ndim >= 3 else a,
            pages, quantize_like(kv_format, pages, new))
    return write(k_pages, k), write(v_pages, v)


def quantize_like(kv_format, pages, x):
    """x [..., D] quantized into the container of `pages` (NVFP4: at the pages' tensor
    scale, 1.0 for pools that keep none)."""
    if isinstance(pages, NVFP4):
        scale = pages.tensor_scale
        q = nvfp4_quantize(x, 1.0 if scale is None else scale)
        return NVFP4(q.packed, q.scales, scale)
    return kv_format.quantize(x)


def gather_rows(pages, tables, kv_format=None):
    """Pages of `tables` [..., P] as position-ordered f32 rows [..., P * page_size, H, D]."""
    if kv_format is None:
        rows = pages[tables]
    else:
        rows = kv_format.dequantize(jax.tree.map(lambda a: a[tables] if a.ndim >= 3 else a, pages))
    *lead, p, page_size, h, d = rows.shape
    return rows.astype(jnp.float32).reshape(*lead, p * page_size, h, d)


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
    tree=None,
    *,
    sm_scale,
    sliding_window=None,
    variant=SOFTMAX,
    kv_format=None,
    max_q_len=None,
):
    """Same contract as pallas_kernels.ragged_paged_attention (arguments validated;
    kv_format resolved; max_q_len is only a hint for the faster paths)."""
    num_tokens = q.shape[0]
    num_seqs = block_tables.shape[0]
    seq, q_pos = token_layout(cu_q_lens, kv_lens, num_tokens)
    k_pages, v_pages = write_new_kv(k_pages, v_pages, k, v, block_tables, seq, q_pos, kv_format)
    tables = block_tables[jnp.minimum(seq, num_seqs - 1)]  # [T, max_pages]
    k_rows = gather_rows(k_pages, tables, kv_format)
    v_rows = gather_rows(v_pages, tables, kv_format)
    kv_pos = jnp.broadcast_to(jnp.arange(k_rows.shape[1], dtype=jnp.int32), k_rows.shape[:2])
    mask = tree_mask.visible(tree, seq, q_pos, kv_pos, sliding_window)
    out, lse = attention_over_rows(
        q, k_rows, v_rows, mask, q_pos, kv_pos, sm_scale=sm_scale, variant=variant, sinks=sinks
    )
    padding = (seq == num_seqs)[:, None]  # contract: out 0, lse -inf (no sink)
    out = jnp.where(padding[..., None], 0, out).astype(q.dtype)
    lse = jnp.where(padding, -jnp.inf, lse)
    return out, lse, k_pages, v_pages
