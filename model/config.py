"""Model configuration: a frozen dataclass with an explicit per-layer plan.

`layer_kinds` names what each layer is. The forward pass looks each kind up in
`model.transformer.LAYER_KINDS`, so a new kind (compressed, sparse, cross-layer
reuse attention) is a new entry there, not a rewrite of the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Layer kinds the Llama/Qwen2/Qwen3/Mistral family uses.
ATTENTION = "attention"  # full causal self-attention
SLIDING_ATTENTION = "sliding_attention"  # causal, keys within `sliding_window`

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# MLP activations: "silu" (Llama's SwiGLU), "gelu_tanh" (Gemma's GeGLU, GELU's tanh form),
# "swiglu_oai" (gpt-oss's clamped SwiGLU, model.layers.gated).
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
MOE_ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_topk")  # model/moe.py


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's `rope_scaling` describes it.

    `rope_type`: "default" (none), "linear" (positions / factor), "llama3"
    (Llama 3.1 band-wise), or "yarn" (NTK-by-parts plus attention temperature).
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None -> from factor (and mscale)
    mscale: float | None = None  # yarn (DeepSeek style): attention factor numerator
    mscale_all_dim: float | None = None  # yarn: attention factor denominator
    truncate: bool = True  # yarn: floor/ceil the correction range (HF default)

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {ROPE_TYPES}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer of the Llama family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_kinds: tuple[str, ...]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head over head_dim before RoPE (Qwen3)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # for SLIDING_ATTENTION layers
    rope_local_theta: float | None = None  # RoPE base of SLIDING_ATTENTION layers, unscaled (Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation, one of ACTIVATIONS
    embedding_multiplier: float = 1.0  # token embeddings are scaled by it (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    sandwich_norm: bool = False  # RMSNorm the attention and MLP outputs too, before the residual add (Gemma)
    attn_logit_softcap: float | None = None  # attention scores become cap * tanh(s / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # so do the output logits (Gemma 2)
    attention_out_bias: bool = False  # the output projection carries a bias too (gpt-oss)
    attention_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss)
    swiglu_limit: float | None = None  # the clamp of hidden_act "swiglu_oai"
    # Mixture of experts (model/moe.py): the MLPs of layers `moe_layers` route each token to
    # num_experts_per_tok of num_experts experts of width moe_intermediate_size.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # None: intermediate_size
    moe_router: str = "softmax_topk"  # one of MOE_ROUTERS
    norm_topk_prob: bool = False  # softmax_topk / sigmoid_topk: renormalise the k kept weights to sum to one
    moe_bias: bool = False  # router and expert projections carry biases (gpt-oss)
    num_shared_experts: int = 0  # experts every token also runs, one gated MLP of that many widths (DeepSeek)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "llama"

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be > 0, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.layer_kinds:
            raise ValueError("layer_kinds must name at least one layer")
        if SLIDING_ATTENTION in self.layer_kinds and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window > 0")
        for cap in ("attn_logit_softcap", "final_logit_softcap"):
            if getattr(self, cap) is not None and getattr(self, cap) <= 0:
                raise ValueError(f"ModelConfig.{cap} must be > 0 or None, got {getattr(self, cap)}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {ACTIVATIONS}")
        if (self.hidden_act == "swiglu_oai") != (self.swiglu_limit is not None and self.swiglu_limit > 0):
            raise ValueError("hidden_act 'swiglu_oai' needs swiglu_limit > 0 (and only it takes one)")
        if self.moe_layers:
            if any(not 0 <= i < self.num_layers for i in self.moe_layers):
                raise ValueError(f"moe_layers {self.moe_layers} must be layer indices in [0, {self.num_layers})")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"MoE needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= "
                                 f"num_experts ({self.num_experts})")
            if self.moe_router not in MOE_ROUTERS:
                raise ValueError(f"unknown moe_router {self.moe_router!r}; known: {MOE_ROUTERS}")
            if self.num_shared_experts < 0:
                raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")

    @property
    def sm_scale(self) -> float:
        """The attention softmax scale."""
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token at 2 bytes per element (bf16), all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 2


def rope_scaling_from_hf(rope_scaling: dict[str, Any] | None) -> RopeScaling:
    """Translate Hugging Face's `rope_scaling` / `rope_parameters` dict (or None)."""
    if not rope_scaling:
        return RopeScaling()
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    kwargs: dict[str, Any] = {"rope_type": rope_type, "factor": float(rope_scaling.get("factor") or 1.0)}
    for key in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                "truncate"):
        if rope_scaling.get(key) is not None:
            kwargs[key] = rope_scaling[key]
    return RopeScaling(**kwargs)


# Hugging Face architectures this model implements, and how each differs.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
}
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Gemma's sliding_window_pattern: every n-th layer global, the others sliding
GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_THETA = 10_000.0  # RoPE base of Gemma 3's sliding layers unless the config gives one


HF_REQUIRED = ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` dict."""
    archs = hf.get("architectures") or []
    supported = [a for a in archs if a in HF_ARCHITECTURES]
    if not supported:
        raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}; "
                         f"supported: {sorted(HF_ARCHITECTURES)}")
    family = HF_ARCHITECTURES[supported[0]]
    for key in HF_REQUIRED:
        value = hf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config.json: {key} must be a positive int, got {value!r}")
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    num_layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen2/3 only slide when use_sliding_window is set, and then only on the
        # layers from max_window_layers on.
        if hf.get("use_sliding_window") and window:
            first = hf.get("max_window_layers", num_layers)
            kinds = tuple(ATTENTION if i < first else SLIDING_ATTENTION for i in range(num_layers))
        else:
            kinds, window = (ATTENTION,) * num_layers, None
    elif family == "mistral" and window:
        kinds = (SLIDING_ATTENTION,) * num_layers
    elif family in GEMMA_SLIDING_PATTERN:
        kinds = _layer_types(hf, num_layers, GEMMA_SLIDING_PATTERN[family])
    elif family == "gpt_oss":  # alternating sliding / full unless layer_types says otherwise
        kinds = _layer_types(hf, num_layers, 2)
    else:
        kinds, window = (ATTENTION,) * num_layers, None
    # transformers >= 5 writes `rope_parameters` (theta inside) instead of rope_theta/rope_scaling.
    rope = hf.get("rope_parameters") or {}
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    extra = _gemma_from_hf(hf, hidden, family) if family in GEMMA_SLIDING_PATTERN else \
        _moe_from_hf(hf, num_layers, family) if family in ("qwen3_moe", "gpt_oss") else {}
    if family == "gemma3":  # rope_parameters per layer type; the global layers' here
        rope = rope.get("full_attention") or {"rope_theta": hf.get("rope_theta", 1_000_000.0),
                                              **(hf.get("rope_scaling") or {})}
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        # Qwen3's and Gemma's config classes default head_dim to a constant, not hidden / heads
        head_dim=hf.get("head_dim") or {"qwen3": 128, "gemma2": 256, "gemma3": 256, "gpt_oss": 64}.get(
            family, hidden // num_heads),
        layer_kinds=kinds,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling_from_hf(hf.get("rope_scaling") or rope),
        attention_bias=family == "qwen2" or bool(hf.get("attention_bias", family == "gpt_oss")),
        # the output projection shares q/k/v's bias setting, except in Qwen2 (q/k/v only)
        attention_out_bias=family != "qwen2" and bool(hf.get("attention_bias", family == "gpt_oss")),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family in GEMMA_SLIDING_PATTERN)),
        sliding_window=window,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        name=family,
        **extra,
    )


def _moe_from_hf(hf: dict[str, Any], num_layers: int, family: str) -> dict[str, Any]:
    """Qwen3-MoE: softmax over all experts, top k (renormalised when norm_topk_prob), SwiGLU
    experts on the layers decoder_sparse_step / mlp_only_layers pick. gpt-oss: every layer,
    softmax over the top k logits, clamped SwiGLU experts with biases, attention sinks."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    k = hf.get("num_experts_per_tok")
    if not isinstance(experts, int) or not isinstance(k, int) or not 0 < k <= experts:
        raise ValueError(f"config.json: a MoE needs 0 < num_experts_per_tok ({k!r}) <= num_experts ({experts!r})")
    if family == "gpt_oss":
        return dict(moe_layers=tuple(range(num_layers)), num_experts=experts, num_experts_per_tok=k,
                    moe_router="topk_softmax", moe_bias=True, hidden_act="swiglu_oai",
                    swiglu_limit=float(hf.get("swiglu_limit", 7.0)), attention_sinks=True)
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    return dict(moe_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
                num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=hf.get("moe_intermediate_size"),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _layer_types(hf: dict[str, Any], num_layers: int, pattern: int) -> tuple[str, ...]:
    """Layer kinds from `layer_types`, or else every `sliding_window_pattern`-th (default
    `pattern`) layer global and the others sliding (Gemma 2 / 3, gpt-oss)."""
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("sliding_window_pattern", pattern) == 0
        else "sliding_attention" for i in range(num_layers)]
    kinds = {"full_attention": ATTENTION, "sliding_attention": SLIDING_ATTENTION}
    if len(types) != num_layers or any(t not in kinds for t in types):
        raise ValueError(f"config.json: layer_types must name {num_layers} layers from {sorted(kinds)}, "
                         f"got {types!r}")
    return tuple(kinds[t] for t in types)


def _gemma_from_hf(hf: dict[str, Any], hidden: int, family: str) -> dict[str, Any]:
    """What Gemma 2 / 3 change in the Llama layer: GeGLU, scaled embeddings, norms around both
    sublayers, a softmax scale from query_pre_attn_scalar; Gemma 2 soft-caps attention scores
    and logits, Gemma 3 rotates its sliding layers with their own RoPE base."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention (an encoder) is not supported")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"config.json: unsupported hidden_activation {act!r}; supported: "
                         f"{sorted(_HF_ACTIVATIONS)}")
    extra = dict(hidden_act=_HF_ACTIVATIONS[act], embedding_multiplier=hidden ** 0.5, sandwich_norm=True,
                 attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5)
    if family == "gemma2":
        return dict(extra, attn_logit_softcap=hf.get("attn_logit_softcapping", 50.0),
                    final_logit_softcap=hf.get("final_logit_softcapping", 30.0))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"config.json: {key} (soft-capping) is not part of Gemma 3")
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: scaled RoPE on sliding layers ({local['rope_type']}) is not supported")
    theta = local.get("rope_theta", hf.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
    return dict(extra, rope_local_theta=float(theta))
