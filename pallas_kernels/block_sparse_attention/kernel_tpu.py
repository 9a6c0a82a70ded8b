"""Block-sparse (BSR) attention as a Pallas TPU kernel: one dense tile kernel driven by
the block pattern (FlashInfer's view of every sparse layout).

Grid (row block, nonzero slot): indptr and indices are scalar-prefetched; step j of row
block i reads KV column block indices[indptr[i] + j] through the BlockSpec index map.
The slot axis is sized for the densest possible row (all column blocks); slots past a
row's nonzeros repeat its last block index, so the pipeline issues no DMA, and the body
is skipped. q, k, v are head-major ([H, T, D]) so a tile of one head is contiguous.
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


def _kernel(
    indptr_ref, indices_ref, q_ref, k_ref, v_ref, *rest, variant, sm_scale, has_sinks, num_entries
):
    sinks_ref = rest[0] if has_sinks else None
    out_ref, lse_ref, m_ref, l_ref, acc_ref = rest[int(has_sinks) :]
    i, j = pl.program_id(0), pl.program_id(1)
    num_q_heads, block_r, head_dim = q_ref.shape
    num_kv_heads, block_c, _ = k_ref.shape
    begin = indptr_ref[i]

    @pl.when(j == 0)
    def _init():
        m0, l0, acc0 = online_softmax.init_state(*acc_ref.shape)
        m_ref[...], l_ref[...], acc_ref[...] = m0, l0, acc0

    @pl.when(j < indptr_ref[i + 1] - begin)
    def _step():
        col = indices_ref[jnp.minimum(begin + j, num_entries - 1)]
        prec = online_softmax.dot_precision(q_ref.dtype)
        rows = num_q_heads * block_r
        q = q_ref[...].reshape(rows, head_dim)
        s = online_softmax.grouped_scores(q, lambda h: k_ref[h], num_kv_heads, prec) * sm_scale
        row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        q_pos = i * block_r + row % block_r
        kv_pos = col * block_c + lax.broadcasted_iota(jnp.int32, (1, block_c), 1)
        s = variant.transform(s, q_pos, kv_pos, row // block_r)
        mask = jnp.ones(s.shape, bool)
        m_new, l_new, alpha, p = online_softmax.update(variant, m_ref[...], l_ref[...], s, mask)
        pv = online_softmax.grouped_pv(p, lambda h: v_ref[h], num_kv_heads, prec)
        m_ref[...], l_ref[...] = m_new, l_new
        acc_ref[...] = alpha * acc_ref[...] + pv

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        sinks = None if sinks_ref is None else sinks_ref[...]
        out, lse = online_softmax.finalize(variant, m_ref[...], l_ref[...], acc_ref[...], sinks)
        out_ref[...] = out.reshape(out_ref.shape).astype(out_ref.dtype)
        lse_ref[...] = lse


def block_sparse_attention_tpu(
    q,
    k,
    v,
    indptr,
    indices,
    sinks=None,
    *,
    block_r: int,
    block_c: int,
    sm_scale: float,
    variant: AttentionVariant,
    interpret=False,
):
    """Shapes as pallas_kernels.block_sparse_attention."""
    num_q, num_q_heads, head_dim = q.shape
    num_kv, num_kv_heads, _ = k.shape
    num_row_blocks, num_col_blocks = num_q // block_r, num_kv // block_c
    if indices.shape[0] == 0:  # SMEM needs at least one entry; never read
        indices = jnp.zeros((1,), jnp.int32)
    num_entries = indices.shape[0]

    def kv_map(i, j, indptr, indices):
        begin, end = indptr[i], indptr[i + 1]
        slot = jnp.clip(jnp.minimum(begin + j, end - 1), 0, num_entries - 1)
        return 0, jnp.clip(indices[slot], 0, num_col_blocks - 1), 0

    tile_map = lambda i, j, *_: (0, i, 0)
    kv_spec = pl.BlockSpec((num_kv_heads, block_c, head_dim), kv_map)
    in_specs = [pl.BlockSpec((num_q_heads, block_r, head_dim), tile_map), kv_spec, kv_spec]
    operands = [q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)]
    rows = num_q_heads * block_r
    if sinks is not None:
        in_specs.append(pl.BlockSpec((rows, 1), lambda i, j, *_: (0, 0)))
        operands.append(jnp.repeat(sinks.astype(jnp.float32), block_r)[:, None])
    kernel = functools.partial(
        _kernel,
        variant=variant,
        sm_scale=sm_scale,
        has_sinks=sinks is not None,
        num_entries=num_entries,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_row_blocks, num_col_blocks),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, num_q_heads, block_r, head_dim), lambda i, j, *_: (i, 0, 0, 0)),
                pl.BlockSpec((None, rows, 1), lambda i, j, *_: (i, 0, 0)),
            ],
            scratch_shapes=[
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((num_row_blocks, num_q_heads, block_r, head_dim), q.dtype),
            jax.ShapeDtypeStruct((num_row_blocks, rows, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kvfold_block_sparse_attention",
    )(indptr, indices, *operands)
    out = out.transpose(0, 2, 1, 3).reshape(num_q, num_q_heads, head_dim)
    lse = lse.reshape(num_row_blocks, num_q_heads, block_r).transpose(0, 2, 1)
    return out, lse.reshape(num_q, num_q_heads)
