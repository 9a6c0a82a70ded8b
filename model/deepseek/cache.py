"""Per-layer cache of the CSA2 kinds: packed global rows plus a per-layer FP8 window ring.

One pytree per layer, {"global": ..., "local": ...}:

    global (KV sources only; what the persistent / prefix-cache tier keeps):
      "kv":         NVFP4 rows   {"packed": uint8 [B, R, D/2], "scales": E4M3 bits uint8 [B, R, D/16]}
      "index_keys": MXFP4 rows   {"packed": uint8 [B, R, Di/2], "scales": uint8 [B, R, Di/32]}
    local (every layer; rebuilt by bounded replay, never persisted):
      "window":     FP8 ring     {"values": E4M3 bits uint8 [B, W, D], "scales": uint8 [B, W, D/32]}
      "window_end": int32 [B], one past the newest position in the ring (0 = empty)
      "compressor": ratio-2 KV sources only, the pending token of an incomplete group:
                    {"v": f32 [B, D], "gate": f32 [B, D]}

R = capacity // ratio compressed rows; capacity = num_pages * page_size / batch_size
(the positions one sequence can hold). Row j of a ratio-r layer covers positions
[j r, (j + 1) r). Ring slot s holds position q with q % W == s. NVFP4 rows use a fixed
tensor scale of 1 (rows are written one at a time; no tensor amax exists), which
leaves |x| <= 2688 representable; the rows are RMS-normalized, so far inside that.

The E4M3 leaves hold the uint8 bits of their float8_e4m3fn values, like the engine's fp8
and NVFP4 KV pools (pallas_kernels/paged_attention/kv_formats.py): XLA:CPU computes a
float8 scatter in a wider float over the whole leaf, so every write into the pool would
convert and copy each such leaf whole. quant's E4M3 decoders read the bits directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.deepseek.config import DeepSeekConfig, parse_kind
from model.kv_cache import CacheLayout
from pallas_kernels.paged_attention.kv_formats import to_bits
from quant import (
    MXFP4,
    NVFP4,
    FP8Block,
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)

_UNIT = 1.0  # NVFP4 tensor scale of KV rows


def capacity(layout: CacheLayout) -> int:
    if (layout.num_pages * layout.page_size) % layout.batch_size:
        raise ValueError(f"CSA2 caches give each sequence num_pages * page_size / batch_size positions; "
                         f"{layout.num_pages} * {layout.page_size} is not divisible by {layout.batch_size}")
    return layout.num_pages * layout.page_size // layout.batch_size


def init_layer_cache(kind: str, config: DeepSeekConfig, layout: CacheLayout, dtype) -> dict:
    """An empty cache for one layer of `kind` (dtype: unused, every leaf has a fixed format)."""
    del dtype
    if getattr(layout, "kv_cache_dtype", "auto") != "auto":
        raise ValueError(f"CSA2 layers store fixed formats (NVFP4 / MXFP4 / FP8 window); "
                         f"kv_cache_dtype must be 'auto', got {layout.kv_cache_dtype!r}")
    mode, ratio = parse_kind(kind)
    b, d, w = layout.batch_size, config.head_dim, config.window
    local = {"window": {"values": jnp.zeros((b, w, d), jnp.uint8),
                        "scales": jnp.zeros((b, w, d // 32), jnp.uint8)},
             "window_end": jnp.zeros((b,), jnp.int32)}
    cache = {"global": {}, "local": local}
    if mode in ("full", "candidates"):
        rows, di = capacity(layout) // ratio, config.index_dim
        cache["global"] = {
            "kv": {"packed": jnp.zeros((b, rows, d // 2), jnp.uint8),
                   "scales": jnp.zeros((b, rows, d // 16), jnp.uint8)},
            "index_keys": {"packed": jnp.zeros((b, rows, di // 2), jnp.uint8),
                           "scales": jnp.zeros((b, rows, di // 32), jnp.uint8)}}
        if ratio == 2:
            local["compressor"] = {"v": jnp.zeros((b, d), jnp.float32),
                                   "gate": jnp.zeros((b, d), jnp.float32)}
    return cache


# Each format: quantize to the stored dict, dequantize from it. The forward uses the
# dequantized value of what it stores (prefill and decode see the same numbers), with a
# straight-through gradient so training still reaches the weights that produced it.

def encode_kv(x):
    q = nvfp4_quantize(x, _UNIT)
    return {"packed": q.packed, "scales": to_bits(q.scales)}


def decode_kv(s, dtype):
    return nvfp4_dequantize(NVFP4(s["packed"], s["scales"], jnp.float32(_UNIT)), dtype)


def encode_index_key(x):
    q = mxfp4_quantize(x)
    return {"packed": q.packed, "scales": q.scales}


def decode_index_key(s, dtype):
    return mxfp4_dequantize(MXFP4(s["packed"], s["scales"]), dtype)


def encode_window(x):
    q = fp8_block_quantize(x)
    return {"values": to_bits(q.values), "scales": q.scales}


def decode_window(s, dtype):
    return fp8_block_dequantize(FP8Block(s["values"], s["scales"]), dtype)


def fake_quant(x, encode, decode):
    """(value as stored, stored dict): x + stop_gradient(decode(encode(x)) - x)."""
    stored = encode(jax.lax.stop_gradient(x))
    return x + jax.lax.stop_gradient(decode(stored, x.dtype) - x), stored


def scatter_batch_rows(table, rows, index):
    """table [B, N, ...] with rows [B, T, ...] set at index int32 [B, T]; index >= N drops."""
    b = jnp.arange(table.shape[0])[:, None]
    return table.at[b, index].set(rows.astype(table.dtype), mode="drop")


def scatter_stored(stored_table: dict, stored_rows: dict, index) -> dict:
    return {k: scatter_batch_rows(stored_table[k], stored_rows[k], index) for k in stored_table}
