"""The XLA path of paged decode attention, run where no Pallas kernel does (CPU).

ref.py states the operation densely: gather every page of a sequence, dequantize,
attend. As a serving path that materialises each layer's whole gathered KV (at 16
sequences x 4,096 positions, 100 MB per layer) and spends most of a decode step copying
it. Here a `lax.scan` walks the block table a few pages at a time with online softmax
(the FlashAttention recurrence): a block is gathered, decoded to f32 if its pages are
low-bit, scored and folded into a running (max, sum, output), so a step reads each live
page once and keeps only a block's worth of f32 in flight. Tested against ref.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.paged_attention.ref import paged_attention_quantized_ref, paged_attention_ref
from pallas_kernels.variant import SOFTMAX

PAGES_PER_BLOCK = 8
# FP4 pages decode through E2M1 / E4M3 tables that XLA:CPU runs slowly inside a scan step:
# measured at 16 x 2,048 positions, a decode step took 1.6x longer blocked than dense.
DENSE_FORMATS = (kv_formats.BlockFP4,)


def paged_attention_xla(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    sinks=None,
    *,
    sm_scale,
    sliding_window=None,
    variant=SOFTMAX,
    kv_format=None,
):
    """paged_attention (kv_format None) or paged_attention_quantized (a kv_formats object):
    same contract, arguments already validated. Variants without softmax (a weight_fn)
    have no running normaliser to carry, so they take the dense reference, as do the
    DENSE_FORMATS."""
    if not variant.uses_softmax or isinstance(kv_format, DENSE_FORMATS):
        if kv_format is None:
            return paged_attention_ref(q, k_pages, v_pages, block_tables, kv_lens, sinks,
                                       sm_scale=sm_scale, sliding_window=sliding_window, variant=variant)
        return paged_attention_quantized_ref(q, k_pages, v_pages, block_tables, kv_lens, sinks,
                                             kv_format=kv_format, sm_scale=sm_scale,
                                             sliding_window=sliding_window, variant=variant)
    batch, num_q_heads, head_dim = q.shape
    leaves = (k_pages,) if kv_format is None else kv_format.leaves(k_pages)
    num_pages, page_size, num_kv_heads = leaves[0].shape[:3]
    group = num_q_heads // num_kv_heads
    max_pages = block_tables.shape[1]
    per_block = min(PAGES_PER_BLOCK, max_pages)
    num_blocks = -(-max_pages // per_block)
    span = per_block * page_size
    # Entries past a sequence's pages may hold anything: clamp them into the pool (masked).
    tables = jnp.clip(block_tables, 0, num_pages - 1)
    tables = jnp.pad(tables, ((0, 0), (0, num_blocks * per_block - max_pages)))
    blocks = tables.reshape(batch, num_blocks, per_block).transpose(1, 0, 2)  # [nb, B, ppb]

    def read(pages, index):  # [B, ppb] page ids -> f32 [B, span, Hkv, D]
        if kv_format is None:
            rows = pages[index]
        else:  # page-axis leaves are 3-D or 4-D; a scalar (NVFP4's tensor scale) stays
            rows = kv_format.dequantize(jax.tree.map(lambda a: a[index] if a.ndim >= 3 else a, pages))
        return rows.astype(jnp.float32).reshape(batch, span, num_kv_heads, head_dim)

    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
    q_pos = (kv_lens - 1)[:, None, None]
    q_head = jnp.arange(num_q_heads, dtype=jnp.int32)[None, :, None]

    def body(carry, block):
        m, l, acc = carry  # [B, Hq], [B, Hq], [B, Hkv, G, D]
        i, index = block
        k, v = read(k_pages, index), read(v_pages, index)
        s = jnp.einsum("bhgd,bshd->bhgs", qg, k).reshape(batch, num_q_heads, span) * sm_scale
        kv_pos = (i * span + jnp.arange(span, dtype=jnp.int32))[None, None, :]
        s = variant.transform(s, q_pos, kv_pos, q_head)
        visible = kv_pos < kv_lens[:, None, None]
        if sliding_window is not None:
            visible &= kv_pos >= kv_lens[:, None, None] - sliding_window
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # nothing seen yet: no NaN
        p = jnp.exp(s - shift[..., None])
        rescale = jnp.exp(m - shift)
        pv = jnp.einsum("bhgs,bshd->bhgd", p.reshape(batch, num_kv_heads, group, span), v)
        acc = acc * rescale.reshape(batch, num_kv_heads, group, 1) + pv
        return (m_new, l * rescale + p.sum(-1), acc), None

    init = (jnp.full((batch, num_q_heads), -jnp.inf), jnp.zeros((batch, num_q_heads)),
            jnp.zeros((batch, num_kv_heads, group, head_dim)))
    (m, l, acc), _ = lax.scan(body, init, (jnp.arange(num_blocks, dtype=jnp.int32), blocks))
    seen = l > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    out = jnp.where(seen[..., None], acc.reshape(batch, num_q_heads, head_dim) /
                    jnp.where(seen, l, 1.0)[..., None], 0.0)
    if sinks is not None:  # the sink joins the denominator only
        total = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :])
        out = out * jnp.exp(lse - total)[..., None]
        lse = total
    return out.astype(q.dtype), lse
