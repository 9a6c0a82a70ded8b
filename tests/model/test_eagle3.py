"""The EAGLE-3 draft network: vocabulary maps, shapes, the paged cache, storage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import eagle3
from model.config import ModelConfig


@pytest.fixture(scope="module")
def draft():
    target = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_heads=4,
                         num_kv_heads=2, head_dim=8, layer_kinds=("attention",) * 6,
                         max_position_embeddings=64, tie_word_embeddings=True)
    target_params = model.init_params(target, jax.random.key(0))
    draft_ids = np.sort(np.random.default_rng(0).choice(96, 24, replace=False))
    config = eagle3.Eagle3Config(target, 24, eagle3.feature_layers(6), "test")
    params = eagle3.init_draft_params(config, target_params, draft_ids, jax.random.key(1))
    # Trained-looking norms, so the test sees them used.
    params["layer"]["hidden_norm"] = 1 + 0.1 * jax.random.normal(jax.random.key(2), (32,))
    return config, params, target_params, draft_ids


def test_vocab_maps_hand_case():
    d2t, t2d = eagle3.vocab_maps(np.array([7, 2, 5]), 8)
    np.testing.assert_array_equal(d2t, [2, 4, 5])  # draft 0,1,2 -> target 2,5,7
    np.testing.assert_array_equal(np.flatnonzero(t2d), [2, 5, 7])
    with pytest.raises(ValueError):
        eagle3.vocab_maps(np.array([1, 1]), 8)


def test_feature_layers():
    assert eagle3.feature_layers(30) == (2, 15, 27)
    with pytest.raises(ValueError):
        eagle3.feature_layers(3)


def test_init_copies_target_embedding_and_head(draft):
    config, params, target_params, draft_ids = draft
    np.testing.assert_array_equal(params["embed"], target_params["embed"])
    np.testing.assert_array_equal(params["lm_head"], target_params["embed"][draft_ids].T)
    np.testing.assert_array_equal(eagle3.draft_to_target(params, jnp.arange(24)), draft_ids)
    assert params["layer"]["wq"].shape == (64, 32) and params["fc"].shape == (96, 32)


def test_draft_forward_shapes_and_decode_equals_chunk(draft):
    """Prefill then one token at a time through the paged draft cache equals one chunk."""
    config, params, _, _ = draft
    b, t = 2, 12
    hidden = jax.random.normal(jax.random.key(3), (b, t, 32))
    tokens = jax.random.randint(jax.random.key(4), (b, t), 0, 96)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, out, _ = eagle3.draft_forward(params, config, hidden, tokens, positions,
                                          eagle3.init_draft_cache(config, b, 16, page_size=4))
    assert logits.shape == (b, t, 24) and logits.dtype == jnp.float32
    assert out.shape == (b, t, 32)
    cache = eagle3.init_draft_cache(config, b, 16, page_size=4)
    got_logits, _, cache = eagle3.draft_forward(params, config, hidden[:, :8], tokens[:, :8],
                                                positions[:, :8], cache)
    got = [got_logits]
    for p in range(8, t):
        step_logits, _, cache = eagle3.draft_forward(params, config, hidden[:, p:p + 1],
                                                     tokens[:, p:p + 1], positions[:, p:p + 1], cache)
        got.append(step_logits)
    np.testing.assert_allclose(np.concatenate(got, 1), logits, atol=1e-4)


def test_save_load_round_trip(draft, tmp_path):
    config, params, _, _ = draft
    eagle3.save_draft(str(tmp_path), config, params)
    loaded_config, loaded = eagle3.load_draft(str(tmp_path))
    assert loaded_config == config
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="not an EAGLE-3 draft"):
        eagle3.load_draft(str(tmp_path / "missing"))
