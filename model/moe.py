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
tensor-parallel mesh the experts are split across expert groups and their hidden units
across each group's devices (`expert_parallel`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.layers import gated
from model.lora import linear
from model.sharding import EXPERT, MODEL, expert_spec, manual_over_model, mesh_platform, tensor_parallel_size


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


def moe(params: dict, config: ModelConfig, x: jnp.ndarray, mesh=None, exchange: str | None = None) -> jnp.ndarray:
    """The MoE MLP of x [..., H] -> [..., H]. mesh: over a tensor-parallel mesh
    (model/sharding.py) the sharded path runs (`expert_parallel`, which takes `exchange`)."""
    lead, h = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, h)
    shared = 0 if "shared_gate" not in params else linear(  # DeepSeek's shared experts, on every token
        gated(linear(x, params["shared_gate"]), linear(x, params["shared_up"]), config.hidden_act,
              config.swiglu_limit), params["shared_down"])
    if mesh is not None and tensor_parallel_size(mesh) > 1:
        return (expert_parallel(params, config, x, mesh, exchange) + shared).reshape(*lead, h)
    k, e = config.num_experts_per_tok, config.num_experts
    weights, ids = route(linear(x, params["router"], params.get("router_bias")), config)
    flat = ids.reshape(-1)  # token t's j-th choice at t * k + j
    order = jnp.argsort(flat, stable=True)
    expert, token = flat[order], order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    out = _experts(params, config, x[token], expert, sizes) * weights.reshape(-1)[order][:, None].astype(x.dtype)
    return (jnp.zeros_like(x).at[token].add(out) + shared).reshape(*lead, h)


def _experts(params: dict, config: ModelConfig, rows: jnp.ndarray, expert: jnp.ndarray,
             sizes: jnp.ndarray, down_bias: bool = True) -> jnp.ndarray:
    """Each row's expert MLP: rows [M, H] grouped by expert (expert: int [M], sizes[e] rows
    of expert e, in order); rows past sum(sizes) are padding, their outputs unused.
    down_bias=False leaves the down projection's bias out (added after a sum of parts)."""
    expert = jnp.minimum(expert, sizes.shape[0] - 1)  # padding reads some expert's bias

    def project(a, name):
        y = jax.lax.ragged_dot(a, params[name].astype(a.dtype), sizes)
        bias = params.get(f"{name}_bias")
        return y if bias is None or (name == "experts_down" and not down_bias) else y + bias[expert].astype(y.dtype)

    hidden = gated(project(rows, "experts_gate"), project(rows, "experts_up"), config.hidden_act,
                   config.swiglu_limit)
    return project(hidden, "experts_down")


EXPERT_NAMES = ("experts_gate", "experts_up", "experts_down", "experts_gate_bias", "experts_up_bias",
                "experts_down_bias")
EXCHANGES = ("padded", "ragged")


def default_exchange(mesh) -> str:
    """How tokens travel to their experts on the mesh's platform: "ragged" (one
    jax.lax.ragged_all_to_all each way, only the real rows move) on TPU and GPU; "padded"
    (all_to_all into worst-case-capacity buffers) on CPU, whose XLA has no ragged
    all_to_all."""
    return "padded" if mesh_platform(mesh) == "cpu" else "ragged"


def expert_parallel(params: dict, config: ModelConfig, x: jnp.ndarray, mesh, exchange: str | None = None
                    ) -> jnp.ndarray:
    """moe over a tensor-parallel mesh: x [N, H] (replicated, as the tensor-parallel layers
    leave it) -> [N, H], equal to `moe`.

    Under a shard_map each device holds E / ep whole experts ("expert" axis) and, of each,
    1 / (tp / ep) of the hidden units ("model" axis). Each expert group routes its own
    N / ep tokens; each token's k choices travel to the groups owning those experts
    (`exchange`, default `default_exchange(mesh)`):
    - "padded": one all_to_all each way over buffers of a fixed capacity per (source,
      destination) pair;
    - "ragged": the choices sorted by destination, sizes shared by an all_gather, and one
      jax.lax.ragged_all_to_all each way that moves only the real rows (on a CPU mesh a
      reference built from all_gathers stands in for it, so the bookkeeping is tested).
    The owners run their experts as grouped matmuls over their hidden units, a psum over
    "model" adds the parts, the outputs travel back, each token sums its k outputs with
    its routing weights, and an all_gather over "expert" rebuilds every token. Buffers
    hold the worst case, N / ep * k rows from each source, so no token is ever dropped: the
    result is exactly the dense MoE's.
    """
    exchange = default_exchange(mesh) if exchange is None else exchange
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    ep = mesh.shape[EXPERT]
    n, h = x.shape
    k, local = config.num_experts_per_tok, config.num_experts // ep
    per = -(-n // ep)  # tokens each expert group routes
    x = jnp.pad(x, ((0, per * ep - n), (0, 0)))
    ragged = jax.lax.ragged_all_to_all if mesh_platform(mesh) != "cpu" else ragged_all_to_all_reference

    def run(params, rows, expert):  # rows [M, H] for local experts `expert` [M] (local: none)
        order = jnp.argsort(expert, stable=True)  # grouped by local expert, padding last
        sizes = jnp.bincount(expert, length=local + 1)[:local].astype(jnp.int32)
        done = jax.lax.psum(_experts(params, config, rows[order], expert[order], sizes, down_bias=False), MODEL)
        if "experts_down_bias" in params:
            done = done + params["experts_down_bias"][jnp.minimum(expert[order], local - 1)].astype(done.dtype)
        return jnp.zeros_like(done).at[order].set(done)

    def padded(params, rows, dest, expert):
        cap = per * k
        one_hot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)
        slot = jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1  # rank among same dest
        send = jnp.zeros((ep, cap, h), x.dtype).at[dest, slot].set(rows)
        send_expert = jnp.full((ep, cap), local, jnp.int32).at[dest, slot].set(expert)
        recv = jax.lax.all_to_all(send, EXPERT, 0, 0, tiled=True).reshape(ep * cap, h)
        recv_expert = jax.lax.all_to_all(send_expert, EXPERT, 0, 0, tiled=True).reshape(ep * cap)
        done = run(params, recv, recv_expert).reshape(ep, cap, h)
        return jax.lax.all_to_all(done, EXPERT, 0, 0, tiled=True)[dest, slot]

    def ragged_exchange(params, rows, dest, expert):
        me, m = jax.lax.axis_index(EXPERT), per * k
        order = jnp.argsort(dest, stable=True)  # my choices by destination group
        sizes = jnp.bincount(dest, length=ep).astype(jnp.int32)  # rows I send to each group
        offsets = jnp.cumsum(sizes) - sizes
        table = jax.lax.all_gather(sizes, EXPERT)  # [source, destination] row counts
        lands = (jnp.cumsum(table, axis=0) - table)[me]  # where my rows start in each destination
        recv_sizes = table[:, me]
        there = functools.partial(ragged, axis_name=EXPERT)
        recv = there(rows[order], jnp.zeros((ep * m, h), x.dtype), offsets, sizes, lands, recv_sizes)
        recv_expert = there(expert[order], jnp.full((ep * m,), local, jnp.int32), offsets, sizes, lands,
                            recv_sizes)
        done = run(params, recv, recv_expert)
        recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes  # each source's rows in my buffer
        came_from = (jnp.cumsum(table, axis=1) - table)[:, me]  # where they sat in the source's
        back = there(done, jnp.zeros((m, h), x.dtype), recv_offsets, recv_sizes, came_from, sizes)
        return jnp.zeros_like(back).at[order].set(back)

    def body(params, x):
        me = jax.lax.axis_index(EXPERT)
        mine = jax.lax.dynamic_slice_in_dim(x, me * per, per)  # [per, H]
        weights, ids = route(linear(mine, params["router"], params.get("router_bias")), config)
        dest, expert = (ids // local).reshape(-1), (ids % local).reshape(-1)  # [per * k]
        rows = mine[jnp.arange(per * k) // k]  # each choice's token
        if ep == 1:
            done = run(params, rows, expert)
        else:
            done = (padded if exchange == "padded" else ragged_exchange)(params, rows, dest, expert)
        out = (done * weights.reshape(-1, 1).astype(x.dtype)).reshape(per, k, h).sum(axis=1)
        return jax.lax.all_gather(out, EXPERT, tiled=True)  # [per * ep, H]

    specs = {name: expert_spec(name) if name in EXPERT_NAMES else P()
             for name in params if not name.startswith("shared_")}
    params = {name: params[name] for name in specs}
    return manual_over_model(body, mesh, (specs, P()), P())(params, x)[:n]


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    """jax.lax.ragged_all_to_all's result built from all_gathers, for meshes whose backend
    has no ragged all_to_all (XLA:CPU): device d's rows [input_offsets[j], + send_sizes[j])
    land in device j's output at output_offsets[j] (offsets in the receiver's buffer, as
    ragged_all_to_all takes them); rows nothing lands on keep `output`'s values. Every
    device gathers every operand, so this moves ep times the data: a stand-in that keeps
    the ragged bookkeeping testable, not a fast path. recv_sizes is implied by the others."""
    del recv_sizes
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [sources, M, ...]
    starts, sizes, at = (jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes,
                                                                            output_offsets))
    r = jnp.arange(output.shape[0], dtype=starts.dtype)[:, None]
    inside = (r >= at) & (r < at + sizes)  # [R, sources]: which source's rows land on row r
    source = jnp.argmax(inside, axis=1)
    row = jnp.clip(starts[source] + r[:, 0] - at[source], 0, operand.shape[0] - 1)
    keep = inside.any(axis=1).reshape(-1, *(1,) * (output.ndim - 1))
    return jnp.where(keep, operands[source, row], output)


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
