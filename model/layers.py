"""Building blocks of the Llama-family decoder: norm, attention over the paged KV cache, MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.context import ForwardContext
from model.kv_cache import gather_pages, write_pages
from pallas_kernels import paged_attention
from quant import linear  # float [in, out] weights or quantized containers alike
from model.rope import apply_rope


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm over the last axis, computed in float32 like the reference models."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def mlp(params: dict, x: jnp.ndarray) -> jnp.ndarray:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate = linear(x, params["w_gate"])
    return linear(jax.nn.silu(gate) * linear(x, params["w_up"]), params["w_down"])


def attend(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, q_positions: jnp.ndarray,
           sliding_window: int | None, sm_scale: float) -> jnp.ndarray:
    """Causal GQA attention of q [B, T, Hq, D] over position-ordered k, v [B, S, Hkv, D].

    Row s of k/v holds position s; a query at position p sees rows s <= p (and
    s > p - window for sliding layers). Returns [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    slots = jnp.arange(k.shape[1])
    visible = slots[None, None, :] <= q_positions[:, :, None]
    if sliding_window is not None:
        visible &= slots[None, None, :] > q_positions[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A padding query sees nothing; keep it finite instead of NaN.
    probs = jnp.where(jnp.isnan(probs), 0.0, probs).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, hq, d)


def attention_block(params: dict, config: ModelConfig, x: jnp.ndarray, cache: dict,
                    ctx: ForwardContext, sliding_window: int | None) -> tuple[jnp.ndarray, dict]:
    """Self-attention sublayer: project, rotate, write K/V into the pages, attend, project back.

    Decode steps (one token per sequence) go through pallas_kernels.paged_attention;
    longer chunks gather each sequence's pages and attend densely.
    """
    b, t, _ = x.shape
    hd = config.head_dim
    q = linear(x, params["wq"], params.get("bq")).reshape(b, t, config.num_heads, hd)
    k = linear(x, params["wk"], params.get("bk")).reshape(b, t, config.num_kv_heads, hd)
    v = linear(x, params["wv"], params.get("bv")).reshape(b, t, config.num_kv_heads, hd)
    cos, sin = ctx.rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache = {"k": write_pages(cache["k"], k, ctx.slots), "v": write_pages(cache["v"], v, ctx.slots)}
    if t == 1:
        kv_lens = jnp.maximum(ctx.positions[:, 0] + 1, 0).astype(jnp.int32)
        out, _ = paged_attention(q[:, 0], cache["k"], cache["v"], ctx.block_tables, kv_lens,
                                 sm_scale=hd ** -0.5, sliding_window=sliding_window)
        out = out[:, None]
    else:
        out = attend(q, gather_pages(cache["k"], ctx.block_tables),
                     gather_pages(cache["v"], ctx.block_tables), ctx.positions, sliding_window,
                     hd ** -0.5)
    return linear(out.reshape(b, t, -1), params["wo"]), cache
