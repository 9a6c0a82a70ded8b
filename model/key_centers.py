"""Key centering: quantized KV pages store each key minus its layer's mean key.

A softmax does not change when every score of a query moves by one constant, and
q . (k - c) = q . k - q . c moves all of a query's scores by q . c. So a layer may store and
attend over k - c for any fixed vector c per KV head and compute exactly what it computed
over k. Choosing c as the layer's mean post-RoPE key matters for quantized pages: the mean
is large (about 60% of a key's energy in SmolLM2, most of it in a few low-frequency RoPE
channels), and a quantizer's error grows with the vector it codes. With the centers,
`python -m model.kv_eval` measured turboquant-3.5 at +0.48 perplexity over float32 on 1,024
tokens (+1.07 without) and nvfp4 at +0.97 (+1.64); int8's cost was already near zero. The
mean is taken after RoPE: a center subtracted before it would turn, with each key's
position, into a shift that differs between keys.

The centers are a per-layer parameter, "k_center" ([num_kv_heads * head_dim], like "bk"),
which `attention_block` subtracts from the rotated keys before anything reads or writes
them. They come from one forward pass over a calibration text (`calibration_ids`) with a
float cache. Any centers are exact, stale ones included (after a weight update, say); good
ones make the quantized pages more accurate, by as much as the mean dominates the keys.
LLM centers the keys of the formats in CENTERED_FORMATS, where kv_eval measured the gain.

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
from model.kv_formats import get_format
from model.tokenizer import Tokenizer

CENTER = "k_center"
CALIBRATION_TOKENS = 1024
# The formats whose pages hold centered keys: those kv_eval measured better with centers at
# 512 and 1,024 tokens (README's table). fp8 showed no clear change; mxfp4's perplexity cost
# fell but it lost two of its three needles, so both store keys as they are.
CENTERED_FORMATS = ("int8", "nvfp4", "turboquant-3.5", "turboquant-2.5")


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
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    text = documentation_text(reverse=True)
    ids = tokenizer.encode(text[:8 * num_tokens + 256], add_special_tokens=False)
    if len(ids) < num_tokens:
        ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the documentation has {len(ids)} tokens, asked for {num_tokens}")
    return ids[:num_tokens]


def key_centers(params: dict, config: ModelConfig, token_ids, mesh=None) -> list[jax.Array]:
    """Each layer's mean post-RoPE key over `token_ids` (one sequence), [num_kv_heads *
    head_dim] float32, from a forward pass of the model as `params` hold it (packed weights
    too) into a float32 cache; ValueError when the model does not support centering
    (`supports`) or the ids are no 1-D sequence of the model's token ids.

    mesh: params are laid out over it (model/sharding.py), and so is the pass."""
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
    return list(_means(config, ids.size, mesh)(bare, jnp.asarray(ids[None], jnp.int32)))


@functools.cache
def _means(config: ModelConfig, num_tokens: int, mesh):
    from model.transformer import forward_hidden, init_cache

    @jax.jit
    def means(params, tokens):
        cache = init_cache(config, 1, num_tokens, jnp.float32, kv_cache_dtype="float32", mesh=mesh)
        positions = jnp.arange(num_tokens, dtype=jnp.int32)[None]
        _, cache, _ = forward_hidden(params, config, tokens, positions, cache, mesh=mesh)
        # one sequence over contiguous pages: its slots are the pool's rows in order
        return [layer.pages["k"].reshape(-1, config.num_kv_heads * config.head_dim)[:num_tokens].mean(0)
                for layer in cache.layers]
    return means


def set_key_centers(params: dict, centers) -> dict:
    """params with each layer's "k_center" set to centers[layer] (any old ones replaced)."""
    if len(centers) != len(params["layers"]):
        raise ValueError(f"{len(centers)} centers for {len(params['layers'])} layers")
    return {**params, "layers": [{**layer, CENTER: c} for layer, c in zip(params["layers"], centers)]}


def with_key_centers(params: dict, config: ModelConfig, token_ids) -> dict:
    """params with each layer's "k_center" from `key_centers` over `token_ids`."""
    return set_key_centers(params, key_centers(params, config, token_ids))


def applies(config: ModelConfig, kv_cache_dtype: str) -> bool:
    """Whether a model with `kv_cache_dtype` pages centers its keys: the model `supports`
    it and the format is one of CENTERED_FORMATS."""
    get_format(kv_cache_dtype)  # ValueError naming the known ones
    return kv_cache_dtype in CENTERED_FORMATS and supports(config)


def model_calibration_ids(tokenizer: Tokenizer, config: ModelConfig) -> list[int]:
    """`calibration_ids` for this model: as many tokens as its context allows, up to
    CALIBRATION_TOKENS; ValueError when the tokenizer's ids do not fit its vocabulary."""
    ids = calibration_ids(tokenizer, min(CALIBRATION_TOKENS, config.max_position_embeddings))
    if max(ids) >= config.vocab_size:
        raise ValueError(f"the tokenizer gives ids up to {max(ids)} for the key centers' calibration text, "
                         f"past the model's vocabulary of {config.vocab_size}: the two do not fit together")
    return ids


def for_kv_cache(params: dict, config: ModelConfig, tokenizer: Tokenizer, kv_cache_dtype: str) -> dict:
    """params as LLM runs them over `kv_cache_dtype` pages: centered on `model_calibration_ids`
    where the format and model call for it (`applies`), else unchanged."""
    if not applies(config, kv_cache_dtype):
        return params
    return with_key_centers(params, config, model_calibration_ids(tokenizer, config))


def without_key_centers(params: dict) -> dict:
    """params without any "k_center" (a model that `supports` centers computes the same
    either way); params of other layouts as they are."""
    if not isinstance(params.get("layers"), (list, tuple)):
        return params
    return {**params, "layers": [{k: v for k, v in layer.items() if k != CENTER} if isinstance(layer, dict)
                                 else layer for layer in params["layers"]]}
