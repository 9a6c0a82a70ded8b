"""CSA2 layers: sparse selection vs dense attention, Reuse/Reindex vs recomputing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.context import ForwardContext
from model.deepseek import layers as csa
from model.deepseek.attention import csa_attention
from model.deepseek.cache import init_layer_cache
from model.kv_cache import CacheLayout
from tests.model.deepseek_tiny import positions, tiny

B, T = 2, 20


def _ctx(pos):
    zeros = jnp.zeros(pos.shape + (2,))
    return ForwardContext(positions=pos, rope=(zeros, zeros), block_tables=jnp.zeros((B, 2), jnp.int32),
                          slots=jnp.zeros(pos.shape, jnp.int32), page_size=16)


def _cache(kind, config):
    return init_layer_cache(kind, config, CacheLayout(B, 2 * 32 // 16, 16), jnp.float32)


def _x(config, seed):
    return jax.random.normal(jax.random.key(seed), (B, T, config.hidden_size))


@pytest.mark.parametrize("layer", [2, 4])  # Full at ratio 2, Full + candidates at ratio 1
def test_topk_over_every_visible_row_equals_dense_attention(layer):
    config, params = tiny()
    config = dataclasses.replace(config, index_top_k=32, num_candidate_blocks=8)  # >= every visible row
    kind, p = config.layer_kinds[layer], params["layers"][layer]
    ratio = config.compress_ratios[layer]
    pos = positions(B, 0, T)

    @jax.jit
    def run(p, x, cache):
        cache, ctx = csa.compress_and_publish(kind, p, config, x, cache, _ctx(pos))
        pub = ctx.shared[csa.published_key(ratio)]
        h = csa.rms_norm(x, p["attn_norm"], config.rms_norm_eps)
        q_latent = csa.rms_norm(csa.linear(h, p["wq_a"]), p["q_norm"], config.rms_norm_eps)
        selected, _ = csa.select(p, config, ratio, q_latent, h, pos, pub["index_keys"], candidates=ratio == 1)
        window_rows, window_idx, _ = csa.window_step(p, config, h, pos, cache["local"], True)
        return pub["rows"], selected, window_rows, window_idx

    rows, selected, window_rows, window_idx = run(p, _x(config, layer), _cache(kind, config))
    # The causal rule: row j is visible to position p iff j < floor((p + 1) / r).
    n_vis = (np.arange(T) + 1) // ratio
    want = np.where(np.arange(32)[None] < n_vis[:, None], np.arange(32)[None], -1)
    np.testing.assert_array_equal(np.asarray(selected), np.broadcast_to(want, (B, T, 32)))
    keys = jax.random.split(jax.random.key(7), 2)
    q = jax.random.normal(keys[0], (B, T, config.num_heads, config.head_dim))
    sinks = jax.random.normal(keys[1], (config.num_heads,))
    got = jax.jit(csa_attention)(q, rows, selected, window_rows, window_idx, sinks)

    # Dense: every visible compressed row plus positions (p - W, p] of the chunk, and the sink.
    rows, win = np.asarray(rows, np.float64), np.asarray(window_rows, np.float64)[:, config.window:]
    qn, sk = np.asarray(q, np.float64), np.asarray(sinks, np.float64)
    want = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            kv = np.concatenate([rows[b, :n_vis[t]], win[b, max(0, t - config.window + 1):t + 1]])
            s = qn[b, t] @ kv.T / np.sqrt(config.head_dim)  # [heads, rows]
            m = np.maximum(s.max(-1), sk)
            e = np.exp(s - m[:, None])
            want[b, t] = (e @ kv) / (e.sum(-1) + np.exp(sk - m))[:, None]
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def _apply(kind):
    """The layer kind's apply, jitted; takes and returns ctx.shared instead of the context."""
    @jax.jit
    def run(params, x, cache, pos, shared):
        config = tiny()[0]
        x, cache, ctx = csa.LAYER_KINDS[kind].apply(params, config, x, cache,
                                                    dataclasses.replace(_ctx(pos), shared=shared))
        return x, cache, ctx.shared
    return run


def test_reuse_of_identical_kv_equals_recomputing():
    """A Reuse layer given exactly what it would have computed is the Full layer."""
    config, params = tiny()
    full = params["layers"][2]
    pos = positions(B, 0, T)
    x = _x(config, 3)
    out_full, cache_full, shared = _apply("csa_full_r2")(full, x, _cache("csa_full_r2", config), pos, {})
    reuse = {k: v for k, v in full.items() if k not in ("wkv_gate", "w_ik", "w_iq", "w_iw")}
    assert set(reuse) == set(params["layers"][3])  # the Reuse kind's own params
    out_reuse, cache_reuse, _ = _apply("csa_reuse_r2")(reuse, x, _cache("csa_reuse_r2", config), pos, shared)
    np.testing.assert_allclose(np.asarray(out_reuse), np.asarray(out_full), atol=1e-6)
    for a, b in zip(jax.tree.leaves(cache_reuse["local"]), jax.tree.leaves(cache_full["local"]["window"])
                    + [cache_full["local"]["window_end"]]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert not jax.tree.leaves(cache_reuse["global"])  # Reuse stores no global KV


def test_reindex_with_the_sources_indexer_equals_it():
    """Reindex with the candidate source's own indexer reselects the same rows."""
    config, params = tiny()
    source = params["layers"][4]
    pos = positions(B, 0, T)
    x = _x(config, 4)
    out_src, _, shared = _apply("csa_candidates_r1")(source, x, _cache("csa_candidates_r1", config), pos, {})
    reindex = {k: v for k, v in source.items() if k != "w_ik"}
    assert set(reindex) == set(params["layers"][6])
    out_re, _, shared_re = _apply("csa_reindex_r1")(reindex, x, _cache("csa_reindex_r1", config), pos, shared)
    np.testing.assert_allclose(np.asarray(out_re), np.asarray(out_src), atol=1e-6)
    sel = shared["csa_r1"]["selected"]
    np.testing.assert_array_equal(np.asarray(shared_re["csa_r1"]["selected"]), np.asarray(sel))
    # With 2 candidate blocks of 8, late queries really are restricted (not a dense top-k).
    assert int((np.asarray(sel) >= 0).sum(-1).max()) == config.index_top_k
    visible = np.arange(1, T + 1)  # ratio 1: position p sees p + 1 rows
    assert (np.asarray(shared["csa_r1"]["candidates"]).sum(-1) < visible).any()


def test_a_moe_layer_adds_the_mixture_of_experts_to_its_attention():
    """The tiny preset's layer 5 (Reuse r1) has DeepSeek's FFN: routed experts by sigmoid
    top-k plus a shared expert. Its output is the attention residual plus model.moe over
    its normalised value: with every expert zeroed the layer is attention alone."""
    from model.layers import rms_norm
    from model.moe import moe

    config, params = tiny()
    layer = params["layers"][5]
    assert config.layer_kinds[5] == "csa_reuse_r1" and {"router", "shared_gate", "experts_down"} <= set(layer)
    pos, x = positions(B, 0, T), _x(config, 5)
    _, _, shared = _apply("csa_candidates_r1")(params["layers"][4], x, _cache("csa_candidates_r1", config), pos, {})
    reuse = _apply("csa_reuse_r1")
    out, _, _ = reuse(layer, x, _cache("csa_reuse_r1", config), pos, shared)
    silent = {k: jnp.zeros_like(v) if k.startswith(("experts_", "shared_")) else v for k, v in layer.items()}
    attended, _, _ = reuse(silent, x, _cache("csa_reuse_r1", config), pos, shared)
    ffn = moe(layer, config, rms_norm(attended, layer["mlp_norm"], config.rms_norm_eps))
    assert float(jnp.abs(ffn).max()) > 1e-3  # the experts contribute
    np.testing.assert_allclose(np.asarray(out), np.asarray(attended + ffn), atol=1e-5)
