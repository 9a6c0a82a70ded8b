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


@pytest.mark.parametrize("name", ["llama", "llama_yarn", "mistral_swa", "qwen3", "gemma3"])
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


def test_qwen3_qk_norms_are_loaded_and_matter():
    """tiny_qwen3 has head_dim != hidden / heads and random q/k norm weights: dropping them
    (or swapping them) moves the logits far past the parity tolerance."""
    config, params = model.load(tiny_path("qwen3"))
    assert config.qk_norm and config.head_dim == 24 != config.hidden_size // config.num_heads
    assert params["layers"][0]["q_norm"].shape == (config.head_dim,)
    tokens = np.load(os.path.join(tiny_path("qwen3"), "logits.npz"))["tokens"]
    want = run_full(config, params, tokens)
    swapped = [{**layer, "q_norm": layer["k_norm"], "k_norm": layer["q_norm"]} for layer in params["layers"]]
    dropped = [{k: v for k, v in layer.items() if k not in ("q_norm", "k_norm")} for layer in params["layers"]]
    for layers in (swapped, dropped):
        got = run_full(config, {**params, "layers": layers}, tokens)
        assert np.abs(got - want).max() > 0.1


def test_qwen3_greedy_through_llm_matches_transformers(default_tokenizer):
    """The serving engine (packed steps) on tiny_qwen3 continues greedily as transformers did."""
    from serving import LLM, SamplingParams

    config, params = model.load(tiny_path("qwen3"))
    ref = np.load(os.path.join(tiny_path("qwen3"), "logits.npz"))
    want = ref["greedy"].tolist()
    assert len(set(want)) > 4  # not one repeated token
    llm = LLM.from_loaded(config, params, default_tokenizer, max_model_len=64)
    prompt = ref["tokens"][0, :golden.GREEDY_PROMPT].tolist()
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True))
    assert out[0].outputs[0].token_ids == want


# transformers' Qwen3 tensor names -> llama.cpp's (convert_hf_to_gguf.py, arch "qwen3")
_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _qwen3_gguf(path) -> None:
    """tiny_qwen3 as llama.cpp lays out a `qwen3` GGUF (float32 tensors, rows unpermuted)."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(tiny_path("qwen3"), "config.json")) as f:
        hf = json.load(f)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    for key, value in (("embedding_length", hf["hidden_size"]), ("block_count", hf["num_hidden_layers"]),
                       ("feed_forward_length", hf["intermediate_size"]), ("vocab_size", hf["vocab_size"]),
                       ("context_length", hf["max_position_embeddings"]),
                       ("attention.head_count", hf["num_attention_heads"]),
                       ("attention.head_count_kv", hf["num_key_value_heads"]),
                       ("attention.key_length", hf["head_dim"]), ("attention.value_length", hf["head_dim"])):
        writer.add_uint32(f"qwen3.{key}", value)
    writer.add_float32("qwen3.attention.layer_norm_rms_epsilon", hf["rms_norm_eps"])
    writer.add_float32("qwen3.rope.freq_base", hf["rope_parameters"]["rope_theta"])
    for name, w in load_file(os.path.join(tiny_path("qwen3"), "model.safetensors")).items():
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers."):].split(".", 1)
            name = f"blk.{idx}.{_GGUF_NAMES[rest.rsplit('.', 1)[0]]}.weight"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name]
        writer.add_tensor(name, np.asarray(w, np.float32))  # [out, in]; GGUF lists [in, out]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3_gguf_matches_transformers(tmp_path):
    path = tmp_path / "tiny_qwen3.gguf"
    _qwen3_gguf(path)
    config, params = model.load(str(path))
    assert config.name == "qwen3" and config.qk_norm and config.tie_word_embeddings
    ref = np.load(os.path.join(tiny_path("qwen3"), "logits.npz"))
    np.testing.assert_allclose(run_full(config, params, ref["tokens"]), ref["logits"], atol=1e-3, rtol=0)


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


def check_gguf_logits(config, params, ref, which=None):
    """A golden.gguf_reference's prompts (those numbered `which`, default all) in one
    right-padded batch (one compilation)."""
    which = range(sum(k.startswith("prompt") for k in ref)) if which is None else which
    ref = {**ref, **{f"{key}{i}": ref[f"{key}{n}"] for i, n in enumerate(which)
                     for key in ("prompt", "positions", "subset_logits", "top_ids", "top_logits")}}
    prompts = [ref[f"prompt{i}"] for i in range(len(which))]
    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), width), np.int32)
    positions = np.full((len(prompts), width), -1, np.int32)
    for i, ids in enumerate(prompts):
        tokens[i, :len(ids)], positions[i, :len(ids)] = ids, np.arange(len(ids))
    cache = model.init_cache(config, len(prompts), width)
    logits, _ = model.forward(params, config, jnp.asarray(tokens), jnp.asarray(positions), cache)
    for i in range(len(prompts)):
        at = np.asarray(logits[i])[ref[f"positions{i}"]]
        np.testing.assert_allclose(at[:, ref["vocab_ids"]], ref[f"subset_logits{i}"], atol=1e-3, rtol=0)
        np.testing.assert_allclose(np.take_along_axis(at, ref[f"top_ids{i}"], axis=-1),
                                   ref[f"top_logits{i}"], atol=1e-3, rtol=0)


def test_default_model_logits_match_transformers(default_model, smollm2_golden):
    """Three prompts, one longer than 512 tokens, against transformers reading the same GGUF."""
    assert len(smollm2_golden["prompt2"]) > 512
    check_gguf_logits(*default_model, smollm2_golden)


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
    ref = golden.gguf_reference(model.default_model_path(), golden.smollm2_prompts, greedy_tokens=4)
    check_gguf_logits(*default_model, ref)
