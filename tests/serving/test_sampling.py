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
