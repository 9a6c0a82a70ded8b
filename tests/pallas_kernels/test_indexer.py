"""indexer_topk: lightning-indexer scores, causal visibility, candidate blocks, top-k."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import indexer_topk
from pallas_kernels.indexer import block_candidates
from pallas_kernels.lowering import TRITON_CALL, export_cuda, export_tpu
from tests.pallas_kernels.helpers import spec


def _inputs(seed, *, num_tokens=11, num_heads=4, index_dim=32, num_rows=40, ratio=2):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, index_dim)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((num_tokens, num_heads)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((num_rows, index_dim)), jnp.float32)
    # Positions from 0 (sees nothing at ratio 2) to past the last compressed row.
    pos = np.sort(rng.choice(num_rows * ratio + 8, num_tokens - 1, replace=False))
    pos = jnp.asarray(np.concatenate([[0], pos + 1]), jnp.int32)
    return q, w, k, pos


def _scores_f64(q, w, k, pos, ratio):
    q, w, k = (np.asarray(x, np.float64) for x in (q, w, k))
    s = np.einsum("th,thn->tn", w, np.maximum(np.einsum("thd,nd->thn", q, k), 0.0))
    visible = np.arange(k.shape[0])[None, :] < ((np.asarray(pos) + 1) // ratio)[:, None]
    return np.where(visible, s, -np.inf), visible


def _top_k_numpy(scores, visible, top_k):
    """Stable argsort: equal scores keep the lower row first."""
    out = np.full((scores.shape[0], top_k), -1)
    for t in range(scores.shape[0]):
        rows = np.flatnonzero(visible[t])
        best = rows[np.argsort(-scores[t, rows], kind="stable")][:top_k]
        out[t, : len(best)] = np.sort(best)
    return out


def test_ref_matches_float64_and_numpy_top_k():
    q, w, k, pos = _inputs(0)
    idx, scores = indexer_topk(q, w, k, pos, top_k=6, compress_ratio=2)  # CPU: reference
    s64, visible = _scores_f64(q, w, k, pos, 2)
    np.testing.assert_array_equal(np.isneginf(scores), ~visible)
    np.testing.assert_allclose(np.asarray(scores)[visible], s64[visible], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(idx, _top_k_numpy(s64, visible, 6))
    assert (np.asarray(idx)[0] == -1).all()  # position 0 at ratio 2 sees no row


@pytest.mark.parametrize("ratio,num_rows,tpu_checks", [(2, 40, False), (1, 300, True)])
def test_kernel_matches_ref(ratio, num_rows, tpu_checks):
    """300 rows: three key tiles of 128 (one padded), the last skipped for early tokens;
    that case under TPU interpret mode with NaN-filled buffers and OOB reads raising."""
    q, w, k, pos = _inputs(1, ratio=ratio, num_rows=num_rows)
    interpret = (
        pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
        if tpu_checks
        else True
    )
    want = indexer_topk(q, w, k, pos, top_k=8, compress_ratio=ratio)
    got = indexer_topk(q, w, k, pos, top_k=8, compress_ratio=ratio, interpret=interpret)
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
    finite = np.isfinite(np.asarray(want[1]))
    np.testing.assert_allclose(
        np.asarray(got[1])[finite], np.asarray(want[1])[finite], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(got[0], want[0])


def test_top_k_at_least_visible_returns_exactly_the_visible_rows():
    q, w, k, pos = _inputs(2)
    idx, _ = indexer_topk(q, w, k, pos, top_k=45, compress_ratio=2)
    for t, p in enumerate(np.asarray(pos)):
        n = min((p + 1) // 2, 40)
        np.testing.assert_array_equal(
            np.asarray(idx[t]), np.concatenate([np.arange(n), np.full(45 - n, -1)])
        )


def test_ties_go_to_the_lower_row():
    q, w, k, pos = _inputs(3, num_rows=16, ratio=1)
    k = jnp.tile(k[:4], (4, 1))  # rows r, r + 4, r + 8, r + 12 score the same
    idx, scores = indexer_topk(q, w, k, jnp.full_like(pos, 100), top_k=6, compress_ratio=1)
    s = np.asarray(scores)
    np.testing.assert_array_equal(s[:, :4], s[:, 12:])  # the ties are real
    np.testing.assert_array_equal(idx, _top_k_numpy(s, np.ones(s.shape, bool), 6))
    # 6 slots over 4-way ties: the best group fills 4, the second its lowest two rows.
    for t in range(q.shape[0]):
        order = np.argsort(-s[t, :4], kind="stable")
        want = np.sort(np.concatenate([order[0] + 4 * np.arange(4), order[1] + 4 * np.arange(2)]))
        np.testing.assert_array_equal(idx[t], want)


def test_block_candidates_keep_top_blocks_plus_newest_partial():
    q, w, k, pos = _inputs(4, num_rows=60, ratio=1, num_tokens=9)
    pos = jnp.asarray([0, 5, 8, 16, 23, 33, 47, 59, 70], jnp.int32)
    idx, scores = indexer_topk(q, w, k, pos, top_k=5, compress_ratio=1, num_candidate_blocks=2)
    mask = np.asarray(block_candidates(scores, pos, num_blocks=2))
    s = np.asarray(scores)
    for t, p in enumerate(np.asarray(pos)):
        n = min(p + 1, 60)
        blocks = [s[t, b * 8 : min(b * 8 + 8, n)].max() for b in range(-(-n // 8))]
        keep = set(np.argsort(-np.asarray(blocks), kind="stable")[:2].tolist())
        if n % 8:
            keep.add(n // 8)
        want = np.array([(r // 8) in keep and r < n for r in range(60)])
        np.testing.assert_array_equal(mask[t], want)
        masked = np.where(want, s[t], -np.inf)
        np.testing.assert_array_equal(idx[t], _top_k_numpy(masked[None], want[None], 5)[0])
    # Reindex layers pass the Full layer's mask: the same selection.
    again, _ = indexer_topk(q, w, k, pos, top_k=5, candidate_mask=jnp.asarray(mask))
    np.testing.assert_array_equal(again, idx)


def test_validation_errors():
    q, w, k, pos = _inputs(5)
    with pytest.raises(ValueError, match="weights must have shape"):
        indexer_topk(q, w[:, :2], k, pos, top_k=4)
    with pytest.raises(ValueError, match="index_keys dim"):
        indexer_topk(q, w, k[:, :8], pos, top_k=4)
    with pytest.raises(ValueError, match="q_positions must have dtype"):
        indexer_topk(q, w, k, pos.astype(jnp.float32), top_k=4)
    with pytest.raises(ValueError, match="top_k must be positive"):
        indexer_topk(q, w, k, pos, top_k=0)
    with pytest.raises(ValueError, match="not both"):
        indexer_topk(
            q, w, k, pos, top_k=4, num_candidate_blocks=2, candidate_mask=jnp.ones((11, 40), bool)
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu_and_reference_for_cuda(dtype):
    q, w, k, pos = _inputs(6)
    fn = lambda q, w, k, pos: indexer_topk(
        q, w, k, pos, top_k=8, compress_ratio=2, num_candidate_blocks=2
    )
    args = [spec(q.astype(dtype)), spec(w), spec(k.astype(dtype)), spec(pos)]
    assert "tpu_custom_call" in export_tpu(fn, *args)
    assert TRITON_CALL not in export_cuda(fn, *args)
