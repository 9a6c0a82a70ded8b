"""Read a Hugging Face checkpoint directory: config.json + *.safetensors."""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np

from model.config import ModelConfig, config_from_hf

_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
    "self_attn.o_proj.bias": "bo", "self_attn.sinks": "sinks",
    # mixtures of experts (model/moe.py): Qwen3-MoE's router, gpt-oss's router and fused experts
    "mlp.gate.weight": "router", "mlp.router.weight": "router", "mlp.router.bias": "router_bias",
    "mlp.experts.gate_up_proj": "experts_gate_up", "mlp.experts.gate_up_proj_bias": "experts_gate_up_bias",
    "mlp.experts.down_proj": "experts_down", "mlp.experts.down_proj_bias": "experts_down_bias",
}
# Qwen3-MoE saves each expert's projections apart: mlp.experts.{e}.{gate,up,down}_proj.weight
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_TOP_TENSORS = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head", "model.norm.weight": "final_norm"}
# Gemma 2 / 3 name their norms after where they sit: post_attention_layernorm is the
# attention output's norm there, not the MLP's input norm as in Llama.
_SANDWICH_TENSORS = {**_LAYER_TENSORS, "post_attention_layernorm.weight": "attn_post_norm",
                     "pre_feedforward_layernorm.weight": "mlp_norm",
                     "post_feedforward_layernorm.weight": "mlp_post_norm"}
NORMS = frozenset({"attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm", "q_norm", "k_norm",
                   "final_norm"})


def read_hf_config(path: str) -> ModelConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ValueError(f"{path} is not a Hugging Face checkpoint: no config.json")
    with open(cfg_file) as f:
        try:
            hf = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object, got {type(hf).__name__}")
    return config_from_hf(hf)


def params_from_hf_dir(path: str, config: ModelConfig, dtype=np.float32,
                       weights_dtype: str | None = None) -> dict:
    """The checkpoint's tensors as model params, read one tensor at a time and each kept as
    model/weights.py `store` says (in `dtype` when weights_dtype is None)."""
    from safetensors import safe_open

    from model.weights import check_complete, store, store_rows

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    params: dict = {"layers": [{} for _ in range(config.num_layers)]}
    layer_tensors = _SANDWICH_TENSORS if config.sandwich_norm else _LAYER_TENSORS
    # Gemma's RMSNorm multiplies by (1 + weight): store the factor itself, as GGUF files do
    norm_offset = 1.0 if config.name.startswith("gemma") else 0.0
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if name in _TOP_TENSORS:
                    key, layer = _TOP_TENSORS[name], None
                elif name.startswith("model.layers."):
                    idx, rest = name[len("model.layers."):].split(".", 1)
                    if rest.endswith("rotary_emb.inv_freq"):
                        continue
                    expert = _EXPERT.fullmatch(rest)
                    if expert:  # gathered per expert, stacked [E, in, out] below
                        e, proj = int(expert[1]), f"experts_{expert[2]}"
                        w = np.asarray(f.get_tensor(name), np.float32).T
                        params["layers"][int(idx)].setdefault(proj, {})[e] = store(proj, w, weights_dtype, dtype)
                        continue
                    if rest not in layer_tensors:
                        raise ValueError(f"unexpected tensor {name!r} in {path}")
                    key, layer = layer_tensors[rest], int(idx)
                else:
                    raise ValueError(f"unexpected tensor {name!r} in {path}")
                if key.startswith("experts_"):  # gpt-oss's fused experts: [E, in, out] already, biases [E, out]
                    w = np.asarray(f.get_tensor(name), np.float32)
                    if key.startswith("experts_gate_up"):  # gate and up columns interleaved
                        suffix = key[len("experts_gate_up"):]
                        parts = {"experts_gate" + suffix: w[..., 0::2], "experts_up" + suffix: w[..., 1::2]}
                    else:
                        parts = {key: w}
                    for part, value in parts.items():
                        params["layers"][layer][part] = store(part, value, weights_dtype, dtype)
                    continue
                tensor = f.get_slice(name)  # [out, in] rows read on demand; bf16 arrives as ml_dtypes.bfloat16
                shift = norm_offset if key in NORMS else 0.0
                w = store_rows(key, lambda r0, r1, tensor=tensor, shift=shift:
                               np.asarray(tensor[r0:r1], np.float32) + np.float32(shift),
                               tensor.get_shape()[0], weights_dtype, dtype)
                if layer is None:
                    params[key] = w
                else:
                    params["layers"][layer][key] = w
    for i, layer in enumerate(params["layers"]):
        for proj, experts in list(layer.items()):
            if isinstance(experts, dict):
                wrong = sorted(set(range(config.num_experts)) ^ set(experts))
                if wrong:
                    raise ValueError(f"{path}: layer {i} {proj} lacks or has extra experts {wrong[:8]} "
                                     f"(the config has {config.num_experts})")
                layer[proj] = np.stack([experts[e] for e in range(config.num_experts)])
    check_complete(params, config, path)
    return params
