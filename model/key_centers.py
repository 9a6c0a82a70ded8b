"""Key centering and key bases: quantized KV pages store each key minus its layer's mean key;
TurboQuant's store it in a basis fitted to the keys and queries, and TurboQuant's and
nvfp4's put the sink token's key on one channel of theirs.

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

Key bases (BALANCED_FORMATS, TurboQuant's pages). The same identity holds for any invertible
A per KV head: (B q) . (A k) = q . k when B = A^-T. TurboQuant rotates each half of a row at
random, so its error is spread evenly over a half's directions with a size set by that
half's energy; the score error of a half is then about D(b) ||k_half||^2 ||q_half||^2 / (d/2).
`key_bases` takes the basis where keys (about their center) and queries both decorrelate
and have equal variances (a square root of the key covariance, then the eigenvectors of
the queries' second moment in its basis, scaled by their eigenvalues^(1/4)), which minimizes
E||A k||^2 E||B q||^2, and puts its d/2 directions of most variance in the channels
TurboQuant stores at the higher rate (model/kv_formats.py rope_outlier_channels). The
layer stores A (k - c) and attends with B q ("k_basis", "q_basis": [num_kv_heads, d, d],
float32, applied at full precision).

The sink token. Many heads put much of every query's attention on the first token (the
attention sink of "Efficient Streaming Language Models with Attention Sinks", Xiao et al.,
2024; a token, not the learned sink logit some models add, below): on the default model, a
third of it on average over the layers, over half in layers 14, 18, 20 and 23-26 (512 tokens
of the evaluation text). From layer 12 on, that token's key is the same whatever the token,
to about 1% (its hidden state has seen only itself; "Massive Activations in Large Language
Models", Sun et al., 2024). Centered, it is far from the mean (||k_0 - c|| about 16 against
||k_0|| about 5), so TurboQuant coded it with a large error that every query then read. In a
throwaway numpy probe (keys through turboquant-3.5 pages, float values, 512 tokens), the
mean attention-output error over the layers was 0.107 with the bases and 0.072 with the
first key kept exact, as IntactKV (Liu et al., 2024) keeps such pivot tokens. The bases
reach that at no cost: `key_bases` reflects each head's A and B (a Householder reflection,
so still B^T A = I) so that A (k_0 - c) for the calibration text's first key lies on one
channel, and TurboQuant keeps each half's largest channel exact. The probe measured
0.071-0.072 whichever channel took it; the code takes the one where it was largest, the
smallest reflection. nvfp4 pages (the "sink" kind of `basis_kind`) keep the channel basis
(the balanced one measured worse for them) but take the same reflection, scaled so that the
sink's channel is 6 x 2^n (`sink_bases`): E2M1's largest code under a power-of-two block
scale, which the format stores exactly. The probe, with nvfp4 pages: 0.182 centered, 0.116
with the first key exact, 0.132 reflected, 0.119 reflected and scaled.

Measured on the default model with `python -m model.kv_eval`, centers alone -> with bases ->
with the sink token on one channel: turboquant-3.5's perplexity over float32 +0.58 -> +0.80
-> -0.04 at 512 tokens, +0.48 -> +0.39 -> +0.10 at 1,024 and +0.58 -> +0.57 -> +0.29 at
2,048; its mean relative attention-output error 0.141 -> 0.127 -> 0.103 at 512 tokens and
0.137 -> 0.133 -> 0.112 at 2,048; turboquant-2.5's perplexity +4.15 -> +2.97 -> +0.94 at 512
tokens, +3.25 -> +2.17 -> +1.22 at 1,024. Perplexity moves with TurboQuant's rotation seed
about as much as with each step, so take means: over seeds 0-3 at 512 tokens turboquant-3.5
measured +0.58 / +1.56 / +1.18 / +1.31 (mean +1.16) centered, +0.80 / +0.53 / +0.93 / +0.46
(mean +0.68) with bases and -0.04 / +0.53 / +0.39 / +0.59 (mean +0.37) with the sink token,
the attention error lower at every seed and step (0.141-0.146 -> 0.124-0.130 ->
0.102-0.103). The bases' gain (before the sink token) shrank past the 1,024 calibration
tokens (the slow RoPE pairs turn the keys into directions calibration saw little of).
Calibrating over 2,048 tokens instead gave 0.127 at 2,048 tokens but 0.135 at 512 (+0.59
perplexity) in a probe: the basis fits the positions it was taken over, so the calibration
stays at 1,024 tokens. The balanced basis did not help int8 or nvfp4 in a probe (nvfp4 +1.18
against +0.97 at 1,024 tokens), so they keep the channel basis; nvfp4's sink reflection took
it from +1.08 / +0.97 / +1.03 centered to +0.84 / +0.53 / +0.80 at 512 / 1,024 / 2,048 tokens
(attention error 0.127 / 0.125 / 0.138). The keys' principal axes alone (an orthogonal
basis) did worse at 2,048 tokens (+0.74): the slow pairs, which the centered keys rarely use
in calibration, hold much of the queries' energy.

Only where the identity holds: Llama-family attention layers without learned sink logits (a
sink's fixed logit does not move with the scores) and without a score soft-cap (tanh is not
shift-invariant). `supports(config)` says which.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from model.config import ATTENTION, SLIDING_ATTENTION, ModelConfig
from model.kv_formats import get_format, rope_outlier_channels
from model.tokenizer import Tokenizer
from quant.formats import E2M1_MAX

CENTER = "k_center"
CALIBRATION_TOKENS = 1024
# The formats whose pages hold centered keys: those kv_eval measured better with centers at
# 512 and 1,024 tokens (README's table). fp8 showed no clear change; mxfp4's perplexity cost
# fell but it lost two of its three needles, so both store keys as they are.
CENTERED_FORMATS = ("int8", "nvfp4", "turboquant-3.5", "turboquant-2.5")
BASES = ("k_basis", "q_basis")
# The formats whose pages also hold keys in a calibrated basis (module docstring): TurboQuant's
# two rates in the balanced basis, with the sink token's key on one channel (kv_eval measured
# both steps better); nvfp4 in the channel basis with only the sink token's key moved (the
# balanced basis measured worse for it). int8 keeps its channels: its cost was already near zero.
BALANCED_FORMATS = ("turboquant-3.5", "turboquant-2.5")
BASIS_FORMATS = BALANCED_FORMATS + ("nvfp4",)


class Moments(NamedTuple):
    """One layer's calibration statistics (`key_moments`), float32."""
    mean: jax.Array  # [num_kv_heads * head_dim]: the mean post-RoPE key, the layer's center
    key_cov: jax.Array | None  # [num_kv_heads, head_dim, head_dim]: the keys' covariance about it
    query_moment: jax.Array | None  # [num_kv_heads, head_dim, head_dim]: E[q q^T] over each KV head's group
    sink: jax.Array  # [num_kv_heads, head_dim]: the key at position 0 (the sink token's) minus the mean


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
    too; `key_moments`); ValueError when the model does not support centering
    (`supports`) or the ids are no 1-D sequence of the model's token ids.

    mesh: params are laid out over it (model/sharding.py), and so is the pass."""
    return [m.mean for m in key_moments(params, config, token_ids, mesh, covariances=False)]


def key_moments(params: dict, config: ModelConfig, token_ids, mesh=None, covariances: bool = True
                ) -> list[Moments]:
    """Each layer's `Moments` over `token_ids` as `key_centers` takes them, from q and k
    recomputed (`model.layers.project_qkv`) from each layer's input in one forward pass into
    a float32 cache. Over a mesh, what `key_transforms` reads on the host (the sink and the
    d x d moments) comes back replicated, so every process can read it.
    covariances=False leaves out the two d x d moments (None in their place), which only
    the balanced bases need. ValueError as `key_centers`."""
    if not supports(config):
        raise ValueError("key centers need Llama-family attention layers without learned sink logits or "
                         "a score soft-cap (their softmax is not shift-invariant)")
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be a non-empty 1-D sequence of ints, got shape {ids.shape} "
                         f"of {ids.dtype}")
    if ids.size > config.max_position_embeddings or ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(f"token_ids must be at most {config.max_position_embeddings} ids in "
                         f"[0, {config.vocab_size}), got {ids.size} in [{ids.min()}, {ids.max()}]")
    run = _moments(config, ids.size, mesh, bool(covariances))
    return run(without_key_centers(params), jnp.asarray(ids[None], jnp.int32))


@functools.cache
def _moments(config: ModelConfig, num_tokens: int, mesh, covariances: bool):
    from model.layers import project_qkv
    from model.rope import rope_tables
    from model.transformer import forward_hidden, init_cache

    kv, d = config.num_kv_heads, config.head_dim
    group = config.num_heads // kv
    highest = jax.lax.Precision.HIGHEST

    @jax.jit
    def moments(params, tokens):
        cache = init_cache(config, 1, num_tokens, jnp.float32, kv_cache_dtype="float32", mesh=mesh)
        positions = jnp.arange(num_tokens, dtype=jnp.int32)[None]
        _, _, inputs = forward_hidden(params, config, tokens, positions, cache, tuple(range(config.num_layers)),
                                      mesh=mesh)
        out = []
        for kind, layer, x in zip(config.layer_kinds, params["layers"], inputs):
            rope = rope_tables(config, positions, local=kind == SLIDING_ATTENTION)
            q, k, _ = project_qkv(layer, config, x, rope, (layer["attn_norm"], config.rms_norm_eps))
            q, k = q[0].astype(jnp.float32).reshape(num_tokens, kv, group, d), k[0].astype(jnp.float32)
            mean = k.mean(0)
            rest = k - mean
            host = [rest[0]]  # what key_transforms reads on the host: the sink, the d x d moments
            if covariances:
                host.append(jnp.einsum("thd,the->hde", rest, rest, precision=highest) / num_tokens)
                host.append(jnp.einsum("thgd,thge->hde", q, q, precision=highest) / (num_tokens * group))
            if mesh is not None:  # on every process of a multihost mesh
                host = [jax.lax.with_sharding_constraint(m, NamedSharding(mesh, P())) for m in host]
            sink, key_cov, query_moment = host + [None] * (3 - len(host))
            out.append(Moments(mean.reshape(kv * d), key_cov, query_moment, sink))
        return out
    return moments


def key_bases(key_cov: np.ndarray, query_moment: np.ndarray, high: tuple[int, ...], sink=None
              ) -> tuple[np.ndarray, np.ndarray]:
    """The balanced bases of one layer (module docstring): (A, B), float32 [num_kv_heads, d, d]
    with B^T A = I per head, so (B q) . (A k) = q . k. Before the sink's reflection, A's rows
    are directions where keys and queries have equal variance; the d/2 of most variance go to
    the channels `high` (in descending order), the rest to the other channels (ascending
    positions, descending variance). key_cov, query_moment: float [num_kv_heads, d, d], as
    `key_moments` gives.

    sink: [num_kv_heads, d], the sink token's centered key (`Moments.sink`), or None. Given,
    each head's A and B are then reflected (one Householder reflection, so still B^T A = I,
    and keys and queries keep equal second moments) to put A sink on a single channel, the
    one where it was largest: TurboQuant keeps each half's largest channel exact, so the
    sink's key is then stored almost exactly."""
    heads, d, _ = key_cov.shape
    if query_moment.shape != key_cov.shape or len(high) != d // 2 or len(set(high)) != d // 2:
        raise ValueError(f"key_bases: covariances {key_cov.shape} / {query_moment.shape} and {len(high)} "
                         f"distinct high channels do not fit (need d / 2 of them)")
    if sink is not None and np.shape(sink) != (heads, d):
        raise ValueError(f"key_bases: sink of shape {np.shape(sink)}, need {(heads, d)}")
    low = [c for c in range(d) if c not in set(high)]
    a, b = np.zeros((heads, d, d)), np.zeros((heads, d, d))
    for h in range(heads):
        ck, cq = np.asarray(key_cov[h], np.float64), np.asarray(query_moment[h], np.float64)
        # a square root L L^T = C_k, its variances floored at a millionth of their mean (directions
        # keys never took): in L^-1's basis keys are white. Any root gives the same rows below.
        lam, vec = np.linalg.eigh((ck + ck.T) / 2)
        lam = np.maximum(lam, 1e-6 * max(lam.mean(), 0.0) or 1.0)
        root, inverse = vec * np.sqrt(lam), (vec / np.sqrt(lam)).T
        s, u = np.linalg.eigh(root.T @ ((cq + cq.T) / 2) @ root)  # the queries' variances there, their axes
        s = np.maximum(s, 1e-12 * s.max() if s.max() > 0 else 1.0)
        # U^T L^-1 k has variances 1 and U^T L^T q variances s: scale both to s^(1/2)
        rows_a = s[:, None] ** 0.25 * (u.T @ inverse)
        rows_b = s[:, None] ** -0.25 * (u.T @ root.T)
        sign = np.sign(rows_a[np.arange(d), np.abs(rows_a).argmax(1)])  # one per row: its largest entry > 0
        rows_a, rows_b = rows_a * sign[:, None], rows_b * sign[:, None]
        order = np.argsort(-s, kind="stable")
        a[h, list(high)], a[h, low] = rows_a[order[:d // 2]], rows_a[order[d // 2:]]
        b[h, list(high)], b[h, low] = rows_b[order[:d // 2]], rows_b[order[d // 2:]]
        if sink is not None:
            a[h], b[h] = _onto_one_channel(a[h] @ np.asarray(sink[h], np.float64), a[h], b[h])
    return a.astype(np.float32), b.astype(np.float32)


_E4M3_POWERS = (-9, 8)  # the powers of two E4M3 holds: 2^-9 (its least subnormal) to 2^8 (448 is its largest)


def sink_bases(sink, code: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) per head, float32 [num_kv_heads, d, d], from the channel basis: the reflection H
    that puts the sink token's centered key sink [num_kv_heads, d] on one channel
    (`key_bases`; H is symmetric and orthogonal), as A = a H and B = H / a, so B^T A = I.

    code: a format's largest code under power-of-two block scales (nvfp4 pages, tensor scale
    1: 6, E2M1's, under a block scale 2^n, which E4M3 holds exactly for n in [-9, 8]). Then
    a (in [2^-1/2, 2^1/2] but for n clipped to that range) makes the sink's channel code x
    2^n, which the format stores exactly: the calibration text's sink, and a served first
    token's whose key is within about -3% / +6% of it (its block scale rounds to the same
    2^n); else a = 1."""
    sink = np.asarray(sink, np.float64)
    if sink.ndim != 2:
        raise ValueError(f"sink_bases: sink must be [num_kv_heads, head_dim], got shape {sink.shape}")
    eye = np.eye(sink.shape[-1])
    a, b = [], []
    for row in sink:
        h, _ = _onto_one_channel(row, eye, eye)
        norm = np.linalg.norm(row)
        power = np.clip(np.round(np.log2(norm / code)), *_E4M3_POWERS) if code and norm > 0 else None
        scale = 1.0 if power is None else code * 2.0 ** power / norm
        a.append(scale * h)
        b.append(h / scale)
    return np.stack(a).astype(np.float32), np.stack(b).astype(np.float32)


def basis_kind(kv_cache_dtype: str) -> str | None:
    """The key basis `key_transforms` gives pages of this format: "balanced" (`key_bases`),
    "sink" (`sink_bases`) or None (the channel basis)."""
    get_format(kv_cache_dtype)  # ValueError naming the known ones
    return ("balanced" if kv_cache_dtype in BALANCED_FORMATS else "sink" if kv_cache_dtype in BASIS_FORMATS
            else None)


def _onto_one_channel(u: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(H a, H b) for the reflection H = I - 2 w w^T (orthogonal: (H b)^T H a = b^T a) that
    maps the direction of u onto the channel of u's largest entry, sign kept."""
    norm = np.linalg.norm(u)
    if norm == 0:
        return a, b
    x = u / norm
    j = int(np.abs(x).argmax())
    w = x.copy()
    w[j] -= 1.0 if x[j] >= 0 else -1.0
    if np.linalg.norm(w) < 1e-12:  # already on one channel
        return a, b
    w /= np.linalg.norm(w)
    return a - 2 * np.outer(w, w @ a), b - 2 * np.outer(w, w @ b)


def key_transforms(params: dict, config: ModelConfig, token_ids, kv_cache_dtype: str, mesh=None,
                   model_kv_heads: int | None = None):
    """(centers, bases) for `kv_cache_dtype` pages over `token_ids`: each layer's center
    (`key_centers`) and, for BASIS_FORMATS, its (k_basis, q_basis) (`basis_kind`:
    `key_bases` with the channels TurboQuant stores at its higher rate, or `sink_bases`),
    else None.

    model_kv_heads: the model's own KV heads when `config` has them repeated for tensor
    parallelism (model/sharding.py): each repeat then serves part of its head's queries, so
    their statistics are pooled and the bases repeated, as the model's own would be."""
    kind = basis_kind(kv_cache_dtype)
    heads = config.num_kv_heads if model_kv_heads is None else model_kv_heads
    if (isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads < 1
            or config.num_kv_heads % heads):
        raise ValueError(f"model_kv_heads must be a positive int dividing the {config.num_kv_heads} KV heads, "
                         f"got {model_kv_heads!r}")
    moments = key_moments(params, config, token_ids, mesh, covariances=kind == "balanced")
    centers = [m.mean for m in moments]
    if kind is None:
        return centers, None
    repeat, d = config.num_kv_heads // heads, config.head_dim

    def pooled(moment):
        moment = np.asarray(moment, np.float64)
        return moment.reshape(heads, repeat, *moment.shape[1:]).mean(1)
    high = rope_outlier_channels(d)
    bases = []
    for m in moments:
        sink = pooled(m.sink)
        bases.append(key_bases(pooled(m.key_cov), pooled(m.query_moment), high, sink=sink) if kind == "balanced"
                     else sink_bases(sink, code=E2M1_MAX))  # nvfp4, the one format of this kind
    return centers, [tuple(np.repeat(m, repeat, axis=0) for m in pair) for pair in bases]


def set_key_centers(params: dict, centers, bases=None) -> dict:
    """params with each layer's "k_center" set to centers[layer] and, given bases, its
    "k_basis", "q_basis" to bases[layer] (any old ones replaced, removed without bases)."""
    if len(centers) != len(params["layers"]):
        raise ValueError(f"{len(centers)} centers for {len(params['layers'])} layers")
    if bases is not None and len(bases) != len(centers):
        raise ValueError(f"{len(bases)} bases for {len(centers)} layers")
    layers = without_key_centers(params)["layers"]
    extra = [{} for _ in layers] if bases is None else [dict(zip(BASES, map(jnp.asarray, pair))) for pair in bases]
    return {**params, "layers": [{**layer, CENTER: c, **more} for layer, c, more in zip(layers, centers, extra)]}


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
    where the format and model call for it (`applies`), and in key bases for BASIS_FORMATS
    (`key_transforms`), else unchanged."""
    if not applies(config, kv_cache_dtype):
        return params
    return set_key_centers(params, *key_transforms(params, config, model_calibration_ids(tokenizer, config),
                                                   kv_cache_dtype))


def without_key_centers(params: dict) -> dict:
    """params without any "k_center", "k_basis" or "q_basis" (a model that `supports`
    them computes the same either way); params of other layouts as they are."""
    if not isinstance(params.get("layers"), (list, tuple)):
        return params
    return {**params, "layers": [{k: v for k, v in layer.items() if k not in (CENTER, *BASES)}
                                 if isinstance(layer, dict) else layer for layer in params["layers"]]}
