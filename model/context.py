"""What every layer of one forward pass shares besides its own params and cache."""

from __future__ import annotations

import dataclasses
import functools

import jax


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


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """Per-step inputs computed once and read by every layer.

    positions: int32 [B, T] (negative = padding); rope: (cos, sin) [B, T, head_dim];
    block_tables: int32 [B, pages_per_seq]; slots: int32 [B, T] flat KV slot of each
    token (past the pool for padding); page_size: positions per page.
    tree: a TokenTree when the chunk is draft-tree nodes (speculative decoding), else None.
    shared: state a layer publishes for later layers (cross-layer KV reuse); a layer
    returns a new context with `dataclasses.replace(ctx, shared={...})`.
    """

    positions: jax.Array
    rope: tuple[jax.Array, jax.Array]
    block_tables: jax.Array
    slots: jax.Array
    page_size: int
    tree: TokenTree | None = None
    shared: dict = dataclasses.field(default_factory=dict)
