"""KIVI 2/4-bit KV: per-group rounding bound, per-channel/per-token grouping, exact
residual window, and real byte counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quant
from quant.packing import unpack_bits

B, H, D = 2, 2, 64


def _kv(rng, t):
    # Keys with a few outlier channels (the reason KIVI groups keys per channel).
    k = rng.standard_normal((B, H, t, D)) * np.where(np.arange(D) % 16 == 3, 8.0, 1.0)
    v = rng.standard_normal((B, H, t, D)) + rng.uniform(-2, 2, (B, H, t, 1))
    return k.astype(np.float32), v.astype(np.float32)


def _check_groups(x, x_hat, codes, bits, axis):
    """x grouped with the reduction axis `axis` of the grouped view; min-max rounding bound."""
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    bound = (hi - lo) / (2 * (2**bits - 1))
    err = np.abs(x_hat - x)
    assert np.all(err <= bound + 1e-6 * (1 + np.abs(x)))
    assert err.max() > 0.1 * bound.max()  # not trivially exact
    # Asymmetric min-max uses the whole code range in every group.
    assert np.all(codes.min(axis=axis) == 0) and np.all(codes.max(axis=axis) == 2**bits - 1)


@pytest.mark.parametrize("bits", [2, 4])
def test_keys_per_channel_groups_of_32_tokens(bits):
    k, _ = _kv(np.random.default_rng(bits), 96)
    q = quant.kivi_quantize_keys(jnp.asarray(k), bits)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (B, H, 96, D * bits // 8)
    assert q.scale.shape == q.zero.shape == (B, H, 3, D)
    k_hat = np.asarray(quant.kivi_dequantize_keys(q))
    codes = np.asarray(unpack_bits(q.codes, bits))
    g = (B, H, 3, 32, D)
    _check_groups(k.reshape(g), k_hat.reshape(g), codes.reshape(g), bits, axis=3)


@pytest.mark.parametrize("bits", [2, 4])
def test_values_per_token_groups_of_32_channels(bits):
    _, v = _kv(np.random.default_rng(10 + bits), 40)  # any token count works for values
    q = quant.kivi_quantize_values(jnp.asarray(v), bits)
    assert q.codes.shape == (B, H, 40, D * bits // 8) and q.scale.shape == (B, H, 40, 2)
    v_hat = np.asarray(quant.kivi_dequantize_values(q))
    codes = np.asarray(unpack_bits(q.codes, bits))
    g = (B, H, 40, 2, 32)
    _check_groups(v.reshape(g), v_hat.reshape(g), codes.reshape(g), bits, axis=4)


def test_window_rule_keeps_recent_tokens_exact():
    rng = np.random.default_rng(20)
    k, v = _kv(rng, 300)
    kv = quant.kivi_compress(jnp.asarray(k), jnp.asarray(v), bits=2, window=128)
    n_quant = quant.kivi_num_quantized(300, 128)
    assert n_quant == 160  # (300 - 128) // 32 * 32
    assert kv.k_recent.shape[-2] == 140 >= 128
    k_hat, v_hat = (np.asarray(a) for a in quant.kivi_decompress(kv))
    assert k_hat.shape == v_hat.shape == k.shape
    np.testing.assert_array_equal(k_hat[..., n_quant:, :], k[..., n_quant:, :])
    np.testing.assert_array_equal(v_hat[..., n_quant:, :], v[..., n_quant:, :])
    np.testing.assert_array_equal(k_hat[..., :n_quant, :], np.asarray(quant.kivi_dequantize_keys(kv.keys)))
    assert np.abs(k_hat[..., :n_quant, :] - k[..., :n_quant, :]).max() > 0.1

    # Shorter than the window: nothing is quantized.
    short = quant.kivi_compress(jnp.asarray(k[..., :100, :]), jnp.asarray(v[..., :100, :]), bits=4)
    np.testing.assert_array_equal(np.asarray(quant.kivi_decompress(short)[0]), k[..., :100, :])


def test_real_bytes_and_jit():
    rng = np.random.default_rng(21)
    k, v = _kv(rng, 640)
    k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    compress = jax.jit(quant.kivi_compress, static_argnames=("bits", "window", "group_size"))
    kv = compress(k, v, bits=2)
    n, r = 512, 128
    codes = 2 * B * H * n * D * 2 // 8
    key_scales = 2 * B * H * (n // 32) * D * 4
    value_scales = 2 * B * H * n * (D // 32) * 4
    recent = 2 * B * H * r * D * 2  # bf16
    assert kv.nbytes == codes + key_scales + value_scales + recent
    # At 2 bits, D=64, with f32 scales and minimums, a quantized token costs 1/4 of bf16.
    assert (kv.nbytes - recent) * 4 == (k.nbytes + v.nbytes) * n // 640
    k_hat, _ = quant.kivi_decompress(kv)
    assert k_hat.dtype == jnp.bfloat16


def test_kivi_validation():
    x = jnp.zeros((1, 64, 64))
    with pytest.raises(ValueError, match="bits must be one of"):
        quant.kivi_quantize_keys(x, 3)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quant.kivi_quantize_keys(jnp.zeros((1, 40, 64)), 2)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quant.kivi_quantize_values(jnp.zeros((1, 40, 48)), 2)
    with pytest.raises(ValueError, match="must both be"):
        quant.kivi_compress(x, jnp.zeros((1, 32, 64)), 2)
