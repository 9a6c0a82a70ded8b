"""Paged decode attention as a Pallas TPU (Mosaic) kernel.

Grid (batch, page): one step reads one KV page for all KV heads (decode is bandwidth
bound, so every page is read once and serves all query heads). Block tables and
kv_lens are scalar-prefetched; the page index map clamps to the pages the sequence
actually uses (and to the sliding window), so a skipped step re-uses the previous block
and issues no DMA; the body is skipped with pl.when.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax
from pallas_kernels.variant import AttentionVariant


def _page_range(kv_len, page_size, sliding_window):
    """[first, last] page index a sequence of kv_len reads (last >= first even if empty)."""
    last = jnp.maximum(kv_len - 1, 0) // page_size
    if sliding_window is None:
        return 0, last
    first = jnp.maximum(kv_len - sliding_window, 0) // page_size
    return jnp.minimum(first, last), last


def _kernel(
    block_tables_ref,
    kv_lens_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    variant,
    sm_scale,
    sliding_window,
    has_sinks,
):
    if has_sinks:
        sinks_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    else:
        sinks_ref = None
        out_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    b, p = pl.program_id(0), pl.program_id(1)
    page_size, num_kv_heads, _ = k_ref.shape
    num_q_heads = q_ref.shape[0]
    group = num_q_heads // num_kv_heads
    kv_len = kv_lens_ref[b]
    first, last = _page_range(kv_len, page_size, sliding_window)

    @pl.when(p == 0)
    def _init():
        m0, l0, acc0 = online_softmax.init_state(*acc_ref.shape)
        m_ref[...], l_ref[...], acc_ref[...] = m0, l0, acc0

    @pl.when((p >= first) & (p <= last) & (kv_len > 0))
    def _step():
        prec = online_softmax.dot_precision(q_ref.dtype)
        q = q_ref[...].astype(jnp.float32) if prec is not None else q_ref[...]
        scores = []
        for h in range(num_kv_heads):
            s_h = lax.dot_general(
                q[h * group : (h + 1) * group],
                k_ref[:, h, :],
                (((1,), (1,)), ((), ())),
                precision=prec,
                preferred_element_type=jnp.float32,
            )
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
        pv = []
        for h in range(num_kv_heads):
            v_h = v_ref[:, h, :]
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
        m_ref[...], l_ref[...] = m_new, l_new
        acc_ref[...] = alpha * acc_ref[...] + pv

    @pl.when(p == pl.num_programs(1) - 1)
    def _finish():
        sinks = None if sinks_ref is None else sinks_ref[...]
        out, lse = online_softmax.finalize(variant, m_ref[...], l_ref[...], acc_ref[...], sinks)
        out_ref[...] = out.astype(out_ref.dtype)
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
    interpret=False,
):
    """Shapes as pallas_kernels.paged_attention; sinks f32 [num_q_heads] or None."""
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    max_pages = block_tables.shape[1]

    def page_map(b, p, block_tables, kv_lens):
        first, last = _page_range(kv_lens[b], page_size, sliding_window)
        page = block_tables[b, jnp.clip(p, first, last)]
        return jnp.clip(page, 0, num_pages - 1), 0, 0, 0

    row_map = lambda b, p, *_: (b, 0, 0)
    kv_spec = pl.BlockSpec((None, page_size, num_kv_heads, head_dim), page_map)
    in_specs = [pl.BlockSpec((None, num_q_heads, head_dim), row_map), kv_spec, kv_spec]
    operands = [q, k_pages, v_pages]
    if sinks is not None:
        in_specs.append(pl.BlockSpec((num_q_heads, 1), lambda b, p, *_: (0, 0)))
        operands.append(sinks.astype(jnp.float32).reshape(num_q_heads, 1))
    kernel = functools.partial(
        _kernel,
        variant=variant,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        has_sinks=sinks is not None,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, max_pages),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, num_q_heads, head_dim), row_map),
                pl.BlockSpec((None, num_q_heads, 1), row_map),
            ],
            scratch_shapes=[
                pltpu.VMEM((num_q_heads, 1), jnp.float32),
                pltpu.VMEM((num_q_heads, 1), jnp.float32),
                pltpu.VMEM((num_q_heads, head_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), q.dtype),
            jax.ShapeDtypeStruct((batch, num_q_heads, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kvfold_paged_attention",
    )(block_tables, kv_lens, *operands)
    return out, lse[..., 0]
