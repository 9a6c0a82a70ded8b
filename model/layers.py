"""Building blocks of the Llama-family decoder: norm, attention over the paged KV cache, MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.config import ModelConfig
from model.context import ForwardContext, TokenTree
from model.kv_formats import KVPages, kernel_pages, plain_pages, read_kv, write_kv
from pallas_kernels import paged_attention, paged_attention_quantized
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
           sliding_window: int | None, sm_scale: float, tree: TokenTree | None = None) -> jnp.ndarray:
    """Causal GQA attention of q [B, T, Hq, D] over position-ordered k, v [B, S, Hkv, D].

    Row s of k/v holds position s; a query at position p sees rows s <= p (and
    s > p - window for sliding layers). With a `tree`, rows in the tree region are seen
    through its mask instead, and the window counts from the query's RoPE position
    (a node's ancestors are always inside a window longer than the tree is deep).
    Returns [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    slots = jnp.arange(k.shape[1])[None, None, :]
    visible = slots <= q_positions[:, :, None]
    window_from = q_positions
    if tree is not None:
        offset = slots - tree.start[:, None, None]  # [B, 1, S]
        region = tree.mask.shape[-1]
        in_tree = (offset >= 0) & (offset < region)
        seen = jnp.take_along_axis(tree.mask, jnp.clip(offset, 0, region - 1).repeat(t, axis=1),
                                   axis=2)
        visible &= jnp.where(in_tree, seen, offset < 0)
        window_from = tree.rope_positions
    if sliding_window is not None:
        near = slots > window_from[:, :, None] - sliding_window
        visible &= near if tree is None else near | in_tree
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A padding query sees nothing; keep it finite instead of NaN.
    probs = jnp.where(jnp.isnan(probs), 0.0, probs).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, hq, d)


def attention_block(params: dict, config: ModelConfig, x: jnp.ndarray, cache: KVPages,
                    ctx: ForwardContext, sliding_window: int | None) -> tuple[jnp.ndarray, KVPages]:
    """Self-attention sublayer: project, rotate, write K/V into the pages, attend, project back.

    cache: one layer's KVPages; K/V are stored in its kv_cache_dtype (model/kv_formats.py).
    Decode steps (one token per sequence) go through pallas_kernels.paged_attention over
    float pages and paged_attention_quantized over fp8 / int8 / nvfp4 / turboquant pages
    (the kernel reads the low-bit bytes; on CPU the entry's XLA path dequantizes a block
    of the table's pages at a time). Longer chunks, token trees and KIVI pages read each
    sequence's pages back as float (after this chunk's write) and attend densely.
    """
    b, t, _ = x.shape
    hd = config.head_dim
    q = linear(x, params["wq"], params.get("bq")).reshape(b, t, config.num_heads, hd)
    k = linear(x, params["wk"], params.get("bk")).reshape(b, t, config.num_kv_heads, hd)
    v = linear(x, params["wv"], params.get("bv")).reshape(b, t, config.num_kv_heads, hd)
    cos, sin = ctx.rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache = write_kv(cache, k, v, ctx)
    decode = t == 1 and ctx.tree is None
    quantized = kernel_pages(cache) if decode else None
    if decode and (quantized is not None or plain_pages(cache, q.dtype)):
        kv_lens = jnp.maximum(ctx.positions[:, 0] + 1, 0).astype(jnp.int32)
        kw = dict(sm_scale=hd ** -0.5, sliding_window=sliding_window)
        if quantized is None:
            out, _ = paged_attention(q[:, 0], cache["k"], cache["v"], ctx.block_tables, kv_lens, **kw)
        else:
            kv_format, k_pages, v_pages = quantized
            out, _ = paged_attention_quantized(q[:, 0], k_pages, v_pages, ctx.block_tables, kv_lens,
                                               kv_format=kv_format, **kw)
        out = out[:, None]
    else:
        k_all, v_all = read_kv(cache, ctx, q.dtype)
        out = attend(q, k_all, v_all, ctx.positions, sliding_window, hd ** -0.5, ctx.tree)
    return linear(out.reshape(b, t, -1), params["wo"]), cache
