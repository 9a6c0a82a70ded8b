"""Query tiles of a ragged step, shared by the TPU and GPU kernels and the blocked XLA path.

A step's query tokens are cut, per sequence, into tiles of at most `block_q` tokens of
that one sequence (a decode row is a tile with one live row), planned in XLA before a
kernel runs (FlashInfer's plan / run split). `lowest_seen` bounds the pages a tile reads
from below; `visible` is the in-kernel mask of pallas_kernels.tree_mask's rule over one
tile of queries and one page of keys.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import tree_mask


def plan_tiles(cu_q_lens, num_tokens, block_q):
    """Cut each sequence's query tokens into tiles of <= block_q tokens.

    Returns int32 arrays over a static number of tiles: tile_seq (sequence id, -1 for a
    spare tile), tile_start (first query index inside the sequence's chunk), tile_len
    (live rows, 0 for a spare tile), and tile_first (index of each sequence's first tile).
    """
    num_seqs = cu_q_lens.shape[0] - 1
    num_tiles = -(-num_tokens // block_q) + num_seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tiles_per_seq = (q_lens + block_q - 1) // block_q
    tile_end = jnp.cumsum(tiles_per_seq)
    tile_first = tile_end - tiles_per_seq
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.sum(tile[:, None] >= tile_end[None, :], axis=1).astype(jnp.int32)
    live = seq < num_seqs
    s = jnp.minimum(seq, num_seqs - 1)
    start = (tile - tile_first[s]) * block_q
    length = jnp.where(live, jnp.clip(q_lens[s] - start, 0, block_q), 0)
    return (
        jnp.where(live, seq, -1),
        jnp.where(live, start, 0),
        length.astype(jnp.int32),
        tile_first.astype(jnp.int32),
    )


def lowest_seen(tok, tile_len, pos, logical, region_start, sliding_window):
    """int32 [num_tiles]: the lowest KV position any live row of a tile may see.

    tok: int32 [num_tiles, block_q], each row's token; pos, logical, region_start: int32
    [T], each token's slot, logical position and tree region start (None: no tree). The
    window counts from the logical position and never cuts positions from the region
    start on, so a tree node reaches back to min(its window's start, the region start)."""
    if sliding_window is None:
        return jnp.zeros(tok.shape[:1], jnp.int32)
    lo = jnp.maximum(logical - sliding_window + 1, 0)
    if region_start is not None:
        lo = jnp.where(pos >= region_start, jnp.minimum(lo, region_start), lo)
    live = jnp.arange(tok.shape[1])[None, :] < tile_len[:, None]
    return jnp.min(jnp.where(live, lo[tok], jnp.iinfo(jnp.int32).max), axis=1)


def visible(q_pos, kv_pos, sliding_window, region_start, bits, logical):
    """bool [rows, C]: which positions kv_pos [1, C] queries at slots q_pos [rows, 1] see
    (tree.visible's rule). Without a tree (region_start None): causal and the window.
    With one: bits, the int32 [rows, 1] word columns of the rows' ancestor bits over the
    region from region_start (a scalar; bits past the tree are zero, so zero padding words
    change nothing: every position a row sees lies before its own slot);
    logical [rows, 1], the positions the window counts from (None without a window)."""
    seen = kv_pos <= q_pos
    if region_start is None:
        return seen if sliding_window is None else seen & (kv_pos > q_pos - sliding_window)
    near = True if sliding_window is None else kv_pos > logical - sliding_window
    offset = kv_pos - region_start
    in_bits = jnp.zeros(jnp.broadcast_shapes(q_pos.shape, kv_pos.shape), jnp.bool_)
    for w, column in enumerate(bits):
        word_offset = offset - w * tree_mask.WORD_BITS
        shift = jnp.clip(word_offset, 0, tree_mask.WORD_BITS - 1)
        word = jnp.broadcast_to(column, in_bits.shape)
        bit = lax.shift_right_logical(word, jnp.broadcast_to(shift, in_bits.shape)) & 1
        in_bits |= (word_offset >= 0) & (word_offset < tree_mask.WORD_BITS) & (bit != 0)
    in_region = (offset >= 0) & (offset < len(bits) * tree_mask.WORD_BITS)
    return seen & jnp.where(offset < 0, near, jnp.where(in_region, in_bits, True))
