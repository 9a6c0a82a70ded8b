"""Our forward pass against transformers' logits (committed fixtures; `-m oracle` runs live)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import model
from tests.model import golden

TINY = sorted(golden.TINY_MODELS)


def tiny_path(name: str) -> str:
    return os.path.join(golden.FIXTURES, f"tiny_{name}")


def run_full(config, params, tokens):
    b, t = tokens.shape
    cache = model.init_cache(config, b, 64)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _ = model.forward(params, config, jnp.asarray(tokens), positions, cache)
    return np.asarray(logits)


@pytest.mark.parametrize("name", TINY)
def test_tiny_checkpoint_matches_transformers(name):
    config, params = model.load(tiny_path(name))
    ref = np.load(os.path.join(tiny_path(name), "logits.npz"))
    np.testing.assert_allclose(run_full(config, params, ref["tokens"]), ref["logits"], atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", ["llama", "llama_yarn", "mistral_swa"])
def test_incremental_decode_matches_full_forward(name):
    """Prefill a prefix, then decode one token at a time through the cache."""
    config, params = model.load(tiny_path(name))
    ref = np.load(os.path.join(tiny_path(name), "logits.npz"))
    tokens, want = ref["tokens"], ref["logits"]
    b, t = tokens.shape
    split = 37
    cache = model.init_cache(config, b, 64)
    pos = jnp.broadcast_to(jnp.arange(split), (b, split))
    logits, cache = model.forward(params, config, jnp.asarray(tokens[:, :split]), pos, cache)
    got = [np.asarray(logits)]
    for p in range(split, t):
        logits, cache = model.forward(params, config, jnp.asarray(tokens[:, p:p + 1]),
                                      jnp.full((b, 1), p), cache)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=1e-3, rtol=0)


def test_rope_variants_really_differ():
    """The RoPE fixtures only test scaling if the variants change the logits."""
    logits = {n: np.load(os.path.join(tiny_path(n), "logits.npz"))["logits"]
              for n in ("llama", "llama_linear", "llama3", "llama_yarn")}
    for a in logits:
        for b in logits:
            if a < b:
                assert np.abs(logits[a] - logits[b]).max() > 1e-3, (a, b)


@pytest.fixture(scope="module")
def smollm2_golden():
    return dict(np.load(os.path.join(golden.FIXTURES, "smollm2.npz")))


def check_smollm2_logits(config, params, ref):
    """All three prompts in one right-padded batch (one compilation)."""
    prompts = [ref[f"prompt{i}"] for i in range(3)]
    width = max(len(p) for p in prompts)
    tokens = np.zeros((3, width), np.int32)
    positions = np.full((3, width), -1, np.int32)
    for i, ids in enumerate(prompts):
        tokens[i, :len(ids)], positions[i, :len(ids)] = ids, np.arange(len(ids))
    cache = model.init_cache(config, 3, width)
    logits, _ = model.forward(params, config, jnp.asarray(tokens), jnp.asarray(positions), cache)
    for i in range(3):
        at = np.asarray(logits[i])[ref[f"positions{i}"]]
        np.testing.assert_allclose(at[:, ref["vocab_ids"]], ref[f"subset_logits{i}"], atol=1e-3, rtol=0)
        np.testing.assert_allclose(np.take_along_axis(at, ref[f"top_ids{i}"], axis=-1),
                                   ref[f"top_logits{i}"], atol=1e-3, rtol=0)


def test_default_model_logits_match_transformers(default_model, smollm2_golden):
    """Three prompts, one longer than 512 tokens, against transformers reading the same GGUF."""
    assert len(smollm2_golden["prompt2"]) > 512
    check_smollm2_logits(*default_model, smollm2_golden)


def test_default_model_greedy_matches_transformers(default_model, default_tokenizer, smollm2_golden):
    from serving import LLM, SamplingParams

    llm = LLM.from_loaded(*default_model, default_tokenizer, max_model_len=256)
    want = smollm2_golden["greedy0"].tolist()
    out = llm.generate({"prompt_token_ids": smollm2_golden["prompt0"].tolist()},
                       SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True))
    got = out[0].outputs[0].token_ids
    assert got == want
    assert "Paris" in default_tokenizer.decode(got)


def test_tokenizer_matches_transformers(default_tokenizer):
    with open(os.path.join(golden.FIXTURES, "tokenizer.json")) as f:
        ref = json.load(f)
    for text, ids in zip(ref["texts"], ref["ids"]):
        assert default_tokenizer.encode(text) == ids, text
        assert default_tokenizer.decode(ids) == text
    chat = default_tokenizer.apply_chat_template([{"role": "user", "content": golden.CHAT[0]["content"]}])
    assert chat == ref["chat"]


# --- live oracle (opt-in: pytest -m oracle; needs the `oracle` extra) ---

@pytest.mark.oracle
@pytest.mark.parametrize("name", TINY)
def test_tiny_live_against_transformers(name):
    pytest.importorskip("transformers")
    config, params = model.load(tiny_path(name))
    np.testing.assert_allclose(run_full(config, params, golden.tiny_tokens()),
                               golden.tiny_logits(tiny_path(name)), atol=1e-3, rtol=0)


@pytest.mark.oracle
def test_default_model_live_against_transformers(default_model):
    pytest.importorskip("transformers")
    ref = golden.smollm2_reference(model.default_model_path(), greedy_tokens=4)
    check_smollm2_logits(*default_model, ref)
