"""LoRA adapters on the functional model: PEFT checkpoints, slot stacks, per-token routing.

    adapter = load_peft_adapter("path/to/peft_dir", config)     # host arrays, checked
    stacks = init_stacks(config, num_slots=4, rank=16)           # device, zeros
    stacks = write_slot(stacks, 0, adapter)                      # slot 0 holds it
    step_params = attach(params, stacks, slots)                  # slots int32 [..tokens]
    logits = model.forward(step_params, config, tokens, ...)     # each token its adapter

`attach` swaps each projection weight for a LoRAWeight; `linear` (the one projection
entry of the model's layers) adds the tokens' adapter terms through
pallas_kernels.lora_matmul. Stacks have a fixed shape (slots x max rank), so loading
another adapter into a slot never recompiles. `merge` folds an adapter into the weights
(W + A B), the statement the serving tests compare against.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from pallas_kernels.lora import lora_matmul
from pallas_kernels.quant_matmul import quant_matmul, quant_matmuls
from pallas_kernels.quant_matmul.ref import rms_norm
from quant.packed import PackedWeight
from quant import linear as base_linear

# PEFT's module names (Llama / Qwen / Mistral) -> kvfold's projection names
PEFT_MODULES = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv",
                "self_attn.o_proj": "wo", "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up",
                "mlp.down_proj": "w_down"}
PROJECTIONS = tuple(PEFT_MODULES.values())
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(" + "|".join(re.escape(m) for m in PEFT_MODULES)
                  + r")\.lora_([AB])\.weight$")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["base", "lora_a", "lora_b", "slots"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LoRAWeight:
    """A projection with per-token LoRA adapters (S-LoRA): base weight plus slot stacks.

    base: the weight [in, out] (float or quantized, as quant.linear takes it); lora_a
    [slots, in, rank]; lora_b [slots, rank, out] with each adapter's scaling folded in;
    slots: int32, each token's adapter slot (-1: none), one per token of x in order
    (x's leading axes flattened: [B, T] or the packed step's [N] for x [1, N, in]).
    """

    base: object
    lora_a: jax.Array
    lora_b: jax.Array
    slots: jax.Array


def linear(x, w, b=None, norm=None):
    """The model's one projection entry: x [..., in] times w [in, out], plus b [out].

    w: a float array or quant.Int8Weight (quant.linear), a quant.PackedWeight
    (pallas_kernels.quant_matmul, dequantized tile by tile), or a LoRAWeight over either,
    which adds each token's adapter term. norm: (weight [in], eps) to project
    rms_norm(x, weight, eps) instead of x (a layer's input norm): a packed weight laid out
    for the CPU kernel (`interleaved`) hands it to pallas_kernels.quant_matmul, whose kernel
    applies it to float32 x on the steps it takes; otherwise it is applied here."""
    if norm is not None and not (isinstance(w, PackedWeight) and w.interleaved):
        x, norm = rms_norm(x, *norm), None  # no CPU kernel to fold it into
    delta = None
    if isinstance(w, LoRAWeight):
        if w.slots.size != x.size // x.shape[-1]:
            raise ValueError(f"linear: LoRA slots {w.slots.shape} do not match x's tokens {x.shape[:-1]}")
        delta = lora_matmul(x.reshape(-1, x.shape[-1]), w.lora_a, w.lora_b, w.slots.reshape(-1))
        w = w.base
    if isinstance(w, PackedWeight):
        if x.shape[-1] != w.shape[0]:
            raise ValueError(f"linear: x {x.shape} does not match packed weight [in, out] {w.shape}")
        y = quant_matmul(x.reshape(-1, w.shape[0]), w, norm=norm).reshape(*x.shape[:-1], w.shape[1])
        y = y if b is None else y + b
    else:
        y = base_linear(x, w, b)
    return y if delta is None else y + delta.reshape(*x.shape[:-1], -1)


def linears(x, ws, bs=None, norm=None) -> list:
    """[linear(x, w, b, norm) for w, b in zip(ws, bs)]: projections of the same x (a layer's q,
    k and v; its gate and up). Packed weights without adapters go through one
    pallas_kernels.quant_matmul.quant_matmuls call, which on CPU multiplies them (and
    applies the norm) in one kernel call; anything else is one `linear` each, on x
    normalized once."""
    ws = list(ws)
    bs = list(bs) if bs is not None else [None] * len(ws)
    if norm is not None and not all(isinstance(w, PackedWeight) and w.interleaved for w in ws):
        x, norm = rms_norm(x, *norm), None  # no CPU kernel to fold it into: normalized once, here
    if len(ws) < 2 or not all(isinstance(w, PackedWeight) for w in ws):
        return [linear(x, w, b, norm) for w, b in zip(ws, bs)]
    ys = quant_matmuls(x.reshape(-1, x.shape[-1]), ws, norm=norm)
    return [(y if b is None else y + b).reshape(*x.shape[:-1], w.shape[1]) for y, w, b in zip(ys, ws, bs)]


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """[in, out] of each projection of a decoder layer (what init_params draws, in order)."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h), "w_gate": (h, i),
            "w_up": (h, i), "w_down": (i, h)}


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in host memory: for each (layer, projection) it changes, A [in, rank]
    and B [rank, out] with the scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) in B."""

    rank: int
    weights: dict  # (layer, projection name) -> (A, B) float32 numpy arrays


def _check_peft_config(cfg: dict, path: str) -> None:
    def refuse(what):
        raise ValueError(f"LoRA adapter {path!r}: {what} is not supported")
    if cfg.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        refuse("DoRA (use_dora)")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        refuse(f"a trained bias (bias={cfg.get('bias')!r})")
    if cfg.get("modules_to_save"):
        refuse(f"modules_to_save {cfg['modules_to_save']}")
    if cfg.get("fan_in_fan_out"):
        refuse("fan_in_fan_out")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        refuse("a per-module rank_pattern / alpha_pattern")
    if cfg.get("layer_replication") or cfg.get("trainable_token_indices"):
        refuse("layer_replication / trainable_token_indices")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise ValueError(f"LoRA adapter {path!r}: adapter_config.json needs a positive {key!r}, "
                             f"got {cfg.get(key)!r}")


def load_peft_adapter(path: str, config: ModelConfig) -> LoRAAdapter:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for a
    model of `config`; every tensor is checked against the base model's shapes."""
    from safetensors.numpy import load_file

    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    missing = [f for f in ADAPTER_FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"LoRA adapter {path!r} lacks {missing} (a PEFT save_pretrained directory)")
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    _check_peft_config(cfg, path)
    r = int(cfg["r"])
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    parts: dict = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA A/B of a decoder "
                             f"projection ({', '.join(PEFT_MODULES)})")
        layer, name = int(m.group(1)), PEFT_MODULES[m.group(2)]
        if not 0 <= layer < config.num_layers:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} names layer {layer}; the model has "
                             f"{config.num_layers}")
        parts.setdefault((layer, name), {})[m.group(3)] = np.asarray(value, np.float32)
    if not parts:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA tensors")
    shapes = projection_shapes(config)
    weights = {}
    for (layer, name), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {name} has lora_{next(iter(ab))} "
                             "without its partner")
        d_in, d_out = shapes[name]
        a, b = ab["A"], ab["B"]  # PEFT: A [r, in], B [out, r]
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {name} has A {a.shape} and B {b.shape}; "
                             f"rank {r} on this model needs A {(r, d_in)} and B {(d_out, r)} (an adapter "
                             "for another base model?)")
        weights[(layer, name)] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T * scale))
    return LoRAAdapter(r, weights)


def save_peft_adapter(path: str, weights: dict, r: int, lora_alpha: float) -> None:
    """Write a PEFT LoRA directory that load_peft_adapter (and peft) read: weights maps
    (layer, projection name) to (A [r, in], B [out, r]) in PEFT's layout, unscaled."""
    from safetensors.numpy import save_file

    names = {v: k for k, v in PEFT_MODULES.items()}
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for (layer, name), (a, b) in weights.items():
        prefix = f"base_model.model.model.layers.{layer}.{names[name]}"
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    modules = sorted({names[name].split(".")[-1] for _, name in weights})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "target_modules": modules,
                   "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False}, f,
                  indent=2)


def init_stacks(config: ModelConfig, num_slots: int, rank: int, dtype=jnp.float32) -> dict:
    """Zero slot stacks for every projection of every layer: {"layers": [{name: (A
    [num_slots, in, rank], B [num_slots, rank, out])}]}."""
    shapes = projection_shapes(config)
    moe_mlp = ("w_gate", "w_up", "w_down")  # a mixture-of-experts layer has experts instead

    def layer_stacks(i: int) -> dict:
        return {name: (jnp.zeros((num_slots, d_in, rank), dtype), jnp.zeros((num_slots, rank, d_out), dtype))
                for name, (d_in, d_out) in shapes.items() if i not in config.moe_layers or name not in moe_mlp}

    return {"layers": [layer_stacks(i) for i in range(config.num_layers)]}


@functools.partial(jax.jit, donate_argnames=("stacks",))
def _write(stacks, slot, values):
    return jax.tree.map(lambda s, v: s.at[slot].set(v.astype(s.dtype)), stacks, values)


def write_slot(stacks: dict, slot: int, adapter: LoRAAdapter | None) -> dict:
    """stacks with `slot` holding `adapter` (zeros where it does not reach; None clears
    the slot). The old stacks are donated."""
    rank = stacks["layers"][0]["wq"][0].shape[-1]
    if adapter is not None and adapter.rank > rank:
        raise ValueError(f"LoRA adapter rank {adapter.rank} exceeds the stacks' rank {rank} (max_lora_rank)")
    values = jax.tree.map(lambda s: np.zeros(s.shape[1:], np.float32), stacks)
    for (layer, name), (a, b) in (adapter.weights.items() if adapter else ()):
        if name not in values["layers"][layer]:
            raise ValueError(f"LoRA adapter changes layer {layer} {name}, which this model's layer does not "
                             "have (its MLP is a mixture of experts)")
        values["layers"][layer][name] = (np.pad(a, ((0, 0), (0, rank - a.shape[1]))),
                                         np.pad(b, ((0, rank - b.shape[0]), (0, 0))))
    return _write(stacks, jnp.int32(slot), values)


def attach(params: dict, stacks: dict, slots: jax.Array) -> dict:
    """params whose layer projections carry `stacks` routed by `slots` (int32, one per
    token, shaped like the tokens the forward gets; -1 = the base model)."""
    layers = [{**layer, **{name: LoRAWeight(layer[name], a, b, slots) for name, (a, b) in lstacks.items()}}
              for layer, lstacks in zip(params["layers"], stacks["layers"])]
    return {**params, "layers": layers}


def merge(params: dict, adapter: LoRAAdapter) -> dict:
    """params with the adapter folded into the weights: W + A B (float weights only)."""
    layers = [dict(layer) for layer in params["layers"]]
    for (layer, name), (a, b) in adapter.weights.items():
        w = layers[layer][name]
        if not hasattr(w, "astype"):
            raise ValueError(f"merge folds adapters into float weights; layer {layer} {name} is "
                             f"{type(w).__name__} (load the base with float weights to merge)")
        layers[layer][name] = (w.astype(jnp.float32) + jnp.asarray(a @ b)).astype(w.dtype)
    return {**params, "layers": layers}
