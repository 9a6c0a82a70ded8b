"""Building blocks of the Llama-family decoder: norm, attention over the paged KV cache, MLP."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.context import ForwardContext, TokenTree, ragged_layout
from model.kv_formats import KVPages, kernel_pages, read_kv, write_kv
from model.sharding import TENSOR, kv_spec, manual_over_model, tensor_parallel_size
from pallas_kernels import ragged_paged_attention
from pallas_kernels.quant_matmul.ref import rms_norm  # stated beside the matmul kernel that folds it in
from pallas_kernels.paged_attention.kv_formats import resolve as resolve_format
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla
from pallas_kernels.variant import resolve as resolve_variant
from model.lora import linear, linears  # float [in, out] weights, quantized containers or LoRAWeight alike
from model.rope import apply_rope


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
SWIGLU_OAI_ALPHA = 1.702  # gpt-oss's sigmoid slope


def gated(gate: jnp.ndarray, up: jnp.ndarray, act: str = "silu", limit: float | None = None) -> jnp.ndarray:
    """The gated MLP's hidden units from its gate and up projections; act is a
    model.config.ACTIVATIONS name: act(gate) * up for "silu" (SwiGLU) and "gelu_tanh"
    (Gemma's GeGLU); for "swiglu_oai" (gpt-oss) the gate is clamped above at `limit`, up to
    [-limit, limit], and the units are (up + 1) * gate * sigmoid(1.702 * gate)."""
    if act != "swiglu_oai":
        return _ACTIVATIONS[act](gate) * up
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(SWIGLU_OAI_ALPHA * gate)


def mlp(params: dict, x: jnp.ndarray, act: str = "silu", limit: float | None = None, norm=None) -> jnp.ndarray:
    """Gated MLP: down(gated(gate(x), up(x))) (see `gated` for act and limit). norm: (weight,
    eps) of the RMSNorm x takes first (model.lora.linears folds it into a packed kernel)."""
    gate, up = linears(x, [params["w_gate"], params["w_up"]], norm=norm)
    return linear(gated(gate, up, act, limit), params["w_down"])


def attend(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, q_positions: jnp.ndarray,
           sliding_window: int | None, sm_scale: float, tree: TokenTree | None = None,
           soft_cap: float | None = None, sinks: jnp.ndarray | None = None) -> jnp.ndarray:
    """Causal GQA attention of q [B, T, Hq, D] over position-ordered k, v [B, S, Hkv, D].

    Row s of k/v holds position s; a query at position p sees rows s <= p (and
    s > p - window for sliding layers). With a `tree`, rows in the tree region are seen
    through its mask instead, and the window counts from the query's RoPE position
    (a node's ancestors are always inside a window longer than the tree is deep).
    soft_cap: scaled scores become cap * tanh(s / cap) (Gemma 2). sinks: [Hq] logits that
    join each softmax's denominator only (gpt-oss). Returns [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
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
    if sinks is not None:  # one more column per head, dropped after the softmax
        sink = sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1)
        scores = jnp.concatenate([scores, jnp.broadcast_to(sink, (*scores.shape[:-1], 1))], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    # A padding query sees nothing; keep it finite instead of NaN.
    probs = jnp.where(jnp.isnan(probs), 0.0, probs).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, hq, d)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The static arguments of one ragged attention call."""

    sm_scale: float
    sliding_window: int | None
    kv_format: object  # None, a kv_formats name or a TurboQuant(Split)
    max_q_len: int
    max_chunks: int
    soft_cap: float | None = None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_attention(options: AttentionOptions, q, k, v, k_pages, v_pages, block_tables, cu_q_lens,
                      kv_lens, sinks, tree):
    """(out, k_pages, v_pages) of pallas_kernels.ragged_paged_attention. Differentiable:
    the Pallas kernels have no autodiff rule, so gradients (training the EAGLE-3 draft)
    come from the XLA path, which computes the same function in plain jnp."""
    out, _, k_pages, v_pages = ragged_paged_attention(
        q, k, v, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, sm_scale=options.sm_scale,
        sliding_window=options.sliding_window, soft_cap=options.soft_cap, sinks=sinks, tree=tree,
        kv_format=options.kv_format, max_q_len=options.max_q_len, max_chunks=options.max_chunks)
    return out, k_pages, v_pages


def _ragged_xla(options: AttentionOptions, *args):
    fmt = None if options.kv_format is None else resolve_format(options.kv_format)
    out, _, k_pages, v_pages = ragged_paged_attention_xla(
        *args, sm_scale=options.sm_scale, sliding_window=options.sliding_window,
        kv_format=fmt, max_q_len=options.max_q_len, max_chunks=options.max_chunks,
        variant=resolve_variant(None, options.soft_cap), differentiable=True)
    return out, k_pages, v_pages


def _ragged_fwd(options, *args):
    return _ragged_attention(options, *args), args


def _ragged_bwd(options, args, cotangents):
    return jax.vjp(functools.partial(_ragged_xla, options), *args)[1](cotangents)


_ragged_attention.defvjp(_ragged_fwd, _ragged_bwd)


def _split_heads(attention, mesh, k_pages, v_pages):
    """attention run under jax.shard_map over the mesh's tensor-parallel axes: each device attends
    with its own query heads over its own KV heads' pages (model/sharding.py), so a Pallas
    kernel, which XLA cannot partition, sees one device's share. The block tables, lengths
    and tree are replicated; nothing is exchanged between devices."""
    heads = P(None, TENSOR)  # [tokens, heads, head_dim]
    pages = (jax.tree.map(kv_spec, k_pages), jax.tree.map(kv_spec, v_pages))
    return manual_over_model(attention, mesh, (heads, heads, heads, *pages, P(), P(), P(), P(TENSOR), P()),
                             (heads, *pages))


def project_qkv(params: dict, config: ModelConfig, x: jnp.ndarray, rope, norm=None):
    """An attention layer's q [B, T, num_heads, head_dim] and k, v [B, T, num_kv_heads,
    head_dim] for x [B, T, H]: projected, q/k heads normed where the model does (Qwen3),
    q and k rotated by rope = (cos, sin). norm: as `attention_block`."""
    b, t, _ = x.shape
    hd = config.head_dim
    q, k, v = linears(x, [params["wq"], params["wk"], params["wv"]], [params.get(n) for n in ("bq", "bk", "bv")],
                      norm=norm)
    q = q.reshape(b, t, config.num_heads, hd)
    k, v = k.reshape(b, t, config.num_kv_heads, hd), v.reshape(b, t, config.num_kv_heads, hd)
    if "q_norm" in params:  # Qwen3 (config.qk_norm); the EAGLE-3 draft layer has none
        q = rms_norm(q, params["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, params["k_norm"], config.rms_norm_eps)
    cos, sin = rope
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _in_basis(x: jnp.ndarray, basis: jnp.ndarray) -> jnp.ndarray:
    """x [B, T, heads, ..., d] -> basis[h] @ x[:, :, h, ..., :] per KV head h, in float32 at
    full precision (the bases come from calibration, not training: no TF32 or bf16 passes)."""
    y = jnp.einsum("bth...d,hed->bth...e", x.astype(jnp.float32), basis.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def attention_block(params: dict, config: ModelConfig, x: jnp.ndarray, cache: KVPages,
                    ctx: ForwardContext, sliding_window: int | None, norm=None) -> tuple[jnp.ndarray, KVPages]:
    """Self-attention sublayer: project, (norm q/k heads), rotate, write K/V into the pages,
    attend, project back.

    cache: one layer's KVPages; K/V are stored in its kv_cache_dtype (model/kv_formats.py).
    Every step — prefill chunks, decode rows, draft-tree nodes — goes through
    pallas_kernels.ragged_paged_attention, which writes the new K/V into the pages and
    reads float (of the activations' dtype or another: bfloat16 under float32), fp8, int8,
    nvfp4 and turboquant pages itself (on TPU inside the kernel; on CPU a C++ kernel for
    decode rows over float, int8, fp8 and nvfp4 pages, else its XLA path walks the block
    table a block of pages at a time). Only KIVI pages (their exact newest page lives
    outside the pages) are read back whole and attended densely.

    norm: (weight, eps) of the RMSNorm x takes first (model.lora.linears folds it into a
    packed kernel), or None for x as it is.
    """
    b, t, _ = x.shape
    q, k, v = project_qkv(params, config, x, ctx.rope, norm)
    if "k_center" in params:  # the same scores up to one shift per query (model/key_centers.py)
        k = k - params["k_center"].reshape(config.num_kv_heads, config.head_dim).astype(k.dtype)
    if "k_basis" in params:  # q' . k' = q . k in another basis per KV head (model/key_centers.py)
        group = config.num_heads // config.num_kv_heads
        k = _in_basis(k, params["k_basis"])
        q = _in_basis(q.reshape(b, t, config.num_kv_heads, group, -1), params["q_basis"]).reshape(q.shape)
    pages = kernel_pages(cache)
    if pages is None:
        cache = write_kv(cache, k, v, ctx)
        k_all, v_all = read_kv(cache, ctx, q.dtype)
        out = attend(q, k_all, v_all, ctx.positions, sliding_window, config.sm_scale, ctx.tree,
                     config.attn_logit_softcap, params.get("sinks"))
        return linear(out.reshape(b, t, -1), params["wo"], params.get("bo")), cache
    layout = ctx.layout or ragged_layout(ctx.positions, ctx.tree)
    def pack(a):  # [B, T, H, D] -> the layout's token order [B * T, H, D]
        flat = a.reshape(b * t, *a.shape[2:])
        return flat if layout.order is None else flat[layout.order]
    kv_format, k_pages, v_pages = pages
    options = AttentionOptions(config.sm_scale, sliding_window, kv_format, layout.max_q_len,
                               layout.max_chunks, config.attn_logit_softcap)
    attention = functools.partial(_ragged_attention, options)
    if ctx.mesh is not None and tensor_parallel_size(ctx.mesh) > 1:
        attention = _split_heads(attention, ctx.mesh, k_pages, v_pages)
    out, k_pages, v_pages = attention(pack(q), pack(k), pack(v), k_pages, v_pages, ctx.block_tables,
                                      layout.cu_q_lens, layout.kv_lens, params.get("sinks"), layout.tree)
    if layout.unorder is not None:
        out = out[layout.unorder]
    cache = dataclasses.replace(cache, pages={"k": k_pages, "v": v_pages})
    return linear(out.reshape(b, t, -1), params["wo"], params.get("bo")), cache
