"""Bit packing and element codecs (E2M1, E4M3, UE8M0) against ml_dtypes / numpy oracles."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import quant
from quant import formats
from quant.packing import pack_bits, pack_nibbles, unpack_bits, unpack_nibbles
from tests.round_trips import rounding_round_trips


def _np_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Independent oracle: explicit LSB-first bit stream through numpy.packbits."""
    stream = ((codes[..., None].astype(np.uint16) >> np.arange(bits)) & 1).astype(np.uint8)
    stream = stream.reshape(*codes.shape[:-1], -1)
    return np.packbits(stream, axis=-1, bitorder="little")


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_bits_round_trip_and_layout(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(3, 5, 64), dtype=np.uint8)
    packed = pack_bits(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    np.testing.assert_array_equal(np.asarray(packed), _np_pack(codes, bits))
    np.testing.assert_array_equal(np.asarray(unpack_bits(packed, bits)), codes)


def test_pack_nibbles_low_nibble_first():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(4, 34), dtype=np.uint8)
    packed = np.asarray(pack_nibbles(jnp.asarray(codes)))
    np.testing.assert_array_equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))
    np.testing.assert_array_equal(np.asarray(unpack_nibbles(jnp.asarray(packed))), codes)


def test_pack_rejects_misaligned_and_bad_width():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_bits(jnp.zeros((5,), jnp.uint8), 3)
    with pytest.raises(ValueError, match="1..8"):
        pack_bits(jnp.zeros((8,), jnp.uint8), 9)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(jnp.zeros((3,), jnp.uint8))


def test_e2m1_all_codes_round_trip_and_match_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    values = np.asarray(formats.e2m1_decode(jnp.asarray(codes)))
    np.testing.assert_array_equal(values, codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    np.testing.assert_array_equal(np.signbit(values), codes >= 8)  # -0.0 keeps its sign
    np.testing.assert_array_equal(np.asarray(formats.e2m1_encode(jnp.asarray(values))), codes)


def test_e2m1_round_to_nearest_even_saturating():
    rng = np.random.default_rng(1)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = np.concatenate(
        [
            rng.standard_normal(20000) * 3,
            rng.uniform(-8, 8, 20000),
            mids,
            -mids,  # exact ties
            np.nextafter(mids, 0),
            np.nextafter(mids, 10),
            [7.0, -100.0, 6.5, 1e30],  # saturation
        ]
    ).astype(np.float32)
    got = np.asarray(formats.e2m1_encode(jnp.asarray(x)))
    want = x.astype(np.float64).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(got, want)
    # Ties go to the even code: 0.25 -> 0, 0.75 -> 1.0, 2.5 -> 2.0, 5.0 -> 4.0.
    ties = np.asarray(formats.e2m1_decode(formats.e2m1_encode(jnp.asarray(mids, jnp.float32))))
    np.testing.assert_array_equal(ties, [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])


def test_e4m3_every_finite_value_round_trips_bit_exactly():
    bits = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)  # 0x7F/0xFF are NaN
    values = bits.view(ml_dtypes.float8_e4m3fn)
    decoded = formats.e4m3_decode(jnp.asarray(values))
    np.testing.assert_array_equal(np.asarray(decoded), values.astype(np.float32))
    again = np.asarray(formats.e4m3_encode(decoded)).view(np.uint8)
    np.testing.assert_array_equal(again, bits)


def test_e4m3_random_matches_float64_oracle_and_saturates():
    rng = np.random.default_rng(2)
    x = np.concatenate(
        [
            rng.standard_normal(20000) * 100,
            rng.standard_normal(5000) * 2.0**-8,  # subnormal range
            [448.0, 449.0, 500.0, -1e6, 1e-12],
        ]
    ).astype(np.float32)
    got = np.asarray(formats.e4m3_encode(jnp.asarray(x))).view(np.uint8)
    want = np.clip(x.astype(np.float64), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(got, want)
    assert not np.isnan(np.asarray(formats.e4m3_decode(formats.e4m3_encode(jnp.asarray(x))))).any()


def test_ue8m0_matches_float8_e8m0fnu():
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(formats.ue8m0_decode(jnp.asarray(codes)))
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(got[:255], want[:255])
    assert np.isnan(got[255]) and np.isnan(want[255])
    exps = np.arange(-127, 128)
    np.testing.assert_array_equal(np.asarray(formats.ue8m0_encode(jnp.asarray(exps))), exps + 127)


def test_pow2_exponent_floor_and_ceil():
    rng = np.random.default_rng(3)
    x = np.concatenate([np.exp(rng.uniform(-60, 60, 5000)), 2.0 ** np.arange(-100, 100)]).astype(np.float32)
    x64 = x.astype(np.float64)
    floor = np.asarray(formats.pow2_exponent(jnp.asarray(x), round_up=False))
    ceil = np.asarray(formats.pow2_exponent(jnp.asarray(x), round_up=True))
    np.testing.assert_array_equal(floor, np.floor(np.log2(x64)))
    np.testing.assert_array_equal(ceil, np.ceil(np.log2(x64)))
    e = np.arange(-126, 128)
    np.testing.assert_array_equal(np.asarray(formats.pow2(jnp.asarray(e))), 2.0**e)


def test_e2m1_encode_scaled_is_the_exact_nearest_code_of_the_quotient():
    """Codes of x / scale without dividing: ml_dtypes rounds the float64 quotient (exact for
    these scales) to float4_e2m1fn; ties planted at midpoint * scale go to the even code."""
    rng = np.random.default_rng(2)
    scales = np.abs(rng.standard_normal(4000)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales[:8] = [0.0, 448.0, 2.0**-9, 0.75, 1.0, 3.5, 0.0, 1e-3]
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    x = (rng.standard_normal(4000) * 3 * scales).astype(np.float32)
    x[8:15] = mids * scales[8:15]  # exact ties
    x[15:22] = -np.nextafter(mids * scales[15:22], np.float32(np.inf))
    x[22:25] = [7.0 * scales[22], -100.0 * scales[23], 0.0]
    got = np.asarray(formats.e2m1_encode_scaled(jnp.asarray(x), jnp.asarray(scales)))
    live = scales > 0
    q = np.clip(x[live].astype(np.float64) / scales[live], -6, 6)
    np.testing.assert_array_equal(got[live], q.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    np.testing.assert_array_equal(got[~live], 0)


def test_e2m1_arithmetic_decode_equals_table_decode_on_every_code():
    codes = jnp.asarray(np.arange(256, dtype=np.uint8))  # high nibble must be ignored
    table = np.asarray(formats.e2m1_decode(codes))
    arith = np.asarray(formats.e2m1_decode_arith(codes))
    np.testing.assert_array_equal(arith, table)
    np.testing.assert_array_equal(np.signbit(arith), np.signbit(table))  # code 8 is -0.0
    np.testing.assert_array_equal(np.asarray(formats.e2m1_decode_arith(codes.astype(jnp.int32))), table)


def test_e4m3_arithmetic_decode_equals_the_convert_on_every_code():
    bits = np.arange(256, dtype=np.uint8)
    want = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    # the uint8 bits, the float8 values, and a kernel's widened int8 load (int8, int32 sign-extended)
    for codes in (jnp.asarray(bits), jnp.asarray(bits.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(bits.view(np.int8)),
                  jnp.asarray(bits.view(np.int8).astype(np.int32))):
        got = np.asarray(formats.e4m3_decode_arith(codes))
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)  # 0x7F and 0xFF
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0.0 too
    with pytest.raises(ValueError, match="bfloat16"):  # a wider float is no E4M3 byte
        formats.e4m3_decode_arith(jnp.zeros(4, jnp.bfloat16))


def test_round_trip_finder_sees_a_rounding_cast_pair_through_reshapes_and_nested_jits():
    """The finder behind the next test: a planted f32 -> bf16 -> f32 pair is found directly,
    through a reshape or a slice, across a nested jit and into a conditional's branch or a
    one-step scan; a lossless pair (bf16 -> f32 -> bf16) and a bitcast in between are not round trips."""
    x = jnp.ones((4, 8), jnp.float32)
    to_bf16 = jax.jit(lambda x: x.astype(jnp.bfloat16))
    assert rounding_round_trips(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), x) == [
        "float32 -> bfloat16 -> float32"]
    assert len(rounding_round_trips(lambda x: to_bf16(x).reshape(32).astype(jnp.float32), x)) == 1
    assert len(rounding_round_trips(lambda x: formats.e4m3_encode(x).T.astype(jnp.float32), x)) == 1
    assert len(rounding_round_trips(lambda x: to_bf16(x)[1:3].astype(jnp.float32), x)) == 1
    branch = lambda i, x: jax.lax.switch(i, [lambda y: y.astype(jnp.float32), lambda y: y.astype(jnp.float32) * 2],
                                         to_bf16(x))
    assert len(rounding_round_trips(branch, 0, x)) == 2  # one per branch
    once = lambda x: jax.lax.scan(lambda c, y: (c, y.astype(jnp.float32)), 0.0, to_bf16(x)[None])[1]
    assert len(rounding_round_trips(once, x)) == 1  # a scan of one step is inlined
    assert rounding_round_trips(lambda x: x.astype(jnp.float32).astype(jnp.bfloat16), x.astype(jnp.bfloat16)) == []
    assert rounding_round_trips(lambda x: formats.e4m3_decode_arith(formats.e4m3_encode(x)), x) == []


def test_quantize_then_dequantize_in_one_program_keeps_every_rounding_on_a_gpu():
    """XLA:GPU replaces a chain of float converts by one (SimplifyFPConversions), so a codec
    that rounds with f32 -> float8 and reads the result back with float8 -> f32 in the same
    program would not round there: NVFP4 picked its codes against the unrounded block scale
    (errors beyond the format's bound on an H200), and a fused quantize-dequantize (DeepSeek's
    stored rows, a KV write read back) was the identity. No codec may contain such a pair."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 64)), jnp.float32)
    codecs = {
        "nvfp4": lambda x: quant.nvfp4_dequantize(quant.nvfp4_quantize(x)),
        "nvfp4 unit scale": lambda x: quant.nvfp4_dequantize(quant.nvfp4_quantize(x, 1.0)),
        "mxfp4": lambda x: quant.mxfp4_dequantize(quant.mxfp4_quantize(x)),
        "fp8 ue8m0": lambda x: quant.fp8_block_dequantize(quant.fp8_block_quantize(x)),
        "fp8 rows": lambda x: quant.dequantize_rows(quant.quantize_rows(x, "fp8")),
        "int8 rows": lambda x: quant.dequantize_rows(quant.quantize_rows(x, "int8")),
        "e4m3": lambda x: formats.e4m3_decode(formats.e4m3_encode(x)),
    }
    for name, fn in codecs.items():
        assert rounding_round_trips(fn, x) == [], name


@pytest.mark.parametrize(("bits", "n"), [(3, 8), (5, 16), (6, 4), (7, 8), (3, 40)])
def test_unpack_bits_of_whole_and_partial_groups(bits, n):
    """Straddling widths unpack by groups of 8 codes when the bytes hold whole groups
    (n % 8 == 0) and through the bit stream otherwise (6 bits x 4 codes = 3 bytes)."""
    codes = np.random.default_rng(n).integers(0, 1 << bits, size=(2, n), dtype=np.uint8)
    packed = jnp.asarray(_np_pack(codes, bits))
    np.testing.assert_array_equal(np.asarray(unpack_bits(packed, bits)), codes)
    np.testing.assert_array_equal(np.asarray(unpack_bits(packed, bits, n - 1)), codes[:, :-1])
