"""Greedy decoding's pick in XLA: the index of each row's first maximum."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def first_max(logits: jnp.ndarray) -> jnp.ndarray:
    """int32 [...]: jnp.argmax over the last axis of logits [..., V] (the lowest index among
    tied maxima), and 0 for a row that holds a NaN. From two plain reductions, as XLA:CPU
    runs argmax's paired reduction element by element (180 us over a 49,152-token
    vocabulary against 70 here). A single row takes lax.top_k with k = 1 instead, which
    XLA:CPU runs as one call (162 -> 76 us over that vocabulary); from 16 rows up the
    reductions are faster."""
    if logits.ndim == 2 and logits.shape[0] == 1:
        top, index = jax.lax.top_k(logits, 1)
        return jnp.where(jnp.isnan(top[:, 0]), 0, index[:, 0]).astype(jnp.int32)  # top_k ranks NaN first
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jnp.min(jnp.where(logits == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.where(index < vocab, index, 0)
