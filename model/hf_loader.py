"""Read a Hugging Face checkpoint directory: config.json + *.safetensors."""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from model.config import ModelConfig, config_from_hf

_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
}


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


def params_from_hf_dir(path: str, config: ModelConfig, dtype=np.float32) -> dict:
    from safetensors.numpy import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    params: dict = {"layers": [{} for _ in range(config.num_layers)]}
    for file in files:
        for name, w in load_file(file).items():
            w = np.asarray(w, dtype=np.float32)  # bf16 arrives as ml_dtypes.bfloat16
            if name == "model.embed_tokens.weight":
                params["embed"] = w.astype(dtype)
            elif name == "lm_head.weight":
                if not config.tie_word_embeddings:
                    params["lm_head"] = np.ascontiguousarray(w.T).astype(dtype)
            elif name == "model.norm.weight":
                params["final_norm"] = w.astype(dtype)
            elif name.startswith("model.layers."):
                idx, rest = name[len("model.layers."):].split(".", 1)
                if rest in _LAYER_TENSORS:
                    w = np.ascontiguousarray(w.T) if w.ndim == 2 else w
                    params["layers"][int(idx)][_LAYER_TENSORS[rest]] = w.astype(dtype)
                elif not rest.endswith("rotary_emb.inv_freq"):
                    raise ValueError(f"unexpected tensor {name!r} in {path}")
            else:
                raise ValueError(f"unexpected tensor {name!r} in {path}")
    missing = [k for k in ("embed", "final_norm") if k not in params]
    if not config.tie_word_embeddings and "lm_head" not in params:
        missing.append("lm_head")
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}")
    return params
