"""LLM.int8(): bitsandbytes' published tolerance, the outlier decomposition's properties,
and the params pass + linear dispatch the model uses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quant
from quant.int8 import Int8Weight, int8_matmul, quantize_weight


def _xavier_uniform(rng, fan_in, fan_out):
    bound = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32)


def _bnb_case(rng, rows, d_in, d_out):
    """bitsandbytes test_matmullt: randn inputs with d_in/8 feature columns set to 6.0,
    xavier-uniform weights."""
    a = rng.standard_normal((rows, d_in)).astype(np.float32)
    a[:, rng.integers(0, d_in, d_in // 8)] = 6.0
    return a, _xavier_uniform(rng, d_in, d_out)


def _not_close_fraction(out, ref, atol, rtol):
    return np.mean(~np.isclose(out, ref, atol=atol, rtol=rtol))  # same rule as torch.isclose


@pytest.mark.parametrize("shape", [(64, 32, 48), (128, 512, 256)])
def test_bitsandbytes_tolerance_with_outliers_at_6(shape):
    rng = np.random.default_rng(sum(shape))
    for _ in range(3):
        a, b = _bnb_case(rng, *shape)
        out = np.asarray(int8_matmul(jnp.asarray(a), quantize_weight(jnp.asarray(b))))
        ref = a.astype(np.float64) @ b.astype(np.float64)
        assert _not_close_fraction(out, ref, 0.01, 0.1) <= 0.0175
        assert _not_close_fraction(out, ref, 0.035, 0.2) <= 0.001


def test_decomposition_beats_plain_int8_on_large_outliers():
    rng = np.random.default_rng(1)
    a, b = _bnb_case(rng, 64, 256, 128)
    a[:, :2] = 60.0 * rng.choice([-1, 1], (64, 2))  # LLM-scale outlier features
    qb = quantize_weight(jnp.asarray(b))
    ref = a.astype(np.float64) @ b
    err_mixed = np.abs(np.asarray(int8_matmul(jnp.asarray(a), qb)) - ref).mean()
    err_plain = np.abs(np.asarray(int8_matmul(jnp.asarray(a), qb, threshold=None)) - ref).mean()
    assert err_mixed < err_plain / 5


def test_outlier_columns_take_the_float_path():
    """Zeroing the outlier columns removes exactly x_outlier @ dequant(W) from the output:
    the int8 part (its codes and row scales) does not see those columns at all. Without
    the decomposition the same edit also re-scales every row's int8 grid."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((16, 64)).astype(np.float32)
    cols = np.array([3, 17, 40])
    a[:, cols] = rng.uniform(-12, 12, (16, 3))
    a[0, cols] = 6.0  # exactly the threshold still counts as an outlier (|x| >= 6)
    a[:, 50] = 5.9  # just below: int8 path
    w = rng.standard_normal((64, 32)).astype(np.float32)
    qw = quantize_weight(jnp.asarray(w))
    a_zeroed = a.copy()
    a_zeroed[:, cols] = 0.0
    float_part = a.astype(np.float64)[:, cols] @ np.asarray(qw.dequantize(), np.float64)[cols]

    delta = np.asarray(int8_matmul(jnp.asarray(a), qw)) - np.asarray(int8_matmul(jnp.asarray(a_zeroed), qw))
    np.testing.assert_allclose(delta, float_part, atol=1e-4, rtol=1e-5)

    plain = np.asarray(int8_matmul(jnp.asarray(a), qw, None)) - np.asarray(
        int8_matmul(jnp.asarray(a_zeroed), qw, None)
    )
    assert np.abs(plain - float_part).max() > 1e-2

    # Column 50 (5.9) is not an outlier: zeroing it changes the int8 path's row scales.
    a_no50 = a.copy()
    a_no50[:, 50] = 0.0
    d50 = np.asarray(int8_matmul(jnp.asarray(a), qw)) - np.asarray(int8_matmul(jnp.asarray(a_no50), qw))
    exact50 = a[:, 50:51].astype(np.float64) @ np.asarray(qw.dequantize(), np.float64)[50:51]
    assert np.abs(d50 - exact50).max() > 1e-2


def test_int8_path_is_exact_integer_arithmetic():
    # Rows and weight columns with absmax 127 and integer entries quantize losslessly, so the
    # result must be the exact integer product (int32 accumulation; sums stay below 2**24).
    rng = np.random.default_rng(3)
    x = rng.integers(-127, 128, (8, 512)).astype(np.float32)
    x[:, 0] = 127
    w = rng.integers(-127, 128, (512, 16)).astype(np.float32)
    w[0] = 127
    out = np.asarray(int8_matmul(jnp.asarray(x / 127 * 5.0), quantize_weight(jnp.asarray(w)), None))
    exact = (x.astype(np.int64) @ w.astype(np.int64)) * 5.0 / 127
    np.testing.assert_allclose(out, exact, rtol=1e-6)


def test_quantize_weight_per_output_channel():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((3, 64, 24)).astype(np.float32) * rng.uniform(0.1, 10, (1, 1, 24))
    qw = quantize_weight(jnp.asarray(w))  # stacked layers keep their leading axis
    assert qw.q.dtype == jnp.int8 and qw.q.shape == (3, 64, 24) and qw.absmax.shape == (3, 24)
    np.testing.assert_allclose(np.asarray(qw.absmax), np.abs(w).max(axis=1))
    assert np.all(np.abs(np.asarray(qw.q)).max(axis=1) == 127)
    err = np.abs(np.asarray(qw.dequantize()) - w)
    assert np.all(err <= np.abs(w).max(axis=1, keepdims=True) / 254 * (1 + 1e-5))
    layer1 = jax.tree.map(lambda t: t[1], qw)
    np.testing.assert_array_equal(np.asarray(layer1.q), np.asarray(quantize_weight(jnp.asarray(w[1])).q))


def _params(rng):
    def f(*s):
        return jnp.asarray(rng.standard_normal(s), jnp.float32)

    layer = lambda: {  # noqa: E731
        "attn": {"wq": f(32, 32), "wk": f(32, 16), "wv": f(32, 16), "wo": f(32, 32)},
        "mlp": {"w_gate": f(32, 64), "w_up": f(32, 64), "w_down": f(64, 32)},
        "attn_norm": f(32),
    }
    return {"embed": f(100, 32), "layers": [layer(), layer()], "final_norm": f(32), "lm_head": f(32, 100)}


def test_quantize_params_replaces_only_selected_linears():
    params = _params(np.random.default_rng(5))
    q = quant.quantize_params(params)
    for layer, qlayer in zip(params["layers"], q["layers"]):
        for group in ("attn", "mlp"):
            for name, w in layer[group].items():
                assert isinstance(qlayer[group][name], Int8Weight), name
                assert qlayer[group][name].shape == w.shape
        assert qlayer["attn_norm"] is layer["attn_norm"]
    assert q["embed"] is params["embed"] and q["lm_head"] is params["lm_head"]

    only_lm_head = quant.quantize_params(params, predicate=lambda path, leaf: path == ("lm_head",))
    assert isinstance(only_lm_head["lm_head"], Int8Weight)
    assert only_lm_head["layers"][0]["attn"]["wq"] is params["layers"][0]["attn"]["wq"]


def test_linear_dispatch_under_jit():
    rng = np.random.default_rng(6)
    params = _params(rng)
    qparams = quant.quantize_params(params)
    x = jnp.asarray(rng.standard_normal((2, 5, 32)), jnp.float32)

    @jax.jit
    def mlp(p, x):
        m = p["layers"][0]["mlp"]
        h = jax.nn.silu(quant.linear(x, m["w_gate"])) * quant.linear(x, m["w_up"])
        return quant.linear(h, m["w_down"])

    ref = np.asarray(mlp(params, x))
    got = np.asarray(mlp(qparams, x))
    w_up = params["layers"][0]["mlp"]["w_up"]
    np.testing.assert_array_equal(np.asarray(quant.linear(x, w_up)), np.asarray(x @ w_up))
    bias = jnp.arange(64, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(quant.linear(x, w_up, bias)), np.asarray(x @ w_up + bias))
    assert got.shape == ref.shape == (2, 5, 32)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 0 < rel < 0.03  # int8 is close but not the float result
    wq = qparams["layers"][0]["attn"]["wq"]
    np.testing.assert_array_equal(np.asarray(quant.linear(x, wq)), np.asarray(int8_matmul(x, wq)))


def test_int8_validation():
    with pytest.raises(ValueError, match="unknown quantization method 'nf4'"):
        quant.quantize_params({}, method="nf4")
    qw = quantize_weight(jnp.ones((8, 4)))
    with pytest.raises(ValueError, match="does not match"):
        int8_matmul(jnp.ones((2, 7)), qw)
    with pytest.raises(ValueError, match="threshold"):
        int8_matmul(jnp.ones((2, 8)), qw, threshold=0.0)
    with pytest.raises(ValueError, match="float"):
        quantize_weight(jnp.ones((8,)))
    with pytest.raises(TypeError, match="unsupported weight type"):
        quant.linear(jnp.ones((2, 8)), [[1.0]])
