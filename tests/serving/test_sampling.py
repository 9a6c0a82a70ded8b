import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.sampling import row_keys, sample


def keys(n, seed=0):
    return row_keys(jnp.full((n,), seed, jnp.uint32), jnp.arange(n, dtype=jnp.uint32))


def reference_distribution(logits, temperature, top_k, top_p, min_p=0.0):
    """Independent float64 numpy statement of what the sampler should draw from."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order].max())
    if top_k > 0:
        p[top_k:] = 0
    p /= p.sum()
    keep = np.zeros_like(p, bool)
    mass = 0.0
    for i in range(len(p)):  # smallest prefix reaching top_p
        if p[i] == 0 or mass >= top_p:
            break
        keep[i] = True
        mass += p[i]
    keep &= p >= min_p * p[0]
    q = np.where(keep, p, 0)
    out = np.zeros_like(q)
    out[order] = q / q.sum()
    return out


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 6, 0.9, 0.0), (1.0, 0, 1.0, 0.2)])
def test_sample_matches_reference_distribution(temperature, top_k, top_p, min_p):
    n, vocab = 40000, 10
    logits = jax.random.normal(jax.random.key(1), (vocab,)) * 2
    draws = sample(jnp.broadcast_to(logits, (n, vocab)), keys(n, 2),
                   jnp.full((n,), temperature), jnp.full((n,), top_k, jnp.int32),
                   jnp.full((n,), top_p), jnp.full((n,), min_p))
    freq = np.bincount(np.asarray(draws), minlength=vocab) / n
    want = reference_distribution(np.asarray(logits), temperature, top_k, top_p, min_p)
    assert np.all(freq[want == 0] == 0)
    np.testing.assert_allclose(freq, want, atol=0.01)


def test_zero_temperature_is_argmax_per_row():
    logits = jax.random.normal(jax.random.key(3), (6, 50))
    temps = jnp.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    out = sample(logits, keys(6, 4), temps, jnp.zeros(6, jnp.int32), jnp.ones(6))
    greedy = np.asarray(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(temps) == 0], greedy[np.asarray(temps) == 0])


def test_top_k_one_is_greedy_even_when_sampling():
    logits = jax.random.normal(jax.random.key(5), (64, 100))
    out = sample(logits, keys(64, 6), jnp.full(64, 2.0), jnp.ones(64, jnp.int32), jnp.ones(64))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.argmax(logits, -1)))


def numpy_adjusted(logits, history, prompt, *, presence=0.0, frequency=0.0, repetition=1.0,
                   bias=None, banned=()):
    """vLLM's penalties and biases, stated token by token in float64: logit_bias and bans,
    then repetition over prompt + output, then frequency and presence over the output."""
    x = np.array(logits, np.float64)
    for t, b in (bias or {}).items():
        x[t] += b
    for t in banned:
        x[t] = -np.inf
    for t in set(prompt) | set(history):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(history):
        x[t] -= frequency * history.count(t) + presence
    return x


def test_adjustments_match_a_numpy_statement():
    from serving.sampling import apply_adjustments

    rng = np.random.default_rng(0)
    vocab, k = 50, 16
    logits = rng.standard_normal((3, vocab)).astype(np.float32) * 3
    rows = [  # (history, prompt, presence, frequency, repetition, bias, banned)
        ([4, 4, 7, 9, 4], [1, 2, 4], 0.5, 0.7, 1.3, {2: 1.5, 11: -3.0}, {13}),
        ([], [5, 6], 0.0, 0.0, 0.8, {}, set()),  # repetition < 1 raises seen tokens
        ([], [], 0.0, 0.0, 1.0, {}, set()),  # adjusts nothing: all padding
    ]
    ids = np.full((3, k), vocab, np.int32)
    counts, seen = np.zeros((3, k), np.int32), np.zeros((3, k), bool)
    bias, penalties = np.zeros((3, k), np.float32), np.tile(np.float32([0, 0, 1]), (3, 1))
    want = []
    for i, (hist, prompt, pres, freq, rep, b, banned) in enumerate(rows):
        toks = sorted(set(hist) | set(prompt) | set(b) | banned)
        ids[i, :len(toks)] = toks
        counts[i, :len(toks)] = [hist.count(t) for t in toks]
        seen[i, :len(toks)] = [t in hist or t in prompt for t in toks]
        bias[i, :len(toks)] = [-np.inf if t in banned else b.get(t, 0.0) for t in toks]
        penalties[i] = pres, freq, rep
        want.append(numpy_adjusted(logits[i], hist, prompt, presence=pres, frequency=freq, repetition=rep,
                                   bias=b, banned=banned))
    got = apply_adjustments(jnp.asarray(logits), *map(jnp.asarray, (ids, counts, seen, bias, penalties)))
    np.testing.assert_allclose(np.asarray(got), np.array(want), rtol=1e-6, atol=1e-6)
    assert not np.allclose(want[0], logits[0]) and not np.allclose(want[1], logits[1])
    np.testing.assert_array_equal(np.asarray(got)[2], logits[2])
