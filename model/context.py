"""What every layer of one forward pass shares besides its own params and cache."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import TreeMask, pack_mask


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["rope_positions", "start", "mask"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TokenTree:
    """Tree attention (speculative decoding): the chunk's tokens are nodes of draft trees.

    A token's K/V slot and its causal order come from `positions` (node i of a tree
    rooted at position p sits in slot p + i), its RoPE from `rope_positions` (p + its
    depth). Slots [start, start + R) of each sequence are the tree region: a query sees
    slot start + j iff mask[b, t, j] (its ancestors and itself); slots before `start`
    are the sequence's accepted prefix, seen causally; slots past the region are not seen.

    rope_positions: int32 [B, T]; start: int32 [B]; mask: bool [B, T, R].
    """

    rope_positions: jax.Array
    start: jax.Array
    mask: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cu_q_lens", "kv_lens", "order", "unorder", "tree"],
                   meta_fields=["max_q_len", "max_chunks"])
@dataclasses.dataclass(frozen=True)
class RaggedLayout:
    """A step's tokens as the ragged attention kernel sees them (pallas_kernels.
    ragged_paged_attention): sequence s owns packed tokens [cu_q_lens[s], cu_q_lens[s+1]),
    at positions kv_lens[s] - q_len_s .. kv_lens[s] - 1; packed tokens past
    cu_q_lens[-1] are padding.

    cu_q_lens: int32 [S + 1]; kv_lens: int32 [S];
    order: int32 [N] flat token index of each packed token, unorder: int32 [N] its
      inverse (both None when the tokens are already packed, as the engine builds them);
    tree: a pallas_kernels TreeMask over the packed tokens, or None;
    max_q_len: static bound on any q_len_s (1 for a decode-only step);
    max_chunks: static bound on the sequences with q_len_s > 1.
    """

    cu_q_lens: jax.Array
    kv_lens: jax.Array
    order: jax.Array | None
    unorder: jax.Array | None
    tree: Any
    max_q_len: int
    max_chunks: int


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """Per-step inputs computed once and read by every layer.

    positions: int32 [B, T] (negative = padding); rope: (cos, sin) [B, T, head_dim];
    block_tables: int32 [B, pages_per_seq]; slots: int32 [B, T] flat KV slot of each
    token (past the pool for padding); page_size: positions per page.
    tree: a TokenTree when the chunk is draft-tree nodes (speculative decoding), else None.
    layout: the same tokens as a RaggedLayout (what attention layers hand the kernel).
    shared: state a layer publishes for later layers (cross-layer KV reuse); a layer
    returns a new context with `dataclasses.replace(ctx, shared={...})`.
    rope_local: (cos, sin) of sliding-window layers when they rotate with their own base
    (model.config rope_local_theta, Gemma 3), else None (they use `rope`).
    mesh: the jax.sharding.Mesh the step is sharded over (model/sharding.py), whose
    tensor-parallel axes attention layers split their heads on; None on one device.
    """

    positions: jax.Array
    rope: tuple[jax.Array, jax.Array]
    block_tables: jax.Array
    slots: jax.Array
    page_size: int
    tree: TokenTree | None = None
    layout: RaggedLayout | None = None
    shared: dict = dataclasses.field(default_factory=dict)
    rope_local: tuple[jax.Array, jax.Array] | None = None
    mesh: Any = None


def ragged_layout(positions: jax.Array, tree: TokenTree | None = None) -> RaggedLayout:
    """The RaggedLayout of a [B, T] batch: row b is sequence b, its tokens with a
    position >= 0 (which must be consecutive: p, p + 1, ...; any padding anywhere) packed
    in row order. A tree's region starts at tree.start; a row without a tree, at its
    kv_len."""
    b, t = positions.shape
    valid = positions >= 0
    q_lens = jnp.sum(valid, axis=1, dtype=jnp.int32)
    kv_lens = jnp.where(q_lens > 0, jnp.max(positions, axis=1) + 1, 0).astype(jnp.int32)
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
    order = jnp.argsort(~valid.reshape(-1), stable=True).astype(jnp.int32)
    unorder = jnp.argsort(order).astype(jnp.int32)
    mask = None
    if tree is not None:
        bits = pack_mask(tree.mask).reshape(b * t, -1)[order]
        mask = TreeMask(tree.start.astype(jnp.int32), bits)
    return RaggedLayout(cu_q_lens, kv_lens, order, unorder, mask, t, b if t > 1 else 0)
