"""Training-time test: the mask, the step alignment, and agreement with chained inference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import eagle3
from model.config import ModelConfig
from training import ttt


@pytest.fixture(scope="module")
def setup():
    target = ModelConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_heads=4,
                         num_kv_heads=2, head_dim=8, layer_kinds=("attention",) * 5,
                         max_position_embeddings=64, tie_word_embeddings=True)
    target_params = model.init_params(target, jax.random.key(0))
    config = eagle3.Eagle3Config(target, 32, eagle3.feature_layers(5), "test")
    draft_ids = np.sort(np.random.default_rng(1).choice(80, 32, replace=False))
    params = eagle3.init_draft_params(config, target_params, draft_ids, jax.random.key(1))
    # Larger weights than init so that every path (attention over each step's keys) matters.
    params["layer"] = {k: v * (6.0 if v.ndim == 2 else 1.0) for k, v in params["layer"].items()}
    b, t = 2, 12
    ks = jax.random.split(jax.random.key(2), 3)
    batch = {"features": jax.random.normal(ks[0], (b, t, 96)),
             "tokens": jax.random.randint(ks[1], (b, t), 0, 80),
             "target_logits": 3 * jax.random.normal(ks[2], (b, t, 32)),
             "target_ids": jnp.asarray(draft_ids)[jax.random.randint(ks[2], (b, t), 0, 32)],
             "loss_mask": jnp.ones((b, t), bool)}
    return config, params, batch


def test_ttt_mask_hand_case():
    want = np.array([[1, 0, 0, 1, 0, 0, 1, 0, 0],
                     [1, 1, 0, 0, 1, 0, 0, 1, 0],
                     [1, 1, 1, 0, 0, 1, 0, 0, 1]], bool)
    np.testing.assert_array_equal(ttt.ttt_mask(3, 2), want)
    np.testing.assert_array_equal(ttt.ttt_mask(3, 0), np.tril(np.ones((3, 3), bool)))


def test_ttt_attention_equals_dense_masked_attention():
    b, t, hq, hkv, d, s = 2, 5, 4, 2, 8, 4
    ks = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(ks[0], (b, t, hq, d))
    k0, v0 = jax.random.normal(ks[1], (2, b, t, hkv, d))
    k_steps, v_steps = jax.random.normal(ks[2], (2, s, b, t, hkv, d))
    for step in range(s):
        got = ttt.ttt_attention(q, k0, v0, k_steps, v_steps, step, d ** -0.5)
        capped = ttt.ttt_attention(q, k0, v0, k_steps, v_steps, step, 0.9, 2.0)
        keys = jnp.concatenate([k0] + [k_steps[j] for j in range(1, step + 1)], axis=1)
        values = jnp.concatenate([v0] + [v_steps[j] for j in range(1, step + 1)], axis=1)
        keys, values = jnp.repeat(keys, hq // hkv, 2), jnp.repeat(values, hq // hkv, 2)
        scores = jnp.einsum("bthd,bshd->bhts", q, keys)
        want_capped = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(
            jnp.where(ttt.ttt_mask(t, step), 2.0 * jnp.tanh(0.9 * scores / 2.0), -jnp.inf), -1), values)
        np.testing.assert_allclose(capped, want_capped, atol=1e-5)
        scores = scores * d ** -0.5
        scores = jnp.where(ttt.ttt_mask(t, step), scores, -jnp.inf)
        want = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), values)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_step0_alignment_feature_t_token_t1_predicts_t2(setup):
    """Only token 7 carries loss: step 0 scores index 5 (feature 5, token 6) against the
    target's distribution at 6; step 1 scores index 4 (token 6, position 5) against it too."""
    config, params, batch = setup
    batch = dict(batch, loss_mask=jnp.zeros((2, 12), bool).at[:, 7].set(True))
    out = ttt.ttt_unroll(params, config, batch, 3)
    p = jax.nn.softmax(batch["target_logits"][:, 6])
    for step, index in ((0, 5), (1, 4), (2, 3)):
        ce = -jnp.sum(p * jax.nn.log_softmax(out["logits"][step][:, index]), -1)
        np.testing.assert_allclose(out["loss"][step], ce.mean(), rtol=1e-5)
    # Step 0 is the plain draft: its index-5 logits depend on tokens up to 6 only.
    changed = dict(batch, tokens=batch["tokens"].at[:, 7:].set(0))
    np.testing.assert_allclose(ttt.ttt_unroll(params, config, changed, 1)["logits"][0][:, :6],
                               out["logits"][0][:, :6], atol=1e-5)


@pytest.mark.parametrize("scores", ["plain", "scaled_and_capped"])
def test_ttt_steps_equal_chained_draft_inference(setup, scores):
    """TTT step i at index p is draft step i after position p at inference: the draft
    cache holds step-0 K/V of positions <= p, then one entry per earlier draft step. Also
    for a target whose scores take another scale and a soft-cap (Gemma 2's)."""
    config, params, batch = setup
    if scores == "scaled_and_capped":
        target = dataclasses.replace(config.target, attention_scale=0.6, attn_logit_softcap=3.0)
        config = dataclasses.replace(config, target=target)
    steps, p = 4, 6
    logits = ttt.ttt_unroll(params, config, batch, steps)["logits"]
    hidden = eagle3.fuse_features(params, batch["features"])
    tokens = batch["tokens"]
    cache = eagle3.init_draft_cache(config, 2, 16, page_size=4)
    positions = jnp.broadcast_to(jnp.arange(p + 1), (2, p + 1))
    step_logits, out, cache = eagle3.draft_forward(params, config, hidden[:, :p + 1],
                                                   tokens[:, 1:p + 2], positions, cache)
    np.testing.assert_allclose(step_logits, logits[0][:, :p + 1], atol=1e-4)
    h = out[:, p:p + 1]
    for i in range(1, steps):
        step_logits, h, cache = eagle3.draft_forward(params, config, h, tokens[:, p + 1 + i:p + 2 + i],
                                                     jnp.full((2, 1), p + i), cache)
        np.testing.assert_allclose(step_logits[:, 0], logits[i][:, p], atol=1e-4)


def test_loss_weights_and_acceptance_chain(setup):
    config, params, batch = setup
    total, metrics = ttt.ttt_loss(params, config, batch, 3)
    np.testing.assert_allclose(total, metrics["loss"] @ jnp.array([1, 0.8, 0.64]), rtol=1e-6)
    # The target agrees with the draft's step-0 proposals: every tried position is
    # accepted at step 0; step 1 is tried only where the data followed the target.
    proposed = np.asarray(ttt.ttt_unroll(params, config, batch, 1)["proposed"][0])
    agree = dict(batch, target_ids=jnp.asarray(np.roll(proposed, 1, axis=1)))
    tried, accepted = ttt.acceptance_counts(params, config, agree, 2)
    follows = np.asarray(batch["tokens"])[:, 2:11] == proposed[:, :9]
    assert int(tried[0]) == int(accepted[0]) == 2 * 10
    assert int(tried[1]) == follows.sum()
    summary = ttt.acceptance_summary(np.array([10, 5, 2]), np.array([5, 2, 0]))
    assert summary["acceptance"] == [0.5, 0.4, 0.0]
    assert summary["mean_accepted_length"] == pytest.approx(1 + 0.5 + 0.2)
