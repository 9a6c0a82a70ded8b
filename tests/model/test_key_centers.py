"""Key centers: exact for float attention, the stored keys' mean after centering is zero,
and quantized pages read closer to the float model with them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import key_centers, kv_eval, kv_formats
from model.config import ModelConfig
from model.layers import project_qkv
from model.rope import rope_tables
from tests.model.test_kv_formats import D, write_read

T = 64


@pytest.fixture(scope="module")
def biased():
    """A GQA model with a sliding layer whose keys share a large offset (a key bias, as in
    Qwen2), the mean that makes quantized keys costly."""
    config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_heads=4,
                         num_kv_heads=2, head_dim=32, layer_kinds=("attention", "sliding_attention"),
                         max_position_embeddings=128, sliding_window=24, attention_bias=True)
    params = model.init_params(config, jax.random.key(0))
    params = jax.tree.map(lambda a: a * 10, params)  # keys of order one, not 0.02
    for i, layer in enumerate(params["layers"]):
        layer["bk"] = 3 * jax.random.normal(jax.random.key(10 + i), layer["bk"].shape)
    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, config.vocab_size)
    return config, params, tokens


def logits(params, config, tokens, kv_cache_dtype="float32"):
    cache = model.init_cache(config, 1, T, kv_cache_dtype=kv_cache_dtype)
    out, _ = model.forward(params, config, tokens, jnp.arange(T)[None], cache)
    return np.asarray(out[0], np.float64)


def spread_error(got, want):
    return np.linalg.norm(got - want) / np.linalg.norm(want - want.mean(-1, keepdims=True))


def test_centered_float_attention_equals_uncentered(biased):
    config, params, tokens = biased
    centered = key_centers.with_key_centers(params, config, tokens[0])
    c = np.asarray(centered["layers"][0]["k_center"])
    assert c.shape == (config.num_kv_heads * config.head_dim,) and np.linalg.norm(c) > 10
    want = logits(params, config, tokens)
    assert spread_error(logits(centered, config, tokens), want) < 1e-4
    # any center is exact: the identity does not depend on its being the mean
    shifted = jax.tree.map(lambda a: a, centered)
    for layer in shifted["layers"]:
        layer["k_center"] = layer["k_center"] + 5.0
    assert spread_error(logits(shifted, config, tokens), want) < 1e-4


def stored_key_means(params, config, tokens):
    cache = model.init_cache(config, 1, T, kv_cache_dtype="float32")
    _, cache = model.forward(params, config, tokens, jnp.arange(T)[None], cache)
    return [np.asarray(layer.pages["k"]).reshape(-1, config.num_kv_heads * config.head_dim)[:T].mean(0)
            for layer in cache.layers]


def test_centers_are_the_mean_stored_key_and_centered_keys_average_to_zero(biased):
    """Each layer's center is the mean of the keys the plain model stores over the tokens;
    the centered model stores keys of mean zero in every layer (layer 1's keys come after
    layer 0's centered attention, unchanged by the identity)."""
    config, params, tokens = biased
    centered = key_centers.with_key_centers(params, config, tokens[0])
    plain_means, centered_means = stored_key_means(params, config, tokens), stored_key_means(centered, config, tokens)
    for layer, plain, mean in zip(centered["layers"], plain_means, centered_means):
        np.testing.assert_allclose(layer["k_center"], plain, rtol=1e-5, atol=1e-5)
        assert np.linalg.norm(mean) < 1e-5 * np.linalg.norm(plain)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "nvfp4", "mxfp4", "turboquant-3.5", "turboquant-2.5"])
def test_quantized_scores_err_less_on_centered_keys(fmt):
    """Keys with a common offset in the low-frequency RoPE channels, 80% of their energy (the
    default model's mean key holds about 60%): through each format's pages, the scores
    q . k_hat err less when the pages hold k - mean, since every format's error grows
    with the rows it codes."""
    rng = np.random.default_rng(0)
    b, t, h, d = 1, 64, 2, D
    offset = np.zeros((h, d))
    offset[:, list(kv_formats.rope_outlier_channels(d))] = rng.standard_normal((h, d // 2)) * 2
    k = jnp.asarray(offset + rng.standard_normal((b, t, h, d)) * 0.5, jnp.float32)
    v = jnp.zeros_like(k)
    q = rng.standard_normal((16, h, d))
    mean = k.mean(axis=1)

    def score_error(keys, shift):
        _, got, _ = write_read(fmt, keys, v, [t])
        err = np.einsum("qhd,bthd->qbth", q, got + shift - np.asarray(k, np.float64))
        return np.sqrt(np.mean(err ** 2))
    plain, centered = score_error(k, 0.0), score_error(k - mean[:, None], np.asarray(mean)[:, None])
    assert centered < 0.7 * plain, (centered, plain)


def test_for_kv_cache_centers_quantized_pages_of_supported_models(biased, default_tokenizer):
    config, params, _ = biased
    config = dataclasses.replace(config, vocab_size=default_tokenizer.vocab_size)
    params = model.init_params(config, jax.random.key(2))
    for kept in ("bfloat16", "fp8", "mxfp4"):  # float pages; formats kv_eval measured no gain for
        assert key_centers.for_kv_cache(params, config, default_tokenizer, kept) is params
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        key_centers.for_kv_cache(params, config, default_tokenizer, "int3")
    centered = key_centers.for_kv_cache(params, config, default_tokenizer, "int8")
    ids = key_centers.calibration_ids(default_tokenizer, config.max_position_embeddings)
    for got, want in zip(centered["layers"], key_centers.key_centers(params, config, ids)):
        np.testing.assert_array_equal(got["k_center"], want)
    # centering again takes the mean of the model's own keys, not of already centered ones
    again = key_centers.with_key_centers(centered, config, ids)
    np.testing.assert_allclose(again["layers"][1]["k_center"], centered["layers"][1]["k_center"], atol=1e-6)
    assert key_centers.without_key_centers(centered)["layers"][0].keys() == params["layers"][0].keys()
    for other in (dict(attention_sinks=True), dict(attn_logit_softcap=30.0)):
        unsupported = dataclasses.replace(config, **other)
        assert not key_centers.supports(unsupported)
        assert key_centers.for_kv_cache(params, unsupported, default_tokenizer, "int8") is params
        with pytest.raises(ValueError, match="shift-invariant"):
            key_centers.key_centers(params, unsupported, ids)


def test_calibration_text_is_fixed_and_apart_from_the_evaluation_text(default_tokenizer):
    n = key_centers.CALIBRATION_TOKENS
    ids = key_centers.calibration_ids(default_tokenizer, n)
    assert len(ids) == n and ids[:100] == key_centers.calibration_ids(default_tokenizer, 100)
    assert default_tokenizer.decode(ids).startswith('The "yield" statement')  # the last topic first
    grams = lambda x: {tuple(x[i:i + 16]) for i in range(len(x) - 15)}  # no passage of the evaluated text
    assert not grams(ids) & grams(kv_eval.documentation_ids(default_tokenizer, 2048))
    with pytest.raises(ValueError, match="asked for"):
        key_centers.calibration_ids(default_tokenizer, 10 ** 8)
    for bad in (-5, 0, 2.0, True):
        with pytest.raises(ValueError, match="num_tokens must be a positive int"):
            key_centers.calibration_ids(default_tokenizer, bad)


def test_a_tokenizer_past_the_models_vocabulary_is_named(biased, default_tokenizer):
    config, params, _ = biased
    with pytest.raises(ValueError, match="past the model's vocabulary of 128"):
        key_centers.for_kv_cache(params, config, default_tokenizer, "int8")
    with pytest.raises(ValueError, match="1 centers for 2 layers"):
        key_centers.set_key_centers(params, [params["layers"][0]["bk"]])


@pytest.mark.parametrize("ids, match", [
    ([[1, 2], [3, 4]], "1-D"), ([], "non-empty"), ([0.5, 1.0], "ints"), ([1, 128], r"\[0, 128\)"),
    ([-1, 3], r"\[0, 128\)"), (list(range(100)) * 2, "at most 128"),
])
def test_key_centers_reject_bad_token_ids(biased, ids, match):
    config, params, _ = biased
    with pytest.raises(ValueError, match=match):
        key_centers.key_centers(params, config, ids)


def random_moments(rng, heads, d):
    """Key covariances and query second moments with spread-out spectra, float64."""
    def spd():
        g = rng.standard_normal((heads, d, d)) * np.logspace(0, -2, d)
        return g @ np.swapaxes(g, -1, -2) / d
    return spd(), spd()


def test_key_bases_are_dual_and_balance_keys_and_queries():
    """B^T A = I; in A's basis keys and queries are uncorrelated with equal variances, whose
    squares are the eigenvalues of C_k C_q (numpy's, not the Cholesky route the bases take);
    the d/2 largest sit in the high channels; and E||Ak||^2 E||Bq||^2 reaches its minimum
    (sum sqrt(eig C_k C_q))^2, below the channel basis's tr C_k tr C_q."""
    rng = np.random.default_rng(0)
    d, heads = 32, 2
    key_cov, query_moment = random_moments(rng, heads, d)
    high = kv_formats.rope_outlier_channels(d)
    a, b = key_centers.key_bases(key_cov, query_moment, high)
    assert a.shape == b.shape == (heads, d, d) and a.dtype == np.float32
    low = [c for c in range(d) if c not in high]
    for h in range(heads):
        ah, bh = a[h].astype(np.float64), b[h].astype(np.float64)
        np.testing.assert_allclose(bh.T @ ah, np.eye(d), atol=2e-4)
        keys, queries = ah @ key_cov[h] @ ah.T, bh @ query_moment[h] @ bh.T
        scale = np.trace(keys) / d
        np.testing.assert_allclose(keys, np.diag(np.diag(keys)), atol=1e-4 * scale)
        np.testing.assert_allclose(queries, np.diag(np.diag(keys)), atol=1e-4 * scale)
        eig = np.sort(np.linalg.eigvals(key_cov[h] @ query_moment[h]).real)
        np.testing.assert_allclose(np.sort(np.diag(keys)) ** 2, eig, rtol=1e-3, atol=1e-6 * eig.max())
        assert np.diag(keys)[list(high)].min() >= np.diag(keys)[low].max()
        floor = np.sum(np.sqrt(np.maximum(eig, 0))) ** 2
        np.testing.assert_allclose(np.trace(keys) * np.trace(queries), floor, rtol=1e-3)
        assert floor < 0.9 * np.trace(key_cov[h]) * np.trace(query_moment[h])
    with pytest.raises(ValueError, match="do not fit"):
        key_centers.key_bases(key_cov, query_moment, high[:-1])


def test_key_bases_keep_float_attention_exact(biased):
    """A model with centers and bases computes the plain model's logits; the bases are no
    identity; nvfp4 pages' sink reflection is exact too, and in both the first token's stored
    key lies on one channel; int8 pages get centers only."""
    config, params, tokens = biased
    centers, bases = key_centers.key_transforms(params, config, tokens[0], "turboquant-3.5")
    transformed = key_centers.set_key_centers(params, centers, bases)
    for layer in transformed["layers"]:
        assert layer["k_basis"].shape == (config.num_kv_heads, config.head_dim, config.head_dim)
        assert np.abs(np.asarray(layer["k_basis"]) - np.eye(config.head_dim)).max() > 0.1
    assert spread_error(logits(transformed, config, tokens), logits(params, config, tokens)) < 1e-4
    assert key_centers.key_transforms(params, config, tokens[0], "int8")[1] is None
    reflected = key_centers.set_key_centers(params, *key_centers.key_transforms(params, config, tokens[0], "nvfp4"))
    assert spread_error(logits(reflected, config, tokens), logits(params, config, tokens)) < 1e-4
    for run in (transformed, reflected):  # the first token's stored key, A (k_0 - c), sits on one channel
        cache = model.init_cache(config, 1, T)
        _, cache = model.forward(run, config, tokens, jnp.arange(T)[None], cache)
        for layer in cache.layers:
            rows = np.asarray(layer.pages["k"], np.float64).reshape(-1, config.num_kv_heads, config.head_dim)
            first = np.abs(rows[0])
            assert (np.sort(first, -1)[:, -2] < 1e-4 * first.max(-1)).all(), first
            if run is reflected:  # scaled to 6 x 2^n, which nvfp4 stores exactly
                power = np.log2(first.max(-1) / 6)
                np.testing.assert_allclose(power, np.round(power), atol=1e-4)
    assert key_centers.without_key_centers(transformed)["layers"][0].keys() == params["layers"][0].keys()
    with pytest.raises(ValueError, match="1 bases for 2 layers"):
        key_centers.set_key_centers(params, centers, bases[:1])
    for heads in (0, -1, 3, True, 1.0):
        with pytest.raises(ValueError, match="model_kv_heads must be a positive int dividing the 2"):
            key_centers.key_transforms(params, config, tokens[0], "turboquant-3.5", model_kv_heads=heads)


def test_key_moments_match_the_stored_keys_and_the_queries(biased):
    """The key covariance is the covariance of the keys the plain model stores (its float
    pages); the query moment is the mean q q^T over the tokens and the query heads i that
    read KV head i // (num_heads / num_kv_heads), q taken from each layer's own input."""
    config, params, tokens = biased
    cache = model.init_cache(config, 1, T, kv_cache_dtype="float32")
    _, cache = model.forward(params, config, tokens, jnp.arange(T)[None], cache)
    positions = jnp.arange(T)[None]
    _, _, inputs = model.forward_hidden(params, config, tokens, positions, model.init_cache(config, 1, T),
                                        (0, 1))
    group = config.num_heads // config.num_kv_heads
    moments = key_centers.key_moments(params, config, tokens[0])
    means_only = key_centers.key_moments(params, config, tokens[0], covariances=False)
    for full, means in zip(moments, means_only):
        np.testing.assert_allclose(means.mean, full.mean, rtol=1e-4, atol=1e-4)
        assert means.key_cov is None and means.query_moment is None
        np.testing.assert_allclose(means.sink, full.sink, rtol=1e-4, atol=1e-4)
    for (mean, key_cov, query_moment, sink), layer, kind, x, layer_cache in zip(
            moments, params["layers"], config.layer_kinds, inputs, cache.layers):
        keys = np.asarray(layer_cache.pages["k"], np.float64).reshape(-1, config.num_kv_heads, config.head_dim)[:T]
        rope = rope_tables(config, positions, local=kind == "sliding_attention")
        q, _, _ = project_qkv(layer, config, x, rope, (layer["attn_norm"], config.rms_norm_eps))
        q = np.asarray(q[0], np.float64)
        first = keys[0] - keys.mean(0)
        np.testing.assert_allclose(sink, first, rtol=1e-4, atol=1e-4 * np.abs(first).max())
        for h in range(config.num_kv_heads):
            np.testing.assert_allclose(key_cov[h], np.cov(keys[:, h].T, bias=True), rtol=1e-4,
                                       atol=1e-5 * np.trace(key_cov[h]))
            heads = [i for i in range(config.num_heads) if i // group == h]
            want = sum(q[:, i].T @ q[:, i] for i in heads) / (T * len(heads))
            np.testing.assert_allclose(query_moment[h], want, rtol=1e-4, atol=1e-5 * np.trace(want))


def test_key_bases_cut_turboquant_score_error():
    """Centered keys and queries whose energy sits in different directions (neither in the
    slow RoPE channels): through turboquant-3.5 and -2.5 pages, q . k_hat errs less when the
    pages hold A (k - c) and the scores take B q, with the bases fitted on other samples."""
    rng = np.random.default_rng(1)
    h, d, n = 2, D, 96  # the rows write_read's pages hold
    mix_k = rng.standard_normal((h, d, d)) * np.logspace(0, -1.5, d)
    mix_q = rng.standard_normal((h, d, d)) * np.logspace(0, -1.5, d)[::-1]

    def samples(seed, n):
        r = np.random.default_rng(seed)
        k = np.einsum("hde,nhe->nhd", mix_k, r.standard_normal((n, h, d)))
        q = np.einsum("hde,nhe->nhd", mix_q, r.standard_normal((n, h, d)))
        return k, q
    k_fit, q_fit = samples(2, 512)
    key_cov = np.einsum("nhd,nhe->hde", k_fit, k_fit) / 512
    query_moment = np.einsum("nhd,nhe->hde", q_fit, q_fit) / 512
    a, b = key_centers.key_bases(key_cov, query_moment, kv_formats.rope_outlier_channels(d))
    k, q = samples(3, n)
    want = np.einsum("qhd,khd->qkh", q[:64], k)
    for fmt in ("turboquant-3.5", "turboquant-2.5"):
        def score_error(keys, queries):
            _, got, _ = write_read(fmt, jnp.asarray(keys[None], jnp.float32), jnp.zeros((1, n, h, d)), [n])
            return np.sqrt(np.mean((np.einsum("qhd,khd->qkh", queries[:64], got[0]) - want) ** 2))
        plain = score_error(k, q)
        based = score_error(np.einsum("hed,nhd->nhe", a, k), np.einsum("hed,nhd->nhe", b, q))
        assert based < 0.7 * plain, (fmt, based, plain)


def test_the_sink_key_lands_on_one_channel_and_is_stored_almost_exactly():
    """With the sink token's centered key given, A sink has one non-zero channel (the one
    where it was largest without it), B^T A = I still, keys and queries keep equal second
    moments; through turboquant-3.5 pages the sink's key comes back to about 1e-2 of its
    norm (TurboQuant keeps each half's largest channel exact), against several percent
    without the reflection. `sink_bases` does the same from the channel basis: nvfp4 pages
    store the sink's key with less than half the error, and exactly once it is scaled to 6 x 2^n."""
    rng = np.random.default_rng(4)
    heads, d = 2, D
    key_cov, query_moment = random_moments(rng, heads, d)
    high = kv_formats.rope_outlier_channels(d)
    sink = 5 * rng.standard_normal((heads, d)) @ np.linalg.cholesky(key_cov[0]).T
    plain_a, _ = key_centers.key_bases(key_cov, query_moment, high)
    a, b = key_centers.key_bases(key_cov, query_moment, high, sink=sink)
    for h in range(heads):
        ah, bh = a[h].astype(np.float64), b[h].astype(np.float64)
        np.testing.assert_allclose(bh.T @ ah, np.eye(d), atol=2e-4)
        on = ah @ sink[h]
        j = int(np.abs(plain_a[h] @ sink[h]).argmax())
        assert np.abs(np.delete(on, j)).max() < 1e-5 * abs(on[j])
        np.testing.assert_allclose(ah @ key_cov[h] @ ah.T, bh @ query_moment[h] @ bh.T,
                                   atol=1e-4 * np.trace(key_cov[h]))

    def stored_error(fmt, basis):
        rows = np.einsum("hed,hd->he", basis, sink)[None].repeat(16, 0)  # a page of sink keys
        _, got, _ = write_read(fmt, jnp.asarray(rows[None], jnp.float32), jnp.zeros((1, 16, heads, d)), [16])
        return np.linalg.norm(got[0, 0] - rows[0]) / np.linalg.norm(rows[0])
    errors = stored_error("turboquant-3.5", a), stored_error("turboquant-3.5", plain_a)
    assert errors[0] < 1e-2 and errors[1] > 3e-2, errors

    # nvfp4 pages: the channel basis with the sink reflected alone (H symmetric, orthogonal),
    # scaled so that the sink's channel is 6 x 2^n, which nvfp4 stores exactly
    plain_h, _ = key_centers.sink_bases(sink)
    h_a, h_b = key_centers.sink_bases(sink, code=6.0)
    for h in range(heads):
        np.testing.assert_allclose(plain_h[h], plain_h[h].T, atol=1e-6)
        np.testing.assert_allclose(plain_h[h] @ plain_h[h], np.eye(d), atol=1e-5)
        np.testing.assert_allclose(h_b[h].T.astype(np.float64) @ h_a[h], np.eye(d), atol=1e-5)
        on = h_a[h].astype(np.float64) @ sink[h]
        j = int(np.abs(sink[h]).argmax())
        assert np.abs(np.delete(on, j)).max() < 1e-5 * abs(on[j])
        power = np.log2(abs(on[j]) / 6)
        assert abs(power - round(power)) < 1e-5, on[j]
    eye = np.stack([np.eye(d)] * heads)
    errors = stored_error("nvfp4", h_a), stored_error("nvfp4", plain_h), stored_error("nvfp4", eye)
    assert errors[0] < 1e-4 and errors[1] < 0.5 * errors[2], errors
    for size, power in ((1e4, 8), (1e-4, -9)):  # past E4M3's powers of two: the nearest it holds
        tiny_a, _ = key_centers.sink_bases(sink * size / np.linalg.norm(sink[:1]), code=6.0)
        on = np.abs(tiny_a[0].astype(np.float64) @ (sink[0] * size / np.linalg.norm(sink[0])))
        np.testing.assert_allclose(on.max(), 6 * 2.0 ** power, rtol=1e-5)
    with pytest.raises(ValueError, match="sink of shape"):
        key_centers.key_bases(key_cov, query_moment, high, sink=sink[:1])
