"""Token sampling: greedy, temperature, top-k, top-p, min-p — one jittable function.

Per-row parameters are arrays so one compiled step serves a batch of requests with
different settings. A row with temperature 0 is greedy. Each row draws with its own
key, so a seeded request samples the same tokens whatever batch it runs in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(seeds: jnp.ndarray, counters: jnp.ndarray) -> jax.Array:
    """One PRNG key per row from uint32 seeds [B] and step counters [B]."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


def sample(logits: jnp.ndarray, keys: jax.Array, temperature: jnp.ndarray, top_k: jnp.ndarray,
           top_p: jnp.ndarray, min_p: jnp.ndarray | None = None) -> jnp.ndarray:
    """Next tokens int32 [B] from logits [B, V].

    keys: typed PRNG keys [B]; temperature: float [B] (0 = greedy); top_k: int [B]
    (<= 0 = off); top_p: float [B] in (0, 1] (1 = off); min_p: float [B] (0 = off).
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if min_p is None:
        min_p = jnp.zeros_like(top_p)
    # Sorting the vocabulary dominates a CPU decode step: skip it for all-greedy batches.
    return jax.lax.cond(jnp.any(temperature > 0),
                        lambda: _sample_sorted(logits, greedy, keys, temperature, top_k, top_p, min_p),
                        lambda: greedy)


def _sample_sorted(logits, greedy, keys, temperature, top_k, top_p, min_p):
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    ranks = jnp.arange(logits.shape[-1])[None, :]
    keep = (top_k[:, None] <= 0) | (ranks < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
