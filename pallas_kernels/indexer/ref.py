"""Lightning-indexer scores and top-k selection in plain jnp (DeepSeek-V4.1-Flash technical report).

I(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]) over compressed rows s; row s is visible
to the query at position p iff s < floor((p + 1) / compress_ratio). The selection
(candidate blocks, top-k, sorting) is XLA on every backend and is shared by the kernel
path: only the scores are a Pallas kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
CANDIDATE_BLOCK = 8  # compressed positions per candidate block


def num_visible(q_positions, compress_ratio, num_rows):
    """int32 [T]: how many compressed rows each query sees."""
    return jnp.clip((q_positions + 1) // compress_ratio, 0, num_rows)


def indexer_scores_ref(q, weights, index_keys, q_positions, *, compress_ratio):
    """q f32 [T, H, Dk], weights [T, H], index_keys [N, Dk], q_positions int32 [T]
    -> f32 [T, N], -inf where the row is not visible."""
    s = jnp.einsum(
        "thd,nd->thn", q.astype(jnp.float32), index_keys.astype(jnp.float32), precision=HIGHEST
    )
    scores = jnp.einsum(
        "thn,th->tn", jax.nn.relu(s), weights.astype(jnp.float32), precision=HIGHEST
    )
    rows = jnp.arange(index_keys.shape[0], dtype=jnp.int32)
    visible = rows[None, :] < num_visible(q_positions, compress_ratio, index_keys.shape[0])[:, None]
    return jnp.where(visible, scores, -jnp.inf)


def block_candidates(
    scores, q_positions, *, num_blocks, compress_ratio=1, block_size=CANDIDATE_BLOCK
):
    """The hierarchical indexer's candidate mask (the Full layer's step at ratio 1).

    Rows are grouped into blocks of `block_size`; a block's score is the max of its
    visible rows. Each query keeps its top `num_blocks` blocks (ties: lower block first)
    plus the newest partly filled block. scores: f32 [T, N] with -inf = invisible.
    Returns bool [T, N]: visible rows inside a kept block.
    """
    num_tokens, num_rows = scores.shape
    nb = -(-num_rows // block_size)
    padded = jnp.pad(scores, ((0, 0), (0, nb * block_size - num_rows)), constant_values=-jnp.inf)
    block_score = padded.reshape(num_tokens, nb, block_size).max(axis=-1)
    k = min(num_blocks, nb)
    top_val, top_idx = jax.lax.top_k(block_score, k)
    kept = (
        jnp.zeros((num_tokens, nb), bool)
        .at[jnp.arange(num_tokens)[:, None], top_idx]
        .set(top_val > -jnp.inf)
    )
    n_vis = num_visible(q_positions, compress_ratio, num_rows)
    newest = n_vis // block_size  # the block holding the newest rows, if partly filled
    partly = (n_vis % block_size) != 0
    kept |= (jnp.arange(nb)[None, :] == newest[:, None]) & partly[:, None]
    rows = jnp.arange(num_rows)
    mask = jnp.repeat(kept, block_size, axis=1)[:, :num_rows]
    return mask & (rows[None, :] < n_vis[:, None])


def select_top_k(scores, top_k, candidate_mask=None):
    """Top-k visible (and candidate) rows per query, sorted by position; -1 = empty slot.

    Ties go to the lower row id (lax.top_k keeps the lower index first), so the
    selection is deterministic. Returns int32 [T, top_k].
    """
    num_tokens, num_rows = scores.shape
    if candidate_mask is not None:
        scores = jnp.where(candidate_mask, scores, -jnp.inf)
    if top_k > num_rows:
        scores = jnp.pad(scores, ((0, 0), (0, top_k - num_rows)), constant_values=-jnp.inf)
    val, idx = jax.lax.top_k(scores, top_k)
    idx = jnp.where(val > -jnp.inf, idx, num_rows + top_k)  # empties sort last
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx >= num_rows, -1, idx).astype(jnp.int32)
