"""paged_attention: ref vs float64 numpy, kernels vs ref, edge cases, validation, lowering."""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import AttentionVariant, alibi, paged_attention, sigmoid
from pallas_kernels.paged_attention.kernel_gpu import paged_attention_gpu
from pallas_kernels.variant import resolve
from pallas_kernels.lowering import TRITON_CALL, export_cuda, export_tpu
from tests.pallas_kernels.helpers import assert_close, dense_attention_f64, paged_inputs, spec

# (num_q_heads, num_kv_heads, head_dim, page_size, kv_lens, sliding_window, soft_cap, sinks)
# kv_lens cover 0, 1, a page boundary, one past it and a partial last page;
# windows shorter and longer than the context; GQA ratios 1, 4, 8; head_dim 64/128/512.
CASES = {
    "gqa1_d64_edges": (4, 4, 64, 16, [0, 1, 16, 17], None, None, False),
    "gqa4_d128_window_sinks": (8, 2, 128, 16, [33, 48, 5], 7, None, True),
    "gqa8_d512_longwindow_cap": (8, 1, 512, 16, [1, 40], 1000, 5.0, True),
}


def _inputs(case, seed=0, max_pages=3):
    hq, hkv, d, ps, kv_lens, window, cap, with_sinks = CASES[case]
    rng = np.random.default_rng(seed)
    q, k, v, bt, kl = paged_inputs(
        rng,
        kv_lens=kv_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        max_pages=max_pages,
    )
    sinks = jnp.asarray(rng.standard_normal(hq) + 2.0, jnp.float32) if with_sinks else None
    return (q, k, v, bt, kl), dict(sliding_window=window, soft_cap=cap, sinks=sinks)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ref_matches_float64_dense_attention(case):
    (q, k, v, bt, kl), kw = _inputs(case)
    out, lse = paged_attention(q, k, v, bt, kl, **kw)  # CPU: the XLA reference
    d = q.shape[-1]
    ps = k.shape[1]
    for b, n in enumerate(np.asarray(kl)):
        pages = np.asarray(bt[b, : -(-n // ps)]) if n else np.zeros(0, np.int32)
        kb = np.asarray(k)[pages].reshape(-1, *k.shape[2:])[:n]
        vb = np.asarray(v)[pages].reshape(-1, *v.shape[2:])[:n]
        pos = np.arange(n)
        mask = pos >= n - kw["sliding_window"] if kw["sliding_window"] else np.ones(n, bool)
        cap = kw["soft_cap"]
        fn = (lambda s: cap * np.tanh(s / cap)) if cap else None
        o64, lse64 = dense_attention_f64(q[b], kb, vb, mask, d**-0.5, kw["sinks"], fn)
        assert_close(out[b], o64)
        assert_close(lse[b], lse64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_match_ref(case):
    args, kw = _inputs(case, seed=1)
    want = paged_attention(*args, **kw)
    got = paged_attention(*args, interpret=True, **kw)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    empty = np.asarray(args[4]) == 0
    if empty.any():  # documented contract: kv_len 0 -> out 0, lse -inf
        np.testing.assert_array_equal(np.asarray(got[0])[empty], 0.0)
        assert np.all(np.isneginf(np.asarray(got[1])[empty]))
    d = args[0].shape[-1]
    got = paged_attention_gpu(
        *args,
        kw["sinks"],
        sm_scale=d**-0.5,
        sliding_window=kw["sliding_window"],
        variant=resolve(None, kw["soft_cap"]),
        interpret=True,
    )
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


def test_tpu_interpret_semantics_catch_nothing():
    """TPU interpret mode: NaN-filled scratch, OOB reads raise; garbage table slots unread."""
    args, kw = _inputs("gqa4_d128_window_sinks", seed=2)
    params = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
    out, lse = paged_attention(*args, interpret=params, **kw)
    want = paged_attention(*args, **kw)
    assert_close(out, want[0])
    assert_close(lse, want[1])


@pytest.mark.parametrize("variant", ["sigmoid", "custom_bias"])
def test_logits_functor_is_compiled_into_kernels(variant):
    args, _ = _inputs("gqa4_d128_window_sinks", seed=3)
    hq = args[0].shape[1]
    var = {
        "alibi": AttentionVariant(logits_fn=alibi(hq)),
        "sigmoid": sigmoid(bias=-1.0),
        # A causal-distance penalty that depends on every context argument.
        "custom_bias": AttentionVariant(
            logits_fn=lambda s, qp, kp, h: s + 0.1 * h - 0.05 * jnp.abs(qp - kp)
        ),
    }[variant]
    want = paged_attention(*args, variant=var)
    plain = paged_attention(*args)
    assert not np.allclose(want[0][1], plain[0][1])  # the transform did something
    assert_close(paged_attention(*args, variant=var, interpret=True)[0], want[0])
    got = paged_attention_gpu(
        *args, sm_scale=args[0].shape[-1] ** -0.5, variant=var, interpret=True
    )
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


def test_alibi_matches_float64():
    (q, k, v, bt, kl), _ = _inputs("gqa1_d64_edges", seed=6)
    out, _ = paged_attention(q, k, v, bt, kl, variant=AttentionVariant(logits_fn=alibi(4)))
    b, n = 3, int(kl[3])
    kb = np.asarray(k)[np.asarray(bt[b, :2])].reshape(-1, *k.shape[2:])[:n]
    vb = np.asarray(v)[np.asarray(bt[b, :2])].reshape(-1, *v.shape[2:])[:n]
    slopes = 2.0 ** (-8.0 * np.arange(1, 5) / 4)
    bias = -slopes[:, None] * (n - 1 - np.arange(n))[None, :]
    o64, _ = dense_attention_f64(
        q[b], kb, vb, np.ones(n, bool), 1 / 8, logits_fn=lambda s: s + bias
    )
    assert_close(out[b], o64)


def test_sigmoid_reference_is_unnormalised_sum():
    args, _ = _inputs("gqa1_d64_edges", seed=4)
    q, k, v, bt, kl = args
    out, lse = paged_attention(*args, variant=sigmoid())
    b, n = 3, int(kl[3])
    kb = np.asarray(k)[np.asarray(bt[b, :2])].reshape(-1, *k.shape[2:])[:n]
    vb = np.asarray(v)[np.asarray(bt[b, :2])].reshape(-1, *v.shape[2:])[:n]
    s = np.einsum("hd,shd->hs", np.asarray(q[b], np.float64), kb) / 8.0
    w = 1 / (1 + np.exp(-s))
    assert_close(out[b], np.einsum("hs,shd->hd", w, vb))
    assert_close(lse[b], np.log(w.sum(1)))


def test_bf16_kernel_close_to_ref():
    (q, k, v, bt, kl), kw = _inputs("gqa4_d128_window_sinks", seed=5)
    args = [x.astype(jnp.bfloat16) for x in (q, k, v)] + [bt, kl]
    want = paged_attention(*args, **kw)
    got = paged_attention(*args, interpret=True, **kw)
    # bf16 output rounding (2^-8 relative) dominates; probabilities are cast to bf16 for PV.
    assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    assert_close(got[1], want[1], rtol=1e-3, atol=1e-3)


def test_validation_errors():
    (q, k, v, bt, kl), _ = _inputs("gqa4_d128_window_sinks")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(q[:, :3], k, v, bt, kl)
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        paged_attention(q, k, v, bt.astype(jnp.float32), kl)
    with pytest.raises(ValueError, match="kv_lens must have shape"):
        paged_attention(q, k, v, bt, kl[:1])
    with pytest.raises(ValueError, match="k_pages must be 4-D"):
        paged_attention(q, k[0], v, bt, kl)
    with pytest.raises(ValueError, match="sinks must have shape"):
        paged_attention(q, k, v, bt, kl, sinks=jnp.zeros(3))
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        paged_attention(q, k, v, bt, kl, sliding_window=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu_and_cuda(dtype):
    (q, k, v, bt, kl), kw = _inputs("gqa4_d128_window_sinks")
    args = [spec(x.astype(dtype)) for x in (q, k, v)] + [spec(bt), spec(kl), spec(kw["sinks"])]
    fn = lambda q, k, v, bt, kl, sinks: paged_attention(
        q,
        k,
        v,
        bt,
        kl,
        sinks=sinks,
        sliding_window=7,
        soft_cap=30.0,
        variant=AttentionVariant(logits_fn=alibi(8)),
    )
    assert "tpu_custom_call" in export_tpu(fn, *args)
    assert TRITON_CALL in export_cuda(fn, *args)


def test_cuda_falls_back_to_xla_when_triton_cannot_tile():
    """page_size 8 is below Triton's 16-wide dot: CUDA lowers the reference, not a kernel."""
    rng = np.random.default_rng(7)
    args = paged_inputs(
        rng, kv_lens=[9, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8, max_pages=2
    )
    mlir = export_cuda(lambda *a: paged_attention(*a), *[spec(x) for x in args])
    assert TRITON_CALL not in mlir
