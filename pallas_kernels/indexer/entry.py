"""pallas_kernels.indexer_topk: the one entry for the lightning indexer's selection."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import validate
from pallas_kernels.dispatch import bind, dispatch
from pallas_kernels.indexer.kernel_tpu import indexer_scores_tpu
from pallas_kernels.indexer.ref import block_candidates, indexer_scores_ref, select_top_k


def indexer_topk(
    q,
    weights,
    index_keys,
    q_positions,
    *,
    top_k,
    compress_ratio=1,
    num_candidate_blocks=None,
    candidate_mask=None,
    interpret=None,
):
    """Score every compressed row with the lightning indexer and select the top-k rows.

    I(t, s) = sum_h weights[t, h] * ReLU(q[t, h] . index_keys[s]); row s is visible to the
    query at position p iff s < floor((p + 1) / compress_ratio). The scores are a Pallas
    kernel; the selection is XLA (lax.top_k) on every backend: a sort does not map onto
    the TPU's matmul/vector units any better inside a kernel.

    Args:
      q: [num_tokens, num_heads, index_dim], float (the indexer queries).
      weights: [num_tokens, num_heads], float (per-head weights, already scaled).
      index_keys: [num_rows, index_dim], q's dtype (one key per compressed row).
      q_positions: int32 [num_tokens], absolute token positions.
      top_k: number of slots per query.
      num_candidate_blocks: if given, the hierarchical step first keeps, per query, the
        top blocks of 8 rows by block max plus the newest partly filled block, and the
        top-k is taken inside those candidates (the Full layer at ratio 1).
      candidate_mask: bool [num_tokens, num_rows] from another layer's block_candidates
        (Reindex layers); exclusive with num_candidate_blocks.
      interpret: True or a pltpu.InterpretParams runs the TPU kernel in interpret mode;
        None runs Mosaic on TPU and the XLA reference elsewhere (CUDA included).

    Returns:
      indices: int32 [num_tokens, top_k], selected rows sorted ascending, -1 for empty
        slots (fewer visible candidates than top_k). Equal scores go to the lower row id.
      scores: f32 [num_tokens, num_rows], -inf where not visible.
    """
    validate.check_ndim("q", q, 3, "[num_tokens, num_heads, index_dim]")
    validate.check_float("q", q)
    num_tokens, num_heads, index_dim = q.shape
    validate.check_shape("weights", weights, (num_tokens, num_heads))
    validate.check_float("weights", weights)
    validate.check_ndim("index_keys", index_keys, 2, "[num_rows, index_dim]")
    if index_keys.shape[1] != index_dim:
        raise ValueError(f"index_keys dim {index_keys.shape[1]} != q index_dim {index_dim}")
    validate.check_dtype("index_keys", index_keys, [q.dtype])
    validate.check_shape("q_positions", q_positions, (num_tokens,))
    validate.check_dtype("q_positions", q_positions, [jnp.int32])
    validate.check_positive("top_k", top_k)
    validate.check_positive("compress_ratio", compress_ratio)
    validate.check_positive("num_candidate_blocks", num_candidate_blocks)
    if num_candidate_blocks is not None and candidate_mask is not None:
        raise ValueError("pass num_candidate_blocks or candidate_mask, not both")
    if candidate_mask is not None:
        validate.check_shape("candidate_mask", candidate_mask, (num_tokens, index_keys.shape[0]))
        validate.check_dtype("candidate_mask", candidate_mask, [jnp.bool_])
    static = dict(compress_ratio=int(compress_ratio))
    scores = dispatch(
        q,
        weights,
        index_keys,
        q_positions,
        ref=bind(indexer_scores_ref, **static),
        tpu=bind(indexer_scores_tpu, **static),
        gpu=None,
        interpret=interpret,
    )
    if num_candidate_blocks is not None:
        candidate_mask = block_candidates(
            scores,
            q_positions,
            num_blocks=int(num_candidate_blocks),
            compress_ratio=int(compress_ratio),
        )
    return select_top_k(scores, int(top_k), candidate_mask), scores
