"""Key centering: quantized KV pages store each key minus its layer's mean key.

A softmax does not change when every score of a query moves by one constant, and
q . (k - c) = q . k - q . c moves all of a query's scores by q . c. So a layer may store and
attend over k - c for any fixed vector c per KV head and compute exactly what it computed
over k. Choosing c as the layer's mean post-RoPE key matters for quantized pages: the mean
is large (about 60% of a key's energy in SmolLM2, most of it in a few low-frequency RoPE
channels), and a quantizer's error grows with the vector it codes. With the centers,
turboquant-3.5's perplexity cost on the default model drops by about a third and nvfp4's by
about half (`python -m model.kv_eval`); int8's was already near zero. The mean is taken
after RoPE: a center subtracted before it would turn, with each key's position, into a shift
that differs between keys.

The centers are a per-layer parameter, "k_center" ([num_kv_heads * head_dim], like "bk"),
which `attention_block` subtracts from the rotated keys before anything reads or writes
them. They come from one forward pass over a calibration text (`calibration_ids`) with a
float cache. Any centers are exact, stale ones included (after a weight update, say); good
ones only make the quantized pages more accurate.

Only where the identity holds: Llama-family attention layers without attention sinks (a
sink's fixed logit does not move with the scores) and without a score soft-cap (tanh is not
shift-invariant). `supports(config)` says which.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ATTENTION, SLIDING_ATTENTION, ModelConfig
from model.kv_formats import FLOAT_FORMATS
from model.tokenizer import Tokenizer

CENTER = "k_center"
CALIBRATION_TOKENS = 1024


def supports(config: ModelConfig) -> bool:
    """Whether every layer's attention is shift-invariant, so key centers are exact."""
    return (all(kind in (ATTENTION, SLIDING_ATTENTION) for kind in config.layer_kinds)
            and not config.attention_sinks and config.attn_logit_softcap is None)


def documentation_text(reverse: bool = False) -> str:
    """Python's own documentation (pydoc_data.topics, shipped with CPython), topics in
    sorted order, or in reverse order (calibration reads it so, model.kv_eval forwards)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics, reverse=reverse))


def calibration_ids(tokenizer: Tokenizer, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """`num_tokens` token ids of the documentation in reverse topic order: the text the
    centers are taken over, apart from the text model.kv_eval measures them on."""
    text = documentation_text(reverse=True)
    ids = tokenizer.encode(text[:8 * num_tokens + 256], add_special_tokens=False)
    if len(ids) < num_tokens:
        ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the documentation has {len(ids)} tokens, asked for {num_tokens}")
    return ids[:num_tokens]


def key_centers(params: dict, config: ModelConfig, token_ids) -> list[jax.Array]:
    """Each layer's mean post-RoPE key over `token_ids` (one sequence), [num_kv_heads *
    head_dim] float32, computed with the float model and a float32 cache; ValueError when
    the model does not support centering (`supports`) or the ids are no 1-D int sequence."""
    if not supports(config):
        raise ValueError("key centers need Llama-family attention layers without attention sinks or "
                         "a score soft-cap (their softmax is not shift-invariant)")
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be a non-empty 1-D sequence of ints, got shape {ids.shape} "
                         f"of {ids.dtype}")
    if ids.size > config.max_position_embeddings or ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"token_ids must be at most {config.max_position_embeddings} ids in "
                         f"[0, {config.vocab_size}), got {ids.size} in [{ids.min()}, {ids.max()}]")
    bare = without_key_centers(params)
    return list(_means(config, ids.size)(bare, jnp.asarray(ids[None], jnp.int32)))


@functools.cache
def _means(config: ModelConfig, num_tokens: int):
    from model.transformer import forward_hidden, init_cache

    @jax.jit
    def means(params, tokens):
        cache = init_cache(config, 1, num_tokens, jnp.float32, kv_cache_dtype="float32")
        positions = jnp.arange(num_tokens, dtype=jnp.int32)[None]
        _, cache, _ = forward_hidden(params, config, tokens, positions, cache)
        # one sequence over contiguous pages: its slots are the pool's rows in order
        return [layer.pages["k"].reshape(-1, config.num_kv_heads * config.head_dim)[:num_tokens].mean(0)
                for layer in cache.layers]
    return means


def with_key_centers(params: dict, config: ModelConfig, token_ids) -> dict:
    """params with each layer's "k_center" set from `key_centers` (any old ones replaced)."""
    centers = key_centers(params, config, token_ids)
    return {**params, "layers": [{**layer, CENTER: c}
                                 for layer, c in zip(params["layers"], centers)]}


def for_kv_cache(params: dict, config: ModelConfig, tokenizer: Tokenizer, kv_cache_dtype: str) -> dict:
    """params as a model with `kv_cache_dtype` pages runs them: centered on `calibration_ids`
    (as many tokens as the model's context allows) when the pages are quantized and the
    model `supports` centers; else unchanged (float pages gain nothing from them)."""
    if kv_cache_dtype in FLOAT_FORMATS or not supports(config):
        return params
    num_tokens = min(CALIBRATION_TOKENS, config.max_position_embeddings)
    return with_key_centers(params, config, calibration_ids(tokenizer, num_tokens))


def without_key_centers(params: dict) -> dict:
    """params without any "k_center" (the model computes the same either way)."""
    return {**params, "layers": [{k: v for k, v in layer.items() if k != CENTER} for layer in params["layers"]]}
