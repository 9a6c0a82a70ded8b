"""The pure forward pass: (params, config, tokens, positions, cache) -> (logits, cache).

Params are a pytree of per-layer arrays (slicing stacked weights inside a jitted step
copies them on CPU). Weights are stored [in_features, out_features].

    params = {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (untied only),
              "layers": [{"attn_norm", "wq", "wk", "wv", "wo", ("bq", "bk", "bv"),
                          "mlp_norm", "w_gate", "w_up", "w_down"}, ...]}

The cache is a list with one pytree per layer; for attention layers {"k", "v"} of
shape [batch, max_len, num_kv_heads, head_dim] where slot s holds position s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from model.config import ATTENTION, SLIDING_ATTENTION, ModelConfig
from model.layers import attention_block, mlp, rms_norm
from model.rope import rope_tables


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """How one kind of layer is initialised, cached and applied."""

    init_params: Callable[[ModelConfig, jax.Array, jnp.dtype], dict]
    init_cache: Callable[[ModelConfig, int, int, jnp.dtype], dict]
    apply: Callable[..., tuple[jnp.ndarray, dict]]


def _init_decoder_layer(config: ModelConfig, key: jax.Array, dtype) -> dict:
    h, hd, i = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"wq": (h, config.num_heads * hd), "wk": (h, config.num_kv_heads * hd),
              "wv": (h, config.num_kv_heads * hd), "wo": (config.num_heads * hd, h),
              "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}
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
    return layer


def _init_kv_cache(config: ModelConfig, batch_size: int, max_len: int, dtype) -> dict:
    shape = (batch_size, max_len, config.num_kv_heads, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _decoder_layer(window_of: Callable[[ModelConfig], int | None]):
    def apply(params, config, x, positions, rope, cache):
        h = rms_norm(x, params["attn_norm"], config.rms_norm_eps)
        attn, cache = attention_block(params, config, h, positions, rope, cache, window_of(config))
        x = x + attn
        x = x + mlp(params, rms_norm(x, params["mlp_norm"], config.rms_norm_eps))
        return x, cache
    return apply


LAYER_KINDS: dict[str, LayerKind] = {
    ATTENTION: LayerKind(_init_decoder_layer, _init_kv_cache, _decoder_layer(lambda c: None)),
    SLIDING_ATTENTION: LayerKind(_init_decoder_layer, _init_kv_cache,
                                 _decoder_layer(lambda c: c.sliding_window)),
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
    if not config.tie_word_embeddings:
        params["lm_head"] = (0.02 * jax.random.normal(
            k_head, (config.hidden_size, config.vocab_size))).astype(dtype)
    return params


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> list:
    """An empty KV cache for `batch_size` sequences of up to `max_len` positions."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if not 0 < max_len <= config.max_position_embeddings:
        raise ValueError(f"max_len must be in [1, {config.max_position_embeddings}] (the model's "
                         f"context), got {max_len}")
    return [_kind(kind).init_cache(config, batch_size, max_len, dtype) for kind in config.layer_kinds]


def cache_max_len(cache: list) -> int:
    """Positions the cache holds per sequence."""
    return jax.tree.leaves(cache[0])[0].shape[1]


def _check_inputs(config: ModelConfig, tokens, positions, cache) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if positions.shape != tokens.shape:
        raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
    if len(cache) != config.num_layers:
        raise ValueError(f"cache has {len(cache)} layers, config has {config.num_layers}")
    max_len = cache_max_len(cache)
    if tokens.shape[1] > max_len:
        raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than the cache "
                         f"({max_len}); the model's context is {config.max_position_embeddings}")


def forward_hidden(params: dict, config: ModelConfig, tokens: jnp.ndarray,
                   positions: jnp.ndarray, cache: list) -> tuple[jnp.ndarray, list]:
    """Final-norm hidden states [B, T, H] and the updated cache (not jitted)."""
    _check_inputs(config, tokens, positions, cache)
    x = params["embed"][tokens]
    rope = rope_tables(config, positions)
    new_cache = []
    for kind, layer, layer_cache in zip(config.layer_kinds, params["layers"], cache):
        x, layer_cache = LAYER_KINDS[kind].apply(layer, config, x, positions, rope, layer_cache)
        new_cache.append(layer_cache)
    return rms_norm(x, params["final_norm"], config.rms_norm_eps), new_cache


def lm_head(params: dict, config: ModelConfig, hidden: jnp.ndarray) -> jnp.ndarray:
    """Logits [..., V] (float32) from final hidden states [..., H]."""
    w = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return (hidden @ w).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def forward(params: dict, config: ModelConfig, tokens: jnp.ndarray, positions: jnp.ndarray,
            cache: list, logits_indices: jnp.ndarray | None = None) -> tuple[jnp.ndarray, list]:
    """Run the model over tokens and write their K/V into the cache.

    tokens, positions: int32 [batch, seq]. A position >= the cache length marks a
    padding token: its K/V is not written. cache: from `init_cache` (donated).
    logits_indices: optional int32 [batch]; if given, logits only at those sequence
    indices ([batch, V]) instead of every token ([batch, seq, V]).
    """
    hidden, cache = forward_hidden(params, config, tokens, positions, cache)
    if logits_indices is not None:
        hidden = jnp.take_along_axis(hidden, logits_indices[:, None, None], axis=1)[:, 0]
    return lm_head(params, config, hidden), cache
