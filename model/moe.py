"""Mixture-of-experts MLP: a router picks k of E experts per token, their gated MLPs run as
grouped matmuls, and the outputs are summed with the routing weights.

    layer params of a MoE layer (instead of "w_gate", "w_up", "w_down"):
        "router": [H, E] (+ "router_bias": [E]),
        "experts_gate", "experts_up": [E, H, I], "experts_down": [E, I, H]
        (+ "experts_gate_bias", "experts_up_bias": [E, I], "experts_down_bias": [E, H])
        (+ "shared_gate", "shared_up": [H, S * I], "shared_down": [S * I, H] with S =
         config.num_shared_experts: DeepSeek's shared experts, one gated MLP every token runs)

Routing (config.moe_router, one of model.config.MOE_ROUTERS):
- "softmax_topk" (Qwen3-MoE, Mixtral): softmax over all E logits, keep the top k, and
  renormalise them to sum to one when config.norm_topk_prob;
- "topk_softmax" (gpt-oss): keep the top k logits, softmax over those k;
- "sigmoid_topk" (DeepSeek-V3 and later): an independent sigmoid score per expert, keep
  the top k scores (renormalised to sum to one when config.norm_topk_prob).

Tokens are sorted by expert so each expert's projection is one `jax.lax.ragged_dot` group
(a grouped matmul on GPU / TPU; XLA:CPU evaluates it densely over the groups). Over a
tensor-parallel mesh the experts are split across devices (`expert_parallel`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.layers import gated
from model.lora import linear
from model.sharding import MODEL, manual_over_model


def shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each MoE layer param (biases only where the config has them)."""
    h, e, i = config.hidden_size, config.num_experts, config.moe_intermediate_size or config.intermediate_size
    out = {"router": (h, e), "experts_gate": (e, h, i), "experts_up": (e, h, i), "experts_down": (e, i, h)}
    if config.moe_bias:
        out.update(router_bias=(e,), experts_gate_bias=(e, i), experts_up_bias=(e, i), experts_down_bias=(e, h))
    if config.num_shared_experts:
        s = config.num_shared_experts * i
        out.update(shared_gate=(h, s), shared_up=(h, s), shared_down=(s, h))
    return out


def route(logits: jnp.ndarray, config: ModelConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(weights float32 [N, k], expert ids int32 [N, k]) from router logits [N, E]."""
    logits = logits.astype(jnp.float32)
    if config.moe_router == "topk_softmax":
        top, ids = jax.lax.top_k(logits, config.num_experts_per_tok)
        return jax.nn.softmax(top, axis=-1), ids
    scores = jax.nn.sigmoid(logits) if config.moe_router == "sigmoid_topk" else jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(scores, config.num_experts_per_tok)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def moe(params: dict, config: ModelConfig, x: jnp.ndarray, mesh=None) -> jnp.ndarray:
    """The MoE MLP of x [..., H] -> [..., H]. mesh: when its "model" axis splits the experts
    (model/sharding.py), the expert-parallel path runs (`expert_parallel`)."""
    lead, h = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, h)
    shared = 0 if "shared_gate" not in params else linear(  # DeepSeek's shared experts, on every token
        gated(linear(x, params["shared_gate"]), linear(x, params["shared_up"]), config.hidden_act,
              config.swiglu_limit), params["shared_down"])
    if mesh is not None and mesh.shape[MODEL] > 1 and config.num_experts % mesh.shape[MODEL] == 0:
        return (expert_parallel(params, config, x, mesh) + shared).reshape(*lead, h)
    k, e = config.num_experts_per_tok, config.num_experts
    weights, ids = route(linear(x, params["router"], params.get("router_bias")), config)
    flat = ids.reshape(-1)  # token t's j-th choice at t * k + j
    order = jnp.argsort(flat, stable=True)
    expert, token = flat[order], order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    out = _experts(params, config, x[token], expert, sizes) * weights.reshape(-1)[order][:, None].astype(x.dtype)
    return (jnp.zeros_like(x).at[token].add(out) + shared).reshape(*lead, h)


def _experts(params: dict, config: ModelConfig, rows: jnp.ndarray, expert: jnp.ndarray,
             sizes: jnp.ndarray) -> jnp.ndarray:
    """Each row's expert MLP: rows [M, H] grouped by expert (expert: int [M], sizes[e] rows
    of expert e, in order); rows past sum(sizes) are padding, their outputs unused."""
    expert = jnp.minimum(expert, sizes.shape[0] - 1)  # padding reads some expert's bias

    def project(a, name):
        y = jax.lax.ragged_dot(a, params[name].astype(a.dtype), sizes)
        bias = params.get(f"{name}_bias")
        return y if bias is None else y + bias[expert].astype(y.dtype)

    hidden = gated(project(rows, "experts_gate"), project(rows, "experts_up"), config.hidden_act,
                   config.swiglu_limit)
    return project(hidden, "experts_down")


EXPERT_NAMES = ("experts_gate", "experts_up", "experts_down", "experts_gate_bias", "experts_up_bias",
                "experts_down_bias")


def expert_parallel(params: dict, config: ModelConfig, x: jnp.ndarray, mesh) -> jnp.ndarray:
    """moe over experts split across the mesh's "model" axis (expert parallelism): x [N, H]
    (replicated, as the tensor-parallel layers leave it) -> [N, H], equal to `moe`.

    Under a shard_map each of the P devices holds E / P experts and routes its own N / P
    tokens; each token's k choices travel to the devices owning those experts in one
    all_to_all, into buffers padded to a fixed capacity per (source, destination) pair; the
    owners run their experts as grouped matmuls, a second all_to_all brings the outputs
    back, each token sums its k outputs with its routing weights, and an all_gather
    rebuilds every token. The capacity is the worst case, N / P * k (every choice to one
    device), so no token is ever dropped: the result is exactly the dense MoE's.
    XLA:CPU has no ragged all_to_all (jax.lax.ragged_all_to_all), hence the padding.
    """
    p = mesh.shape[MODEL]
    n, h = x.shape
    k, local = config.num_experts_per_tok, config.num_experts // p
    per = -(-n // p)  # tokens each device routes
    x = jnp.pad(x, ((0, per * p - n), (0, 0)))

    def body(params, x):
        me = jax.lax.axis_index(MODEL)
        mine = jax.lax.dynamic_slice_in_dim(x, me * per, per)  # [per, H]
        weights, ids = route(linear(mine, params["router"], params.get("router_bias")), config)
        dest, expert = (ids // local).reshape(-1), (ids % local).reshape(-1)  # [per * k]
        cap = per * k
        slot = jnp.sum(jnp.cumsum(jax.nn.one_hot(dest, p, dtype=jnp.int32), axis=0) *
                       jax.nn.one_hot(dest, p, dtype=jnp.int32), axis=1) - 1  # rank among same dest
        token = jnp.arange(per * k) // k
        send = jnp.zeros((p, cap, h), x.dtype).at[dest, slot].set(mine[token])
        send_expert = jnp.full((p, cap), local, jnp.int32).at[dest, slot].set(expert)  # local: padding
        recv = jax.lax.all_to_all(send, MODEL, 0, 0, tiled=True).reshape(p * cap, h)
        recv_expert = jax.lax.all_to_all(send_expert, MODEL, 0, 0, tiled=True).reshape(p * cap)
        order = jnp.argsort(recv_expert, stable=True)  # grouped by local expert, padding last
        sizes = jnp.bincount(recv_expert, length=local + 1)[:local].astype(jnp.int32)
        done = _experts(params, config, recv[order], recv_expert[order], sizes)
        done = jnp.zeros_like(done).at[order].set(done).reshape(p, cap, h)
        back = jax.lax.all_to_all(done, MODEL, 0, 0, tiled=True)  # [p, cap, H]: my choices' outputs
        out = (back[dest, slot] * weights.reshape(-1, 1).astype(x.dtype)).reshape(per, k, h).sum(axis=1)
        return jax.lax.all_gather(out, MODEL, tiled=True)  # [per * p, H]

    specs = {name: P(MODEL) if name in EXPERT_NAMES else P() for name in params if not name.startswith("shared_")}
    params = {name: params[name] for name in specs}
    return manual_over_model(body, mesh, (specs, P()), P())(params, x)[:n]


def expert_load(params: dict, config: ModelConfig, x: jnp.ndarray) -> jnp.ndarray:
    """The router's load statistics: how many of x's [..., H] tokens pick each expert, int32 [E]."""
    _, ids = route(linear(x.reshape(-1, x.shape[-1]), params["router"], params.get("router_bias")), config)
    return jnp.bincount(ids.reshape(-1), length=config.num_experts).astype(jnp.int32)


def init_params(config: ModelConfig, key: jax.Array, dtype) -> dict:
    """Random MoE params (normal, std 0.02)."""
    named = shapes(config)
    keys = jax.random.split(key, len(named))
    return {name: (0.02 * jax.random.normal(k, shape)).astype(dtype)
            for k, (name, shape) in zip(keys, named.items())}
