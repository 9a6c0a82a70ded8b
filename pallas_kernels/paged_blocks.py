"""Attention of query tiles over paged KV, a block of pages at a time: the XLA path of the
paged kernels, run where no Pallas kernel does (CPU, and GPU steps without a kernel).

The references (ref.py of each op) state the operation densely: gather every page of a
sequence, dequantize, attend. As a serving path that materialises each layer's whole
gathered KV (at 16 sequences x 4,096 positions, 100 MB per layer) and spends most of a
step copying it. Here query tokens come in tiles of one sequence each (a decode row is a
tile of one) and a `lax.scan` walks the block table PAGES_PER_BLOCK pages at a time with
online softmax (the FlashAttention recurrence): per step every tile gathers one block of
its sequence's pages, decodes it to f32 if the pages are low-bit, scores its queries and
folds the result into a running (max, sum, output). A step reads each live page once per
tile and keeps only a block's worth of f32 in flight.

Low-bit blocks are decoded the way the kernel decodes its tiles
(paged_attention/kv_formats.py): one array per channel part (`parts`: the low and high
nibbles of FP4 bytes, TurboQuant's code j of every group), in the basis `prepare_q` puts
the query in, and the output goes back through `finish_out`. Scores and outputs are sums
over parts, so no part is ever interleaved back into head_dim order (XLA:CPU runs such
lane shuffles, and every broadcast that feeds them, element by element), and TurboQuant
rows are never de-rotated one by one (a d x d matmul per row). Heads move ahead of
positions on the gathered codes, the cheapest place, so the decode writes the layout the
dots read. Results equal the dense references to f32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import kv_formats
from pallas_kernels import tree_mask

PAGES_PER_BLOCK = 8


def attend_tiles(q, k_pages, v_pages, block_tables, tile_seq, tile_tokens, tile_live, q_pos, seq,
                 sinks=None, tree=None, *, sm_scale, sliding_window, variant, kv_format=None,
                 live_blocks_only=False):
    """(out [T, Hq, D] f32, lse [T, Hq]) of query tokens grouped into tiles.

    live_blocks_only: walk only the blocks holding positions some live query sees (a loop
    with a traced trip count), so a step costs what its sequences hold however wide the
    block tables are; not reverse-differentiable, so gradients take the default (every
    block of the table, masked).

    q: [T, Hq, D]; tile_seq: int32 [nt] each tile's sequence (any row of block_tables
    for a spare tile); tile_tokens: int32 [nt, bq] the query tokens of each tile;
    tile_live: bool [nt, bq] which of them are real; q_pos, seq: int32 [T] each token's
    position (-1: sees nothing) and sequence; tree: a TreeMask or None. Tokens in no live
    tile row get out 0, lse -inf. variant must use softmax.
    """
    fmt = kv_formats.PLAIN if kv_format is None else kv_format
    num_tokens, num_q_heads, head_dim = q.shape
    num_tiles, block_q = tile_tokens.shape
    num_pages, page_size, num_kv_heads = fmt.leaves(k_pages)[0].shape[:3]
    group = num_q_heads // num_kv_heads
    parts = fmt.parts
    max_pages = block_tables.shape[1]
    per_block = min(PAGES_PER_BLOCK, max_pages)
    num_blocks = -(-max_pages // per_block)
    span = per_block * page_size
    # Entries past a sequence's pages may hold anything: clamp them into the pool (masked).
    tables = jnp.clip(block_tables[tile_seq], 0, num_pages - 1)
    tables = jnp.pad(tables, ((0, 0), (0, num_blocks * per_block - max_pages)))
    blocks = tables.reshape(num_tiles, num_blocks, per_block).transpose(1, 0, 2)  # [nb, nt, ppb]

    def heads_first(a):  # [nt, ppb, page_size, Hkv, ...] -> [nt, Hkv, ppb, page_size, ...]
        return jnp.moveaxis(a, 3, 1) if a.ndim >= 4 else a

    def read(pages, index):  # [nt, ppb] page ids -> per part f32 [nt, Hkv, span, D / parts]
        block = jax.tree.map(heads_first, fmt.gather(pages, index))
        return [fmt.rows(block, j).astype(jnp.float32).reshape(num_tiles, num_kv_heads, span, -1)
                for j in range(parts)]

    tok = tile_tokens.reshape(-1)
    q_rows = fmt.prepare_q(k_pages, q.astype(jnp.float32)[tok])  # [nt * bq, Hq, D]
    qg = [x.reshape(num_tiles, block_q, num_kv_heads, group, -1)
          for x in kv_formats.split_parts(q_rows, parts)]
    qp = jnp.where(tile_live.reshape(-1), q_pos[tok], -1)
    qs = seq[tok]
    q_pos_s = qp.reshape(num_tiles, 1, block_q, 1)
    q_head = jnp.arange(num_q_heads, dtype=jnp.int32)[None, :, None, None]

    def body(carry, block):
        m, l, acc = carry  # [nt, Hq, bq], [nt, Hq, bq], parts x [nt, Hkv, G, bq, D / parts]
        i, index = block
        k, v = read(k_pages, index), read(v_pages, index)
        s = functools.reduce(jnp.add, [jnp.einsum("tqhgd,thsd->thgqs", qj, kj) for qj, kj in zip(qg, k)])
        s = s.reshape(num_tiles, num_q_heads, block_q, span) * sm_scale
        kv_pos = i * span + jnp.arange(span, dtype=jnp.int32)
        s = variant.transform(s, q_pos_s, kv_pos[None, None, None, :], q_head)
        seen = tree_mask.visible(tree, qs, qp, kv_pos[None, :], sliding_window, tok)
        s = jnp.where(seen.reshape(num_tiles, 1, block_q, span), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # nothing seen yet: no NaN
        p = jnp.exp(s - shift[..., None])
        rescale = jnp.exp(m - shift)
        pg = p.reshape(num_tiles, num_kv_heads, group, block_q, span)
        keep = rescale.reshape(num_tiles, num_kv_heads, group, block_q, 1)
        acc = [a * keep + jnp.einsum("thgqs,thsd->thgqd", pg, vj) for a, vj in zip(acc, v)]
        return (m_new, l * rescale + p.sum(-1), acc), None

    init = (jnp.full((num_tiles, num_q_heads, block_q), -jnp.inf),
            jnp.zeros((num_tiles, num_q_heads, block_q)),
            [jnp.zeros((num_tiles, num_kv_heads, group, block_q, head_dim // parts))] * parts)
    if live_blocks_only:  # positions [0, reach) are all any live query can see
        reach = jnp.max(jnp.where(tile_live.reshape(-1), q_pos[tok], -1)) + 1
        count = jnp.clip(-(-reach // span), 0, num_blocks)
        m, l, acc = lax.fori_loop(0, count, lambda i, carry: body(carry, (i, blocks[i]))[0], init)
    else:
        (m, l, acc), _ = lax.scan(body, init, (jnp.arange(num_blocks, dtype=jnp.int32), blocks))
    seen = l > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)  # [nt, Hq, bq]
    acc = kv_formats.merge_parts(jnp.stack(acc)).reshape(num_tiles, num_q_heads, block_q, head_dim)
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    out = fmt.finish_out(v_pages, out)
    if sinks is not None:  # the sink joins the denominator only
        total = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
        out = out * jnp.exp(lse - total)[..., None]
        lse = jnp.where(tile_live[:, None, :], total, -jnp.inf)
    # back to token order; tokens in no live tile row keep out 0, lse -inf
    dest = jnp.where(tile_live, tile_tokens, num_tokens).reshape(-1)
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32).at[dest].set(
        out.transpose(0, 2, 1, 3).reshape(-1, num_q_heads, head_dim), mode="drop")
    lse = jnp.full((num_tokens, num_q_heads), -jnp.inf).at[dest].set(
        lse.transpose(0, 2, 1).reshape(-1, num_q_heads), mode="drop")
    return out, lse
