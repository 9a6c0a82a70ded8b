"""pallas_kernels.block_sparse_attention: attention over a BSR block pattern."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import validate
from pallas_kernels.block_sparse_attention.kernel_tpu import block_sparse_attention_tpu
from pallas_kernels.block_sparse_attention.ref import block_sparse_attention_ref
from pallas_kernels.dispatch import bind, dispatch
from pallas_kernels.variant import AttentionVariant


def block_sparse_attention(
    q,
    k,
    v,
    indptr,
    indices,
    *,
    block_r,
    block_c,
    sm_scale=None,
    soft_cap=None,
    sinks=None,
    variant: AttentionVariant | None = None,
    interpret=None,
):
    """Attention whose visibility is a block-sparse (BSR) matrix, as in FlashInfer.

    Query tile i (rows [i*block_r, (i+1)*block_r)) attends to every key of the column
    blocks indices[indptr[i]:indptr[i+1]] (keys [j*block_c, (j+1)*block_c)), fully:
    there is no mask inside a block (causality, if wanted, is the pattern's job or the
    variant's).

    Args:
      q: [num_q, num_q_heads, head_dim], float; num_q = (len(indptr) - 1) * block_r.
      k, v: [num_kv, num_kv_heads, head_dim], q's dtype; num_kv a multiple of block_c.
      indptr: int32 [num_row_blocks + 1], nondecreasing from 0 (CSR row pointers).
      indices: int32 [nnz], column block ids in [0, num_kv / block_c), distinct in a row.
      block_r, block_c: block sizes (multiples of 8 for the TPU tile).
      sm_scale, soft_cap, sinks, variant: as paged_attention, with q_pos = query row and
        kv_pos = key row.
      interpret: True or a pltpu.InterpretParams runs the TPU kernel in interpret mode;
        None runs Mosaic on TPU and the XLA reference (dense mask) elsewhere, CUDA included.

    Returns:
      out [num_q, num_q_heads, head_dim] in q.dtype, lse f32 [num_q, num_q_heads]; a row
      block with no nonzero gets out 0 and lse -inf (lse = sink with sinks).
    """
    validate.check_ndim("q", q, 3, "[num_q, num_q_heads, head_dim]")
    validate.check_float("q", q)
    num_q, num_q_heads, head_dim = q.shape
    validate.check_ndim("k", k, 3, "[num_kv, num_kv_heads, head_dim]")
    validate.check_shape("v", v, k.shape)
    validate.check_dtype("k", k, [q.dtype])
    validate.check_dtype("v", v, [q.dtype])
    if k.shape[-1] != head_dim:
        raise ValueError(f"k head_dim {k.shape[-1]} != q head_dim {head_dim}")
    validate.check_heads(num_q_heads, k.shape[1])
    validate.check_positive("block_r", block_r)
    validate.check_positive("block_c", block_c)
    validate.check_ndim("indptr", indptr, 1, "[num_row_blocks + 1]")
    validate.check_dtype("indptr", indptr, [jnp.int32])
    validate.check_ndim("indices", indices, 1, "[nnz]")
    validate.check_dtype("indices", indices, [jnp.int32])
    if num_q != (indptr.shape[0] - 1) * block_r:
        raise ValueError(
            f"q has {num_q} rows; indptr describes {indptr.shape[0] - 1} row "
            f"blocks of block_r={block_r}"
        )
    if k.shape[0] % block_c:
        raise ValueError(f"num_kv {k.shape[0]} must be a multiple of block_c={block_c}")
    static = dict(
        block_r=int(block_r),
        block_c=int(block_c),
        **validate.attention_options(head_dim, num_q_heads, sm_scale, soft_cap, sinks, variant),
    )
    return dispatch(
        q,
        k,
        v,
        indptr,
        indices,
        sinks,
        ref=bind(block_sparse_attention_ref, **static),
        tpu=bind(block_sparse_attention_tpu, **static),
        gpu=None,
        interpret=interpret,
    )
