"""block_sparse_attention: BSR pattern vs ref, vs dense masked attention, merge of halves."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import AttentionVariant, block_sparse_attention, merge_states
from pallas_kernels.lowering import TRITON_CALL, export_cuda, export_tpu
from tests.pallas_kernels.helpers import assert_close, dense_attention_f64, spec

BR, BC = 8, 8


def _pattern(rng, num_row_blocks, num_col_blocks, density=0.5):
    """A random block mask (row block 1 empty) and its BSR form, columns shuffled."""
    mask = rng.random((num_row_blocks, num_col_blocks)) < density
    mask[1] = False
    mask[0, 0] = True
    indptr = np.concatenate([[0], np.cumsum(mask.sum(1))]).astype(np.int32)
    indices = np.concatenate([rng.permutation(np.flatnonzero(r)) for r in mask]).astype(np.int32)
    return mask, jnp.asarray(indptr), jnp.asarray(indices)


def _inputs(seed, *, num_q_heads=4, num_kv_heads=2, head_dim=64, row_blocks=3, col_blocks=4):
    rng = np.random.default_rng(seed)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q = f32(row_blocks * BR, num_q_heads, head_dim)
    k, v = (f32(col_blocks * BC, num_kv_heads, head_dim) for _ in range(2))
    mask, indptr, indices = _pattern(rng, row_blocks, col_blocks)
    return (q, k, v, indptr, indices), mask, f32(num_q_heads)


def _dense_mask(block_mask):
    return np.repeat(np.repeat(block_mask, BR, 0), BC, 1)


def test_ref_matches_float64_dense_masked_attention():
    (q, k, v, indptr, indices), mask, sinks = _inputs(0)
    out, lse = block_sparse_attention(q, k, v, indptr, indices, block_r=BR, block_c=BC, sinks=sinks)
    dense = _dense_mask(mask)
    for t in range(q.shape[0]):
        o64, lse64 = dense_attention_f64(q[t], k, v, dense[t], q.shape[-1] ** -0.5, sinks)
        assert_close(out[t], o64)
        assert_close(lse[t], lse64)


@pytest.mark.parametrize("hq,hkv,d,extras", [(4, 2, 64, False), (8, 1, 128, True)])
def test_kernel_matches_ref(hq, hkv, d, extras):
    (q, k, v, indptr, indices), mask, sinks = _inputs(
        1, num_q_heads=hq, num_kv_heads=hkv, head_dim=d
    )
    kw = dict(block_r=BR, block_c=BC)
    if extras:  # sinks, soft-cap and a functor using positions and heads
        kw.update(
            sinks=sinks,
            soft_cap=4.0,
            variant=AttentionVariant(
                logits_fn=lambda s, qp, kp, h: s - 0.02 * jnp.abs(qp - kp) + 0.1 * h
            ),
        )
    want = block_sparse_attention(q, k, v, indptr, indices, **kw)
    interpret = (
        pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
        if extras
        else True
    )
    got = block_sparse_attention(q, k, v, indptr, indices, interpret=interpret, **kw)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    if not extras:  # row block 1 reads nothing: out 0, lse -inf
        np.testing.assert_array_equal(np.asarray(got[0])[BR : 2 * BR], 0.0)
        assert np.all(np.isneginf(np.asarray(got[1])[BR : 2 * BR]))


def test_merge_of_disjoint_halves_equals_whole():
    """Split every row's column blocks into two disjoint BSR matrices; merge == whole."""
    (q, k, v, indptr, indices), mask, _ = _inputs(2, col_blocks=6)
    rng = np.random.default_rng(3)
    whole = block_sparse_attention(q, k, v, indptr, indices, block_r=BR, block_c=BC, interpret=True)
    pick = rng.random(mask.shape) < 0.5
    halves = []
    for part in (mask & pick, mask & ~pick):
        ip = np.concatenate([[0], np.cumsum(part.sum(1))]).astype(np.int32)
        ix = np.concatenate([np.flatnonzero(r) for r in part]).astype(np.int32)
        halves.append(
            block_sparse_attention(
                q, k, v, jnp.asarray(ip), jnp.asarray(ix), block_r=BR, block_c=BC
            )
        )
    merged = merge_states(*halves)
    assert_close(merged[0], whole[0])
    assert_close(merged[1], whole[1])


def test_validation_errors():
    (q, k, v, indptr, indices), _, _ = _inputs(4)
    with pytest.raises(ValueError, match="row blocks"):
        block_sparse_attention(q[:-1], k, v, indptr, indices, block_r=BR, block_c=BC)
    with pytest.raises(ValueError, match="multiple of block_c"):
        block_sparse_attention(q, k, v, indptr, indices, block_r=BR, block_c=5)
    with pytest.raises(ValueError, match="indices must have dtype"):
        block_sparse_attention(q, k, v, indptr, indices.astype(jnp.int16), block_r=BR, block_c=BC)
    with pytest.raises(ValueError, match="indptr must be 1-D"):
        block_sparse_attention(q, k, v, indptr[None], indices, block_r=BR, block_c=BC)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu_and_reference_for_cuda(dtype):
    (q, k, v, indptr, indices), _, sinks = _inputs(5)
    fn = lambda q, k, v, ip, ix, s: block_sparse_attention(
        q, k, v, ip, ix, block_r=BR, block_c=BC, sinks=s, soft_cap=30.0
    )
    args = [spec(x.astype(dtype)) for x in (q, k, v)] + [spec(indptr), spec(indices), spec(sinks)]
    assert "tpu_custom_call" in export_tpu(fn, *args)
    assert TRITON_CALL not in export_cuda(fn, *args)
