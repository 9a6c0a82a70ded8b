"""Mixtures of experts (model/moe.py) and the two families built on them: Qwen3-MoE and
gpt-oss (attention sinks, q/k/v/o biases, clamped SwiGLU experts), against transformers'
tiny checkpoints (tests/model/golden.py) and a float64 statement of the routing."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model.config import ATTENTION, SLIDING_ATTENTION, ModelConfig, config_from_hf
from model.moe import moe, route
from model.weights import expected_layer_params
from tests.model import golden
from tests.model.test_hf_parity import run_full, tiny_path

RNG = np.random.default_rng(0)


def _config(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_heads=4, num_kv_heads=2,
                head_dim=8, layer_kinds=(ATTENTION, ATTENTION), max_position_embeddings=64,
                moe_layers=(1,), num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12)
    return ModelConfig(**{**base, **kw})


def _route64(logits, config):
    """numpy float64: (weights, ids) per token, as transformers' Qwen3-MoE / gpt-oss route."""
    out = []
    for row in np.asarray(logits, np.float64):
        if config.moe_router == "topk_softmax":
            ids = np.argsort(-row)[:config.num_experts_per_tok]
            w = np.exp(row[ids] - row[ids].max())
            out.append((w / w.sum(), ids))
        else:
            if config.moe_router == "sigmoid_topk":
                p = 1 / (1 + np.exp(-row))
            else:
                p = np.exp(row - row.max())
                p /= p.sum()
            ids = np.argsort(-p)[:config.num_experts_per_tok]
            w = p[ids] / (p[ids].sum() if config.norm_topk_prob else 1.0)
            out.append((w, ids))
    return out


@pytest.mark.parametrize("kw", [dict(), dict(norm_topk_prob=True),
                                dict(moe_router="topk_softmax", moe_bias=True, hidden_act="swiglu_oai",
                                     swiglu_limit=0.05),
                                dict(moe_router="sigmoid_topk", norm_topk_prob=True, num_shared_experts=2)])
def test_moe_equals_a_per_token_loop_in_float64(kw):
    """Sorting tokens by expert into grouped matmuls gives each token the weighted sum of
    its k experts' MLPs (biases, clamps and all), plus the shared experts' MLP where the
    config has them (DeepSeek), as a plain per-token loop computes it."""
    config = _config(**kw)
    params = {k: jnp.asarray(RNG.standard_normal(v.shape), jnp.float32) for k, v in
              model.init_params(config, jax.random.key(0))["layers"][1].items()}
    x = RNG.standard_normal((3, 7, config.hidden_size)).astype(np.float32)
    got = np.asarray(moe(params, config, jnp.asarray(x)))
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    flat = x.reshape(-1, config.hidden_size).astype(np.float64)
    logits = flat @ p["router"] + p.get("router_bias", 0.0)
    want = np.zeros_like(flat)
    def bias(name, e):
        return p[name][e] if name in p else 0.0

    for t, (weights, ids) in enumerate(_route64(logits, config)):
        for w, e in zip(weights, ids):
            g = flat[t] @ p["experts_gate"][e] + bias("experts_gate_bias", e)
            u = flat[t] @ p["experts_up"][e] + bias("experts_up_bias", e)
            if config.hidden_act == "swiglu_oai":
                lim = config.swiglu_limit
                g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
                h = (u + 1) * g / (1 + np.exp(-1.702 * g))
            else:
                h = g / (1 + np.exp(-g)) * u
            want[t] += w * (h @ p["experts_down"][e] + bias("experts_down_bias", e))
        if config.num_shared_experts:
            g, u = flat[t] @ p["shared_gate"], flat[t] @ p["shared_up"]
            want[t] += (g / (1 + np.exp(-g)) * u) @ p["shared_down"]
    np.testing.assert_allclose(got.reshape(-1, config.hidden_size), want, rtol=2e-4, atol=2e-4)


def test_routing_matches_its_numpy_statement():
    logits = RNG.standard_normal((9, 5)).astype(np.float32)
    for kw in (dict(), dict(norm_topk_prob=True), dict(moe_router="topk_softmax"),
               dict(moe_router="sigmoid_topk"), dict(moe_router="sigmoid_topk", norm_topk_prob=True)):
        config = _config(**kw)
        weights, ids = route(jnp.asarray(logits), config)
        for (w, i), (w64, i64) in zip(zip(np.asarray(weights), np.asarray(ids)), _route64(logits, config)):
            assert i.tolist() == i64.tolist()
            np.testing.assert_allclose(w, w64, rtol=1e-6)


def test_moe_params_are_initialised_and_get_gradients():
    kw = dict(attention_bias=True, attention_out_bias=True, attention_sinks=True, moe_bias=True,
              moe_router="topk_softmax", hidden_act="swiglu_oai", swiglu_limit=7.0)
    config = _config(**kw)
    params = model.init_params(config, jax.random.key(1))
    for i, layer in enumerate(params["layers"]):
        assert set(layer) == expected_layer_params(config, i)
    assert "router" in params["layers"][1] and "w_gate" in params["layers"][0]
    # the router and every expert param get gradients (through the sort and grouped matmuls)
    experts = {k: v for k, v in params["layers"][1].items() if k.startswith(("router", "experts_"))}
    x = jnp.asarray(RNG.standard_normal((4, 6, config.hidden_size)), jnp.float32)
    grads = jax.grad(lambda p: jnp.sum(moe(p, config, x) ** 2))(experts)
    for name, g in grads.items():
        assert float(jnp.abs(g).max()) > 0, name


@pytest.mark.parametrize("kw, message", [
    (dict(num_experts_per_tok=6), "num_experts_per_tok"),
    (dict(moe_layers=(2,)), "moe_layers"),
    (dict(moe_router="sigmoid"), "moe_router"),
    (dict(hidden_act="swiglu_oai"), "swiglu_limit"),
])
def test_bad_moe_configs_are_value_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)


def test_dense_attention_with_sinks_matches_float64():
    """The dense fallback (KIVI pages) adds each head's sink to its softmax denominator only."""
    from model.layers import attend

    q, k, v = (RNG.standard_normal(s).astype(np.float32) for s in ((1, 3, 4, 8), (1, 5, 2, 8), (1, 5, 2, 8)))
    sinks = RNG.standard_normal(4).astype(np.float32) * 2
    got = np.asarray(attend(*map(jnp.asarray, (q, k, v)), jnp.asarray([[2, 3, 4]]), None, 0.3,
                            sinks=jnp.asarray(sinks)))
    for t, pos in enumerate((2, 3, 4)):
        for h in range(4):
            s = 0.3 * k[0, :pos + 1, h // 2].astype(np.float64) @ q[0, t, h]
            p = np.exp(s - max(s.max(), sinks[h]))
            p /= p.sum() + np.exp(sinks[h] - max(s.max(), sinks[h]))
            np.testing.assert_allclose(got[0, t, h], p @ v[0, :pos + 1, h // 2], rtol=1e-5, atol=1e-6)


def test_families_load_their_plans():
    config, params = model.load(tiny_path("qwen3_moe"))
    assert config.moe_layers == (1,) and config.norm_topk_prob and config.qk_norm
    assert params["layers"][1]["experts_gate"].shape == (4, 64, 32)
    config, params = model.load(tiny_path("gpt_oss"))
    assert config.layer_kinds == (SLIDING_ATTENTION, ATTENTION) and config.moe_layers == (0, 1)
    assert config.attention_sinks and config.attention_out_bias and config.rope_scaling.rope_type == "yarn"
    assert params["layers"][0]["experts_gate"].shape == (4, 64, 96)


@pytest.mark.parametrize("name, changes", [
    ("qwen3_moe", [dict(norm_topk_prob=False), dict(num_experts_per_tok=1)]),
    ("gpt_oss", [dict(attention_sinks=False), dict(hidden_act="silu", swiglu_limit=None),
                 dict(moe_router="softmax_topk")]),
])
def test_each_part_matters(name, changes):
    """Undoing one difference moves the tiny checkpoint's logits far past the 1e-3 parity
    tolerance, so the parity test checks it (sinks are dropped with their param)."""
    config, params = model.load(tiny_path(name))
    tokens = np.load(os.path.join(tiny_path(name), "logits.npz"))["tokens"]
    want = run_full(config, params, tokens)
    for change in changes:
        layers = params["layers"]
        if change.get("attention_sinks") is False:
            layers = [{k: v for k, v in layer.items() if k != "sinks"} for layer in layers]
        got = run_full(dataclasses.replace(config, **change), {**params, "layers": layers}, tokens)
        assert np.abs(got - want).max() > 0.1, change


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_greedy_through_llm_matches_transformers(name, default_tokenizer):
    """The serving engine (packed steps: sinks inside the ragged kernel, experts per step)
    continues greedily as transformers did."""
    from serving import LLM, SamplingParams

    config, params = model.load(tiny_path(name))
    ref = np.load(os.path.join(tiny_path(name), "logits.npz"))
    want = ref["greedy"].tolist()
    assert len(set(want)) > 4  # not one repeated token
    llm = LLM.from_loaded(config, params, default_tokenizer, max_model_len=64)
    out = llm.generate({"prompt_token_ids": ref["tokens"][0, :golden.GREEDY_PROMPT].tolist()},
                       SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True))
    assert out[0].outputs[0].token_ids == want


def test_a_missing_expert_is_a_value_error(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "qwen3_moe"
    shutil.copytree(tiny_path("qwen3_moe"), path)
    tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if ".experts.3." not in k}
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="experts"):
        model.load(str(path))


def test_moe_config_needs_its_expert_counts():
    with open(os.path.join(tiny_path("qwen3_moe"), "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        config_from_hf({**hf, "num_experts_per_tok": 9})
