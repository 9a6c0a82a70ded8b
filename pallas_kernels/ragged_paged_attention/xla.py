"""The XLA path of ragged paged attention, run where no Pallas kernel does (CPU).

ref.py gathers every page of a query's sequence once per query token: a 512-token
prefill chunk over 512 positions moves 512 copies of its KV. Here the query tokens are
cut into tiles of one sequence each, as the TPU kernel does (kernel_tpu.plan_tiles), and
a `lax.scan` walks the block table a few pages at a time with online softmax (the
FlashAttention recurrence): per step every tile gathers one block of its sequence's
pages (decoding low-bit pages to f32 a block at a time), scores its queries against it
and folds the result into a running (max, sum, output). Rows of one query token (decode)
get tiles of one, so they cost what paged decode attention costs even in a step with
prefill chunks; chunks get tiles of min(max_q_len, 16) tokens, at most
ceil(tokens / 16) + max_chunks of them (a tile's work is paid even when it is spare, so
the static bounds matter). Tested against ref.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.ragged_paged_attention import tree as tree_mask
from pallas_kernels.ragged_paged_attention.kernel_tpu import plan_tiles
from pallas_kernels.ragged_paged_attention.ref import (
    gather_rows,
    ragged_paged_attention_ref,
    token_layout,
    write_new_kv,
)
from pallas_kernels.variant import SOFTMAX

PAGES_PER_BLOCK = 8
MAX_BLOCK_Q = 16


def ragged_paged_attention_xla(
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
    max_chunks=None,
):
    """Same contract as ragged_paged_attention_ref. Without max_q_len (no bound on a
    sequence's query tokens) or for variants without softmax (no running normaliser to
    carry), the dense reference runs instead. max_chunks: static bound on the sequences
    with more than one query token (None: any)."""
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, variant=variant,
              kv_format=kv_format, max_q_len=max_q_len)
    if max_q_len is None or not variant.uses_softmax:
        return ragged_paged_attention_ref(q, k, v, k_pages, v_pages, block_tables, cu_q_lens,
                                          kv_lens, sinks, tree, **kw)
    num_tokens = q.shape[0]
    num_seqs = block_tables.shape[0]
    seq, q_pos = token_layout(cu_q_lens, kv_lens, num_tokens)
    k_pages, v_pages = write_new_kv(k_pages, v_pages, k, v, block_tables, seq, q_pos, kv_format)
    attend = functools.partial(_attend_tiles, q, k_pages, v_pages, block_tables, cu_q_lens, seq,
                               q_pos, sinks, tree, sm_scale=sm_scale, sliding_window=sliding_window,
                               variant=variant, kv_format=kv_format)
    if max_q_len == 1:  # decode only: one query per tile
        return (*attend(cu_q_lens, 1, num_tokens), k_pages, v_pages)
    # Rows of one token get tiles of one; chunks get tiles of block_q (at most max_chunks rows)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    only = lambda keep: jnp.concatenate([cu_q_lens[:1], jnp.cumsum(jnp.where(keep, q_lens, 0))])
    block_q = min(1 << (max_q_len - 1).bit_length(), MAX_BLOCK_Q)
    chunks = num_seqs if max_chunks is None else min(max_chunks, num_seqs)
    out_d, lse_d = attend(only(q_lens == 1), 1, min(num_seqs, num_tokens))
    if chunks == 0:
        return out_d, lse_d, k_pages, v_pages
    out_c, lse_c = attend(only(q_lens > 1), block_q, min(-(-num_tokens // block_q) + chunks, num_tokens))
    chunk_token = (q_lens[jnp.minimum(seq, num_seqs - 1)] > 1)[:, None]
    out = jnp.where(chunk_token[..., None], out_c, out_d)
    return out, jnp.where(chunk_token, lse_c, lse_d), k_pages, v_pages


def _attend_tiles(q, k_pages, v_pages, block_tables, cu_q_lens, seq, q_pos, sinks, tree, tile_cu,
                  block_q, num_tiles, *, sm_scale, sliding_window, variant, kv_format):
    """Attention of the query tokens of the sequences that tile_cu (cu_q_lens with the
    other sequences' lengths set to 0) keeps, in at most num_tiles tiles of block_q tokens
    of one sequence; (out, lse) over all tokens, 0 / -inf for tokens it does not keep."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, max_pages = block_tables.shape
    leaves = [k_pages] if kv_format is None else kv_format.leaves(k_pages)
    num_pages, page_size, num_kv_heads = leaves[0].shape[:3]
    group = num_q_heads // num_kv_heads

    tile_seq, tile_start, tile_len, _ = plan_tiles(tile_cu, num_tokens, block_q)
    num_tiles = min(tile_seq.shape[0], num_tiles)  # live tiles come first
    tile_seq, tile_start, tile_len = tile_seq[:num_tiles], tile_start[:num_tiles], tile_len[:num_tiles]
    s_of = jnp.maximum(tile_seq, 0)
    rows = jnp.arange(block_q, dtype=jnp.int32)[None, :]
    live = rows < tile_len[:, None]  # [nt, bq]
    tok = jnp.where(live, cu_q_lens[s_of][:, None] + tile_start[:, None] + rows, num_tokens)
    tok_c = jnp.minimum(tok, num_tokens - 1)
    qt = q[tok_c].astype(jnp.float32).reshape(num_tiles, block_q, num_kv_heads, group, head_dim)
    qp = jnp.where(live, q_pos[tok_c], -1).reshape(-1)  # [nt * bq]
    qs = jnp.where(live, seq[tok_c], num_seqs).reshape(-1)

    per_block = min(PAGES_PER_BLOCK, max_pages)
    num_blocks = -(-max_pages // per_block)
    span = per_block * page_size
    tables = jnp.clip(block_tables[s_of], 0, num_pages - 1)  # unread entries: clamp (masked)
    tables = jnp.pad(tables, ((0, 0), (0, num_blocks * per_block - max_pages)))
    blocks = tables.reshape(num_tiles, num_blocks, per_block).transpose(1, 0, 2)  # [nb, nt, ppb]
    q_head = jnp.arange(num_q_heads, dtype=jnp.int32)[None, :, None, None]
    q_pos_b = qp.reshape(num_tiles, 1, block_q, 1)

    def body(carry, block):
        m, l, acc = carry  # [nt, Hq, bq], [nt, Hq, bq], [nt, Hkv, G, bq, D]
        i, index = block
        kb, vb = gather_rows(k_pages, index, kv_format), gather_rows(v_pages, index, kv_format)
        s = jnp.einsum("tqhgd,tshd->thgqs", qt, kb).reshape(num_tiles, num_q_heads, block_q, span)
        kv_pos = i * span + jnp.arange(span, dtype=jnp.int32)
        s = variant.transform(s * sm_scale, q_pos_b, kv_pos[None, None, None, :], q_head)
        seen = tree_mask.visible(tree, qs, qp, kv_pos[None, :], sliding_window, tok_c.reshape(-1))
        s = jnp.where(seen.reshape(num_tiles, 1, block_q, span), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # nothing seen yet: no NaN
        p = jnp.exp(s - shift[..., None])
        rescale = jnp.exp(m - shift)
        pv = jnp.einsum("thgqs,tshd->thgqd",
                        p.reshape(num_tiles, num_kv_heads, group, block_q, span), vb)
        acc = acc * rescale.reshape(num_tiles, num_kv_heads, group, block_q, 1) + pv
        return (m_new, l * rescale + p.sum(-1), acc), None

    init = (jnp.full((num_tiles, num_q_heads, block_q), -jnp.inf),
            jnp.zeros((num_tiles, num_q_heads, block_q)),
            jnp.zeros((num_tiles, num_kv_heads, group, block_q, head_dim)))
    (m, l, acc), _ = lax.scan(body, init, (jnp.arange(num_blocks, dtype=jnp.int32), blocks))
    seen = l > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)  # [nt, Hq, bq]
    out = acc.reshape(num_tiles, num_q_heads, block_q, head_dim) / jnp.where(seen, l, 1.0)[..., None]
    out = jnp.where(seen[..., None], out, 0.0)
    if sinks is not None:  # the sink joins the denominator only
        total = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
        out = out * jnp.exp(lse - total)[..., None]
        lse = jnp.where(live[:, None, :], total, -jnp.inf)
    # back to token order; padding tokens keep out 0, lse -inf
    dest = tok.reshape(-1)
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32).at[dest].set(
        out.transpose(0, 2, 1, 3).reshape(-1, num_q_heads, head_dim), mode="drop")
    lse = jnp.full((num_tokens, num_q_heads), -jnp.inf).at[dest].set(
        lse.transpose(0, 2, 1).reshape(-1, num_q_heads), mode="drop")
    return out.astype(q.dtype), lse
