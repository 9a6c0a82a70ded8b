"""The XLA path of ragged paged attention, run where no Pallas kernel does (CPU).

ref.py gathers every page of a query's sequence once per query token: a 512-token
prefill chunk over 512 positions moves 512 copies of its KV. Here the new K/V rows are
written first, then the query tokens are cut into tiles of one sequence each, as the TPU
kernel does (tiles.plan_tiles), and pallas_kernels/paged_blocks.py attends each
tile over its sequence's pages a block at a time. Rows of one query token (decode)
get tiles of one, so they cost what paged decode attention costs even in a step with
prefill chunks; chunks get tiles of min(max_q_len, 16) tokens, at most
ceil(tokens / 16) + max_chunks of them (a tile's work is paid even when it is spare, so
the static bounds matter). Tested against ref.py. (On CPU the entry runs steps over
float32, bfloat16, int8, fp8, NVFP4 and TurboQuant pages, draft trees included, on the C++
kernel of cpu.py instead: decode-only ones, and with chunks where head_dim is a multiple
of 16 up to 256.)
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.paged_blocks import attend_tiles
from pallas_kernels.ragged_paged_attention.tiles import plan_tiles
from pallas_kernels.ragged_paged_attention.ref import (
    ragged_paged_attention_ref,
    token_layout,
    write_new_kv,
)
from pallas_kernels.variant import SOFTMAX

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
    differentiable=False,
):
    """Same contract as ragged_paged_attention_ref. Without max_q_len (no bound on a
    sequence's query tokens) or for variants without softmax (no running normaliser to
    carry), the dense reference runs instead. max_chunks: static bound on the sequences
    with more than one query token (None: any). The block walk stops after the last block
    a query sees (its cost follows the live context, not the table width) unless
    differentiable, which walks every block so reverse-mode autodiff works."""
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
                               variant=variant, kv_format=kv_format, live_blocks_only=not differentiable)
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
                  block_q, num_tiles, *, sm_scale, sliding_window, variant, kv_format, live_blocks_only):
    """Attention of the query tokens of the sequences that tile_cu (cu_q_lens with the
    other sequences' lengths set to 0) keeps, in at most num_tiles tiles of block_q tokens
    of one sequence; (out, lse) over all tokens, 0 / -inf for tokens it does not keep."""
    num_tokens = q.shape[0]
    tile_seq, tile_start, tile_len, _ = plan_tiles(tile_cu, num_tokens, block_q)
    num_tiles = min(tile_seq.shape[0], num_tiles)  # live tiles come first
    tile_seq, tile_start, tile_len = tile_seq[:num_tiles], tile_start[:num_tiles], tile_len[:num_tiles]
    s_of = jnp.maximum(tile_seq, 0)
    rows = jnp.arange(block_q, dtype=jnp.int32)[None, :]
    live = rows < tile_len[:, None]  # [nt, bq]
    tok = jnp.minimum(cu_q_lens[s_of][:, None] + tile_start[:, None] + rows, num_tokens - 1)
    out, lse = attend_tiles(q, k_pages, v_pages, block_tables, s_of, tok, live, q_pos, seq, sinks, tree,
                            sm_scale=sm_scale, sliding_window=sliding_window, variant=variant,
                            kv_format=kv_format, live_blocks_only=live_blocks_only)
    return out.astype(q.dtype), lse
