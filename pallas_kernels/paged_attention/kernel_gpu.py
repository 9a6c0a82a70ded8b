"""Paged decode attention as a Pallas GPU kernel (Triton lowering).

Grid (batch, kv_head): each program holds its group of query heads (padded to >= 16
rows, the smallest Triton dot) and walks the sequence's pages with a fori_loop, loading
one page of its KV head at a time through the block table (a gather from the pool).
Triton compiler params are accepted by jax 0.10 and 0.11 (deprecated there in favour of
Mosaic GPU, which has no gather-by-block-table path we could rely on yet).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import online_softmax
from pallas_kernels.paged_attention.pages import page_range
from pallas_kernels.variant import AttentionVariant

MIN_DOT = 16


def gpu_supported(page_size: int, head_dim: int) -> bool:
    """Triton needs power-of-two tiles and dot dimensions of at least 16."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0
    return pow2(page_size) and pow2(head_dim) and page_size >= MIN_DOT and head_dim >= MIN_DOT


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    block_table_ref,
    kv_len_ref,
    sinks_ref,
    out_ref,
    lse_ref,
    *,
    variant,
    sm_scale,
    sliding_window,
    group,
):
    kv_head = pl.program_id(1)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    kv_len = kv_len_ref[0]
    first, last = page_range(kv_len, page_size, sliding_window)
    last = jnp.where(kv_len > 0, last, first - 1)
    prec = online_softmax.dot_precision(q_ref.dtype)
    q = q_ref[...]
    q_head = kv_head * group + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)

    def body(i, carry):
        m, l, acc = carry
        page = block_table_ref[i]
        k = k_ref[page]
        v = v_ref[page]
        s = (
            lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
            )
            * sm_scale
        )
        kv_pos = i * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        s = variant.transform(s, kv_len - 1, kv_pos, q_head)
        mask = kv_pos < kv_len
        if sliding_window is not None:
            mask &= kv_pos >= kv_len - sliding_window
        mask = jnp.broadcast_to(mask, s.shape)
        m, l, alpha, p = online_softmax.update(variant, m, l, s, mask)
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=prec,
            preferred_element_type=jnp.float32,
        )
        return m, l, alpha * acc + pv

    m, l, acc = lax.fori_loop(first, last + 1, body, online_softmax.init_state(rows, head_dim))
    sinks = None if sinks_ref is None else sinks_ref[...][:, None]
    out, lse = online_softmax.finalize(variant, m, l, acc, sinks)
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse[:, 0]


def paged_attention_gpu(
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
    num_warps: int = 4,
    num_stages: int = 2,
):
    """Shapes as pallas_kernels.paged_attention; requires gpu_supported(page_size, head_dim)."""
    batch, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    rows = max(MIN_DOT, 1 << (group - 1).bit_length())
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    operands = [qg, k_pages, v_pages, block_tables, kv_lens]
    kv_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, h: (0, 0, h, 0))
    in_specs = [
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0)),
        kv_spec,
        kv_spec,
        pl.BlockSpec((None, max_pages), lambda b, h: (b, 0)),
        pl.BlockSpec((1,), lambda b, h: (b,)),
    ]
    if sinks is not None:
        sg = jnp.pad(
            sinks.astype(jnp.float32).reshape(num_kv_heads, group),
            ((0, 0), (0, rows - group)),
            constant_values=-jnp.inf,
        )
        operands.append(sg)
        in_specs.append(pl.BlockSpec((None, rows), lambda b, h: (h, 0)))
    else:
        operands.append(None)
        in_specs.append(None)
    kernel = functools.partial(
        _kernel, variant=variant, sm_scale=sm_scale, sliding_window=sliding_window, group=group
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, rows), lambda b, h: (b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), q.dtype),
            jax.ShapeDtypeStruct((batch, num_kv_heads, rows), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kvfold_paged_attention_gpu",
    )(*operands)
    out = out[:, :, :group].reshape(batch, num_q_heads, head_dim)
    return out, lse[:, :, :group].reshape(batch, num_q_heads)
