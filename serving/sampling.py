"""Token sampling: greedy, temperature, top-k, top-p, min-p — one jittable function —
and what comes before it: structured outputs' token masks, penalties and biases.

Per-row parameters are arrays so one compiled step serves a batch of requests with
different settings. A row with temperature 0 is greedy. Each row draws with its own
key, so a seeded request samples the same tokens whatever batch it runs in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.first_max import first_max


def row_keys(seeds: jnp.ndarray, counters: jnp.ndarray) -> jax.Array:
    """One PRNG key per row from seeds and step counters uint32 [B].

    seeds: uint32 [B] or [B, 2] (the low and high words of a 64-bit seed); a seed below
    2**32 gives the same key either way.
    """
    if seeds.ndim == 1:
        seeds = jnp.stack([seeds, jnp.zeros_like(seeds)], axis=-1)

    def one(seed, counter):
        key = jax.random.key(seed[0])
        wide = jax.random.fold_in(key, seed[1])
        key = jax.random.wrap_key_data(jnp.where(seed[1] != 0, jax.random.key_data(wide),
                                                 jax.random.key_data(key)))
        return jax.random.fold_in(key, counter)
    return jax.vmap(one)(seeds.astype(jnp.uint32), counters)


def apply_token_masks(logits: jnp.ndarray, masks: jnp.ndarray, constrained: jnp.ndarray) -> jnp.ndarray:
    """logits with the tokens a row's grammar forbids at -inf (structured outputs).

    logits [B, ..., V]; masks int32 [B, ..., ceil(V / 32)]: bit t % 32 of word t // 32 set
    = token t allowed (llguidance's bitmask); constrained bool [B]: rows whose mask
    applies. A batch with no constrained row skips the unpacking entirely.
    """
    def masked():
        ids = jnp.arange(logits.shape[-1])
        allowed = (jnp.take(masks, ids // 32, axis=-1) >> (ids % 32)) & 1
        flag = constrained.reshape(constrained.shape + (1,) * (logits.ndim - 1))
        return jnp.where((allowed != 0) | ~flag, logits, -jnp.inf)
    return jax.lax.cond(jnp.any(constrained), masked, lambda: logits)


def apply_adjustments(logits: jnp.ndarray, ids: jnp.ndarray, counts: jnp.ndarray, seen: jnp.ndarray,
                      bias: jnp.ndarray, penalties: jnp.ndarray) -> jnp.ndarray:
    """logits [B, V] after each row's penalties and biases (SamplingParams), in vLLM's order.

    Per row, a sparse list of the tokens it adjusts, K of them (padding ids = V, dropped):
    ids int32 [B, K]; counts int32 [B, K], how often the row generated each; seen bool
    [B, K], whether it is in the prompt or the output; bias float32 [B, K], logit_bias
    plus -inf for banned tokens (bad_words, min_tokens). penalties float32 [B, 3]:
    presence, frequency, repetition. A token's logit x becomes
    x' = x + bias; x' / rep if x' > 0 else x' * rep (when seen); then
    x' - frequency * count - presence * (count > 0). A batch in which no row adjusts
    anything skips the gather and scatter.
    """
    def adjusted():
        vocab = logits.shape[-1]
        x = jnp.take_along_axis(logits, jnp.minimum(ids, vocab - 1), axis=-1).astype(jnp.float32) + bias
        presence, frequency, repetition = (penalties[:, i:i + 1] for i in range(3))
        x = jnp.where(seen, jnp.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * (counts > 0)
        rows = jnp.arange(logits.shape[0])[:, None]
        return logits.at[rows, ids].set(x.astype(logits.dtype), mode="drop")
    return jax.lax.cond(jnp.any(ids < logits.shape[-1]), adjusted, lambda: logits)


def sample(logits: jnp.ndarray, keys: jax.Array, temperature: jnp.ndarray, top_k: jnp.ndarray,
           top_p: jnp.ndarray, min_p: jnp.ndarray | None = None) -> jnp.ndarray:
    """Next tokens int32 [B] from logits [B, V].

    keys: typed PRNG keys [B]; temperature: float [B] (0 = greedy); top_k: int [B]
    (<= 0 = off); top_p: float [B] in (0, 1] (1 = off); min_p: float [B] (0 = off).
    """
    logits = logits.astype(jnp.float32)
    greedy = first_max(logits)
    if min_p is None:
        min_p = jnp.zeros_like(top_p)
    # Sorting the vocabulary dominates a CPU decode step: skip it for all-greedy batches.
    return jax.lax.cond(jnp.any(temperature > 0),
                        lambda: _sample_sorted(logits, greedy, keys, temperature, top_k, top_p, min_p),
                        lambda: greedy)


def _filtered_sorted(scaled, top_k, top_p, min_p):
    """(order, sorted logits with filtered-out tokens at -inf), over the last axis.
    Per-row parameters are already broadcast to scaled's rank."""
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    ranks = jnp.arange(scaled.shape[-1])
    keep = (top_k <= 0) | (ranks < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p
    keep &= probs >= min_p * probs[..., :1]
    return order, jnp.where(keep, sorted_logits, -jnp.inf)


def _sample_sorted(logits, greedy, keys, temperature, top_k, top_p, min_p):
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order, masked = _filtered_sorted(scaled, top_k[:, None], top_p[:, None], min_p[:, None])
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def processed_probs(logits: jnp.ndarray, temperature: jnp.ndarray, top_k: jnp.ndarray,
                    top_p: jnp.ndarray, min_p: jnp.ndarray) -> jnp.ndarray:
    """The distribution `sample` draws from, as probabilities [B, ..., V] (float32).

    logits [B, ..., V]; per-row parameters [B] as in `sample`. Greedy rows get a one-hot
    at the argmax. Speculative verification accepts draft tokens against these.
    """
    logits = logits.astype(jnp.float32)
    expand = lambda a: a.reshape(a.shape + (1,) * (logits.ndim - 1))
    temperature, top_k, top_p, min_p = map(expand, (temperature, top_k, top_p, min_p))
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def tempered():
        scaled = logits / jnp.maximum(temperature, 1e-6)

        def filtered():
            order, masked = _filtered_sorted(scaled, top_k, top_p, min_p)
            probs = jax.nn.softmax(masked, axis=-1)
            return jnp.put_along_axis(jnp.zeros_like(probs), order, probs, axis=-1, inplace=False)
        # Sorting the vocabulary is the expensive part: only when a row filters.
        probs = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1) | (min_p > 0)), filtered,
                             lambda: jax.nn.softmax(scaled, axis=-1))
        return jnp.where(temperature > 0, probs, one_hot)
    return jax.lax.cond(jnp.any(temperature > 0), tempered, lambda: one_hot)
