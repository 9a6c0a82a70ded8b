"""Read a GGUF file: architecture metadata -> ModelConfig, tensors -> params.

llama.cpp stores the q/k projection rows of `llama` models permuted for its
interleaved RoPE; we undo that so the halves (HF) RoPE layout applies everywhere.
"""

from __future__ import annotations

import numpy as np

from model.config import (ATTENTION, GEMMA3_LOCAL_THETA, GEMMA_SLIDING_PATTERN, SLIDING_ATTENTION, ModelConfig,
                          RopeScaling)

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def open_gguf(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises bare ValueError/struct errors on garbage
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {GGUF_ARCHITECTURES}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF files with a rope_freqs tensor (Llama 3.1 scaling) are not supported; "
                         "load the Hugging Face checkpoint directory instead")
    hidden = int(field(reader, f"{arch}.embedding_length"))
    heads = int(field(reader, f"{arch}.attention.head_count"))
    layers = int(field(reader, f"{arch}.block_count"))
    scaling_type = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type in ("none", None):
        scaling = RopeScaling()
    elif scaling_type in ("linear", "yarn"):
        scaling = RopeScaling(
            rope_type=scaling_type, factor=float(field(reader, f"{arch}.rope.scaling.factor")),
            original_max_position_embeddings=field(
                reader, f"{arch}.rope.scaling.original_context_length"))
    else:
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: linear, yarn")
    window = field(reader, f"{arch}.attention.sliding_window")
    kinds = (SLIDING_ATTENTION if window else ATTENTION,) * layers
    extra = {}
    if arch == "gemma3":  # as llama.cpp builds it: every 6th layer global, GeGLU, sandwich norms
        kinds = tuple(ATTENTION if (i + 1) % GEMMA_SLIDING_PATTERN[arch] == 0 else SLIDING_ATTENTION
                      for i in range(layers))
        extra = dict(hidden_act="gelu_tanh", embedding_multiplier=hidden ** 0.5, sandwich_norm=True,
                     rope_local_theta=GEMMA3_LOCAL_THETA)  # llama.cpp fixes it too
    vocab = field(reader, f"{arch}.vocab_size") or len(field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        layer_kinds=kinds,
        max_position_embeddings=int(field(reader, f"{arch}.context_length")),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch in ("qwen3", "gemma3"),
        tie_word_embeddings="output.weight" not in names,
        sliding_window=int(window) if window else None,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        name=arch,
        **extra,
    )


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permute of q/k rows ([out, in] or [out])."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm", "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv",
    "attn_output.weight": "wo", "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down", "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    # Gemma 3's norms after attention and the MLP (GGUF stores its norm weights as 1 + w)
    "post_attention_norm.weight": "attn_post_norm", "post_ffw_norm.weight": "mlp_post_norm",
}


def params_from_gguf(reader, config: ModelConfig, dtype=np.float32, weights_dtype: str | None = None) -> dict:
    """Arrange the file's tensors as model params, each kept as model/weights.py `store`
    says (dequantized to `dtype` when weights_dtype is None)."""
    from gguf.quants import dequantize

    from model.weights import check_complete, store_gguf, store_rows

    permuted = config.name == "llama"  # llama.cpp only permutes for its NORM RoPE
    params: dict = {"layers": [{} for _ in range(config.num_layers)]}
    for t in reader.tensors:
        name = t.name
        if name == "token_embd.weight":
            key, layer = "embed", None
        elif name == "output.weight":
            key, layer = "lm_head", None
        elif name == "output_norm.weight":
            key, layer = "final_norm", None
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_TENSORS:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            key, layer = _LAYER_TENSORS[rest], int(idx)
        elif name == "rope_freqs.weight":
            continue
        else:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        rows = t.data  # [out, in] values, or [out, bytes] of blocks (GGUF lists shapes [in, out]); [n] for vectors
        if permuted and key in ("wq", "bq"):
            rows = _unpermute_rope_rows(rows, config.num_heads)
        elif permuted and key in ("wk", "bk"):
            rows = _unpermute_rope_rows(rows, config.num_kv_heads)
        d_in, d_out = int(t.shape[0]), int(t.shape[-1])
        w = store_gguf(key, rows, t.tensor_type.name, (d_in, d_out), weights_dtype)
        if w is None:
            w = store_rows(key, lambda r0, r1, rows=rows, qtype=t.tensor_type: dequantize(rows[r0:r1], qtype),
                           len(rows), weights_dtype, dtype)
        if layer is None:
            params[key] = w
        else:
            params["layers"][layer][key] = w
    check_complete(params, config, "GGUF file")
    return params
