"""DeepSeek-V4.1-Flash (CSA2) configuration: the layer plan, presets and its KV accounting.

The plan (DeepSeek-V4.1-Flash technical report) is four lists: `compress_ratios` (0 = SWA only, 1 or 2 =
compressed), `kv_sources` (Full layers: run the compressor and publish KV rows and index
keys), `index_sources` (Full layers plus Reindex layers, which re-select with their own
indexer) and `candidate_sources` (Full layers that also publish the hierarchical
indexer's candidate blocks). Every other compressed layer is Reuse. From the plan each
layer gets a kind name `csa_<mode>_r<ratio>` (or `csa_swa`), which is what
`model.transformer.LAYER_KINDS` dispatches on: the forward pass never needs a layer index.

Choices not fixed by the released config (documented here, used everywhere):
- The MoE FFN is out of scope: every layer has a dense SwiGLU MLP of `intermediate_size`.
- Index keys are W_ik c_j, a 512 -> 128 projection of the compressor latent c_j (after its
  RMSNorm, before RoPE); the indexer query is W_iq applied to the normalized q latent,
  the indexer weights W_w x * 128^-0.5 * 32^-0.5 (as the index score formula says).
- Window rows are RMSNorm(W_kv x) with the RoPE of the layer (Full layers share W_kv with
  their compressor). YaRN changes the frequencies only: the YaRN attention temperature is
  not applied, because the output's RoPE channels are rotated back and a scaled rotation
  has no exact inverse.
- vocab_size 129280 (DeepSeek-V3's tokenizer) and context 65536 x 16 for the Flash preset.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from model.config import ModelConfig, RopeScaling
from quant import bytes_per_row

SWA = "csa_swa"
MODES = ("full", "candidates", "reuse", "reindex")
RATIOS = (1, 2)
CANDIDATE_BLOCK = 8  # compressed positions per candidate block (pallas_kernels.indexer)

# Storage formats of the three row kinds (quant.bytes_per_row names).
MAIN_KV_FORMAT = "nvfp4"
INDEX_KEY_FORMAT = "mxfp4"
WINDOW_FORMAT = "fp8_ue8m0"
# DeepSeek-V4's FP8 main-KV row, for the FP4 comparison: 448 E4M3 + 64 BF16 RoPE + 7 UE8M0 + 1 pad.
V4_FP8_MAIN_ROW_BYTES = 448 + 64 * 2 + 7 + 1


def kind_name(mode: str, ratio: int) -> str:
    return f"csa_{mode}_r{ratio}"


def layer_plan(compress_ratios, kv_sources, index_sources, candidate_sources) -> tuple[str, ...]:
    """The kind of every layer; raises ValueError on an inconsistent plan."""
    n = len(compress_ratios)
    for name, layers in (("kv_sources", kv_sources), ("index_sources", index_sources),
                         ("candidate_sources", candidate_sources)):
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < n for i in layers):
            raise ValueError(f"{name} must be sorted, distinct layer indices in [0, {n}), got {layers}")
    if any(r not in (0,) + RATIOS for r in compress_ratios):
        raise ValueError(f"compress_ratios must be 0 (SWA only) or one of {RATIOS}, got {compress_ratios}")
    if not set(kv_sources) <= set(index_sources):
        raise ValueError(f"every KV source is an index source: {kv_sources} not within {index_sources}")
    if not set(candidate_sources) <= set(kv_sources):
        raise ValueError(f"candidate_sources {candidate_sources} must be KV sources {kv_sources}")
    kinds, latest_source, latest_candidates = [], {}, {}
    for i, r in enumerate(compress_ratios):
        if r == 0:
            if i in index_sources:
                raise ValueError(f"layer {i} is SWA only (ratio 0) but listed as a KV/index source")
            kinds.append(SWA)
            continue
        if i in kv_sources:
            latest_source[r] = i
            if i in candidate_sources:
                latest_candidates[r] = i
            kinds.append(kind_name("candidates" if i in candidate_sources else "full", r))
            continue
        if r not in latest_source:
            raise ValueError(f"compressed layer {i} (ratio {r}) does not follow a KV source with "
                             f"ratio {r}; KV sources: {kv_sources}")
        if i in index_sources:
            if latest_candidates.get(r, -1) < latest_source[r]:
                raise ValueError(f"Reindex layer {i} (ratio {r}) needs its latest KV source "
                                 f"({latest_source[r]}) to be a candidate source; got {candidate_sources}")
            kinds.append(kind_name("reindex", r))
        else:
            kinds.append(kind_name("reuse", r))
    return tuple(kinds)


def parse_kind(kind: str) -> tuple[str, int]:
    """(mode, ratio) of a kind name; ("swa", 0) for SWA-only layers."""
    if kind == SWA:
        return "swa", 0
    _, mode, ratio = kind.split("_")
    return mode, int(ratio[1:])


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig(ModelConfig):
    """ModelConfig plus the CSA2 plan. num_kv_heads is 1 (K = V single latent of head_dim).

    rope_theta / rope_scaling apply to compressed layers, swa_rope_theta to SWA-only ones;
    RoPE covers the last `rope_dim` channels of q and k. `sliding_window` is the window.
    """

    compress_ratios: tuple[int, ...] = ()
    kv_sources: tuple[int, ...] = ()
    index_sources: tuple[int, ...] = ()
    candidate_sources: tuple[int, ...] = ()
    rope_dim: int = 64
    swa_rope_theta: float = 10000.0
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_heads: int = 32
    index_dim: int = 128
    index_top_k: int = 512
    num_candidate_blocks: int = 2048

    def __post_init__(self):
        super().__post_init__()
        if len(self.compress_ratios) != self.num_layers:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries for "
                             f"{self.num_layers} layers")
        plan = layer_plan(self.compress_ratios, self.kv_sources, self.index_sources,
                          self.candidate_sources)
        if plan != tuple(self.layer_kinds):
            raise ValueError(f"layer_kinds {self.layer_kinds} do not match the plan {plan}; "
                             "build them with layer_plan(...)")
        if self.num_kv_heads != 1:
            raise ValueError(f"CSA2 has one shared K = V head, got num_kv_heads={self.num_kv_heads}")
        if not self.sliding_window or self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {self.sliding_window}")
        if self.head_dim % 32:
            raise ValueError(f"head_dim must be a multiple of 32 (FP8/NVFP4 blocks), got {self.head_dim}")
        if self.index_dim % 32:
            raise ValueError(f"index_dim must be a multiple of 32 (MXFP4 blocks), got {self.index_dim}")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"rope_dim must be even and in (0, head_dim], got {self.rope_dim}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of o_groups {self.o_groups}")
        for field in ("q_lora_rank", "o_lora_rank", "index_heads", "index_top_k", "num_candidate_blocks"):
            if getattr(self, field) <= 0:
                raise ValueError(f"DeepSeekConfig.{field} must be > 0, got {getattr(self, field)}")

    @property
    def window(self) -> int:
        return self.sliding_window

    @property
    def last_kv_source(self) -> int:
        return max(self.kv_sources)

    @property
    def kv_bytes_per_token(self) -> int | float:
        """Global KV bytes per token (NVFP4 rows + MXFP4 index keys of the KV sources)."""
        return _number(sum(main + index for _, _, _, main, index in global_bytes_by_layer(self)))


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def global_bytes_by_layer(config: DeepSeekConfig, reuse: bool = True,
                          main_row_bytes: int | None = None) -> list[tuple[int, str, int, Fraction, Fraction]]:
    """(layer, kind, ratio, main KV B/token, index key B/token) for every layer.

    reuse=False counts what every compressed layer would store without cross-layer reuse;
    main_row_bytes overrides the NVFP4 main row (e.g. V4_FP8_MAIN_ROW_BYTES).
    """
    main_row = main_row_bytes or bytes_per_row(MAIN_KV_FORMAT, config.head_dim)
    index_row = bytes_per_row(INDEX_KEY_FORMAT, config.index_dim)
    rows = []
    for i, (kind, r) in enumerate(zip(config.layer_kinds, config.compress_ratios)):
        stores = r > 0 and (i in config.kv_sources or not reuse)
        main = Fraction(main_row, r) if stores else Fraction(0)
        index = Fraction(index_row, r) if stores else Fraction(0)
        rows.append((i, kind, r, main, index))
    return rows


def window_bytes_per_sequence(config: DeepSeekConfig) -> int:
    """Bytes of window KV one sequence holds (every layer, `window` FP8 rows): not global."""
    return config.num_layers * config.window * bytes_per_row(WINDOW_FORMAT, config.head_dim)


def _build(name: str, *, compress_ratios, kv_sources, index_sources, candidate_sources,
           **fields) -> DeepSeekConfig:
    kinds = layer_plan(compress_ratios, kv_sources, index_sources, candidate_sources)
    return DeepSeekConfig(name=name, layer_kinds=kinds, num_kv_heads=1,
                          compress_ratios=tuple(compress_ratios), kv_sources=tuple(kv_sources),
                          index_sources=tuple(index_sources),
                          candidate_sources=tuple(candidate_sources), **fields)


def _flash() -> DeepSeekConfig:
    return _build(
        "deepseek-v4.1-flash",
        compress_ratios=[0, 0] + [2] * 18 + [1] * 20, kv_sources=(2, 8, 14, 20),
        index_sources=(2, 8, 14, 20, 24, 28, 32, 36), candidate_sources=(20,),
        vocab_size=129280, hidden_size=5120, intermediate_size=2048,  # FFN: dense stand-in
        num_heads=64, head_dim=512, rope_dim=64, max_position_embeddings=65536 * 16,
        rms_norm_eps=1e-6, rope_theta=160000.0, swa_rope_theta=10000.0,
        rope_scaling=RopeScaling("yarn", factor=16.0, original_max_position_embeddings=65536),
        sliding_window=128, q_lora_rank=1280, o_groups=8, o_lora_rank=1024,
        index_heads=32, index_dim=128, index_top_k=512, num_candidate_blocks=2048)


def _tiny() -> DeepSeekConfig:
    # Flash's structure at 8 layers: SWA, SWA, Full r2, Reuse r2, Full r1 + candidates (the
    # last KV source: layers 4-7 are the CED decoder), Reuse r1, Reindex r1, Reuse r1; and a
    # small MoE FFN where Flash's plan here keeps a dense stand-in.
    return _build(
        "deepseek-v4.1-tiny",
        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1], kv_sources=(2, 4),
        index_sources=(2, 4, 6), candidate_sources=(4,),
        vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, head_dim=64,
        rope_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=160000.0,
        swa_rope_theta=10000.0,
        rope_scaling=RopeScaling("yarn", factor=4.0, original_max_position_embeddings=256),
        sliding_window=8, q_lora_rank=32, o_groups=2, o_lora_rank=32, index_heads=4,
        index_dim=32, index_top_k=8, num_candidate_blocks=2,
        # a small mixture of experts on two of the last layers (DeepSeek keeps its first layers
        # dense): 4 routed experts, 2 per token by sigmoid score, and one shared expert
        moe_layers=(5, 7), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_router="sigmoid_topk", norm_topk_prob=True, num_shared_experts=1)


PRESETS = {"deepseek-v4.1-flash": _flash, "deepseek-v4.1-tiny": _tiny}


def preset(name: str) -> DeepSeekConfig:
    """A DeepSeekConfig by preset name (see PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown DeepSeek preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()
