"""Invariants of the forward pass: paging, padding, captured features, gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model.config import ModelConfig
from model.layers import rms_norm


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4,
                         num_kv_heads=2, head_dim=8, layer_kinds=("attention", "sliding_attention") * 2,
                         max_position_embeddings=128, sliding_window=5)
    return config, model.init_params(config, jax.random.key(0))


def full_logits(config, params, tokens, cache):
    b, t = tokens.shape
    logits, _ = model.forward(params, config, tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), cache)
    return np.asarray(logits)


def test_shuffled_pages_equal_contiguous_cache(tiny):
    """Block tables decide where K/V live; the answer must not depend on it."""
    config, params = tiny
    tokens = jax.random.randint(jax.random.key(1), (3, 30), 0, config.vocab_size)
    want = full_logits(config, params, tokens, model.init_cache(config, 3, 32, page_size=4))
    perm = np.random.default_rng(0).permutation(3 * 8 + 5)[:24]  # 5 spare pages, random order
    cache = model.init_paged_cache(config, 29, 4, jnp.float32, jnp.asarray(perm.reshape(3, 8), jnp.int32))
    got = full_logits(config, params, tokens, cache)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_decode_over_pages_equals_full_forward(tiny):
    config, params = tiny
    tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, config.vocab_size)
    want = full_logits(config, params, tokens, model.init_cache(config, 2, 20, page_size=4))
    cache = model.init_cache(config, 2, 20, page_size=4)
    logits, cache = model.forward(params, config, tokens[:, :9], jnp.broadcast_to(jnp.arange(9), (2, 9)), cache)
    steps = [np.asarray(logits)]
    for p in range(9, 20):
        logits, cache = model.forward(params, config, tokens[:, p:p + 1], jnp.full((2, 1), p), cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, 1), want, atol=1e-5)


def test_padding_tokens_neither_write_nor_disturb(tiny):
    config, params = tiny
    tokens = jax.random.randint(jax.random.key(3), (1, 12), 0, config.vocab_size)
    want = full_logits(config, params, tokens, model.init_cache(config, 1, 16))
    padded = jnp.concatenate([tokens, jnp.zeros((1, 4), jnp.int32)], axis=1)
    positions = jnp.concatenate([jnp.arange(12), -jnp.ones(4, jnp.int32)])[None]
    cache = model.init_cache(config, 1, 16)
    logits, cache = model.forward(params, config, padded, positions, cache)
    np.testing.assert_allclose(np.asarray(logits)[:, :12], want, atol=1e-5)
    assert np.all(np.asarray(cache.layers[0]["k"]).reshape(-1, 2, 8)[12:] == 0)


def test_captured_features_are_the_residual_entering_each_layer(tiny):
    config, params = tiny
    tokens = jax.random.randint(jax.random.key(4), (2, 10), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(10), (2, 10))
    _, _, captured = model.forward_hidden(params, config, tokens, positions,
                                          model.init_cache(config, 2, 16), capture_layers=(0, 3))
    np.testing.assert_array_equal(captured[0], params["embed"][tokens])
    short = dataclasses.replace(config, layer_kinds=config.layer_kinds[:3])
    short_params = {**params, "layers": params["layers"][:3]}
    hidden, _, _ = model.forward_hidden(short_params, short, tokens, positions,
                                        model.init_cache(short, 2, 16))
    np.testing.assert_allclose(rms_norm(captured[1], params["final_norm"], config.rms_norm_eps),
                               hidden, atol=1e-5)


def test_gradients_reach_every_parameter(tiny):
    assert_gradients_reach_every_parameter(*tiny)


def test_qk_norm_params_are_initialised_and_trained(tiny):
    """qk_norm (Qwen3) layers get q_norm / k_norm of ones over head_dim (here != hidden / heads)."""
    from model.weights import expected_layer_params

    config = dataclasses.replace(tiny[0], qk_norm=True, head_dim=12)
    params = model.init_params(config, jax.random.key(1))
    for i, layer in enumerate(params["layers"]):
        assert set(layer) == expected_layer_params(config, i)
        np.testing.assert_array_equal(layer["q_norm"], np.ones(12))
        np.testing.assert_array_equal(layer["k_norm"], np.ones(12))
    assert_gradients_reach_every_parameter(config, params)


def assert_gradients_reach_every_parameter(config, params):
    tokens = jax.random.randint(jax.random.key(5), (2, 12), 0, config.vocab_size)

    def loss(p):
        hidden, _, _ = model.forward_hidden(p, config, tokens, jnp.broadcast_to(jnp.arange(12), (2, 12)),
                                            model.init_cache(config, 2, 12))
        logits = model.lm_head(p, config, hidden)
        return -jnp.mean(jax.nn.log_softmax(logits[:, :-1]) [
            jnp.arange(2)[:, None], jnp.arange(11)[None], tokens[:, 1:]])

    grads = jax.grad(loss)(params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)


def test_tree_attention_equals_each_path_alone(tiny):
    """Scoring a draft tree in one pass (model/context.py TokenTree) gives, at every node,
    the logits of running the prefix followed by that node's root-to-node path. The
    sliding window (5) is shorter than prefix + tree, so the window rule is exercised."""
    config, params = tiny
    parents = np.array([-1, 0, 0, 1, 1, 2, 3])
    depth = np.zeros(7, np.int32)
    mask = np.eye(7, dtype=bool)
    for i in range(1, 7):
        depth[i], mask[i] = depth[parents[i]] + 1, mask[i] | mask[parents[i]]
    b, prefix = 2, 9
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (b, prefix + 7), 0, config.vocab_size))
    cache = model.init_cache(config, b, 32, page_size=4)
    _, cache = model.forward(params, config, jnp.asarray(tokens[:, :prefix]),
                             jnp.broadcast_to(jnp.arange(prefix), (b, prefix)), cache)
    tree_tokens = tokens[:, prefix:]
    tree = model.TokenTree(jnp.asarray(np.broadcast_to(prefix + depth, (b, 7)), jnp.int32),
                           jnp.full((b,), prefix, jnp.int32), jnp.asarray(np.broadcast_to(mask, (b, 7, 7))))
    got, _ = model.forward(params, config, jnp.asarray(tree_tokens),
                           jnp.broadcast_to(prefix + jnp.arange(7), (b, 7)), cache, tree=tree)
    # Every node's path as its own sequence, in one batch: [node * b + row], padded at the
    # end (causal: padding after a path's last token does not change its logits).
    longest = prefix + depth.max() + 1
    seqs = np.zeros((7 * b, longest), np.int64)
    for node in range(7):
        path = [j for j in range(7) if mask[node, j]]  # ancestors are in increasing order
        seqs[node * b:(node + 1) * b, :prefix + len(path)] = np.concatenate(
            [tokens[:, :prefix], tree_tokens[:, path]], axis=1)
    want = full_logits(config, params, jnp.asarray(seqs), model.init_cache(config, 7 * b, 32, page_size=4))
    for node in range(7):
        np.testing.assert_allclose(np.asarray(got)[:, node], want[node * b:(node + 1) * b, prefix + depth[node]],
                                   atol=1e-5, err_msg=f"node {node}")
