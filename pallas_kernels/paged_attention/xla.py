"""The XLA path of paged decode attention, run where no Pallas kernel does (CPU).

ref.py states the operation densely: gather every page of a sequence, dequantize,
attend. As a serving path that materialises each layer's whole gathered KV (at 16
sequences x 4,096 positions, 100 MB per layer) and spends most of a decode step copying
it. Here a `lax.scan` walks the block table a few pages at a time with online softmax
(the FlashAttention recurrence): a block is gathered, decoded to f32 if its pages are
low-bit, scored and folded into a running (max, sum, output), so a step reads each live
page once and keeps only a block's worth of f32 in flight. Tested against ref.py.

Low-bit blocks are decoded the way the kernel decodes its tiles (kv_formats.py): one
array per channel part (`parts`: the low and high nibbles of FP4 bytes, TurboQuant's
code j of every group), in the basis `prepare_q` puts the query in, and the output
goes back through `finish_out`. Scores and outputs are sums over parts, so no part is
ever interleaved back into head_dim order (XLA:CPU runs such lane shuffles, and every
broadcast that feeds them, element by element), and TurboQuant rows are never
de-rotated one by one (a d x d matmul per row). Heads move ahead of positions on the
gathered codes, the cheapest place, so the decode writes the layout the dots read.
Results equal the dense reference to f32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.paged_attention.ref import paged_attention_quantized_ref, paged_attention_ref
from pallas_kernels.variant import SOFTMAX

PAGES_PER_BLOCK = 8


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
    have no running normaliser to carry, so they take the dense reference."""
    if not variant.uses_softmax:
        if kv_format is None:
            return paged_attention_ref(q, k_pages, v_pages, block_tables, kv_lens, sinks,
                                       sm_scale=sm_scale, sliding_window=sliding_window, variant=variant)
        return paged_attention_quantized_ref(q, k_pages, v_pages, block_tables, kv_lens, sinks,
                                             kv_format=kv_format, sm_scale=sm_scale,
                                             sliding_window=sliding_window, variant=variant)
    fmt = kv_formats.PLAIN if kv_format is None else kv_format
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads = fmt.leaves(k_pages)[0].shape[:3]
    group = num_q_heads // num_kv_heads
    parts = fmt.parts
    max_pages = block_tables.shape[1]
    per_block = min(PAGES_PER_BLOCK, max_pages)
    num_blocks = -(-max_pages // per_block)
    span = per_block * page_size
    # Entries past a sequence's pages may hold anything: clamp them into the pool (masked).
    tables = jnp.clip(block_tables, 0, num_pages - 1)
    tables = jnp.pad(tables, ((0, 0), (0, num_blocks * per_block - max_pages)))
    blocks = tables.reshape(batch, num_blocks, per_block).transpose(1, 0, 2)  # [nb, B, ppb]

    def heads_first(a):  # [B, ppb, page_size, Hkv, ...] -> [B, Hkv, ppb, page_size, ...]
        return jnp.moveaxis(a, 3, 1) if a.ndim >= 4 else a

    def read(pages, index):  # [B, ppb] page ids -> per part f32 [B, Hkv, span, D / parts]
        block = jax.tree.map(heads_first, fmt.gather(pages, index))
        return [fmt.rows(block, j).astype(jnp.float32).reshape(batch, num_kv_heads, span, -1)
                for j in range(parts)]

    q_parts = kv_formats.split_parts(fmt.prepare_q(k_pages, q.astype(jnp.float32)), parts)
    qg = [x.reshape(batch, num_kv_heads, group, -1) for x in q_parts]
    q_pos = (kv_lens - 1)[:, None, None]
    q_head = jnp.arange(num_q_heads, dtype=jnp.int32)[None, :, None]

    def body(carry, block):
        m, l, acc = carry  # [B, Hq], [B, Hq], parts x [B, Hkv, G, D / parts]
        i, index = block
        k, v = read(k_pages, index), read(v_pages, index)
        s = functools.reduce(jnp.add, [jnp.einsum("bhgd,bhsd->bhgs", qj, kj) for qj, kj in zip(qg, k)])
        s = s.reshape(batch, num_q_heads, span) * sm_scale
        kv_pos = (i * span + jnp.arange(span, dtype=jnp.int32))[None, None, :]
        s = variant.transform(s, q_pos, kv_pos, q_head)
        visible = kv_pos < kv_lens[:, None, None]
        if sliding_window is not None:
            visible &= kv_pos >= kv_lens[:, None, None] - sliding_window
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # nothing seen yet: no NaN
        p = jnp.exp(s - shift[..., None]).reshape(batch, num_kv_heads, group, span)
        rescale = jnp.exp(m - shift)
        keep = rescale.reshape(batch, num_kv_heads, group, 1)
        acc = [a * keep + jnp.einsum("bhgs,bhsd->bhgd", p, vj) for a, vj in zip(acc, v)]
        return (m_new, l * rescale + p.sum(-1).reshape(batch, num_q_heads), acc), None

    init = (jnp.full((batch, num_q_heads), -jnp.inf), jnp.zeros((batch, num_q_heads)),
            [jnp.zeros((batch, num_kv_heads, group, head_dim // parts))] * parts)
    (m, l, acc), _ = lax.scan(body, init, (jnp.arange(num_blocks, dtype=jnp.int32), blocks))
    seen = l > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    acc = kv_formats.merge_parts(jnp.stack(acc)).reshape(batch, num_q_heads, head_dim)
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    out = fmt.finish_out(v_pages, out)
    if sinks is not None:  # the sink joins the denominator only
        total = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :])
        out = out * jnp.exp(lse - total)[..., None]
        lse = total
    return out.astype(q.dtype), lse
