"""quant.kv_rows: per-row int8 / FP8 KV quantization against its stated error bounds."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from quant.kv_rows import RowQuantized, dequantize_rows, quantize_rows


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_round_trip_within_format_error_and_layout(fmt):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 2, 64)) * np.exp(rng.uniform(-4, 4, (3, 4, 2, 1)))
    x[0, 0, 0] = 0.0  # an all-zero row
    q = quantize_rows(jnp.asarray(x, jnp.float32), fmt)
    assert q.codes.shape == x.shape and q.scales.shape == x.shape[:-1]
    assert q.codes.dtype == (jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn) and q.fmt == fmt
    absmax = np.abs(x).max(-1)
    qmax = 127.0 if fmt == "int8" else 448.0
    np.testing.assert_allclose(np.asarray(q.scales), absmax / qmax, rtol=1e-6)
    x_hat = np.asarray(dequantize_rows(q), np.float64)
    err = np.abs(x_hat - x)
    scale = (absmax / qmax)[..., None]
    if fmt == "int8":
        bound = scale / 2 * (1 + 1e-5)
    else:  # 3 mantissa bits: half an ulp is 2^-4 relative; subnormal spacing 2^-9
        bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scale) * (1 + 1e-5)
    assert np.all(err <= bound + 1e-30)
    assert err.max() > 0  # it did quantize
    np.testing.assert_array_equal(x_hat[0, 0, 0], 0.0)
    # The absmax element is exact up to f32 rounding of the scale.
    top = np.argmax(np.abs(x), -1)[..., None]
    np.testing.assert_allclose(
        np.take_along_axis(x_hat, top, -1), np.take_along_axis(x, top, -1), rtol=1e-6
    )


def test_fp8_codes_equal_ml_dtypes_rounding():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    q = quantize_rows(jnp.asarray(x), "fp8")
    # the quantizer's own float32 operations: the scale absmax * (1 / 448), x times its reciprocal
    scale = np.abs(x).max(-1, keepdims=True) * (np.float32(1) / np.float32(448.0))
    y = x * (np.float32(1) / scale)
    np.testing.assert_array_equal(
        np.asarray(q.codes).view(np.uint8), y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    )


def test_validation():
    with pytest.raises(ValueError, match="unknown format"):
        quantize_rows(jnp.ones((2, 4)), "int4")
    with pytest.raises(ValueError, match="float"):
        quantize_rows(jnp.ones((2, 4), jnp.int32), "int8")
    assert isinstance(quantize_rows(jnp.ones((2, 4)), "int8"), RowQuantized)
