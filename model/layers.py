"""Building blocks of the Llama-family decoder: norm, attention over a KV cache, MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.config import ModelConfig
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


def write_kv(cache: jnp.ndarray, new: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    """Scatter new [B, T, Hkv, D] into cache [B, S, Hkv, D] at slot = position.

    Positions >= S (padding) are dropped, so callers pad with `max_len`.
    """
    batch = jnp.arange(cache.shape[0])[:, None]
    return cache.at[batch, positions].set(new.astype(cache.dtype), mode="drop")


def attend(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, q_positions: jnp.ndarray,
           sliding_window: int | None, sm_scale: float) -> jnp.ndarray:
    """Causal GQA attention of q [B, T, Hq, D] over a slot-indexed cache k, v [B, S, Hkv, D].

    Cache slot s holds position s; a query at position p sees slots s <= p (and
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


def attention_block(params: dict, config: ModelConfig, x: jnp.ndarray, positions: jnp.ndarray,
                    rope: tuple[jnp.ndarray, jnp.ndarray], cache: dict,
                    sliding_window: int | None) -> tuple[jnp.ndarray, dict]:
    """Self-attention sublayer: project, rotate, write the cache, attend, project back."""
    b, t, _ = x.shape
    hd = config.head_dim
    q = linear(x, params["wq"], params.get("bq")).reshape(b, t, config.num_heads, hd)
    k = linear(x, params["wk"], params.get("bk")).reshape(b, t, config.num_kv_heads, hd)
    v = linear(x, params["wv"], params.get("bv")).reshape(b, t, config.num_kv_heads, hd)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache = {"k": write_kv(cache["k"], k, positions), "v": write_kv(cache["v"], v, positions)}
    out = attend(q, cache["k"], cache["v"], positions, sliding_window, hd ** -0.5)
    return linear(out.reshape(b, t, -1), params["wo"]), cache
