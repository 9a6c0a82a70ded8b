"""The CSA2 layer kinds: SWA only, Full (+ candidate source), Reuse and Reindex.

Every kind: h = RMSNorm(x); q = W_qb RMSNorm(W_qa h) (64 heads x 512 in Flash), RoPE on
the last rope_dim channels; its own window KV row RMSNorm(W_kv h) written to an FP8 ring;
attention over [window rows ; selected compressed rows] with a per-head sink; inverse RoPE
on the output's RoPE channels at the query position; grouped output projection
(o_groups x W_oa -> o_lora, then W_ob); then the FFN: a dense SwiGLU MLP, or on layers of
config.moe_layers DeepSeek's mixture of experts (routed experts with sigmoid top-k gating
plus shared experts, model/moe.py).

Full layers (KV sources) also run the compressor and the lightning indexer and publish
rows, index keys and their top-k selection in ctx.shared["csa_r<ratio>"]; a candidate
source also publishes the hierarchical candidate mask. Reindex layers score the published
index keys with their own indexer inside those candidates and replace the selection;
Reuse layers take rows and selection as published. Indexer weights get no gradient from
the LM loss (top-k is discrete; DeepSeek trains the indexer with its own objective).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from model.config import RopeScaling
from model.context import ForwardContext
from model.deepseek.attention import csa_attention
from model.deepseek.cache import (
    decode_index_key,
    decode_kv,
    decode_window,
    encode_index_key,
    encode_kv,
    encode_window,
    fake_quant,
    init_layer_cache,
    scatter_batch_rows,
    scatter_stored,
)
from model.deepseek.config import (
    MODES,
    RATIOS,
    SWA,
    DeepSeekConfig,
    kind_name,
    parse_kind,
)
from model.layers import mlp, rms_norm
from model.moe import moe
from model.rope import apply_rope, rope_frequencies
from model.transformer import LAYER_KINDS, LayerKind
from pallas_kernels import indexer_topk
from pallas_kernels.indexer import block_candidates
from quant import linear

# ctx.shared keys. FROZEN_GLOBAL (a Python bool) makes KV sources read their global rows
# instead of writing them: bounded replay rebuilds window KV over rows restored from the
# persistent tier and must not overwrite them with replayed values.
FROZEN_GLOBAL = "csa_frozen_global"
PER_QUERY = ("selected", "candidates")  # published entries with a [B, T, ...] query axis


def published_key(ratio: int) -> str:
    return f"csa_r{ratio}"


def init_layer(kind: str, config: DeepSeekConfig, key: jax.Array, dtype) -> dict:
    """Random params of one layer (normal, std 0.02; norms at 1; sinks at 0)."""
    mode, ratio = parse_kind(kind)
    h, d, hq, ql = config.hidden_size, config.head_dim, config.num_heads, config.q_lora_rank
    g, ol, i = config.o_groups, config.o_lora_rank, config.intermediate_size
    shapes = {"wq_a": (h, ql), "wq_b": (ql, hq * d), "w_kv": (h, d), "wo_a": (g, hq * d // g, ol),
              "wo_b": (g * ol, h), "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}
    if mode in ("full", "candidates", "reindex"):
        shapes.update(w_iq=(ql, config.index_heads * config.index_dim), w_iw=(h, config.index_heads))
    if mode in ("full", "candidates"):
        shapes["w_ik"] = (d, config.index_dim)
        if ratio == 2:
            shapes["wkv_gate"] = (h, d)
    keys = jax.random.split(key, len(shapes))
    layer = {name: (0.02 * jax.random.normal(k, shape)).astype(dtype)
             for k, (name, shape) in zip(keys, shapes.items())}
    for name, width in (("attn_norm", h), ("q_norm", ql), ("kv_norm", d), ("mlp_norm", h)):
        layer[name] = jnp.ones((width,), dtype)
    layer["sinks"] = jnp.zeros((hq,), jnp.float32)
    return layer


def rope_tables(config: DeepSeekConfig, positions, compressed: bool):
    """cos, sin f32 [*positions.shape, rope_dim]: YaRN theta on compressed layers, plain on SWA."""
    if compressed:
        theta, scaling = config.rope_theta, config.rope_scaling
    else:
        theta, scaling = config.swa_rope_theta, RopeScaling()
    inv_freq, _ = rope_frequencies(config.rope_dim, theta, scaling, config.max_position_embeddings)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate(x, cos, sin):
    """RoPE on the last rope_dim channels of x [B, T, H, D] (cos, sin [B, T, rope_dim])."""
    r = cos.shape[-1]
    return jnp.concatenate([x[..., :-r], apply_rope(x[..., -r:], cos, sin)], axis=-1)


def _rotate_rows(x, cos, sin):
    return rotate(x[:, :, None], cos, sin)[:, :, 0]


def window_step(params, config: DeepSeekConfig, h, positions, local: dict, compressed: bool):
    """Write this chunk's window rows to the ring; rows and indices for the window segment.

    Contract: positions[b] = p0, p0 + 1, ... followed by padding (< 0). Returns
    (rows [B, W + T, D]: the ring then the chunk, indices int32 [B, T, W], new local).
    A query at p sees positions (p - W, p]: from the chunk if >= p0, else from the ring if
    the ring holds them (window_end says which positions it holds).
    """
    w = config.window
    kv = rms_norm(linear(h, params["w_kv"]), params["kv_norm"], config.rms_norm_eps)
    row, stored = fake_quant(_rotate_rows(kv, *rope_tables(config, positions, compressed)),
                             encode_window, decode_window)
    rows = jnp.concatenate([decode_window(local["window"], h.dtype), row], axis=1)
    p0 = positions[:, :1, None]
    end = local["window_end"][:, None, None]
    q = positions[:, :, None] - w + 1 + jnp.arange(w, dtype=jnp.int32)
    in_ring = (q < end) & (q >= end - w)
    idx = jnp.where(q >= p0, w + q - p0, jnp.where(in_ring, q % w, -1))
    idx = jnp.where((q >= 0) & (positions[:, :, None] >= 0), idx, -1).astype(jnp.int32)
    n_valid = jnp.sum(positions >= 0, axis=1)
    last = positions[:, 0] + n_valid - 1
    keep = (positions >= 0) & (positions > last[:, None] - w)  # only the newest W reach the ring
    local = dict(local, window=scatter_stored(local["window"], stored, jnp.where(keep, positions % w, w)),
                 window_end=jnp.where(n_valid > 0, last + 1, local["window_end"]).astype(jnp.int32))
    return rows, idx, local


def publish_kv(params, config: DeepSeekConfig, ratio: int, h, positions, cache: dict, frozen: bool):
    """The compressor of a KV source: write this chunk's completed rows and index keys.

    v = W_kv h, s = W_gate h; row j = RMSNorm(sum_t softmax_t(s) v_t) over its r tokens,
    RoPE at position j r; index key = W_ik (row before RoPE). A ratio-2 group split across
    calls (decode at an odd position) takes its first token from the compressor state.
    Returns (cache, rows [B, R, D], index keys [B, R, Di]) as the attention will read them.
    """
    glob, local = cache["global"], dict(cache["local"])
    v = linear(h, params["w_kv"])
    n_valid = jnp.sum(positions >= 0, axis=1)
    if ratio == 2:
        s = linear(h, params["wkv_gate"])
        state = local["compressor"]
        prev_v = jnp.concatenate([state["v"][:, None].astype(v.dtype), v[:, :-1]], axis=1)
        prev_s = jnp.concatenate([state["gate"][:, None].astype(s.dtype), s[:, :-1]], axis=1)
        gate = jax.nn.softmax(jnp.stack([prev_s, s]).astype(jnp.float32), axis=0).astype(v.dtype)
        v_pooled = gate[0] * prev_v + gate[1] * v
        last = jnp.clip(n_valid - 1, 0)[:, None, None]
        has = (n_valid > 0)[:, None]
        local["compressor"] = {
            "v": jnp.where(has, jnp.take_along_axis(v, last, 1)[:, 0], state["v"]).astype(jnp.float32),
            "gate": jnp.where(has, jnp.take_along_axis(s, last, 1)[:, 0], state["gate"]).astype(jnp.float32)}
    else:
        v_pooled = v
    latent = rms_norm(v_pooled, params["kv_norm"], config.rms_norm_eps)
    j = (positions + 1) // ratio - 1
    num_rows = glob["kv"]["packed"].shape[1]
    row_index = jnp.where((positions >= 0) & ((positions + 1) % ratio == 0), j, num_rows)
    if frozen:
        return ({"global": glob, "local": local}, decode_kv(glob["kv"], h.dtype),
                decode_index_key(glob["index_keys"], h.dtype))
    row, row_stored = fake_quant(_rotate_rows(latent, *rope_tables(config, j * ratio, True)),
                                 encode_kv, decode_kv)
    key, key_stored = fake_quant(linear(latent, params["w_ik"]), encode_index_key, decode_index_key)
    glob = {"kv": scatter_stored(glob["kv"], row_stored, row_index),
            "index_keys": scatter_stored(glob["index_keys"], key_stored, row_index)}
    # The stored rows decoded, with this chunk's rows set again so their gradient flows.
    rows = scatter_batch_rows(decode_kv(glob["kv"], h.dtype), row, row_index)
    keys = scatter_batch_rows(decode_index_key(glob["index_keys"], h.dtype), key, row_index)
    return {"global": glob, "local": local}, rows, keys


def select(params, config: DeepSeekConfig, ratio: int, q_latent, h, positions, index_keys,
           candidates: bool = False, candidate_mask=None):
    """The lightning indexer's top-k over published index keys (pallas_kernels.indexer_topk).

    Returns (indices int32 [B, T, top_k] sorted, -1 empty; candidate mask bool [B, T, R]
    if `candidates` (the hierarchical step of a candidate source), else None).
    """
    b, t, _ = h.shape
    hi, di = config.index_heads, config.index_dim
    iq = jax.lax.stop_gradient(linear(q_latent, params["w_iq"]).reshape(b, t, hi, di))
    iw = jax.lax.stop_gradient(linear(h, params["w_iw"]) * (di ** -0.5 * hi ** -0.5))
    keys = jax.lax.stop_gradient(index_keys).astype(iq.dtype)
    positions = positions.astype(jnp.int32)
    top = functools.partial(indexer_topk, top_k=config.index_top_k, compress_ratio=ratio,
                            num_candidate_blocks=config.num_candidate_blocks if candidates else None)
    if candidate_mask is None:
        idx, scores = jax.vmap(lambda q, w, k, p: top(q, w, k, p))(iq, iw, keys, positions)
    else:
        idx, scores = jax.vmap(lambda q, w, k, p, m: top(q, w, k, p, candidate_mask=m))(
            iq, iw, keys, positions, candidate_mask)
    if not candidates:
        return idx, None
    mask = jax.vmap(lambda s, p: block_candidates(s, p, num_blocks=config.num_candidate_blocks,
                                                  compress_ratio=ratio))(scores, positions)
    return idx, mask


def attention_and_mlp(kind: str, params, config: DeepSeekConfig, x, cache: dict, ctx: ForwardContext):
    """Everything of a layer but the compressor: attention sublayer and MLP (see module doc)."""
    mode, ratio = parse_kind(kind)
    b, t, _ = x.shape
    hq, d = config.num_heads, config.head_dim
    h = rms_norm(x, params["attn_norm"], config.rms_norm_eps)
    q_latent = rms_norm(linear(h, params["wq_a"]), params["q_norm"], config.rms_norm_eps)
    cos, sin = rope_tables(config, ctx.positions, ratio > 0)
    q = rotate(linear(q_latent, params["wq_b"]).reshape(b, t, hq, d), cos, sin)
    window_rows, window_idx, local = window_step(params, config, h, ctx.positions, cache["local"], ratio > 0)
    shared, rows, idx = dict(ctx.shared), None, None
    if ratio:
        key = published_key(ratio)
        pub = dict(shared[key])
        if mode in ("full", "candidates"):
            idx, mask = select(params, config, ratio, q_latent, h, ctx.positions, pub["index_keys"],
                               candidates=mode == "candidates")
            if mask is not None:
                pub["candidates"] = mask
        elif mode == "reindex":
            idx, _ = select(params, config, ratio, q_latent, h, ctx.positions, pub["index_keys"],
                            candidate_mask=pub["candidates"])
        else:
            idx = pub["selected"]
        pub["selected"] = idx
        shared[key], rows = pub, pub["rows"]
    out = csa_attention(q, rows, idx, window_rows, window_idx, params["sinks"])
    out = rotate(out, cos, -sin)  # undo the keys' rotation carried into V's RoPE channels
    g = config.o_groups
    out = jnp.einsum("btgi,gio->btgo", out.reshape(b, t, g, hq * d // g), params["wo_a"])
    x = x + linear(out.reshape(b, t, -1), params["wo_b"])
    h = rms_norm(x, params["mlp_norm"], config.rms_norm_eps)
    x = x + (moe(params, config, h, ctx.mesh) if "router" in params else mlp(params, h))
    return x, dict(cache, local=local), dataclasses.replace(ctx, shared=shared)


def compress_and_publish(kind: str, params, config: DeepSeekConfig, x, cache: dict, ctx: ForwardContext):
    """A KV source's compressor over x [B, T, H] at ctx.positions; publishes its rows."""
    _, ratio = parse_kind(kind)
    h = rms_norm(x, params["attn_norm"], config.rms_norm_eps)
    cache, rows, keys = publish_kv(params, config, ratio, h, ctx.positions, cache,
                                   bool(ctx.shared.get(FROZEN_GLOBAL, False)))
    shared = dict(ctx.shared)
    shared[published_key(ratio)] = {"rows": rows, "index_keys": keys, "selected": None, "candidates": None}
    return cache, dataclasses.replace(ctx, shared=shared)


def _apply(kind: str):
    mode, _ = parse_kind(kind)

    def apply(params, config, x, cache, ctx):
        if mode in ("full", "candidates"):
            cache, ctx = compress_and_publish(kind, params, config, x, cache, ctx)
        return attention_and_mlp(kind, params, config, x, cache, ctx)
    return apply


def is_kv_source(kind: str) -> bool:
    return parse_kind(kind)[0] in ("full", "candidates")


KINDS = (SWA,) + tuple(kind_name(m, r) for m in MODES for r in RATIOS)
for _kind in KINDS:
    LAYER_KINDS[_kind] = LayerKind(functools.partial(init_layer, _kind),
                                   functools.partial(init_layer_cache, _kind), _apply(_kind))
