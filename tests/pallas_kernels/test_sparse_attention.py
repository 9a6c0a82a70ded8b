"""sparse_attention (CSA2 selected rows + window + sink) and merge_states."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import merge_states, paged_attention, sparse_attention
from pallas_kernels.lowering import TRITON_CALL, export_cuda, export_tpu
from tests.pallas_kernels.helpers import assert_close, dense_attention_f64, paged_inputs, spec


def _csa_inputs(
    seed, *, num_q_heads=4, num_kv_heads=1, head_dim=128, num_rows=40, num_selected=12, window=5
):
    rng = np.random.default_rng(seed)
    t = 3
    q = jnp.asarray(rng.standard_normal((t, num_q_heads, head_dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((num_rows, num_kv_heads, head_dim)), jnp.float32)
    wk = jnp.asarray(rng.standard_normal((10, num_kv_heads, head_dim)), jnp.float32)
    wv = jnp.asarray(rng.standard_normal((10, num_kv_heads, head_dim)), jnp.float32)
    idx = np.where(
        rng.random((t, num_selected)) < 0.3, -1, rng.integers(0, num_rows, (t, num_selected))
    )
    idx[0] = -1  # token 0 selected nothing
    widx = rng.integers(-1, 10, (t, window))
    widx[2] = -1  # token 2 has no window rows
    sinks = jnp.asarray(rng.standard_normal(num_q_heads), jnp.float32)
    return q, kv, jnp.asarray(idx, jnp.int32), (wk, wv, jnp.asarray(widx, jnp.int32)), sinks


def test_ref_matches_float64_dense_attention():
    q, kv, idx, (wk, wv, widx), sinks = _csa_inputs(0)
    out, lse = sparse_attention(q, kv, kv, idx, window=(wk, wv, widx), sinks=sinks)
    for t in range(q.shape[0]):
        rows = np.asarray(idx[t])
        wrows = np.asarray(widx[t])
        sel, win = np.maximum(rows, 0), np.maximum(wrows, 0)
        k = np.concatenate([np.asarray(kv)[sel], np.asarray(wk)[win]])
        v = np.concatenate([np.asarray(kv)[sel], np.asarray(wv)[win]])
        mask = np.concatenate([rows >= 0, wrows >= 0])
        o64, lse64 = dense_attention_f64(q[t], k, v, mask, q.shape[-1] ** -0.5, sinks)
        assert_close(out[t], o64)
        assert_close(lse[t], lse64)


# (num_q_heads, num_kv_heads, head_dim, with window + sinks + soft-cap)
@pytest.mark.parametrize("hq,hkv,head_dim,extras", [(8, 1, 512, True), (4, 4, 64, False)])
def test_tpu_kernel_matches_ref(hq, hkv, head_dim, extras):
    q, kv, idx, window, sinks = _csa_inputs(1, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim)
    kw = dict(window=window, sinks=sinks, soft_cap=4.0) if extras else {}
    want = sparse_attention(q, kv, kv, idx, **kw)
    got = sparse_attention(q, kv, kv, idx, interpret=True, **kw)  # TPU interpret: real DMAs
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    if not extras:  # token 0 selected nothing: out 0, lse -inf
        np.testing.assert_array_equal(np.asarray(got[0])[0], 0.0)
        assert np.all(np.isneginf(np.asarray(got[1])[0]))


def test_merge_of_any_split_equals_unsplit():
    """Paged prefix [0, cut) merged with a sparse suffix [cut, kv_len) == whole paged call."""
    rng = np.random.default_rng(2)
    ps = 8
    q, k, v, bt, kl = paged_inputs(
        rng,
        kv_lens=[37, 1, 0, 16],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=ps,
        max_pages=5,
    )
    whole = paged_attention(q, k, v, bt, kl)
    k_rows = k.reshape(-1, *k.shape[2:])
    v_rows = v.reshape(-1, *v.shape[2:])
    pos = np.arange(5 * ps)
    flat = np.asarray(bt)[:, pos // ps] * ps + pos % ps  # row id of every position
    for cut in (0, 5, 8, 30, 40):
        prefix = paged_attention(q, k, v, bt, jnp.minimum(kl, cut))
        in_suffix = (pos[None] >= cut) & (pos[None] < np.asarray(kl)[:, None])
        suffix = sparse_attention(
            q, k_rows, v_rows, jnp.asarray(np.where(in_suffix, flat, -1), jnp.int32)
        )
        for merged in (merge_states(prefix, suffix), merge_states(suffix, prefix)):
            assert_close(merged[0], whole[0])
            assert_close(merged[1], whole[1])


def test_merge_sparse_segments_equals_concatenated():
    q, kv, idx, (wk, wv, widx), _ = _csa_inputs(3)
    whole = sparse_attention(q, kv, kv, idx, window=(wk, wv, widx))
    a = sparse_attention(q, kv, kv, idx)
    b = sparse_attention(q, wk, wv, widx)
    merged = merge_states(a, b)
    assert_close(merged[0], whole[0])
    assert_close(merged[1], whole[1])
    # Three-way split of the selected rows, merged in two different orders.
    splits = (slice(0, 3), slice(3, 7), slice(7, None))
    parts = [sparse_attention(q, kv, kv, idx[:, s]) for s in splits]
    left = merge_states(merge_states(parts[0], parts[1]), parts[2])
    right = merge_states(parts[0], merge_states(parts[2], parts[1]))
    assert_close(left[0], a[0])
    assert_close(right[0], a[0])
    assert_close(right[1], a[1])


def test_validation_errors():
    q, kv, idx, window, sinks = _csa_inputs(4)
    with pytest.raises(ValueError, match="indices must have dtype"):
        sparse_attention(q, kv, kv, idx.astype(jnp.int16))
    with pytest.raises(ValueError, match="tokens"):
        sparse_attention(q, kv, kv, idx[:2])
    with pytest.raises(ValueError, match="out_b must have shape"):
        merge_states((q, q[..., 0]), (q[:1], q[:1, :, 0]))


def test_lowers_for_tpu_and_cpu_path_for_cuda():
    q, kv, idx, window, sinks = _csa_inputs(5)
    fn = lambda q, kv, idx, wk, wv, widx, sinks: sparse_attention(
        q, kv, kv, idx, window=(wk, wv, widx), sinks=sinks
    )
    args = [spec(x) for x in (q, kv, idx, *window, sinks)]
    assert "tpu_custom_call" in export_tpu(fn, *args)
    # No GPU kernel yet: CUDA lowers the XLA reference (gather + dense), no custom call.
    assert TRITON_CALL not in export_cuda(fn, *args)
