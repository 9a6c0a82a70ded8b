"""Paged decode attention as a Pallas TPU (Mosaic) kernel.

Grid (batch, page): one step reads one KV page for all KV heads (decode is bandwidth
bound, so every page is read once and serves all query heads). Block tables and
kv_lens are scalar-prefetched; the page index map clamps to the pages the sequence
actually uses (and to the sliding window), so a skipped step re-uses the previous block
and issues no DMA; the body is skipped with pl.when.

Quantized pages (kv_formats) use the same kernel: every page-axis leaf of the container
(codes, scales) gets the page's BlockSpec, and each KV head's tile is decoded to f32 in
VMEM right before its dot, so HBM traffic is the low-bit bytes only. The query and the
accumulator carry a leading `parts` axis (channel slices of packed codes; 1 for plain).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax
from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.paged_attention.kv_formats import merge_parts, split_parts
from pallas_kernels.paged_attention.pages import page_range
from pallas_kernels.variant import AttentionVariant


def _kernel(
    block_tables_ref,
    kv_lens_ref,
    q_ref,
    *refs,
    kv_format,
    num_leaves,
    num_extras,
    variant,
    sm_scale,
    sliding_window,
    has_sinks,
):
    k_refs, v_refs = refs[:num_leaves], refs[num_leaves : 2 * num_leaves]
    extras = refs[2 * num_leaves : 2 * num_leaves + num_extras]
    rest = refs[2 * num_leaves + num_extras :]
    if has_sinks:
        sinks_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    else:
        sinks_ref = None
        out_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    b, p = pl.program_id(0), pl.program_id(1)
    page_size, num_kv_heads = k_refs[0].shape[:2]
    parts, num_q_heads, _ = q_ref.shape
    group = num_q_heads // num_kv_heads
    kv_len = kv_lens_ref[b]
    first, last = page_range(kv_len, page_size, sliding_window)

    def getter(leaf_refs, h):
        # One KV head of this page: [page_size, n] for 4-D leaves, [page_size, 1] for 3-D.
        return lambda i: (
            leaf_refs[i][:, h, :] if len(leaf_refs[i].shape) == 3 else leaf_refs[i][:, h : h + 1]
        )

    @pl.when(p == 0)
    def _init():
        m0, l0, acc0 = online_softmax.init_state(num_q_heads, acc_ref.shape[-1])
        m_ref[...], l_ref[...] = m0, l0
        for j in range(parts):
            acc_ref[j] = acc0

    @pl.when((p >= first) & (p <= last) & (kv_len > 0))
    def _step():
        prec = online_softmax.dot_precision(q_ref.dtype)
        qs = [q_ref[j] for j in range(parts)]
        scores = []
        for h in range(num_kv_heads):
            s_h = None
            for j in range(parts):
                k_tile = kv_format.tile(getter(k_refs, h), j, extras).astype(q_ref.dtype)
                d = lax.dot_general(
                    qs[j][h * group : (h + 1) * group],
                    k_tile,
                    (((1,), (1,)), ((), ())),
                    precision=prec,
                    preferred_element_type=jnp.float32,
                )
                s_h = d if s_h is None else s_h + d
            scores.append(s_h)
        s = jnp.concatenate(scores, axis=0) * sm_scale if num_kv_heads > 1 else scores[0] * sm_scale
        kv_pos = p * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        q_head = lax.broadcasted_iota(jnp.int32, (num_q_heads, 1), 0)
        s = variant.transform(s, kv_len - 1, kv_pos, q_head)
        mask = kv_pos < kv_len
        if sliding_window is not None:
            mask &= kv_pos >= kv_len - sliding_window
        mask = jnp.broadcast_to(mask, s.shape)
        m_new, l_new, alpha, probs = online_softmax.update(variant, m_ref[...], l_ref[...], s, mask)
        for j in range(parts):
            pv = []
            for h in range(num_kv_heads):
                v_h = kv_format.tile(getter(v_refs, h), j, extras).astype(q_ref.dtype)
                pv.append(
                    lax.dot_general(
                        probs[h * group : (h + 1) * group].astype(v_h.dtype),
                        v_h,
                        (((1,), (0,)), ((), ())),
                        precision=prec,
                        preferred_element_type=jnp.float32,
                    )
                )
            pv = jnp.concatenate(pv, axis=0) if num_kv_heads > 1 else pv[0]
            acc_ref[j] = alpha * acc_ref[j] + pv
        m_ref[...], l_ref[...] = m_new, l_new

    @pl.when(p == pl.num_programs(1) - 1)
    def _finish():
        sinks = None if sinks_ref is None else sinks_ref[...]
        for j in range(parts):
            out, lse = online_softmax.finalize(variant, m_ref[...], l_ref[...], acc_ref[j], sinks)
            out_ref[j] = out.astype(out_ref.dtype)
        lse_ref[...] = lse


def paged_attention_tpu(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    sinks=None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    variant: AttentionVariant,
    kv_format=kv_formats.PLAIN,
    interpret=False,
):
    """Shapes as pallas_kernels.paged_attention (or paged_attention_quantized, whose page
    containers kv_format, a kv_formats object, reads); sinks f32 [num_q_heads] or None."""
    batch, num_q_heads, head_dim = q.shape
    k_leaves, v_leaves = kv_format.leaves(k_pages), kv_format.leaves(v_pages)
    num_pages, page_size, num_kv_heads = k_leaves[0].shape[:3]
    max_pages = block_tables.shape[1]
    parts = kv_format.parts
    part_dim = head_dim // parts
    # [batch, parts, num_q_heads, part_dim]: the query in the basis and channel order of
    # the decoded tiles (identity for plain pages).
    qp = jnp.moveaxis(split_parts(kv_format.prepare_q(k_pages, q), parts), 0, 1)

    def page_map(b, p, block_tables, kv_lens):
        first, last = page_range(kv_lens[b], page_size, sliding_window)
        page = block_tables[b, jnp.clip(p, first, last)]
        return jnp.clip(page, 0, num_pages - 1), 0, 0, 0

    def leaf_spec(leaf):
        tail = leaf.shape[3:]
        index = lambda *a: page_map(*a)[: leaf.ndim]
        return pl.BlockSpec((None, page_size, num_kv_heads, *tail), index)

    row_map = lambda b, p, *_: (b, 0, 0, 0)
    extras = kv_format.extras()
    in_specs = [pl.BlockSpec((None, parts, num_q_heads, part_dim), row_map)]
    in_specs += [leaf_spec(x) for x in k_leaves + v_leaves]
    in_specs += [pl.BlockSpec(memory_space=pltpu.SMEM) for _ in extras]
    operands = [qp, *k_leaves, *v_leaves, *extras]
    if sinks is not None:
        in_specs.append(pl.BlockSpec((num_q_heads, 1), lambda b, p, *_: (0, 0)))
        operands.append(sinks.astype(jnp.float32).reshape(num_q_heads, 1))
    kernel = functools.partial(
        _kernel,
        kv_format=kv_format,
        num_leaves=len(k_leaves),
        num_extras=len(extras),
        variant=variant,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        has_sinks=sinks is not None,
    )
    # Quantized pages: the output may still be rotated / scaled, so keep it f32 until then.
    out_dtype = q.dtype if kv_format is kv_formats.PLAIN else jnp.float32
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, max_pages),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, parts, num_q_heads, part_dim), row_map),
                pl.BlockSpec((None, num_q_heads, 1), lambda b, p, *_: (b, 0, 0)),
            ],
            scratch_shapes=[
                pltpu.VMEM((num_q_heads, 1), jnp.float32),
                pltpu.VMEM((num_q_heads, 1), jnp.float32),
                pltpu.VMEM((parts, num_q_heads, part_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, parts, num_q_heads, part_dim), out_dtype),
            jax.ShapeDtypeStruct((batch, num_q_heads, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kvfold_paged_attention"
        if kv_format is kv_formats.PLAIN
        else "kvfold_paged_attention_" + kv_format.label,
    )(block_tables, kv_lens, *operands)
    out = kv_format.finish_out(v_pages, merge_parts(jnp.moveaxis(out, 1, 0)))
    return out.astype(q.dtype), lse[..., 0]
