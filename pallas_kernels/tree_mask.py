"""Tree attention inside a ragged step: draft-tree nodes whose visibility is given as data.

Speculative decoding scores (or, in the draft, grows) a tree of candidate tokens in one
pass. The nodes of sequence s are laid out in KV slots of a region that starts at
`start[s]`; a node sees the sequence's prefix (positions before the region) causally and,
inside the region, exactly its ancestors and itself. Which ones is given per query as
bits: `bits[i, w]` holds region offsets 32w .. 32w + 31 (bit b of word w: offset 32w + b).

A query i of sequence s at slot p_i sees kv position j iff j <= p_i and
  - j < start[s]: the sliding-window rule j > l_i - window holds, where l_i is the
    query's logical position (its RoPE position): p_i for a query before the region,
    start[s] - 1 + (set bits of row i) for a node inside it (the root of a verify tree
    sits at start[s] and is its own only ancestor: l = start[s]);
  - start[s] <= j < start[s] + 32 * words: bit j - start[s] of row i is set (the window
    does not apply inside the region: a node's ancestors are never farther back than the
    tree is deep);
  - j past the region: seen causally.
A sequence without a tree puts start[s] at its kv_len (an empty region): plain causal
attention with the window from p_i. Bits of a query before its region are ignored.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

WORD_BITS = 32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["start", "bits"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TreeMask:
    """start: int32 [num_seqs] first slot of each sequence's tree region;
    bits: int32 [total_q_tokens, words] each query's ancestor-or-self bits over the region."""

    start: jax.Array
    bits: jax.Array

    @property
    def region(self) -> int:
        return self.bits.shape[1] * WORD_BITS


def ancestor_mask(parents) -> np.ndarray:
    """bool [N, N] on the host: mask[i, j] iff node j is node i or one of its ancestors, for a
    tree whose node i > 0 has parent parents[i] < i (node 0 the root; its entry is unused)."""
    mask = np.eye(len(parents), dtype=bool)
    for i in range(1, len(parents)):
        mask[i] |= mask[parents[i]]
    return mask


def pack_mask(mask: jax.Array) -> jax.Array:
    """bool [..., R] -> int32 [..., ceil(R / 32)]: bit b of word w is mask[..., 32w + b]."""
    r = mask.shape[-1]
    words = -(-r // WORD_BITS)
    padded = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, words * WORD_BITS - r)])
    grouped = padded.reshape(*mask.shape[:-1], words, WORD_BITS).astype(jnp.uint32)
    packed = jnp.sum(grouped << jnp.arange(WORD_BITS, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(packed, jnp.int32)


def region_bit(bits: jax.Array, offset: jax.Array) -> jax.Array:
    """bits [..., words] and offsets [..., S] inside the region -> bool [..., S]."""
    word = jnp.take_along_axis(bits, jnp.clip(offset // WORD_BITS, 0, bits.shape[-1] - 1), axis=-1)
    return ((word >> (offset % WORD_BITS)) & 1) == 1


def logical_positions(tree: TreeMask | None, seq, q_pos, token=None) -> jax.Array:
    """Each query's logical position l_i (module docstring). seq, q_pos: int32 [T] of the
    queries, token: their rows of tree.bits (default: query i is row i)."""
    if tree is None:
        return q_pos
    bits = tree.bits if token is None else tree.bits[token]
    start = tree.start[jnp.minimum(seq, tree.start.shape[0] - 1)]
    depth = jnp.sum(jax.lax.population_count(bits), axis=-1)
    return jnp.where(q_pos >= start, start - 1 + depth, q_pos)


def visible(tree: TreeMask | None, seq, q_pos, kv_pos, sliding_window, token=None):
    """bool [T, S]: which kv positions [T, S] (or [1, S]) each query sees (docstring);
    arguments as logical_positions."""
    q = q_pos[:, None]
    seen = (kv_pos <= q) & (q >= 0)
    near = True if sliding_window is None else \
        kv_pos > logical_positions(tree, seq, q_pos, token)[:, None] - sliding_window
    if tree is None:
        return seen & near
    bits = tree.bits if token is None else tree.bits[token]
    start = tree.start[jnp.minimum(seq, tree.start.shape[0] - 1)][:, None]
    offset = kv_pos - start
    in_region = (offset >= 0) & (offset < tree.region)
    inside = region_bit(bits, jnp.broadcast_to(offset, (q.shape[0], offset.shape[1])))
    return seen & jnp.where(offset < 0, near, jnp.where(in_region, inside, True))
