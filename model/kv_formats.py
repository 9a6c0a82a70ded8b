"""KV cache formats (`kv_cache_dtype`): how an attention layer's pages are stored, written, read.

Every format stores K and V of each (token, kv head) row of head_dim d in page pools with
the leading axes [num_pages, page_size] of model/kv_cache.py. Bytes per row, K and V each
(the last column for d = 64):

| kv_cache_dtype       | stored per row                                                 | d=64 |
|----------------------|----------------------------------------------------------------|------|
| auto                 | the cache's `dtype` (float32 by default)                      | 256  |
| float32, bfloat16    | d values                                                       | 256, 128 |
| fp8, int8            | d E4M3 / int8 codes + f32 absmax scale per row (quant.kv_rows) | 68   |
| nvfp4                | d/2 packed E2M1 + d/16 E4M3 block scales; tensor scale fixed 1 | 36   |
| mxfp4                | d/2 packed E2M1 + d/32 UE8M0 block scales (OCP MX)             | 34   |
| kivi-int4, kivi-int2 | d*b/8 packed codes + f16 scale and min per group of 32         | 40, 24 |
| turboquant-3.5, -2.5 | d*b/8 packed Lloyd-Max indices (MSE mode) + per channel half: | 42, 34 |
|                      | f32 scale, one sparse channel (uint8 index, bf16 value)        |      |

Float, fp8, int8, nvfp4, mxfp4 and turboquant pages are each one container per K and V,
the one the paged attention kernels read (pallas_kernels/paged_attention/kv_formats.py:
an array, quant.RowQuantized, quant.NVFP4, quant.MXFP4, quant.SplitCodes), and that
module's format object quantizes, writes, gathers and decodes them; this one only picks
the object and checks a config against it. Every leaf keeps the leading page axis (the
serving engine copies and swaps pages leaf by leaf), so NVFP4 pages hold no scalar tensor
scale: it is fixed at 1 and stored as None (quant.NVFP4(packed, scales, None)).

KIVI groups keys per channel over 32 tokens and values per token over 32 channels
(quant/kivi.py); its scales are stored as float16 as in the paper. The page size must be
a multiple of 32 so groups never straddle pages. Window rule (the one KIVI rule that
differs from quant.kivi_compress's 128-token window): a sequence of length L keeps
positions [L // page_size * page_size, L), its newest partially filled page, exact in a
per-sequence `recent` buffer [batch, page_size, kv_heads, d] of the cache's dtype; a page
is quantized (keys and values) in the write that fills it. The buffer is a fixed cost per
sequence, reported by `recent_bytes_per_seq`, not per token. Writes must append to a
sequence (positions continue it within its newest page) and a batch row keeps its
sequence, so the serving engine, which re-rows sequences every step, cannot use KIVI yet.
Because a query reads the cache after its chunk's write, a query inside a page that the
same chunk completes reads that page quantized, while token-by-token decode would have
read it exact: chunked KIVI is slightly pessimistic (split chunks at page boundaries to
match decode exactly). The other formats quantize each row alone and do not care.

TurboQuant splits each (token, head) vector into outlier and regular channels, d/2 each,
and quantizes them as two independent TurboQuant instances (own Haar rotation from a fixed
seed, own Lloyd-Max codes, own norm) at 4 + 3 bits (3.5) or 3 + 2 bits (2.5): TurboQuant
(Zandieh et al., 2025), Section 4.3. The rotations are constants of the compiled program
shared by K, V and every layer, never stored per token. Each half also keeps its largest
channel aside, exact to bfloat16 (quant.TurboQuant sparse=1: dense-and-sparse as in
KVQuant, Hooper et al., 2024), and stores the scale that gives the rotated rest its own
norm back (rescale=True). Both are per-token and data-free, so they fit the page pools.

Which channels are outliers. Rows are quantized as they arrive and every page leaf is
per token, so the set must be fixed before any data is seen. It is the d/4 lowest-
frequency RoPE pairs (channels [d/4, d/2) and [3d/4, d), `rope_outlier_channels`), for
three reasons measured on the default model (SmolLM2-135M, 512 tokens of documentation):
a RoPE pair's energy k_i^2 + k_{i+d/2}^2 does not depend on the position, so a choice by
pairs holds for every token; key energy is very skewed (the largest channel carries ~23x
the mean, and 61% of ||k||^2 is the token-independent mean key, which RoPE keeps nearly
still only in the slow pairs); and the slow pairs hold 76% of the key energy against 50%
for any fixed half chosen blind. Values have no RoPE and no such structure: they use the
same set, as good as any fixed half. Measured dppl at 3.5 bits over float32 (python -m
model.kv_eval setup): channel halves of the rotated vector (the old layout) +4.2; this
choice +3.2; slow pairs for keys with per-layer, per-head value sets calibrated on other
text +2.2; calibrated sets for both (88% of key, 64% of value energy in the outliers)
+1.9. Calibrated sets would need per-layer state that the page pools cannot hold (every
leaf of a pool is indexed by page), so they are not used. The model can do the converse:
LLM's TurboQuant pools store keys in a per-layer basis (model/key_centers.py, key bases)
that puts the directions where keys and queries vary most into these channels, and the
attention sink's key (the first token's) on one channel, which the sparse channel keeps.

Why the sparse channel and the rescale. On the same text, the single largest channel of
a key holds 36% of ||k||^2 on average (the top 2: 44%), and the error is all in the keys:
quantizing only V at 3.5 bits moves perplexity by -0.004, only K by +2.6. The Lloyd-Max
reconstruction is also shorter than the vector (by sqrt(1 - D)), which shrinks every score
and flattens the softmax. Perplexity over float32, fake-quantizing K and V of the float
model (a throwaway probe, not a repo script), 2,048 tokens: +2.19 for the split alone,
+0.81 with a sparse channel per half and the rescale; one half-sparse channel is as good
as the two largest of the whole vector (+0.84), two per half +0.71. The cost is 6 bytes
a row (36 -> 42 at d = 64 and 3.5 bits).

Reads return position-ordered float K/V [batch, pages_per_seq * page_size, heads, d]: the
cache is read after the chunk's own write, so prefill and decode see the same codes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import quant
from model.config import ATTENTION, SLIDING_ATTENTION
from model.kv_cache import DEFAULT_PAGE_SIZE, CacheLayout, gather_pages, scatter_rows
from pallas_kernels.paged_attention import kv_formats

KIVI_GROUP = 32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pages", "recent"],
                   meta_fields=["kv_cache_dtype"])
@dataclasses.dataclass(frozen=True)
class KVPages:
    """One attention layer's KV storage.

    pages: name -> the per-token storage: "k" and "v", one kernel container each (an array
      [num_pages, page_size, num_kv_heads, head_dim] for float formats), or KIVI's
      codes / scales / zeros arrays; every leaf starts [num_pages, ...];
    recent: name -> [batch, page_size, num_kv_heads, head_dim], KIVI's exact newest page
      (empty for other formats);
    kv_cache_dtype: the format's name (static).
    """

    pages: dict
    recent: dict
    kv_cache_dtype: str

    def __getitem__(self, name: str):
        return self.pages[name]


def _no_check(head_dim: int, page_size: int) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class PagedFormat:
    """A format whose K and V pages are one container each, quantized, written, gathered
    and decoded by its pallas_kernels kv_formats object (kv_formats.PLAIN for floats).

    dtype: float formats' stored dtype (None: the cache's); check(head_dim, page_size)
    raises ValueError where the format cannot store rows of head_dim.
    """

    name: str
    dtype: Any = None
    check: Callable[[int, int], None] = _no_check

    @property
    def is_float(self) -> bool:
        return self.name in FLOAT_FORMATS

    def kv_format(self, head_dim: int):
        """The format object (head_dim matters to TurboQuant only: its rotations)."""
        if self.is_float:
            return kv_formats.PLAIN
        if self.name.startswith("turboquant-"):
            return kv_formats.resolve(turboquant(head_dim, _turbo_bits(self.name)))
        return kv_formats.resolve(self.name)

    def allocate(self, config, layout: CacheLayout, dtype) -> KVPages:
        fmt = self.kv_format(config.head_dim)
        pages = lambda: fmt.allocate(layout.num_pages, layout.page_size, config.num_kv_heads,
                                     config.head_dim, self.dtype or dtype)
        return KVPages({"k": pages(), "v": pages()}, {}, "")

    def write(self, cache: KVPages, k: jax.Array, v: jax.Array, ctx) -> KVPages:
        fmt = self.kv_format(k.shape[-1])
        page_ids, slots = ctx.slots // ctx.page_size, ctx.slots % ctx.page_size  # padding: past the pool
        pages = {name: fmt.write(cache.pages[name], x, page_ids, slots) for name, x in (("k", k), ("v", v))}
        return dataclasses.replace(cache, pages=pages)

    def read(self, cache: KVPages, ctx, dtype) -> tuple[jax.Array, jax.Array]:
        fmt = _kv_format(cache)

        def one(name):
            rows = fmt.dequantize(fmt.gather(cache.pages[name], ctx.block_tables))  # [B, P, ps, H, D]
            rows = rows.reshape(rows.shape[0], -1, *rows.shape[3:])
            return rows if dtype is None and self.is_float else rows.astype(dtype or jnp.float32)
        return one("k"), one("v")

    def bytes_per_token(self, config, dtype) -> int:
        """Bytes one token's K and V take in one layer."""
        fmt = self.kv_format(config.head_dim)
        return 2 * fmt.bytes_per_token(config.num_kv_heads, config.head_dim, self.dtype or dtype)


def _multiple_of(n: int, what: str):
    def check(head_dim, page_size):
        if head_dim % n:
            raise ValueError(f"kv_cache_dtype {what} needs head_dim divisible by {n}, got {head_dim}")
    return check


def rope_outlier_channels(head_dim: int) -> tuple[int, ...]:
    """The d/2 channels of the d/4 lowest-frequency RoPE pairs (rotate-half layout: pair i
    is channels i and i + d/2, frequency theta^(-2i/d)): [d/4, d/2) and [3d/4, d)."""
    half, quarter = head_dim // 2, head_dim // 4
    return tuple(range(quarter, half)) + tuple(range(half + quarter, head_dim))


@functools.cache
def turboquant(head_dim: int, bits: float) -> quant.TurboQuantSplit:
    """The quantizer of kv_cache_dtype turboquant-{bits} for head_dim (K and V alike)."""
    with jax.ensure_compile_time_eval():  # first built inside a trace: keep its arrays concrete
        return quant.TurboQuantSplit(head_dim, bits, rope_outlier_channels(head_dim), seed=0, sparse=1, rescale=True)


def _turbo_bits(name: str) -> float:
    return float(name.removeprefix("turboquant-"))


def _turbo_check(bits: float):
    def check(head_dim, page_size):
        turboquant(head_dim, bits)  # TurboQuantSplit's own ValueError names the constraint
    return check


def _turbo_head_dim(codes, bits: float) -> int:
    """head_dim of TurboQuantSplit codes: the outlier half packs d/2 codes of ceil(bits) bits."""
    return 2 * codes.outlier.idx.shape[-1] * 8 // math.ceil(bits)


def _kv_format(cache: KVPages):
    """The format object of a PagedFormat cache."""
    name = cache.kv_cache_dtype
    head_dim = _turbo_head_dim(cache["k"], _turbo_bits(name)) if name.startswith("turboquant-") else None
    return FORMATS[name].kv_format(head_dim)


@dataclasses.dataclass(frozen=True)
class KiviCodec:
    """KIVI over pages: a page's keys and values are quantized in the write that fills it."""

    bits: int

    def check(self, head_dim: int, page_size: int) -> None:
        if page_size % KIVI_GROUP or head_dim % KIVI_GROUP:
            raise ValueError(f"kivi-int{self.bits} needs page_size and head_dim divisible by "
                             f"{KIVI_GROUP} (its group), got page_size={page_size}, head_dim={head_dim}")

    def allocate(self, config, layout: CacheLayout, dtype) -> KVPages:
        n, p, h, d = layout.num_pages, layout.page_size, config.num_kv_heads, config.head_dim
        packed = d * self.bits // 8
        pages = {"k_codes": jnp.zeros((n, p, h, packed), jnp.uint8),
                 "k_scale": jnp.zeros((n, p // KIVI_GROUP, h, d), jnp.float16),
                 "k_zero": jnp.zeros((n, p // KIVI_GROUP, h, d), jnp.float16),
                 "v_codes": jnp.zeros((n, p, h, packed), jnp.uint8),
                 "v_scale": jnp.zeros((n, p, h, d // KIVI_GROUP), jnp.float16),
                 "v_zero": jnp.zeros((n, p, h, d // KIVI_GROUP), jnp.float16)}
        recent = {name: jnp.zeros((layout.batch_size, p, h, d), dtype) for name in ("k", "v")}
        return KVPages(pages, recent, "")

    def write(self, cache: KVPages, k: jax.Array, v: jax.Array, ctx) -> KVPages:
        b, t, h, d = k.shape
        size = ctx.page_size
        num_pages, pages_per_seq = cache.pages["k_codes"].shape[0], ctx.block_tables.shape[1]
        valid = ctx.positions >= 0
        has = jnp.any(valid, axis=1)
        start = jnp.where(has, jnp.min(jnp.where(valid, ctx.positions, 2**30), axis=1), 0)
        end = jnp.max(jnp.where(valid, ctx.positions, -1), axis=1) + 1  # the new length
        first = start // size
        touched = (t + 2 * size - 2) // size  # most pages t consecutive positions can span
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        page_of = jnp.where(valid, ctx.positions // size - first[:, None], touched)  # dropped

        def stage(new, recent):
            # Exact rows of every touched page: the newest page's earlier rows, then the chunk.
            older = (jnp.arange(size)[None, :] < (start % size)[:, None])[..., None, None]
            staged = jnp.zeros((b, touched, size, h, d), recent.dtype)
            staged = staged.at[:, 0].set(jnp.where(older, recent, 0))
            return staged.at[rows, page_of, ctx.positions % size].set(new.astype(recent.dtype),
                                                                      mode="drop")

        sk, sv = stage(k, cache.recent["k"]), stage(v, cache.recent["v"])
        logical = first[:, None] + jnp.arange(touched)
        full = has[:, None] & ((logical + 1) * size <= end[:, None]) & (logical < pages_per_seq)
        physical = jnp.take_along_axis(ctx.block_tables, jnp.clip(logical, 0, pages_per_seq - 1), 1)
        physical = jnp.where(full, physical, num_pages).reshape(-1)  # num_pages: dropped

        keys = quant.kivi_quantize_keys(jnp.swapaxes(sk, 2, 3), self.bits, KIVI_GROUP)
        values = quant.kivi_quantize_values(sv, self.bits, KIVI_GROUP)
        swap = lambda a: jnp.swapaxes(a, 2, 3)  # [B, touched, H, rows, ...] -> [.., rows, H, ..]
        new = {"k_codes": swap(keys.codes), "k_scale": swap(keys.scale), "k_zero": swap(keys.zero),
               "v_codes": values.codes, "v_scale": values.scale, "v_zero": values.zero}
        pages = {name: scatter_rows(pool, physical, new[name].reshape(-1, *pool.shape[1:]))
                 for name, pool in cache.pages.items()}
        newest = jnp.clip((end - 1) // size - first, 0, touched - 1)
        keep = has[:, None, None, None]
        recent = {"k": jnp.where(keep, sk[jnp.arange(b), newest], cache.recent["k"]),
                  "v": jnp.where(keep, sv[jnp.arange(b), newest], cache.recent["v"])}
        return dataclasses.replace(cache, pages=pages, recent=recent)

    def read(self, cache: KVPages, ctx, dtype) -> tuple[jax.Array, jax.Array]:
        g = {name: gather_pages(pool, ctx.block_tables) for name, pool in cache.pages.items()}
        f32 = lambda name: g[name].astype(jnp.float32)
        keys = quant.KiviKeys(jnp.swapaxes(g["k_codes"], 1, 2), jnp.swapaxes(f32("k_scale"), 1, 2),
                              jnp.swapaxes(f32("k_zero"), 1, 2), self.bits, KIVI_GROUP)
        k = jnp.swapaxes(quant.kivi_dequantize_keys(keys), 1, 2)
        v = quant.kivi_dequantize_values(quant.KiviValues(g["v_codes"], f32("v_scale"), f32("v_zero"),
                                                          self.bits, KIVI_GROUP))
        size = ctx.page_size
        length = jnp.max(ctx.positions, axis=1) + 1
        newest = (length // size * size)[:, None]
        slots = jnp.arange(k.shape[1])
        exact = ((slots >= newest) & (slots < newest + size))[..., None, None]
        recent = lambda name: cache.recent[name][:, slots % size].astype(jnp.float32)
        out = dtype or jnp.float32
        return (jnp.where(exact, recent("k"), k).astype(out), jnp.where(exact, recent("v"), v).astype(out))


FORMATS: dict[str, Any] = {
    "auto": PagedFormat("auto"),
    "float32": PagedFormat("float32", jnp.float32),
    "bfloat16": PagedFormat("bfloat16", jnp.bfloat16),
    "fp8": PagedFormat("fp8"),
    "int8": PagedFormat("int8"),
    "nvfp4": PagedFormat("nvfp4", check=_multiple_of(16, "nvfp4")),
    "mxfp4": PagedFormat("mxfp4", check=_multiple_of(32, "mxfp4")),
    "kivi-int4": KiviCodec(4),
    "kivi-int2": KiviCodec(2),
    "turboquant-3.5": PagedFormat("turboquant-3.5", check=_turbo_check(3.5)),
    "turboquant-2.5": PagedFormat("turboquant-2.5", check=_turbo_check(2.5)),
}
KV_CACHE_DTYPES = tuple(FORMATS)
FLOAT_FORMATS = ("auto", "float32", "bfloat16")


def get_format(kv_cache_dtype: str):
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")
    return FORMATS[kv_cache_dtype]


def default_page_size(kv_cache_dtype: str) -> int:
    """DEFAULT_PAGE_SIZE, or KIVI's group of 32 for kivi formats."""
    return KIVI_GROUP if isinstance(get_format(kv_cache_dtype), KiviCodec) else DEFAULT_PAGE_SIZE


def check_kv_cache_dtype(kv_cache_dtype: str, config, page_size: int) -> None:
    """ValueError unless `kv_cache_dtype` is known and fits config.head_dim and page_size."""
    get_format(kv_cache_dtype).check(config.head_dim, page_size)


def init_kv_pages(config, layout: CacheLayout, dtype) -> KVPages:
    """Empty pages of one attention layer in layout.kv_cache_dtype."""
    check_kv_cache_dtype(layout.kv_cache_dtype, config, layout.page_size)
    pages = get_format(layout.kv_cache_dtype).allocate(config, layout, dtype)
    return dataclasses.replace(pages, kv_cache_dtype=layout.kv_cache_dtype)


def write_kv(cache: KVPages, k: jax.Array, v: jax.Array, ctx) -> KVPages:
    """Quantize and store new k, v [B, T, Hkv, D] at ctx's positions; padding is dropped."""
    return FORMATS[cache.kv_cache_dtype].write(cache, k, v, ctx)


def read_kv(cache: KVPages, ctx, dtype=None) -> tuple[jax.Array, jax.Array]:
    """Each sequence's K, V as `dtype` [B, pages_per_seq * page_size, Hkv, D], position-ordered.

    dtype None: float formats keep their stored dtype, quantized ones give float32.
    """
    return FORMATS[cache.kv_cache_dtype].read(cache, ctx, dtype)


def kernel_pages(cache: KVPages):
    """(kv_format, k_pages, v_pages): the pages as they are, which are the containers the
    paged attention kernels read, with their kv_formats object (already resolved; None for
    float pages of any float dtype, which the kernels read as they are), or None for KIVI's
    (its exact newest page lives outside the pages)."""
    fmt = get_format(cache.kv_cache_dtype)
    if not isinstance(fmt, PagedFormat):
        return None
    return (None if fmt.is_float else _kv_format(cache)), cache["k"], cache["v"]


def bytes_per_token(kv_cache_dtype: str, config, dtype=jnp.float32, page_size: int | None = None) -> int:
    """Page-pool bytes one token takes over all attention layers (K and V, every kv head)."""
    page_size = page_size or default_page_size(kv_cache_dtype)
    check_kv_cache_dtype(kv_cache_dtype, config, page_size)
    fmt = get_format(kv_cache_dtype)
    if isinstance(fmt, PagedFormat):
        per_layer = fmt.bytes_per_token(config, dtype)
    else:  # KIVI: scales per group of tokens, so count a page's bytes
        layout = CacheLayout(1, 1, page_size, kv_cache_dtype)
        shapes = jax.eval_shape(lambda: init_kv_pages(config, layout, dtype))
        per_page = sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes.pages))
        per_layer = per_page // page_size
    return per_layer * _num_attention_layers(config)


def recent_bytes_per_seq(kv_cache_dtype: str, config, dtype=jnp.float32, page_size: int | None = None) -> int:
    """Fixed bytes per sequence outside the pages (KIVI's exact newest page), all layers."""
    if not isinstance(get_format(kv_cache_dtype), KiviCodec):
        return 0
    page_size = page_size or default_page_size(kv_cache_dtype)
    return 2 * page_size * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize \
        * _num_attention_layers(config)


def _num_attention_layers(config) -> int:
    return sum(kind in (ATTENTION, SLIDING_ATTENTION) for kind in config.layer_kinds)
