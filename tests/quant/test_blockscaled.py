"""NVFP4, MXFP4 and FP8+UE8M0 block formats: exact on representable values, equal to an
independent float64 numpy oracle on random data, and the advertised bytes per row."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import quant
from quant.packing import pack_nibbles

E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
POS_E4M3 = np.arange(1, 0x7F, dtype=np.uint8).view(E4M3).astype(np.float32)  # 2**-9 .. 448
FINITE_E4M3 = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8).view(E4M3).astype(np.float32)


def _e2m1_codes(x64: np.ndarray) -> np.ndarray:
    return x64.astype(E2M1).view(np.uint8)  # ml_dtypes: RNE, saturating at 6


def _packed(codes: np.ndarray) -> np.ndarray:
    return np.asarray(pack_nibbles(jnp.asarray(codes)))


def _random_rows(rng, rows, d):
    # Row magnitudes over many octaves and a few large outliers, so scales vary and saturate.
    x = rng.standard_normal((rows, d)) * np.exp(rng.uniform(-6, 6, (rows, 1)))
    x[rng.random((rows, d)) < 0.01] *= 50
    return x.astype(np.float32)


def _all_codes_blocks(rng, n_blocks, reps):
    """Blocks that each hold every E2M1 code (so +-6 sets the block amax) `reps` times."""
    return np.stack([rng.permutation(np.tile(np.arange(16, dtype=np.uint8), reps)) for _ in range(n_blocks)])


def test_nvfp4_exact_on_representable_values():
    rng = np.random.default_rng(0)
    scales = np.concatenate([POS_E4M3, [448.0]]).astype(np.float32)  # one block at 448 sets the tensor amax
    codes = _all_codes_blocks(rng, len(scales), 1)
    ts = np.float32(2.0**-3)
    x = codes.view(E2M1).astype(np.float32) * scales[:, None] * ts
    q = quant.nvfp4_quantize(jnp.asarray(x.reshape(1, -1)))
    assert float(q.tensor_scale) == ts  # amax / (448 * 6) = 6 * 448 * ts / 2688
    np.testing.assert_array_equal(np.asarray(q.scales).astype(np.float32)[0], scales)
    np.testing.assert_array_equal(np.asarray(q.packed)[0], _packed(codes.reshape(-1)))
    back = np.asarray(quant.nvfp4_dequantize(q))[0]
    np.testing.assert_array_equal(back.view(np.uint32), x.reshape(-1).view(np.uint32))  # -0.0 included


def test_nvfp4_matches_float64_oracle():
    rng = np.random.default_rng(1)
    x = _random_rows(rng, 64, 256)
    q = quant.nvfp4_quantize(jnp.asarray(x))
    blocks = x.reshape(64, -1, 16)
    ts = np.float32(np.abs(x).max()) / np.float32(448 * 6)
    amax = np.abs(blocks).max(-1)
    sb = (amax * (np.float32(1) / (np.float32(6) * ts))).astype(np.float64).clip(0, 448).astype(E4M3)
    denom = sb.astype(np.float32) * ts  # f32, as stored
    # A block far below the tensor amax gets block scale 0 (E4M3 underflow): codes 0.
    safe = np.where(denom > 0, denom, 1).astype(np.float64)[..., None]
    codes = np.where(denom[..., None] > 0, _e2m1_codes(blocks.astype(np.float64) / safe), 0).astype(np.uint8)
    assert float(q.tensor_scale) == ts
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), sb.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.packed), _packed(codes.reshape(64, -1)))
    want = codes.view(E2M1).astype(np.float64) * denom[..., None]
    np.testing.assert_allclose(np.asarray(quant.nvfp4_dequantize(q)), want.reshape(64, -1), rtol=1e-6)


def test_nvfp4_fixed_tensor_scale_for_kv_rows():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    q = quant.nvfp4_quantize(jnp.asarray(x), tensor_scale=1.0)
    assert float(q.tensor_scale) == 1.0
    sb = (np.abs(x.reshape(8, 4, 16)).max(-1) * (np.float32(1) / np.float32(6))).astype(E4M3)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), sb.view(np.uint8))
    # Rows quantize independently with a fixed tensor scale: row 3 alone gives the same bytes.
    q3 = quant.nvfp4_quantize(jnp.asarray(x[3:4]), tensor_scale=1.0)
    np.testing.assert_array_equal(np.asarray(q3.packed)[0], np.asarray(q.packed)[3])


def test_mxfp4_exact_on_representable_values():
    rng = np.random.default_rng(3)
    exps = np.arange(-30, 31)
    codes = _all_codes_blocks(rng, len(exps), 2)
    x = codes.view(E2M1).astype(np.float32) * (2.0 ** exps[:, None]).astype(np.float32)
    q = quant.mxfp4_quantize(jnp.asarray(x.reshape(1, -1)))
    np.testing.assert_array_equal(np.asarray(q.scales)[0], exps + 127)
    np.testing.assert_array_equal(np.asarray(q.packed)[0], _packed(codes.reshape(-1)))
    back = np.asarray(quant.mxfp4_dequantize(q))[0]
    np.testing.assert_array_equal(back.view(np.uint32), x.reshape(-1).view(np.uint32))


def test_mxfp4_matches_float64_oracle():
    rng = np.random.default_rng(4)
    x = _random_rows(rng, 64, 256)
    q = quant.mxfp4_quantize(jnp.asarray(x))
    blocks = x.reshape(64, -1, 32).astype(np.float64)
    exp = np.floor(np.log2(np.abs(blocks).max(-1))) - 2  # OCP MX shared exponent
    codes = _e2m1_codes(blocks / 2.0 ** exp[..., None])
    np.testing.assert_array_equal(np.asarray(q.scales), exp + 127)
    np.testing.assert_array_equal(np.asarray(q.packed), _packed(codes.reshape(64, -1)))
    want = codes.view(E2M1).astype(np.float64) * 2.0 ** exp[..., None]
    want = want.reshape(64, -1).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(quant.mxfp4_dequantize(q)), want)


def test_fp8_block_exact_on_representable_values():
    rng = np.random.default_rng(5)
    vals = rng.permutation(FINITE_E4M3)
    n_blocks = -(-len(vals) // 31)
    vals = np.resize(vals, (n_blocks, 31))
    tops = 448.0 * rng.choice([-1.0, 1.0], (n_blocks, 1))  # one +-448 per block fixes the scale
    exps = rng.integers(-20, 20, n_blocks)
    blocks = np.concatenate([vals, tops], axis=1) * (2.0 ** exps[:, None])
    x = blocks.astype(np.float32).reshape(1, -1)
    q = quant.fp8_block_quantize(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(q.scales)[0], exps + 127)
    back = np.asarray(quant.fp8_block_dequantize(q))
    np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32))


def test_fp8_block_matches_float64_oracle():
    rng = np.random.default_rng(6)
    x = _random_rows(rng, 32, 512)
    q = quant.fp8_block_quantize(jnp.asarray(x))
    blocks = x.reshape(32, -1, 32).astype(np.float64)
    exp = np.ceil(np.log2(np.abs(blocks).max(-1) / 448))  # DeepSeek ue8m0: rounded up
    vals = (blocks / 2.0 ** exp[..., None]).astype(E4M3)  # never above 448, so never NaN
    np.testing.assert_array_equal(np.asarray(q.scales), exp + 127)
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), vals.reshape(32, -1).view(np.uint8))
    back = np.asarray(quant.fp8_block_dequantize(q))
    assert not np.isnan(back).any()
    # E4M3 error: half an ulp, 2**-4 relative for normals, 2**-10 * scale in the subnormals.
    err = np.abs(back - x).reshape(32, -1, 32)
    bound = np.maximum(2.0**-4 * np.abs(blocks), 2.0**-10 * 2.0 ** exp[..., None])
    assert np.all(err <= bound)


@pytest.mark.parametrize(
    "quantize, fmt, dim, expected",
    [
        (quant.nvfp4_quantize, "nvfp4", 512, 288),
        (quant.mxfp4_quantize, "mxfp4", 128, 68),
        (quant.fp8_block_quantize, "fp8_ue8m0", 512, 528),
    ],
)
def test_bytes_per_row_from_real_arrays(quantize, fmt, dim, expected):
    x = np.random.default_rng(7).standard_normal((3, 2, dim)).astype(np.float32)
    q = quantize(jnp.asarray(x))
    rows = 6
    leaves = [q.values if fmt == "fp8_ue8m0" else q.packed, q.scales]
    assert sum(a.nbytes for a in leaves) == rows * expected
    assert quant.stored_bytes_per_row(q) == expected == quant.bytes_per_row(fmt, dim)
    assert quant.bytes_per_row("bf16", dim) == 2 * dim


def test_containers_are_pytrees_and_jit():
    x = jnp.asarray(np.random.default_rng(8).standard_normal((4, 64)), jnp.float32)
    q = jax.jit(quant.nvfp4_quantize)(x)
    eager = quant.nvfp4_quantize(x)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert len(jax.tree.leaves(quant.mxfp4_quantize(x))) == 2


def test_block_formats_validate_input():
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        quant.nvfp4_quantize(jnp.zeros((2, 24)))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quant.mxfp4_quantize(jnp.zeros((2, 48)))
    with pytest.raises(ValueError, match="float"):
        quant.fp8_block_quantize(jnp.zeros((2, 32), jnp.int32))
    with pytest.raises(ValueError, match="tensor_scale must be > 0"):
        quant.nvfp4_quantize(jnp.ones((1, 16)), tensor_scale=0.0)
    with pytest.raises(ValueError, match="unknown format 'int3'"):
        quant.bytes_per_row("int3", 128)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.bytes_per_row("mxfp4", 100)
