"""TurboQuant: Lloyd-Max codebooks equal the paper's, measured distortion equals the exact
Lloyd-Max value, prod mode is unbiased and within its bound, 1-bit MSE shrinks by 2/pi."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import ml_dtypes
import pytest

import quant
from quant.lloyd_max import sphere_codebook, sphere_codebook_mse
from quant.turboquant import main, measure, prod_distortion_bound

D = 128
PAPER_CENTROIDS = {  # positive centroids * sqrt(d) at d = 128 (TurboQuant, Zandieh et al. 2025)
    1: [0.7994],
    2: [0.4525, 1.5052],
    3: [0.2444, 0.7533, 1.3366, 2.1315],
    4: [0.1279, 0.3864, 0.6536, 0.9371, 1.2478, 1.6043, 2.0459, 2.6889],
}
PAPER_MSE = {1: 0.3609, 2: 0.1160, 3: 0.0340, 4: 0.0093}
GAUSSIAN_LLOYD_MAX = {1: [0.7979], 2: [0.4528, 1.5104], 3: [0.2451, 0.7560, 1.3439, 2.1520]}


@functools.cache
def _measured(bits, mode):
    return measure(D, bits, mode, n=10_000, seed=0)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_matches_paper(bits):
    c = sphere_codebook(D, bits)
    assert len(c) == 2**bits and np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-15)
    np.testing.assert_allclose(c[2 ** (bits - 1) :] * math.sqrt(D), PAPER_CENTROIDS[bits], atol=2e-4)
    assert abs(sphere_codebook_mse(D, bits) - PAPER_MSE[bits]) < 1e-4


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_codebook_tends_to_gaussian_lloyd_max(bits):
    # For large d the coordinate density tends to N(0, 1/d): classic Lloyd-Max (Max, 1960).
    c = sphere_codebook(8192, bits) * math.sqrt(8192)
    np.testing.assert_allclose(c[2 ** (bits - 1) :], GAUSSIAN_LLOYD_MAX[bits], atol=1e-3)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_measured_mse_matches_lloyd_max(bits):
    assert abs(_measured(bits, "mse")["mse"] / PAPER_MSE[bits] - 1) < 0.05
    assert 4.0**-bits < _measured(bits, "mse")["mse"] < math.sqrt(3) * math.pi / 2 * 4.0**-bits


def test_one_bit_mse_shrinks_inner_products_by_two_over_pi():
    assert abs(_measured(1, "mse")["slope"] - 2 / math.pi) < 0.01


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_prod_mode_unbiased_and_within_bound(bits):
    m = _measured(bits, "prod")
    assert abs(m["slope"] - 1) < 0.05
    assert m["ip_distortion"] <= prod_distortion_bound(D, bits)
    # QJL on the residual of the (b-1)-bit MSE stage: about pi/2 * mse(b-1) / d.
    expected = math.pi / 2 * (1.0 if bits == 1 else PAPER_MSE[bits - 1]) / D
    assert abs(m["ip_distortion"] / expected - 1) < 0.15


@pytest.mark.parametrize("bits, hi, lo", [(2.5, 3, 2), (3.5, 4, 3)])
def test_fractional_rates_split_channels(bits, hi, lo):
    tq = quant.TurboQuant(D, bits)
    x = np.random.default_rng(7).standard_normal((4096, D)).astype(np.float32)
    codes = tq.quantize(jnp.asarray(x))
    assert codes.idx.shape == (4096, (64 * hi + 64 * lo) // 8)
    assert codes.nbytes == 4096 * ((64 * hi + 64 * lo) // 8 + 4)
    u = x / np.linalg.norm(x, axis=-1, keepdims=True)
    x_hat = np.asarray(tq.dequantize(codes)) / np.linalg.norm(x, axis=-1, keepdims=True)
    mse = np.mean(np.sum((u - x_hat) ** 2, -1))
    # Half the rotated coordinates at each rate: the average of the two distortions.
    assert abs(mse / ((PAPER_MSE[hi] + PAPER_MSE[lo]) / 2) - 1) < 0.05


OUTLIERS = tuple(range(D // 4, D // 2)) + tuple(range(3 * D // 4, D))  # any half works


def _split_reference(x, split):
    """TurboQuantSplit in float64 numpy, from the paper's definition, with the sparse
    channels (dense-and-sparse, KVQuant) and rescaled norms when the quantizer has them."""
    from quant.turboquant import _random_matrices

    out = np.empty_like(x)
    for channels, bits, seed in ((split.outliers, split.hi.bits, split.seed),
                                 (split.regular, split.lo.bits, split.seed + 1)):
        part = x[:, channels].copy()
        spikes = np.zeros_like(part)
        if split.sparse:
            top = np.argsort(-np.abs(part), axis=-1, kind="stable")[:, :split.sparse]
            values = np.take_along_axis(part, top, -1)
            np.put_along_axis(spikes, top, values.astype(ml_dtypes.bfloat16).astype(np.float64), -1)
            np.put_along_axis(part, top, 0.0, -1)
        norm = np.linalg.norm(part, axis=-1, keepdims=True)
        pi, _ = _random_matrices(len(channels), seed)
        c = sphere_codebook(len(channels), int(bits))
        y = (part / norm) @ pi.T
        centroids = c[np.argmin(np.abs(y[..., None] - c), -1)]
        if split.rescale:
            norm = norm / np.linalg.norm(centroids, axis=-1, keepdims=True)
        out[:, channels] = norm * (centroids @ pi) + spikes
    return out


@pytest.mark.parametrize("bits, sparse, rescale", [(2.5, 0, False), (3.5, 0, False), (3.5, 1, True), (2.5, 3, False)])
def test_split_equals_float64_reference(bits, sparse, rescale):
    split = quant.TurboQuantSplit(D, bits, OUTLIERS, seed=5, sparse=sparse, rescale=rescale)
    x = np.random.default_rng(11).standard_normal((512, D)) * np.linspace(0.2, 3, D)
    codes = split.quantize(jnp.asarray(x, jnp.float32))
    hi, lo = math.ceil(bits), math.floor(bits)
    assert codes.outlier.idx.shape == (512, D // 2 * hi // 8)
    assert codes.regular.idx.shape == (512, D // 2 * lo // 8)
    # + two f32 norms, and per half `sparse` uint8 indices and bfloat16 values
    assert codes.nbytes == 512 * (D * bits / 8 + 8 + 2 * sparse * 3)
    got = np.asarray(split.dequantize(codes), np.float64)
    want = _split_reference(x, split)
    # f32 rounding may flip a coordinate that sits on a codebook boundary.
    rows_equal = np.all(np.isclose(got, want, rtol=1e-4, atol=1e-4), axis=-1)
    assert rows_equal.mean() > 0.99


@pytest.mark.parametrize("bits", [2.5, 3.5])
def test_split_error_follows_the_outlier_energy(bits):
    """Outlier channels at 4x the scale hold f = 16/17 of the energy: the error is
    f * D(b+1) + (1 - f) * D(b) of the half-size codebooks (TurboQuant, Section 4.3), well
    below the mean of the two that an index split (or a wrong channel set) gives."""
    split = quant.TurboQuantSplit(D, bits, OUTLIERS, seed=2)
    scale = np.ones(D)
    scale[list(OUTLIERS)] = 4.0
    x = np.random.default_rng(3).standard_normal((8192, D)) * scale
    got = np.asarray(split.dequantize(split.quantize(jnp.asarray(x, jnp.float32))), np.float64)
    rel = np.mean(np.sum((got - x) ** 2, -1) / np.sum(x ** 2, -1))
    hi, lo = (sphere_codebook_mse(D // 2, b) for b in (math.ceil(bits), math.floor(bits)))
    f = 16 / 17
    assert abs(rel / (f * hi + (1 - f) * lo) - 1) < 0.1
    assert rel < 0.6 * (hi + lo) / 2


def test_sparse_values_are_their_bfloat16_bits():
    """sparse_val holds the kept channels' bfloat16 bits (uint16), read back exactly; codes
    whose values are a float array (cast, not reinterpreted, they would read wrong) are a
    ValueError naming the dtype."""
    tq = quant.TurboQuant(64, 3, sparse=2)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 64)), jnp.float32)
    codes = tq.quantize(x)
    assert codes.sparse_val.dtype == jnp.uint16
    kept = np.take_along_axis(np.asarray(x), np.asarray(codes.sparse_idx, np.int64), axis=-1)
    np.testing.assert_array_equal(np.asarray(codes.sparse_val).view(ml_dtypes.bfloat16),
                                  kept.astype(ml_dtypes.bfloat16))
    as_floats = dataclasses.replace(codes, sparse_val=jax.lax.bitcast_convert_type(codes.sparse_val, jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 bits .uint16., got bfloat16"):
        tq.dequantize(as_floats)


def test_sparse_channels_take_the_spike_out_of_the_error():
    """Keys of LLMs carry a few channels far above the rest (model/kv_formats.py). With the
    spike kept aside (bfloat16, relative error <= 2^-9) the rotated part's error scales with
    the rest's norm: D(b) * ||rest||^2 instead of D(b) * ||x||^2."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4096, 64))
    x[np.arange(4096), rng.integers(0, 64, 4096)] = 30.0 * rng.choice([-1, 1], 4096)
    plain, sparse = quant.TurboQuant(64, 3), quant.TurboQuant(64, 3, sparse=1)
    err = {}
    for name, tq in (("plain", plain), ("sparse", sparse)):
        got = np.asarray(tq.dequantize(tq.quantize(jnp.asarray(x, jnp.float32))), np.float64)
        err[name] = np.mean(np.sum((got - x) ** 2, -1))
    codes = sparse.quantize(jnp.asarray(x, jnp.float32))
    np.testing.assert_array_equal(np.asarray(codes.sparse_idx[:, 0]), np.argmax(np.abs(x), -1))
    rest2 = np.sum(x ** 2, -1) - np.max(x ** 2, -1)
    d3 = sphere_codebook_mse(64, 3)
    assert abs(err["plain"] / (d3 * np.mean(np.sum(x ** 2, -1))) - 1) < 0.1
    assert abs(err["sparse"] / (d3 * np.mean(rest2)) - 1) < 0.1
    assert err["sparse"] < err["plain"] / 10


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_rescale_keeps_the_norm_and_the_direction(bits):
    """rescale=True: ||x_hat|| = ||x|| (Lloyd-Max alone shrinks it by about 1 - D/2), and
    x_hat points where the unrescaled one does."""
    x = np.random.default_rng(9).standard_normal((2048, D)) * 3
    plain, rescaled = quant.TurboQuant(D, bits, seed=1), quant.TurboQuant(D, bits, seed=1, rescale=True)
    a, b = (np.asarray(tq.dequantize(tq.quantize(jnp.asarray(x, jnp.float32))), np.float64)
            for tq in (plain, rescaled))
    norm = np.linalg.norm(x, axis=-1)
    np.testing.assert_allclose(np.linalg.norm(b, axis=-1), norm, rtol=1e-5)
    shrink = np.mean(np.linalg.norm(a, axis=-1) / norm)
    assert abs(shrink - math.sqrt(1 - PAPER_MSE[bits])) < 0.02
    np.testing.assert_allclose(b / norm[:, None], a / np.linalg.norm(a, axis=-1, keepdims=True), atol=1e-5)


def test_split_validation():
    with pytest.raises(ValueError, match=r"b \+ 0.5"):
        quant.TurboQuantSplit(D, 3, OUTLIERS)
    with pytest.raises(ValueError, match="distinct channels"):
        quant.TurboQuantSplit(D, 3.5, OUTLIERS[:-1] + (0, 0))
    with pytest.raises(ValueError, match="divisible by 16"):
        quant.TurboQuantSplit(40, 3.5, range(20))
    with pytest.raises(ValueError, match=r"sparse must be an integer in \[0, dim=64\)"):
        quant.TurboQuantSplit(D, 3.5, OUTLIERS, sparse=64)
    with_sparse = quant.TurboQuantSplit(D, 3.5, OUTLIERS, sparse=1)
    codes = quant.TurboQuantSplit(D, 3.5, OUTLIERS).quantize(jnp.ones((2, D)))
    with pytest.raises(ValueError, match="codes were not made by this mse-mode TurboQuant"):
        with_sparse.dequantize(codes)
    with pytest.raises(ValueError, match="codes were not made by this TurboQuantSplit"):
        with_sparse.dequantize(codes.outlier)


@pytest.mark.parametrize("mode", ["mse", "prod", "mse-sparse"])
def test_score_equals_inner_product_with_dequantized_keys(mode):
    sparse = mode == "mse-sparse"
    tq = quant.TurboQuant(64, 3, mode=mode.removesuffix("-sparse"), seed=3, sparse=2 if sparse else 0, rescale=sparse)
    rng = np.random.default_rng(8)
    keys = jnp.asarray(rng.standard_normal((2, 4, 10, 64)) * 3, jnp.float32)  # [B, H, N, d], not unit
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    codes = tq.quantize(keys)
    assert codes.norm.shape == (2, 4, 10) and codes.idx.dtype == jnp.uint8
    if mode == "prod":
        assert codes.qjl.shape == (2, 4, 10, 8) and codes.rnorm.shape == (2, 4, 10)
    want = np.einsum("bhd,bhnd->bhn", np.asarray(q), np.asarray(tq.dequantize(codes)))
    np.testing.assert_allclose(np.asarray(tq.score(q, codes)), want, rtol=1e-4, atol=1e-4)
    # [M, d] queries against [N] keys broadcast to [M, N]; works inside jit.
    flat = jax.tree.map(lambda a: a[0, 0], codes)
    got = jax.jit(tq.score)(q[0], flat)
    want = np.asarray(q[0]) @ np.asarray(tq.dequantize(flat)).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_rotation_is_orthogonal_and_seeded():
    a, b = quant.TurboQuant(D, 2, seed=1), quant.TurboQuant(D, 2, seed=1)
    pi = np.asarray(a.rotation, np.float64)
    np.testing.assert_allclose(pi @ pi.T, np.eye(D), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.rotation), np.asarray(b.rotation))
    assert not np.allclose(np.asarray(a.rotation), np.asarray(quant.TurboQuant(D, 2, seed=2).rotation))


def test_turboquant_validation():
    with pytest.raises(ValueError, match="mode must be one of"):
        quant.TurboQuant(D, 2, mode="fast")
    with pytest.raises(ValueError, match="multiple of 0.5"):
        quant.TurboQuant(D, 2.25)
    with pytest.raises(ValueError, match="prod mode needs bits"):
        quant.TurboQuant(D, 1.5, mode="prod")
    with pytest.raises(ValueError, match="whole number of bytes"):
        quant.TurboQuant(100, 3)
    with pytest.raises(ValueError, match=r"float \[\.\.\., 128\]"):
        quant.TurboQuant(D, 2).quantize(jnp.zeros((3, 64)))
    with pytest.raises(ValueError, match="options of mode='mse'"):
        quant.TurboQuant(D, 3, mode="prod", sparse=1)
    with pytest.raises(ValueError, match="options of mode='mse'"):
        quant.TurboQuant(D, 3, mode="prod", rescale=True)
    with pytest.raises(ValueError, match="sparse must be an integer"):
        quant.TurboQuant(D, 3, sparse=-1)
    with pytest.raises(ValueError, match="indexed by uint8"):
        quant.TurboQuant(512, 3, sparse=1)
    with pytest.raises(ValueError, match="prod-mode"):
        quant.TurboQuant(D, 2, mode="prod").dequantize(quant.TurboQuant(D, 2).quantize(jnp.ones((1, D))))
    with pytest.raises(SystemExit):
        main([])  # the CLI needs --table
