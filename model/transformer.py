"""The pure forward pass: (params, config, tokens, positions, cache) -> (logits, cache).

Params are a pytree of per-layer arrays (slicing stacked weights inside a jitted step
copies them on CPU). Weights are stored [in_features, out_features].

    params = {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (untied only),
              "layers": [{"attn_norm", "wq", "wk", "wv", "wo", ("bq", "bk", "bv"),
                          ("q_norm", "k_norm") [head_dim], "mlp_norm", "w_gate", "w_up",
                          "w_down", ("attn_post_norm", "mlp_post_norm") [H], ("bo") [H],
                          ("sinks") [num_heads]}, ...]}

A layer of config.moe_layers holds model/moe.py's router and experts instead of "w_gate",
"w_up" and "w_down".

Norm weights multiply the normalised input as they are: checkpoints that store Gemma's
(1 + weight) form are converted when loaded.

Projections (and the embedding and head) may be packed (pallas_kernels.quant_matmul's
PackedWeight, what `model.load(..., weights_dtype=...)` returns): a packed embedding is
kept in the head's [H, V] orientation, since its scales run along H; `embed` and `lm_head`
below read either form.

The cache is a `KVCache` (model/kv_cache.py): one page pool per layer, for attention
layers {"k", "v"} of shape [num_pages, page_size, num_kv_heads, head_dim], and the
block tables mapping each sequence's positions to pages.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from model.config import ATTENTION, SLIDING_ATTENTION, ModelConfig
from model.context import ForwardContext, RaggedLayout, TokenTree, ragged_layout
from model.kv_cache import CacheLayout, KVCache, contiguous_block_tables, slot_mapping
from model.kv_formats import (KiviCodec, KVPages, check_kv_cache_dtype, default_page_size, get_format,
                              init_kv_pages)
from model.layers import attention_block, mlp, rms_norm
from model.lora import linear, projection_shapes
from model.moe import init_params as moe_params, moe
from model.rope import rope_tables
from model.sharding import (AXES, EXPERT, check_expert_parallel, check_tensor_parallel, kv_shardings,
                            tensor_parallel_size)
from quant.packed import PackedWeight
from pallas_kernels.validate import check_block_tables


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """How one kind of layer is initialised, cached and applied.

    apply(layer_params, config, x [B, T, H], layer_cache, ctx) -> (x, layer_cache, ctx)
    """

    init_params: Callable[[ModelConfig, jax.Array, jnp.dtype], dict]
    init_cache: Callable[[ModelConfig, CacheLayout, jnp.dtype], dict]
    apply: Callable[..., tuple[jnp.ndarray, dict, ForwardContext]]


def _init_decoder_layer(config: ModelConfig, key: jax.Array, dtype) -> dict:
    h, hd = config.hidden_size, config.head_dim
    shapes = projection_shapes(config)
    keys = jax.random.split(key, len(shapes) + 3)
    layer = {name: (0.02 * jax.random.normal(k, shape)).astype(dtype)
             for k, (name, shape) in zip(keys, shapes.items())}
    layer["attn_norm"] = jnp.ones((h,), dtype)
    layer["mlp_norm"] = jnp.ones((h,), dtype)
    if config.attention_bias:
        for k, name, width in zip(keys[-3:], ("bq", "bk", "bv"),
                                  (config.num_heads * hd, config.num_kv_heads * hd,
                                   config.num_kv_heads * hd)):
            layer[name] = (0.02 * jax.random.normal(k, (width,))).astype(dtype)
    if config.qk_norm:
        layer["q_norm"] = jnp.ones((hd,), dtype)
        layer["k_norm"] = jnp.ones((hd,), dtype)
    if config.sandwich_norm:
        layer["attn_post_norm"] = jnp.ones((h,), dtype)
        layer["mlp_post_norm"] = jnp.ones((h,), dtype)
    if config.attention_out_bias:
        layer["bo"] = (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (h,))).astype(dtype)
    if config.attention_sinks:
        layer["sinks"] = jnp.zeros((config.num_heads,), dtype)
    return layer


def _decoder_layer(sliding: bool):
    def apply(params, config, x, cache, ctx):
        eps = config.rms_norm_eps
        layer_ctx = ctx
        if sliding and ctx.rope_local is not None:
            layer_ctx = dataclasses.replace(ctx, rope=ctx.rope_local)
        attn, cache = attention_block(params, config, x, cache, layer_ctx, config.sliding_window if sliding else None,
                                      norm=(params["attn_norm"], eps))
        if config.sandwich_norm:
            attn = rms_norm(attn, params["attn_post_norm"], eps)
        x = x + attn
        if "router" in params:
            out = moe(params, config, rms_norm(x, params["mlp_norm"], eps), ctx.mesh)
        else:
            out = mlp(params, x, config.hidden_act, config.swiglu_limit, norm=(params["mlp_norm"], eps))
        if config.sandwich_norm:
            out = rms_norm(out, params["mlp_post_norm"], eps)
        return x + out, cache, ctx
    return apply


LAYER_KINDS: dict[str, LayerKind] = {
    ATTENTION: LayerKind(_init_decoder_layer, init_kv_pages, _decoder_layer(sliding=False)),
    SLIDING_ATTENTION: LayerKind(_init_decoder_layer, init_kv_pages, _decoder_layer(sliding=True)),
}


def _kind(name: str) -> LayerKind:
    if name not in LAYER_KINDS:
        raise ValueError(f"unknown layer kind {name!r}; known: {sorted(LAYER_KINDS)}")
    return LAYER_KINDS[name]


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters (normal, std 0.02; norms at 1) for any config."""
    k_embed, k_head, k_layers = jax.random.split(key, 3)
    layer_keys = jax.random.split(k_layers, config.num_layers)
    params = {
        "embed": (0.02 * jax.random.normal(k_embed, (config.vocab_size, config.hidden_size))).astype(dtype),
        "final_norm": jnp.ones((config.hidden_size,), dtype),
        "layers": [_kind(kind).init_params(config, k, dtype)
                   for kind, k in zip(config.layer_kinds, layer_keys)],
    }
    for i in config.moe_layers:  # the MLP becomes a mixture of experts
        layer = {k: v for k, v in params["layers"][i].items() if k not in ("w_gate", "w_up", "w_down")}
        params["layers"][i] = {**layer, **moe_params(config, jax.random.fold_in(layer_keys[i], 1), dtype)}
    if not config.tie_word_embeddings:
        params["lm_head"] = (0.02 * jax.random.normal(
            k_head, (config.hidden_size, config.vocab_size))).astype(dtype)
    return params


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32,
               page_size: int | None = None, kv_cache_dtype: str = "auto", mesh=None) -> KVCache:
    """An empty KV cache for `batch_size` sequences of up to `max_len` positions each.

    page_size: None picks DEFAULT_PAGE_SIZE (32, KIVI's group, for kivi formats).
    kv_cache_dtype: how attention pages are stored (model/kv_formats.py); "auto" = `dtype`.
    mesh: lay the pages out over it, split by KV heads (model/sharding.py).
    """
    page_size = default_page_size(kv_cache_dtype) if page_size is None else page_size
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if not 0 < max_len <= config.max_position_embeddings:
        raise ValueError(f"max_len must be in [1, {config.max_position_embeddings}] (the model's "
                         f"context), got {max_len}")
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    pages_per_seq = -(-max_len // page_size)
    return init_paged_cache(config, batch_size * pages_per_seq, page_size, dtype,
                            contiguous_block_tables(batch_size, pages_per_seq), kv_cache_dtype, mesh)


def init_paged_cache(config: ModelConfig, num_pages: int, page_size: int, dtype,
                     block_tables: jax.Array, kv_cache_dtype: str = "auto", mesh=None) -> KVCache:
    """A cache over a pool of `num_pages` pages, addressed through `block_tables`."""
    return KVCache(init_kv_pool(config, num_pages, page_size, dtype, kv_cache_dtype, block_tables.shape[0],
                                mesh), block_tables, page_size)


def init_kv_pool(config: ModelConfig, num_pages: int, page_size: int, dtype, kv_cache_dtype: str = "auto",
                 batch_size: int = 1, mesh=None) -> list:
    """Every layer's empty page pool ([num_pages, page_size, ...] leaves), as a serving
    engine keeps it: each step brings its own block tables. batch_size sizes the
    per-sequence state of formats that have one (KIVI's residual buffer). mesh: the
    pages are created split by KV heads over its tensor-parallel axes, each device allocating
    only its share (model/sharding.py)."""
    check_kv_cache_dtype(kv_cache_dtype, config, page_size)
    _check_mesh(config, mesh)
    layout = CacheLayout(batch_size, num_pages, page_size, kv_cache_dtype)

    def build():
        return [_kind(kind).init_cache(config, layout, dtype) for kind in config.layer_kinds]
    if mesh is None:
        return build()
    return jax.jit(build, out_shardings=kv_shardings(jax.eval_shape(build), mesh))()


def _num_pages(cache: KVCache) -> int:
    return jax.tree.leaves(cache.layers[0])[0].shape[0]


def _check_inputs(config: ModelConfig, tokens, positions, cache: KVCache) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if positions.shape != tokens.shape:
        raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache from model.init_cache, got {type(cache).__name__}")
    if len(cache.layers) != config.num_layers:
        raise ValueError(f"cache has {len(cache.layers)} layers, config has {config.num_layers}")
    if cache.batch_size != tokens.shape[0]:
        raise ValueError(f"cache holds {cache.batch_size} sequences, tokens have {tokens.shape[0]}")
    if tokens.shape[1] > cache.capacity:
        raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than the cache "
                         f"({cache.capacity}); the model's context is {config.max_position_embeddings}")


def forward_context(config: ModelConfig, positions: jnp.ndarray, cache: KVCache,
                    tree: TokenTree | None = None, mesh=None) -> ForwardContext:
    """The per-step context every layer reads: RoPE tables, KV slots, block tables, tree,
    and the mesh attention splits its heads over (None on one device)."""
    rope_positions = positions if tree is None else tree.rope_positions
    return ForwardContext(
        positions=positions, rope=rope_tables(config, rope_positions), block_tables=cache.block_tables,
        slots=slot_mapping(positions, cache.block_tables, cache.page_size, _num_pages(cache)),
        page_size=cache.page_size, tree=tree, layout=ragged_layout(positions, tree),
        rope_local=_rope_local(config, rope_positions), mesh=mesh)


def _rope_local(config: ModelConfig, rope_positions: jnp.ndarray):
    """Sliding layers' own RoPE tables, when the model gives them another base (Gemma 3)."""
    if config.rope_local_theta is None or SLIDING_ATTENTION not in config.layer_kinds:
        return None
    return rope_tables(config, rope_positions, local=True)


def _check_tree(config: ModelConfig, tokens, tree: TokenTree) -> None:
    other = sorted(set(config.layer_kinds) - {ATTENTION, SLIDING_ATTENTION})
    if other:
        raise ValueError(f"tree attention needs standard attention layers; this model has {other}")
    b, t = tokens.shape
    if tree.rope_positions.shape != (b, t) or tree.start.shape != (b,) or \
            tree.mask.ndim != 3 or tree.mask.shape[:2] != (b, t):
        raise ValueError(f"tree shapes rope_positions {tree.rope_positions.shape}, start "
                         f"{tree.start.shape}, mask {tree.mask.shape} do not fit tokens {tokens.shape}")


def forward_hidden(params: dict, config: ModelConfig, tokens: jnp.ndarray, positions: jnp.ndarray,
                   cache: KVCache, capture_layers: tuple[int, ...] = (), tree: TokenTree | None = None,
                   mesh=None) -> tuple[jnp.ndarray, KVCache, tuple[jnp.ndarray, ...]]:
    """(final-norm hidden [B, T, H], updated cache, captured) — not jitted.

    captured[i] is the residual stream entering layer capture_layers[i] ([B, T, H]),
    the features EAGLE-3 drafts from. tree: the tokens are draft-tree nodes
    (model/context.py TokenTree); `positions` are then their KV slots. mesh: as `forward`.
    """
    _check_inputs(config, tokens, positions, cache)
    if any(not 0 <= i < config.num_layers for i in capture_layers):
        raise ValueError(f"capture_layers {capture_layers} must be in [0, {config.num_layers})")
    if tree is not None:
        _check_tree(config, tokens, tree)
    x = embed(params, tokens, config)
    ctx = forward_context(config, positions, cache, tree, mesh)
    hidden, layers, captured = _run_layers(params, config, x, cache.layers, ctx, capture_layers)
    return hidden, KVCache(layers, cache.block_tables, cache.page_size), captured


def _run_layers(params, config, x, layers, ctx, capture_layers):
    """(final-norm hidden, new layer caches, residual streams entering capture_layers)."""
    new_layers, captured = [], {}
    for i, (kind, layer, layer_cache) in enumerate(zip(config.layer_kinds, params["layers"], layers)):
        captured[i] = x
        x, layer_cache, ctx = LAYER_KINDS[kind].apply(layer, config, x, layer_cache, ctx)
        new_layers.append(layer_cache)
    hidden = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    return hidden, new_layers, tuple(captured[i] for i in capture_layers)


def forward_packed(params: dict, config: ModelConfig, tokens: jnp.ndarray, positions: jnp.ndarray,
                   cache: KVCache, layout: RaggedLayout, capture_layers: tuple[int, ...] = (),
                   mesh=None, rope=None) -> tuple[jnp.ndarray, KVCache, tuple[jnp.ndarray, ...]]:
    """forward_hidden over a packed step, the serving engine's layout (not jitted).

    tokens, positions: int32 [N], every sequence's tokens back to back as `layout`
    (model/context.py RaggedLayout, order None) describes them: prefill chunks, decode
    rows and draft-tree nodes alike (positions are RoPE positions; a tree node's KV slot
    comes from the layout). cache.block_tables: [S, pages] for the layout's S sequences.
    Returns hidden [N, H], the cache and captured residual streams [N, H]. mesh: as `forward`.
    rope: packed_rope(config, positions) when the caller has them (computed once for several
    steps, outside their loop); None computes them here.
    """
    if tokens.ndim != 1 or positions.shape != tokens.shape:
        raise ValueError(f"packed tokens {tokens.shape} and positions {positions.shape} must be "
                         "equal 1-D shapes")
    if layout.cu_q_lens.shape != (cache.batch_size + 1,) or layout.order is not None:
        raise ValueError(f"layout must be packed (order None) with cu_q_lens [{cache.batch_size + 1}]"
                         f" for block tables of {cache.batch_size} sequences")
    other = sorted(set(config.layer_kinds) - {ATTENTION, SLIDING_ATTENTION})
    if other:
        raise ValueError(f"packed steps need standard attention layers; this model has {other}")
    if any(isinstance(layer, KVPages) and isinstance(get_format(layer.kv_cache_dtype), KiviCodec)
           for layer in cache.layers):
        raise ValueError("packed steps cannot use KIVI pages (their newest page is kept per batch row)")
    hidden, layers, captured = _run_layers(params, config, embed(params, tokens, config)[None], cache.layers,
                                           packed_context(config, positions, cache, layout, mesh, rope),
                                           capture_layers)
    return hidden[0], KVCache(layers, cache.block_tables, cache.page_size), tuple(c[0] for c in captured)


def packed_context(config: ModelConfig, positions: jnp.ndarray, cache: KVCache, layout: RaggedLayout,
                   mesh=None, rope=None) -> ForwardContext:
    """The context of a packed step (forward_packed): positions [N] are RoPE positions,
    every token's KV slot and visibility come from `layout`; layers see one row [1, N].
    rope: packed_rope's tables for positions, or None to compute them."""
    rope, rope_local = packed_rope(config, positions) if rope is None else rope
    return ForwardContext(positions=positions[None], rope=rope, block_tables=cache.block_tables, slots=None,
                          page_size=cache.page_size, layout=layout, rope_local=rope_local, mesh=mesh)


def packed_rope(config: ModelConfig, positions: jnp.ndarray):
    """(RoPE tables, sliding layers' own tables or None) of a packed step's positions [N],
    each cos, sin [1, N, head_dim]. A caller running several steps computes them for all
    steps before its loop: XLA:CPU fuses cos and sin into every consumer, so tables made
    inside a step are evaluated again for each head of each layer's rotation (60 fusions of
    2-3 us per SmolLM2 decode token)."""
    return rope_tables(config, positions[None]), _rope_local(config, positions[None])


def embed(params: dict, tokens: jnp.ndarray, config: ModelConfig) -> jnp.ndarray:
    """Token embeddings [..., H] of int tokens [...] (float rows of a [V, H] table, or the
    dequantized columns of a packed [H, V] one), times config.embedding_multiplier."""
    table, dtype = params["embed"], params["final_norm"].dtype  # rows in the compute dtype
    if isinstance(table, PackedWeight):
        rows = table.columns(tokens.reshape(-1), dtype).reshape(*tokens.shape, table.shape[0])
    else:
        rows = table[tokens].astype(dtype)
    if config.embedding_multiplier != 1.0:  # in the compute dtype, as Gemma scales them
        rows = rows * jnp.asarray(config.embedding_multiplier, dtype)
    return rows


def head_weight(params: dict, config: ModelConfig):
    """The vocabulary projection [H, V]: the untied head, or the tied embedding (float or packed)."""
    if not config.tie_word_embeddings:
        return params["lm_head"]
    table = params["embed"]
    return table if isinstance(table, PackedWeight) else table.T


def lm_head(params: dict, config: ModelConfig, hidden: jnp.ndarray) -> jnp.ndarray:
    """Logits [..., V] (float32) from final hidden states [..., H], soft-capped when the
    model says so (Gemma 2: cap * tanh(logits / cap))."""
    logits = linear(hidden, head_weight(params, config)).astype(jnp.float32)
    cap = config.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def _check_consecutive(positions: np.ndarray) -> None:
    """ValueError unless each row's positions >= 0 run p, p + 1, ... (the ragged layout)."""
    for b, row in enumerate(positions):
        real = row[row >= 0]
        if real.size and np.any(np.diff(real) != 1):
            raise ValueError(f"positions of row {b} must be consecutive (p, p + 1, ...; negative = "
                             f"padding anywhere), got {real.tolist()[:8]}")


def forward(params: dict, config: ModelConfig, tokens: jnp.ndarray, positions: jnp.ndarray,
            cache: KVCache, logits_indices: jnp.ndarray | None = None,
            tree: TokenTree | None = None, mesh=None) -> tuple[jnp.ndarray, KVCache]:
    """Run the model over tokens and write their K/V into the cache (jitted, config static).

    tokens, positions: int32 [batch, seq]. A negative position marks a padding
    token: its K/V is not written and it attends to nothing. A row's other positions
    must be consecutive (checked when concrete). cache: a KVCache from
    `init_cache` / `init_paged_cache` (donated); the block table entries that hold a
    sequence's positions [0, its largest position] must be pages of the pool (checked
    when tables and positions are concrete; later entries are never read).
    logits_indices: optional int32 [batch]; if given, logits only at those sequence
    indices ([batch, V]) instead of every token ([batch, seq, V]).
    tree: score draft-tree nodes in one pass (speculative decoding, model/context.py).
    mesh: a jax.sharding.Mesh (model.make_mesh) the params and cache are laid out over
    (model.shard_params, init_cache(..., mesh=mesh)): attention splits its heads over the
    mesh's tensor-parallel axes ("expert" x "model"; a MoE layer splits its experts over
    "expert" and their hidden units over "model"); the "data" axis replicates the work
    (serving runs one engine per data-parallel rank); None for one device.
    """
    _check_inputs(config, tokens, positions, cache)  # shapes first: the value check needs them
    paged = [layer for layer in cache.layers if isinstance(layer, KVPages)]
    if not isinstance(positions, jax.core.Tracer):
        _check_consecutive(np.asarray(positions))
    if paged and not isinstance(positions, jax.core.Tracer):  # CSA2 layers keep rows, not pages
        kv_lens = np.maximum(np.asarray(positions).max(axis=1, initial=-1) + 1, 0)
        check_block_tables(cache.block_tables, jax.tree.leaves(paged[0].pages)[0].shape[0], kv_lens,
                           cache.page_size)
    _check_mesh(config, mesh)
    return _forward(params, config, tokens, positions, cache, logits_indices, tree, mesh)


def _check_mesh(config: ModelConfig, mesh) -> None:
    if mesh is None:
        return
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {AXES} (model.make_mesh), got {mesh!r}")
    tp = tensor_parallel_size(mesh)
    check_tensor_parallel(config, tp)
    check_expert_parallel(config, tp, mesh.shape[EXPERT])
    if tp > 1 and config.num_kv_heads % tp:
        raise ValueError(f"{config.num_kv_heads} KV heads do not split {tp} ways: shard the params with "
                         "model.shard_params(params, config, mesh), which repeats them, and use its config")


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("cache",))
def _forward(params, config, tokens, positions, cache, logits_indices, tree, mesh):
    hidden, cache, _ = forward_hidden(params, config, tokens, positions, cache, tree=tree, mesh=mesh)
    if logits_indices is not None:
        hidden = jnp.take_along_axis(hidden, logits_indices[:, None, None], axis=1)[:, 0]
    return lm_head(params, config, hidden), cache
