"""What every layer of one forward pass shares besides its own params and cache."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """Per-step inputs computed once and read by every layer.

    positions: int32 [B, T] (negative = padding); rope: (cos, sin) [B, T, head_dim];
    block_tables: int32 [B, pages_per_seq]; slots: int32 [B, T] flat KV slot of each
    token (past the pool for padding); page_size: positions per page.
    shared: state a layer publishes for later layers (cross-layer KV reuse); a layer
    returns a new context with `dataclasses.replace(ctx, shared={...})`.
    """

    positions: jax.Array
    rope: tuple[jax.Array, jax.Array]
    block_tables: jax.Array
    slots: jax.Array
    page_size: int
    shared: dict = dataclasses.field(default_factory=dict)
