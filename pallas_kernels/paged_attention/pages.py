"""Which pages of its block table a decode row reads, shared by the TPU and GPU kernels
(the XLA path masks by position instead and needs no page bounds)."""

from __future__ import annotations

import jax.numpy as jnp


def page_range(kv_len, page_size: int, sliding_window: int | None):
    """[first, last] block-table index a sequence of kv_len tokens reads, the query at
    position kv_len - 1 seeing the last `sliding_window` positions (all when None).

    kv_len: int32 scalar (traced). Returns (first, last), first <= last also for kv_len = 0
    (both 0: the kernels skip an empty sequence by its kv_len, not by the range).
    """
    last = jnp.maximum(kv_len - 1, 0) // page_size
    if sliding_window is None:
        return 0, last
    first = jnp.maximum(kv_len - sliding_window, 0) // page_size
    return jnp.minimum(first, last), last
