"""The EAGLE-3 draft model: what it computes at inference, and how it is stored.

The draft predicts the target's next tokens from the target's own features: the
residual stream entering three target layers (low / mid / high), concatenated and
fused by a bias-free linear 3H -> H. One decoder layer reads
[RMSNorm(token embedding) ; RMSNorm(hidden)] (2H) into q/k/v; its residual is the
un-normalised hidden; then the post-attention norm and the MLP. A final norm and an
LM head over a reduced draft vocabulary give the logits; the pre-norm output is the
hidden the next draft step consumes in place of the fused features.

    params = {"embed": [V, H] (the target's, frozen), "fc": [3H, H],
              "layer": {"input_norm", "hidden_norm": [H], "wq": [2H, Hq*D], "wk", "wv":
                        [2H, Hkv*D], "wo": [Hq*D, H], "mlp_norm": [H], "w_gate", "w_up",
                        "w_down"},
              "final_norm": [H], "lm_head": [H, Vd],
              "d2t": int32 [Vd] (target id = draft id + d2t[draft id]),
              "t2d": bool [V] (target id is in the draft vocabulary)}

A draft directory holds `config.json` and `model.safetensors`; `load_draft(dir)`
reads it back. Training (training/) imports this module; serving calls `draft_apply`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from model import layers
from model.config import ATTENTION, ModelConfig, RopeScaling
from model.context import RaggedLayout, TokenTree
from model.kv_cache import KVCache
from model.layers import attention_block, mlp, rms_norm
from model.rope import rope_tables
from model.transformer import forward_context, head_weight, init_cache, packed_context
from quant.packed import PackedWeight
from quant import linear

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FROZEN = ("embed", "d2t", "t2d")  # copied from the target / the data, never trained


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Target layers whose incoming residual stream EAGLE-3 fuses: 2, L/2, L-3."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 needs a target with at least 4 layers, got {num_layers}")
    return 2, num_layers // 2, num_layers - 3


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """A draft for one target. `target` is the target's architecture: the draft layer
    uses its hidden size, heads, MLP width, norm epsilon and RoPE."""

    target: ModelConfig
    draft_vocab_size: int
    target_layer_ids: tuple[int, ...]
    target_source: str = ""

    def __post_init__(self):
        if not 0 < self.draft_vocab_size <= self.target.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.target.vocab_size}], "
                             f"got {self.draft_vocab_size}")
        if len(self.target_layer_ids) != 3 or any(
                not 0 <= i < self.target.num_layers for i in self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be 3 layers of [0, {self.target.num_layers}), "
                             f"got {self.target_layer_ids}")

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def layer_config(self) -> ModelConfig:
        """The draft's one decoder layer as a ModelConfig (for its KV cache)."""
        return dataclasses.replace(self.target, layer_kinds=(ATTENTION,), sliding_window=None)

    def to_json(self) -> dict:
        target = dataclasses.asdict(self.target)
        target["layer_kinds"] = list(self.target.layer_kinds)
        target["moe_layers"] = list(self.target.moe_layers)
        return {"method": "eagle3", "draft_vocab_size": self.draft_vocab_size,
                "target_layer_ids": list(self.target_layer_ids), "hidden_size": self.hidden_size,
                "target": self.target_source, "target_config": target}

    @classmethod
    def from_json(cls, d: dict) -> "Eagle3Config":
        if d.get("method") != "eagle3":
            raise ValueError(f"not an EAGLE-3 draft config (method={d.get('method')!r})")
        t = dict(d["target_config"])
        t["layer_kinds"] = tuple(t["layer_kinds"])
        t["moe_layers"] = tuple(t.get("moe_layers", ()))
        t["rope_scaling"] = RopeScaling(**t["rope_scaling"])
        return cls(ModelConfig(**t), int(d["draft_vocab_size"]), tuple(d["target_layer_ids"]),
                   d.get("target", ""))


def vocab_maps(draft_ids: np.ndarray, target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int32 [Vd], t2d bool [V]) for the target ids in the draft vocabulary."""
    ids = np.sort(np.asarray(draft_ids, np.int64))
    if len(np.unique(ids)) != len(ids) or ids[0] < 0 or ids[-1] >= target_vocab_size:
        raise ValueError(f"draft ids must be distinct target ids in [0, {target_vocab_size})")
    t2d = np.zeros(target_vocab_size, bool)
    t2d[ids] = True
    return (ids - np.arange(len(ids))).astype(np.int32), t2d


def draft_to_target(params: dict, draft_ids: jnp.ndarray) -> jnp.ndarray:
    """Target token ids of draft-vocabulary ids (any shape)."""
    return draft_ids + params["d2t"][draft_ids]


def _dense(w):
    """A float array of a target weight that may be packed (the draft trains float copies)."""
    return w.dequantize() if isinstance(w, PackedWeight) else w


def init_draft_params(config: Eagle3Config, target_params: dict, draft_ids: np.ndarray,
                      key: jax.Array, dtype=jnp.float32) -> dict:
    """Random draft layer and fc (normal, std 0.02; norms at 1); embedding copied from the
    target. The LM head starts as the target's head restricted to the draft vocabulary
    and the final norm as the target's: the draft then only has to learn to produce the
    target's last hidden state, which is what makes a short CPU training useful."""
    t = config.target
    h, hd, inter = t.hidden_size, t.head_dim, t.intermediate_size
    d2t, t2d = vocab_maps(draft_ids, t.vocab_size)
    shapes = {"wq": (2 * h, t.num_heads * hd), "wk": (2 * h, t.num_kv_heads * hd),
              "wv": (2 * h, t.num_kv_heads * hd), "wo": (t.num_heads * hd, h),
              "w_gate": (h, inter), "w_up": (h, inter), "w_down": (inter, h)}
    keys = jax.random.split(key, len(shapes) + 1)
    layer = {name: (0.02 * jax.random.normal(k, shape)).astype(dtype)
             for k, (name, shape) in zip(keys, shapes.items())}
    for name in ("input_norm", "hidden_norm", "mlp_norm"):
        layer[name] = jnp.ones((h,), dtype)
    target_ids = jnp.asarray(np.sort(draft_ids))
    head = _dense(head_weight(target_params, t))  # [H, V]; a packed target is dequantized here
    return {
        "embed": jnp.asarray(head.T if t.tie_word_embeddings else _dense(target_params["embed"]), dtype),
        "fc": (0.02 * jax.random.normal(keys[-1], (3 * h, h))).astype(dtype),
        "layer": layer,
        "final_norm": jnp.array(target_params["final_norm"], dtype),  # a copy: trained, donated
        "lm_head": jnp.asarray(head[:, target_ids], dtype),
        "d2t": jnp.asarray(d2t),
        "t2d": jnp.asarray(t2d),
    }


# --- the computation, shared by inference (below) and training-time test (training/) ---

def fuse_features(params: dict, features: jnp.ndarray) -> jnp.ndarray:
    """fc: the target's captured residuals [..., 3H] (low ; mid ; high) -> [..., H]."""
    return linear(features, params["fc"])


def layer_input(params: dict, config: Eagle3Config, hidden: jnp.ndarray,
                tokens: jnp.ndarray) -> jnp.ndarray:
    """[RMSNorm(embed(tokens)) ; RMSNorm(hidden)]: [B, T, 2H], the input to q/k/v."""
    eps, layer = config.target.rms_norm_eps, params["layer"]
    embeds = params["embed"][tokens].astype(hidden.dtype) * config.target.embedding_multiplier
    return jnp.concatenate([rms_norm(embeds, layer["input_norm"], eps),
                            rms_norm(hidden, layer["hidden_norm"], eps)], axis=-1)


def project_qkv(params: dict, config: Eagle3Config, x: jnp.ndarray, positions: jnp.ndarray):
    """Rotated q [B, T, Hq, D], k and v [B, T, Hkv, D] from the layer input x [B, T, 2H]: the
    target's projection (model.layers.project_qkv) on the draft layer's weights, which have
    no biases or q/k norms."""
    return layers.project_qkv(params["layer"], config.target, x, rope_tables(config.target, positions))


def layer_output(params: dict, config: Eagle3Config, hidden: jnp.ndarray,
                 attn: jnp.ndarray) -> jnp.ndarray:
    """Residual (the un-normalised hidden) + attention output [B, T, H], then the MLP."""
    layer = params["layer"]
    x = hidden + attn
    return x + mlp(layer, rms_norm(x, layer["mlp_norm"], config.target.rms_norm_eps))


def draft_logits(params: dict, config: Eagle3Config, hidden: jnp.ndarray) -> jnp.ndarray:
    """Logits over the draft vocabulary [..., Vd] (float32) from pre-norm hidden [..., H]."""
    h = rms_norm(hidden, params["final_norm"], config.target.rms_norm_eps)
    return (h @ params["lm_head"]).astype(jnp.float32)


def init_draft_cache(config: Eagle3Config, batch_size: int, max_len: int, dtype=jnp.float32,
                     page_size: int | None = None) -> KVCache:
    """An empty one-layer KV cache for the draft (page_size None: the model's default)."""
    return init_cache(config.layer_config, batch_size, max_len, dtype, page_size)


def draft_apply(params: dict, config: Eagle3Config, hidden: jnp.ndarray, tokens: jnp.ndarray,
                positions: jnp.ndarray, cache: KVCache, tree: TokenTree | None = None,
                layout: RaggedLayout | None = None) -> tuple[jnp.ndarray, jnp.ndarray, KVCache]:
    """`draft_forward` unjitted, for callers that fuse it into a larger step (serving).

    tree: the rows are draft-tree nodes (model/context.py TokenTree): `positions` are their
    KV slots and the tree gives their RoPE positions and which nodes each one sees.
    layout: the tokens are packed as a serving step packs them (hidden [N, H], tokens and
    positions [N]; model/context.py RaggedLayout, as `model.forward_packed` reads it).
    """
    x = layer_input(params, config, hidden, tokens)
    if layout is None:
        ctx = forward_context(config.target, positions, cache, tree)
    else:
        ctx, x = packed_context(config.target, positions, cache, layout), x[None]
    attn, layer_cache = attention_block(params["layer"], config.target, x, cache.layers[0], ctx, None)
    out = layer_output(params, config, hidden, attn if layout is None else attn[0])
    return (draft_logits(params, config, out), out,
            KVCache([layer_cache], cache.block_tables, cache.page_size))


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def draft_forward(params: dict, config: Eagle3Config, hidden: jnp.ndarray, tokens: jnp.ndarray,
                  positions: jnp.ndarray, cache: KVCache
                  ) -> tuple[jnp.ndarray, jnp.ndarray, KVCache]:
    """One draft pass over a chunk, writing its K/V into the draft cache.

    hidden: [B, T, H], `fuse_features` of the target's features at positions t, or the
    previous draft step's returned hidden; tokens: int32 [B, T], the token at t + 1 (the
    one the target sampled / the draft proposed after position t); positions: int32
    [B, T], negative for padding; cache: from `init_draft_cache` (donated).
    Returns (logits over the draft vocabulary [B, T, Vd] float32, predicting the token
    at t + 2; the draft hidden [B, T, H] for the next step; the cache).
    """
    return draft_apply(params, config, hidden, tokens, positions, cache)


# --- storage ---

def _flatten(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    flat = {}
    for name, value in params.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[prefix + name] = np.asarray(value)
    return flat


def save_draft(directory: str, config: Eagle3Config, params: dict) -> None:
    """Write `config.json` and `model.safetensors` into `directory`."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    save_file(_flatten(params), os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config.to_json(), f, indent=2)


def load_draft(directory: str, dtype=jnp.float32) -> tuple[Eagle3Config, dict]:
    """(draft_config, draft_params) from a directory written by `save_draft`."""
    from safetensors.numpy import load_file

    paths = [os.path.join(directory, name) for name in (CONFIG_FILE, WEIGHTS_FILE)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"{directory!r} is not an EAGLE-3 draft directory: missing {missing}")
    with open(paths[0]) as f:
        config = Eagle3Config.from_json(json.load(f))
    params: dict = {}
    for name, value in load_file(paths[1]).items():
        *path, leaf = name.split(".")
        node = params
        for p in path:
            node = node.setdefault(p, {})
        floating = np.issubdtype(value.dtype, np.floating)
        node[leaf] = jnp.asarray(value, dtype if floating else value.dtype)
    if params["lm_head"].shape[1] != config.draft_vocab_size:
        raise ValueError(f"lm_head has {params['lm_head'].shape[1]} columns, config says "
                         f"draft_vocab_size={config.draft_vocab_size}")
    return config, params
