"""Mixture-of-experts MLP: a router picks k of E experts per token, their gated MLPs run as
grouped matmuls, and the outputs are summed with the routing weights.

    layer params of a MoE layer (instead of "w_gate", "w_up", "w_down"):
        "router": [H, E] (+ "router_bias": [E]),
        "experts_gate", "experts_up": [E, H, I], "experts_down": [E, I, H]
        (+ "experts_gate_bias", "experts_up_bias": [E, I], "experts_down_bias": [E, H])

Routing (config.moe_router, one of model.config.MOE_ROUTERS):
- "softmax_topk" (Qwen3-MoE, Mixtral): softmax over all E logits, keep the top k, and
  renormalise them to sum to one when config.norm_topk_prob;
- "topk_softmax" (gpt-oss): keep the top k logits, softmax over those k.

Tokens are sorted by expert so each expert's projection is one `jax.lax.ragged_dot` group
(a grouped matmul on GPU / TPU; XLA:CPU evaluates it densely over the groups).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.layers import gated
from model.lora import linear


def shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each MoE layer param (biases only where the config has them)."""
    h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size or config.intermediate_size
    out = {"router": (h, e), "experts_gate": (e, h, i), "experts_up": (e, h, i), "experts_down": (e, i, h)}
    if config.moe_bias:
        out.update(router_bias=(e,), experts_gate_bias=(e, i), experts_up_bias=(e, i), experts_down_bias=(e, h))
    return out


def route(logits: jnp.ndarray, config: ModelConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(weights float32 [N, k], expert ids int32 [N, k]) from router logits [N, E]."""
    logits = logits.astype(jnp.float32)
    if config.moe_router == "topk_softmax":
        top, ids = jax.lax.top_k(logits, config.num_experts_per_tok)
        return jax.nn.softmax(top, axis=-1), ids
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), config.num_experts_per_tok)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def moe(params: dict, config: ModelConfig, x: jnp.ndarray) -> jnp.ndarray:
    """The MoE MLP of x [..., H] -> [..., H]."""
    lead, h = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, h)
    k, e = config.num_experts_per_tok, config.num_experts
    weights, ids = route(linear(x, params["router"], params.get("router_bias")), config)
    flat = ids.reshape(-1)  # token t's j-th choice at t * k + j
    order = jnp.argsort(flat, stable=True)
    expert, token = flat[order], order // k
    rows = x[token]  # [N * k, H], grouped by expert
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)

    def project(a, name):
        y = jax.lax.ragged_dot(a, params[name].astype(a.dtype), sizes)
        bias = params.get(f"{name}_bias")
        return y if bias is None else y + bias[expert].astype(y.dtype)

    hidden = gated(project(rows, "experts_gate"), project(rows, "experts_up"), config.hidden_act,
                   config.swiglu_limit)
    out = project(hidden, "experts_down") * weights.reshape(-1)[order][:, None].astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(out).reshape(*lead, h)


def init_params(config: ModelConfig, key: jax.Array, dtype) -> dict:
    """Random MoE params (normal, std 0.02)."""
    named = shapes(config)
    keys = jax.random.split(key, len(named))
    return {name: (0.02 * jax.random.normal(k, shape)).astype(dtype)
            for k, (name, shape) in zip(keys, named.items())}
