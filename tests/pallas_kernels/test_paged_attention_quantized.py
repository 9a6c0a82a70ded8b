"""paged_attention_quantized: kernel vs reference per format, error vs full precision,
validation, lowering, and that the kernel reads low-bit leaves only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import paged_attention_quantized
from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.paged_attention.kernel_tpu import paged_attention_tpu
from pallas_kernels.variant import resolve
from quant.blockscaled import MXFP4, nvfp4_quantize
from quant.kv_rows import quantize_rows
from quant.lloyd_max import sphere_codebook_mse
from quant.packing import unpack_bits
from quant.turboquant import TurboQuant, TurboQuantSplit
from pallas_kernels.lowering import TRITON_CALL, export_cuda, export_tpu
from tests.pallas_kernels.helpers import assert_close, assert_written_in_place, paged_inputs, spec

D = 64
TQ4, TQ1 = TurboQuant(D, 4, seed=3), TurboQuant(D, 1, seed=4)
# The KV cache's turboquant-3.5 / -2.5: channel halves at 4 + 3 / 3 + 2 bits (3 straddles bytes);
# 3.5 also with two sparse channels per half and rescaled norms (the cache keeps one per half).
OUTLIERS = tuple(range(D // 4, D // 2)) + tuple(range(3 * D // 4, D))
TQ35 = TurboQuantSplit(D, 3.5, OUTLIERS, seed=5, sparse=2, rescale=True)
TQ25 = TurboQuantSplit(D, 2.5, OUTLIERS[::-1], seed=6)
FORMATS = {"int8": "int8", "fp8": "fp8", "nvfp4": "nvfp4", "mxfp4": "mxfp4", "tq4": TQ4, "tq1": TQ1,
           "tq3.5": TQ35, "tq2.5": TQ25}
SINKS = (0.5, -1.0, 2.0, 0.0)


def _problem(name, seed, kv_lens=(0, 1, 8, 13, 20), num_kv_heads=1):
    """Quantized paged problem; kv_lens cover empty, 1, a page boundary and partial pages."""
    rng = np.random.default_rng(seed)
    q, k, v, bt, kl = paged_inputs(
        rng,
        kv_lens=list(kv_lens),
        num_q_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=D,
        page_size=8,
        max_pages=3,
    )
    # Spread the row magnitudes so per-row / per-block scales matter.
    k = k * jnp.exp(jnp.asarray(rng.uniform(-1, 1, (*k.shape[:3], 1)), jnp.float32))
    fmt = kv_formats.resolve(FORMATS[name])
    return (q, fmt.quantize(k), fmt.quantize(v), bt, kl), (k, v)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_kernel_matches_reference(name):
    """Kernel and reference decode the same codes: equal to f32 rounding (sinks, soft cap;
    GQA over two KV heads for the per-token and NVFP4 scales, one head elsewhere for speed).

    NVFP4 runs under TPU interpret semantics (NaN-filled scratch, out-of-bounds reads
    raise) with a sliding window, so skipped pages and garbage table slots are exercised.
    """
    args, _ = _problem(name, seed=1, num_kv_heads=2 if name in ("int8", "nvfp4") else 1)
    kw = dict(sinks=jnp.asarray(SINKS), soft_cap=20.0)
    interpret = True
    if name == "nvfp4":
        interpret = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
        kw["sliding_window"] = 9
    want = paged_attention_quantized(*args, kv_format=FORMATS[name], **kw)  # CPU: reference
    got = paged_attention_quantized(*args, kv_format=FORMATS[name], interpret=interpret, **kw)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    empty = np.asarray(args[4]) == 0
    np.testing.assert_array_equal(np.asarray(got[0])[empty], 0.0)


def test_bf16_query_close_to_reference():
    args, _ = _problem("int8", seed=3, kv_lens=(9, 2))
    args = (args[0].astype(jnp.bfloat16), *args[1:])
    want = paged_attention_quantized(*args, kv_format="int8")
    got = paged_attention_quantized(*args, kv_format="int8", interpret=True)
    assert got[0].dtype == jnp.bfloat16
    # The kernel rounds decoded tiles and probabilities to bf16 for the MXU (2^-9 relative
    # each, so logits move by <= 2^-9 sum_j |q_j k_j| / 8 ~ 1e-2 here) and outputs bf16.
    assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    assert_close(got[1], want[1], rtol=1e-2, atol=1e-2)


def _elem_error_bound(name, x, qx):
    """The format's worst-case |x - x_hat| per element (None for TurboQuant).

    int8: half a step, scale / 2. fp8 (3 mantissa bits): 2^-4 |x| in the normal range,
    2^-10 scale below it. E2M1 (grid 0, .5, 1, 1.5, 2, 3, 4, 6) on r = |x| / S: half the
    spacing, 0.25 below 2, 0.5 below 4, 1 up to 6, and r - 6 where it saturates (NVFP4's
    rounded E4M3 scale or MXFP4's floor exponent can leave r slightly / up to 8 above 6).
    """
    x = np.asarray(x, np.float64)
    if name in ("int8", "fp8"):
        s = np.asarray(qx.scales, np.float64)[..., None]
        return s / 2 if name == "int8" else np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * s)
    if name in ("nvfp4", "mxfp4"):
        raw = np.asarray(qx.scales.astype(jnp.float32) if name == "nvfp4" else qx.scales)
        s = raw.astype(np.float64) if name == "nvfp4" else 2.0 ** (raw.astype(np.float64) - 127)
        s = np.repeat(s, 16 if name == "nvfp4" else 32, axis=-1)
        r = np.abs(x) / s
        half = np.where(r <= 2, 0.25, np.where(r <= 4, 0.5, 1.0))
        return s * np.maximum(half, r - 6)
    return None


@pytest.mark.parametrize("name", ["int8", "fp8", "nvfp4", "mxfp4", "tq4"])
def test_error_vs_full_precision_within_format_bound(name):
    """Quantized attention stays within a bound propagated from the format's rounding error.

    Derivation. Let e = x_hat - x per element, |e| <= eps (the format's bound above; for
    TurboQuant E||e_t||^2 = ||x_t||^2 D_b with D_b the Lloyd-Max distortion, spread evenly
    over the d rotated-then-unrotated channels, so Var(e_tj) = ||x_t||^2 D_b / d).
    Treat rounding errors as independent and zero-mean (Var <= eps^2 for a bounded one).
    Logits: ds_t = sm_scale <q, e^k_t>, Var(ds_t) <= sm_scale^2 sum_j q_j^2 eps^k_tj^2.
    Softmax Jacobians (p from full precision): dlse = sum_t p_t ds_t and
    do_j = sum_t p_t (v_tj - o_j) ds_t + sum_t p_t e^v_tj, so
      sigma_lse^2 <= sum_t p_t^2 Var(ds_t),
      sigma_o,j^2 <= sum_t p_t^2 ((v_tj - o_j)^2 Var(ds_t) + eps^v_tj^2).
    Each is a sum of many independent bounded terms, so (CLT) |error| <= 6 sigma fails with
    probability ~1e-9 per entry; the second-order remainder is at most
    max_t Var(ds_t) * max|v| (one more term of the expansion), plus f32 slack.
    """
    args, (k, v) = _problem(name, seed=5, kv_lens=(5, 16, 23), num_kv_heads=2)
    q, kq, vq, bt, kl = args
    fmt = kv_formats.resolve(FORMATS[name])
    out, lse = paged_attention_quantized(*args, kv_format=FORMATS[name])
    k64, v64 = np.asarray(k, np.float64), np.asarray(v, np.float64)
    eps_k, eps_v = _elem_error_bound(name, k64, kq), _elem_error_bound(name, v64, vq)
    k_err = np.asarray(fmt.dequantize(kq), np.float64) - k64
    if eps_k is None:  # TurboQuant: realised MSE close to the Lloyd-Max distortion
        dist = sphere_codebook_mse(D, 4)
        rel = np.sum(k_err**2, -1) / np.sum(k64**2, -1)
        assert 0.7 * dist < rel.mean() < 1.3 * dist
        var_k = np.repeat(np.sum(k64**2, -1, keepdims=True) * dist / D, D, -1)
        var_v = np.repeat(np.sum(v64**2, -1, keepdims=True) * dist / D, D, -1)
    else:  # the caches honour the format's worst case
        assert np.all(np.abs(k_err) <= eps_k * (1 + 1e-6) + 1e-30)
        var_k, var_v = eps_k**2, eps_v**2
    sm = D**-0.5
    group = 4 // 2
    for b, n in enumerate(np.asarray(kl)):
        pages = np.asarray(bt[b, : -(-n // 8)])
        kb, vb, vk, vv = (a[pages].reshape(-1, *a.shape[2:])[:n] for a in (k64, v64, var_k, var_v))
        qb = np.asarray(q[b], np.float64)
        kh, vh = np.repeat(kb, group, 1), np.repeat(vb, group, 1)  # [n, Hq, D]
        s = np.einsum("hd,thd->ht", qb, kh) * sm
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        o = np.einsum("ht,thd->hd", p, vh)
        lse64 = np.log(np.sum(np.exp(s - s.max(1, keepdims=True)), 1)) + s.max(1)
        var_s = sm**2 * np.einsum("hd,thd->ht", qb**2, np.repeat(vk, group, 1))
        sig_lse = np.sqrt(np.sum(p**2 * var_s, 1))
        dv = vh.transpose(1, 0, 2) - o[:, None, :]  # [Hq, n, D]
        var_o = np.einsum("ht,htd->hd", p**2 * var_s, dv**2)
        var_o += np.einsum("ht,thd->hd", p**2, np.repeat(vv, group, 1))
        second = var_s.max() * np.abs(vb).max()
        err_lse = np.abs(np.asarray(lse[b], np.float64) - lse64)
        err_o = np.abs(np.asarray(out[b], np.float64) - o)
        assert np.all(err_lse <= 6 * sig_lse + second + 1e-5), (err_lse, sig_lse)
        assert np.all(err_o <= 6 * np.sqrt(var_o) + second + 1e-5), (err_o.max(), var_o.max())
        assert err_o.max() > 1e-6  # the cache really is quantized


def test_validation_errors():
    (q, kq, vq, bt, kl), (k, _) = _problem("int8", seed=6)
    call = lambda *a, **kw: paged_attention_quantized(*a, **{"kv_format": "int8", **kw})
    with pytest.raises(ValueError, match="kv_format must be one of"):
        call(q, kq, vq, bt, kl, kv_format="int4")
    with pytest.raises(ValueError, match="mode='mse' with bits"):
        call(q, kq, vq, bt, kl, kv_format=TurboQuant(D, 3))
    with pytest.raises(ValueError, match="must be a quant.RowQuantized"):
        call(q, k, vq, bt, kl)
    with pytest.raises(ValueError, match="codes must be uint8 or float8_e4m3fn, got int8"):
        call(q, kq, vq, bt, kl, kv_format="fp8")
    with pytest.raises(ValueError, match="must be a quant.NVFP4"):
        call(q, kq, vq, bt, kl, kv_format="nvfp4")
    with pytest.raises(ValueError, match="scales leading shape"):
        call(q, kq._replace(scales=kq.scales[:, :4]), vq, bt, kl)
    with pytest.raises(ValueError, match="codes last axis must be 32"):
        call(q[..., :32], kq, vq, bt, kl)
    with pytest.raises(ValueError, match="v_pages leaf shapes"):
        call(q, kq, jax.tree.map(lambda x: x[:3], vq), bt, kl)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        three = lambda c: jax.tree.map(lambda x: jnp.concatenate([x, x, x], 2), c)
        call(q, three(kq), three(vq), bt, kl)
    with pytest.raises(ValueError, match="kv_lens must have shape"):
        call(q, kq, vq, bt, kl[:1])
    with pytest.raises(ValueError, match="TurboQuant dim 32"):
        call(q, kq, vq, bt, kl, kv_format=TurboQuant(32, 2))
    mx = MXFP4(jnp.zeros((2, 8, 1, 24), jnp.uint8), jnp.zeros((2, 8, 1, 1), jnp.uint8))
    with pytest.raises(ValueError, match="mxfp4 needs head_dim % 32"):
        call(jnp.ones((5, 4, 48)), mx, mx, bt, kl, kv_format="mxfp4")


@pytest.mark.parametrize("name", ["int8", "fp8", "nvfp4", "mxfp4", "tq4"])
def test_lowers_for_tpu_reads_low_bit_leaves_and_cuda_uses_xla(name):
    args, _ = _problem(name, seed=7, num_kv_heads=2)
    q, kq, vq, bt, kl = args
    kv_format = FORMATS[name]
    fn = lambda q, kq, vq, bt, kl, sinks: paged_attention_quantized(
        q, kq, vq, bt, kl, kv_format=kv_format, sinks=sinks, sliding_window=7, soft_cap=30.0
    )
    specs = [jax.tree.map(spec, a) for a in (q, kq, vq, bt, kl, jnp.zeros(4))]
    assert "tpu_custom_call" in export_tpu(fn, *specs)
    assert TRITON_CALL not in export_cuda(fn, *specs)  # CUDA: the XLA reference
    # The kernel's operands are the containers' own low-bit leaves: no dequantized cache.
    fmt = kv_formats.resolve(kv_format)
    kernel = lambda *a: paged_attention_tpu(
        *a, sm_scale=0.125, variant=resolve(None, None), kv_format=fmt, interpret=True
    )
    jaxpr = jax.make_jaxpr(kernel)(q, kq, vq, bt, kl).jaxpr
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    num_pages = fmt.leaves(kq)[0].shape[0]
    page_avals = [x.aval for x in call.invars if x.aval.ndim >= 3 and x.aval.shape[0] == num_pages]
    leaves = [x.aval for x in fmt.leaves(kq) + fmt.leaves(vq)]
    assert [(a.shape, a.dtype) for a in page_avals] == [(a.shape, a.dtype) for a in leaves]


@pytest.mark.parametrize("bits", range(1, 9))
def test_group_codes_reads_pack_bits_streams(bits):
    """Code j of every 8-code group, read with the kernel's byte picks, equals unpack_bits'
    codes of channels j::8 (3, 5, 6, 7 straddle bytes)."""
    from quant.packing import pack_bits

    codes = np.random.default_rng(bits).integers(0, 1 << bits, (5, 64))
    packed = pack_bits(jnp.asarray(codes), bits)
    for j in range(8):
        got = kv_formats.group_codes(packed, bits, j)
        np.testing.assert_array_equal(np.asarray(got), codes[:, j::8])


def test_cpu_path_dequantizes_only_the_block_tables_pages():
    """The engine hands the entry a block table cut to the live pages of a large pool: the
    XLA path the entry runs on CPU must not decode the pages no sequence names (it
    decodes one block of the table's pages per scan step)."""
    args, _ = _problem("tq3.5", seed=8, kv_lens=(5, 16))
    q, kq, vq, bt, kl = args
    big = lambda c: jax.tree.map(lambda a: jnp.concatenate([a] * 50, 0), c)  # 50x the pages
    seen = []

    class Recording(kv_formats.TurboSplit):
        def gather(self, pages, page_ids):  # what the path then decodes
            seen.append(page_ids.shape)
            return super().gather(pages, page_ids)

    from pallas_kernels.paged_attention.xla import paged_attention_xla

    fmt = Recording(TQ35)
    got = paged_attention_xla(q, big(kq), big(vq), bt, kl, kv_format=fmt, sm_scale=D**-0.5,
                              variant=resolve(None, None))
    want = paged_attention_quantized(*args, kv_format=TQ35)
    assert seen == [tuple(bt.shape)] * 2  # K and V: [batch, pages of the table] (one block here)
    assert_close(got[0], want[0])


# The format objects' XLA-side API: every low-bit format, leaves holding every byte value.
OBJECT_FORMATS = ["int8", "fp8", "nvfp4", "mxfp4", "tq4", "tq1", "tq3.5", "tq2.5"]


def _random_bytes(rng, fmt, lead):
    """A container of `fmt` with leading shape `lead` whose code leaves hold random bytes
    (every code a decoder may meet, NaN codes included) and positive random scales."""
    template = jax.eval_shape(fmt.quantize, jax.ShapeDtypeStruct((*lead, D), jnp.float32))

    def leaf(s):
        if s.dtype == jnp.float32:  # row scales and norms
            return jnp.asarray(rng.uniform(0.1, 3.0, s.shape), jnp.float32)
        raw = rng.integers(0, 256, s.shape, dtype=np.uint8)
        return jnp.asarray(raw.view(jnp.dtype(s.dtype)) if s.dtype.itemsize == 1 else raw)

    return jax.tree.map(leaf, template)


def _bits(x):
    """Bit patterns of an f32 array, NaNs made one pattern (payloads are not compared)."""
    x = np.asarray(x, np.float32)
    return np.where(np.isnan(x), np.uint32(0x7FC00000), x.view(np.uint32))


@pytest.mark.parametrize("name", ["int8", "fp8", "nvfp4", "mxfp4"])
def test_dequantize_is_quants_decoder_bit_for_bit(name):
    """The XLA decoders (bits to f32 with integer ops) equal quant's own on every byte,
    -0.0 and NaN included; NVFP4 with its tensor scale None (1, as pools keep it) and a
    real scalar one."""
    from quant.blockscaled import mxfp4_dequantize, nvfp4_dequantize
    from quant.kv_rows import dequantize_rows

    fmt = kv_formats.resolve(name)
    pages = _random_bytes(np.random.default_rng(11), fmt, (6, 8, 2))
    if name in ("int8", "fp8"):
        wants = [(pages, dequantize_rows(pages))]
    elif name == "mxfp4":
        wants = [(pages, mxfp4_dequantize(pages))]
    else:
        assert pages.tensor_scale is None
        scaled = pages._replace(tensor_scale=jnp.float32(0.37))
        wants = [(pages, nvfp4_dequantize(pages._replace(tensor_scale=jnp.float32(1.0)))),
                 (scaled, nvfp4_dequantize(scaled))]
    for container, want in wants:
        got = jax.jit(fmt.dequantize)(container)
        np.testing.assert_array_equal(_bits(got), _bits(want))
    assert np.isnan(np.asarray(got)).any() == (name != "int8")  # NaN codes were met


@pytest.mark.parametrize("name", OBJECT_FORMATS)
def test_rows_in_the_kernels_basis_score_and_sum_like_dequantized_rows(name):
    """rows(pages, part) is tile(part) for every row: scores <split_parts(prepare_q(q))[j],
    rows j> summed over parts are <q, x_hat>, and finish_out(merge_parts(sum_t p_t rows))
    is sum_t p_t x_hat_t (an NVFP4 tensor scale folded into both)."""
    rng = np.random.default_rng(12)
    fmt = kv_formats.resolve(FORMATS[name])
    pages = fmt.quantize(jnp.asarray(rng.standard_normal((40, D)) * 3, jnp.float32))
    if name == "nvfp4":
        pages = pages._replace(tensor_scale=jnp.float32(0.5))
    x_hat = np.asarray(fmt.dequantize(pages), np.float64)
    q = jnp.asarray(rng.standard_normal((3, D)), jnp.float32)
    p = jnp.asarray(rng.uniform(0, 1, (3, 40)), jnp.float32)
    q_parts = kv_formats.split_parts(fmt.prepare_q(pages, q), fmt.parts)
    rows = [fmt.rows(pages, j) for j in range(fmt.parts)]
    assert all(r.shape == (40, D // fmt.parts) for r in rows)
    scores = sum(np.asarray(qj, np.float64) @ np.asarray(r, np.float64).T for qj, r in zip(q_parts, rows))
    np.testing.assert_allclose(scores, np.asarray(q, np.float64) @ x_hat.T, rtol=1e-5, atol=1e-5)
    summed = kv_formats.merge_parts(jnp.stack([p @ r for r in rows]))
    np.testing.assert_allclose(np.asarray(fmt.finish_out(pages, summed), np.float64),
                               np.asarray(p, np.float64) @ x_hat, rtol=1e-5, atol=1e-5)


def test_sparse_index_past_the_half_adds_nothing_in_rows_and_tile():
    """A sparse index no write made (garbage bytes of a page) reads as no sparse channel in
    the XLA path's rows and in the kernel's tile alike, not as a clamped channel."""
    fmt = kv_formats.resolve(TQ35)
    pages = fmt.quantize(jnp.asarray(np.random.default_rng(3).standard_normal((1, 8, 1, D)), jnp.float32))
    bad = dataclasses.replace(pages, outlier=dataclasses.replace(
        pages.outlier, sparse_idx=pages.outlier.sparse_idx.at[0, 2:5, 0, 1].set(200)))
    none = dataclasses.replace(pages, outlier=dataclasses.replace(
        pages.outlier, sparse_val=pages.outlier.sparse_val.at[0, 2:5, 0, 1].set(0)))
    leaves = lambda p: [leaf[0, :, 0].reshape(8, -1) for leaf in fmt.leaves(p)]  # one page, one head
    for part in range(fmt.parts):
        want = np.asarray(fmt.rows(none, part))
        np.testing.assert_array_equal(np.asarray(fmt.rows(bad, part)), want)
        got = fmt.tile(lambda i, ls=leaves(bad): ls[i], part, fmt.extras())
        np.testing.assert_allclose(np.asarray(got), want[0, :, 0], rtol=1e-6, atol=1e-6)


def _assert_same_turbo_codes(tq, got, want, x, tol=1e-5):
    """TurboQuant(Split) codes got and want of the rows x [..., d] agree, except a coordinate
    whose float64 rotated value lies within tol * norm of the boundary between the two codes,
    where neighbouring codes are both a correct rounding; norms agree to float32."""
    if isinstance(tq, TurboQuantSplit):
        x = np.asarray(x)[..., np.asarray(tq.outliers + tq.regular)]
        half = tq.dim // 2
        _assert_same_turbo_codes(tq.hi, got.outlier, want.outlier, x[..., :half], tol)
        _assert_same_turbo_codes(tq.lo, got.regular, want.regular, x[..., half:], tol)
        return
    x = np.asarray(x, np.float64)
    if tq.sparse:  # the same channels kept aside, with the same values; the rest is rotated
        np.testing.assert_array_equal(np.asarray(got.sparse_idx), np.asarray(want.sparse_idx))
        np.testing.assert_array_equal(np.asarray(got.sparse_val), np.asarray(want.sparse_val))  # bf16 bits
        x = x.copy()
        np.put_along_axis(x, np.asarray(want.sparse_idx, np.int64), 0.0, axis=-1)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    if not tq.rescale:  # rescaled norms depend on the codes: compared through dequantize below
        np.testing.assert_allclose(np.asarray(got.norm), norm[..., 0], rtol=1e-6)
    y = x @ np.asarray(tq.rotation, np.float64).T
    offset = 0
    for (start, size, bits), c in zip(tq._params.layout, tq._params.centroids):
        nbytes = size * bits // 8
        g, w = (np.asarray(unpack_bits(codes.idx[..., offset:offset + nbytes], bits, size), np.int64)
                for codes in (got, want))
        offset += nbytes
        c = np.asarray(c, np.float64)
        boundary = 0.5 * (c[np.minimum(g, w)] + c[np.minimum(np.maximum(g, w), len(c) - 1)]) * norm
        on_boundary = (np.abs(g - w) == 1) & (np.abs(y[..., start:start + size] - boundary) <= tol * norm)
        assert np.all((g == w) | on_boundary), f"{np.sum((g != w) & ~on_boundary)} codes differ off a boundary"


@pytest.mark.parametrize("name", OBJECT_FORMATS + ["plain-bf16"])
@pytest.mark.parametrize("num_rows", [1, 9])
def test_write_stores_quantized_rows_at_their_slots_and_drops_padding(name, num_rows):
    """write(pages, rows, page_ids, slots) changes exactly the named slots of every leaf to
    quantize(rows) (bytes compared); page id num_pages (padding) and -1 write nothing.
    One row exercises the single-row scatter; bf16 pools go through their bits too."""
    rng = np.random.default_rng(13 + num_rows)
    fmt = kv_formats.PLAIN if name == "plain-bf16" else kv_formats.resolve(FORMATS[name])
    dtype = jnp.bfloat16 if name == "plain-bf16" else jnp.float32
    num_pages, page_size, heads = 5, 4, 2
    pool = fmt.allocate(num_pages, page_size, heads, D, dtype)
    assert all(a.shape[:3] == (num_pages, page_size, heads) and not np.asarray(a).any()
               for a in jax.tree.leaves(pool))
    pool = fmt.write(pool, jnp.asarray(rng.standard_normal((num_pages * page_size, heads, D)), jnp.float32),
                     jnp.repeat(jnp.arange(num_pages), page_size), jnp.tile(jnp.arange(page_size), num_pages))
    rows = jnp.asarray(rng.standard_normal((num_rows, heads, D)), jnp.float32)
    flat = rng.choice(num_pages * page_size, num_rows, replace=False)
    ids, slots = flat // page_size, flat % page_size
    if num_rows > 1:
        ids[0], ids[1] = num_pages, -1  # padding rows
    got = jax.jit(fmt.write, donate_argnums=0)(jax.tree.map(jnp.copy, pool), rows, jnp.asarray(ids, jnp.int32),
                                              jnp.asarray(slots, jnp.int32))
    as_bytes = lambda a: np.asarray(a).view(np.uint8)
    new = fmt.quantize(rows)
    if isinstance(fmt, (kv_formats.Turbo, kv_formats.TurboSplit)):
        # The rotation is a matmul whose float32 summation order is the compiler's choice per
        # program (on a GPU the jitted write and the eager quantize differ in the last ulp),
        # so a coordinate on a codebook boundary may land on either side: check the codes,
        # then hold the written slots to exactly those bytes and every other slot unchanged.
        for t in range(num_rows):
            if 0 <= ids[t] < num_pages:
                _assert_same_turbo_codes(fmt.tq, jax.tree.map(lambda a: a[ids[t], slots[t]], got),
                                         jax.tree.map(lambda a: a[t], new), rows[t])
        new = jax.tree.map(lambda a: a[np.clip(ids, 0, num_pages - 1), slots], got)
    for before, new, after in zip(jax.tree.leaves(pool), jax.tree.leaves(new), jax.tree.leaves(got)):
        want = np.array(as_bytes(before))
        for t in range(num_rows):
            if 0 <= ids[t] < num_pages:
                want[ids[t], slots[t]] = as_bytes(np.asarray(new.astype(before.dtype)))[t]
        assert after.dtype == before.dtype
        np.testing.assert_array_equal(as_bytes(after), want)
    assert fmt.bytes_per_token(heads, D, dtype) * num_pages * page_size == sum(a.nbytes for a in jax.tree.leaves(got))


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "tq3.5"])
def test_gather_takes_pages_of_every_leaf(name):
    fmt = kv_formats.resolve(FORMATS[name])
    pool = _random_bytes(np.random.default_rng(14), fmt, (7, 4, 2))
    ids = jnp.asarray([[3, 0, 3], [6, 1, 2]], jnp.int32)
    got = jax.jit(fmt.gather)(pool, ids)
    for a, g in zip(jax.tree.leaves(pool), jax.tree.leaves(got)):
        assert g.dtype == a.dtype and g.shape == (2, 3, *a.shape[1:])
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(a).view(np.uint8)[np.asarray(ids)])


@pytest.mark.parametrize("name", ["int8", "fp8", "nvfp4", "mxfp4", "tq3.5"])
def test_a_write_over_a_donated_pool_copies_no_leaf(name):
    """XLA writes rows (prefill chunks, mixed and verify steps) into donated pages in place:
    the compiled write holds every leaf as a parameter and a scatter and nothing else as
    large. A float8_e4m3fn leaf, scattered as its bits, was copied whole at every write
    (XLA:CPU does not elide the bitcast): 16 rows into an fp8 pool of 16,385 pages took
    20 ms against 0.02 ms now, so the pools keep E4M3 leaves as their uint8 bits."""
    fmt = kv_formats.resolve(FORMATS[name])
    num_pages, page_size, heads = 1024, 8, 2
    pool = fmt.allocate(num_pages, page_size, heads, D)
    rows = jnp.ones((3, heads, D), jnp.float32)
    ids, slots = jnp.asarray([5, 700, num_pages], jnp.int32), jnp.asarray([0, 7, 1], jnp.int32)
    text = jax.jit(fmt.write, donate_argnums=0).lower(pool, rows, ids, slots).compile().as_text()
    assert_written_in_place(text, num_pages * page_size * heads, len(jax.tree.leaves(pool)))


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_e4m3_leaves_as_float8_or_as_bits_are_one_container(name):
    """The pools keep E4M3 leaves as uint8 bits; the same container with float8_e4m3fn
    leaves (as quant's quantizers make them) passes the same check, dequantizes to the same
    values, takes a write of the same bytes and keeps its dtype; other 8-bit dtypes fail."""
    fmt = kv_formats.resolve(name)
    rng = np.random.default_rng(21)
    x = jnp.asarray(rng.standard_normal((4, 8, 2, D)), jnp.float32)
    bits = fmt.quantize(x)
    e4m3 = lambda a: jax.lax.bitcast_convert_type(a, jnp.float8_e4m3fn) if a.dtype == jnp.uint8 else a
    leaf = "codes" if name == "fp8" else "scales"
    floats = bits._replace(**{leaf: e4m3(getattr(bits, leaf))})
    assert getattr(bits, leaf).dtype == jnp.uint8 and getattr(floats, leaf).dtype == jnp.float8_e4m3fn
    for pages in (bits, floats):
        fmt.check(pages, D, "k_pages")
    np.testing.assert_array_equal(fmt.dequantize(bits), fmt.dequantize(floats))
    quant_made = (quantize_rows(x, "fp8") if name == "fp8" else nvfp4_quantize(x, 1.0)._replace(tensor_scale=None))
    np.testing.assert_array_equal(fmt.dequantize(bits), fmt.dequantize(quant_made))
    rows = jnp.asarray(rng.standard_normal((2, 2, D)), jnp.float32)
    ids, slots = jnp.asarray([1, 3], jnp.int32), jnp.asarray([2, 7], jnp.int32)
    wrote = [fmt.write(p, rows, ids, slots) for p in (bits, floats)]
    for a, b, before in zip(*(jax.tree.leaves(w) for w in wrote), jax.tree.leaves(floats)):
        assert b.dtype == before.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    with pytest.raises(ValueError, match="must be uint8 or float8_e4m3fn, got int8"):
        fmt.check(bits._replace(**{leaf: getattr(bits, leaf).view(jnp.int8)}), D, "k_pages")
