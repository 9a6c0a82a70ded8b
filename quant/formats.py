"""Element codecs: E2M1 (FP4), FP8 E4M3 (fn) and UE8M0 power-of-two scales.

These are the per-element building blocks; block-scaled formats (NVFP4, MXFP4, FP8 with
UE8M0 block scales) are in quant/blockscaled.py.

- E2M1 codes are uint8 in [0, 16): bit 3 is the sign, bits 2..0 index the magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6} (the float4_e2m1fn bit pattern). Encoding rounds to nearest,
  ties to the even code, and saturates at +-6 (the format has no inf or NaN).
- E4M3 values are stored as jnp.float8_e4m3fn (one byte each). Encoding saturates at
  +-448: XLA's own convert turns overflow into NaN, which is never what a quantizer wants.
- UE8M0 scales are uint8 biased exponents: code c means 2**(c - 127), c = 255 is NaN,
  exactly the float8_e8m0fnu semantics. We store uint8 rather than float8_e8m0fnu because
  only the exponent is ever used and uint8 is supported by every backend and kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

E2M1_MAX = 6.0
E4M3_MAX = 448.0
UE8M0_BIAS = 127

# Every codec is jitted: eager dispatch would compile each of its small ops separately.

# E2M1 magnitude for codes 0..7; codes 8..15 are the same with the sign bit set.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = np.array(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), np.float32)
# Midpoints between neighbouring magnitudes. At a midpoint the tie goes to the even code:
# codes 2, 4, 6 (1.0, 2.0, 4.0) win their ties, so those thresholds are inclusive.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_GOES_UP = (False, True, False, True, False, True, False)


@jax.jit
def e2m1_encode(x: jax.Array) -> jax.Array:
    """Float [...] -> uint8 E2M1 codes [...] in [0, 16).

    Round to nearest, ties to even, saturating at +-6. -0.0 encodes as code 8. NaN inputs
    give an unspecified code (E2M1 has no NaN).
    """
    return e2m1_encode_scaled(x, 1.0)


@jax.jit
def e2m1_encode_scaled(x: jax.Array, scale: jax.Array) -> jax.Array:
    """e2m1_encode(x / scale) for scale > 0 (broadcasting), without the division: |x| is
    compared with midpoint * scale, so the code is the exact nearest value of x / scale
    (for a scale with few significant bits, as an E4M3 block scale, every product is
    exact). XLA:GPU's float32 division is not correctly rounded (about a quarter of random
    quotients were off by an ulp on an H200), and which division a fusion uses differs
    between programs, so dividing first could give a jitted write and an eager quantize
    different codes for the same row. scale <= 0 gives code 0.
    """
    x = jnp.asarray(x, jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    mag = jnp.abs(x)
    code = jnp.zeros(jnp.broadcast_shapes(x.shape, scale.shape), jnp.uint8)
    for t, up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_GOES_UP):
        code = code + (mag >= t * scale if up else mag > t * scale).astype(jnp.uint8)
    code = code | (jnp.signbit(x).astype(jnp.uint8) << 3)
    return jnp.where(scale > 0, code, jnp.uint8(0))


@jax.jit
def e2m1_decode(codes: jax.Array) -> jax.Array:
    """uint8 E2M1 codes [...] (low 4 bits used) -> float32 [...]."""
    return jnp.asarray(_E2M1_TABLE)[(codes & 0xF).astype(jnp.int32)]


@jax.jit
def e4m3_encode(x: jax.Array) -> jax.Array:
    """Float [...] -> float8_e4m3fn [...], round to nearest even, saturating at +-448."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


@jax.jit
def e4m3_decode(values: jax.Array) -> jax.Array:
    """float8_e4m3fn [...] (or its uint8 bits) -> float32 [...] (exact), decoded from the bits,
    never by a convert.

    XLA:GPU replaces any chain of float converts by one (SimplifyFPConversions, on whenever
    xla_allow_excess_precision is, the default), so convert(convert(s, f8), f32) in one
    program is s unrounded: NVFP4's codes would be chosen against the block scale before its
    E4M3 rounding while the rounded scale is stored, and a quantize-dequantize round trip
    would not round at all. A bitcast is not a convert, so e4m3_decode_arith keeps both.
    """
    return e4m3_decode_arith(values)


@jax.jit
def pow2(exponent: jax.Array) -> jax.Array:
    """Exact 2**e as float32 for integer e in [-127, 127], built from the bit pattern.

    exp2 on a float is an approximation on some backends; scales must be exact powers of
    two so that dividing by them is lossless.
    """
    e = jnp.clip(jnp.asarray(exponent, jnp.int32), -127, 127)
    normal = jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.uint32), jnp.float32)
    return jnp.where(e == -127, jnp.float32(2.0**-127), normal)


@functools.partial(jax.jit, static_argnames="round_up")
def pow2_exponent(amax: jax.Array, round_up: bool) -> jax.Array:
    """Integer floor(log2(amax)) (round_up=False) or ceil(log2(amax)) (round_up=True).

    Exact (via frexp, no float log). amax <= 0 gives -127, the smallest UE8M0 exponent.
    """
    mant, exp = jnp.frexp(jnp.asarray(amax, jnp.float32))  # amax = mant * 2**exp, mant in [0.5, 1)
    e = exp - 1
    if round_up:
        e = jnp.where(mant == 0.5, e, e + 1)
    return jnp.where(amax > 0, e, -127).astype(jnp.int32)


@jax.jit
def ue8m0_encode(exponent: jax.Array) -> jax.Array:
    """Integer exponent e [...] -> uint8 UE8M0 code e + 127, clipped to [0, 254]."""
    e = jnp.clip(jnp.asarray(exponent, jnp.int32), -UE8M0_BIAS, 254 - UE8M0_BIAS)
    return (e + UE8M0_BIAS).astype(jnp.uint8)


@jax.jit
def ue8m0_decode(codes: jax.Array) -> jax.Array:
    """uint8 UE8M0 codes [...] -> float32 scales 2**(code - 127); code 255 -> NaN."""
    e = codes.astype(jnp.int32) - UE8M0_BIAS
    return jnp.where(codes == 255, jnp.float32(jnp.nan), pow2(e))


def e2m1_decode_arith(codes: jax.Array) -> jax.Array:
    """uint8/int E2M1 codes [...] (low 4 bits used) -> float32 [...], without a table.

    Same values as e2m1_decode (-0.0 for code 8 included), computed from the bit fields
    with integer ops and a bitcast: for c = code & 7 = (e << 1) | m with e > 0 the f32
    pattern is c shifted into f32's exponent/mantissa fields (exponent rebiased by
    127 - 1), 2**(e - 1) * (1 + m / 2); the subnormals (c < 2) are m / 2; bit 3 is the
    sign. Not jitted and free of array constants, so it traces inline into Pallas
    kernels, which cannot capture a lookup table (and XLA:CPU runs it far faster than a
    table or a pow2 of the exponent).
    """
    c = codes.astype(jnp.int32)
    low = c & 7
    normal = jax.lax.bitcast_convert_type((low << 22) + (126 << 23), jnp.float32)
    mag = jnp.where(low < 2, 0.5 * low.astype(jnp.float32), normal)
    signed = jax.lax.bitcast_convert_type(mag, jnp.int32) | ((c & 8) << 28)
    return jax.lax.bitcast_convert_type(signed, jnp.float32)


def e4m3_decode_arith(codes: jax.Array) -> jax.Array:
    """float8_e4m3fn [...] (or its bit patterns: uint8, or int8 / int32 holding the byte)
    -> float32 [...], from the bits.

    Same values as a float8_e4m3fn -> float32 convert (ml_dtypes'; -0.0 and the NaN codes
    0x7F / 0xFF included). XLA:CPU converts float8 with a slow software routine, and XLA:GPU
    folds a convert pair (see e4m3_decode); this is integer ops and a bitcast: exponent e =
    bits 6..3 (bias 7), mantissa m = bits 2..0. A normal value's f32 pattern
    is its low 7 bits shifted to f32's exponent/mantissa fields, exponent rebiased by
    127 - 7; a subnormal (e = 0) is m * 2^-9, built as 2^-6 (1 + m / 8) - 2^-6. Not jitted
    and free of array constants, like e2m1_decode_arith.
    """
    if jnp.issubdtype(codes.dtype, jnp.floating):
        if jnp.dtype(codes.dtype).itemsize != 1:
            raise ValueError(f"e4m3_decode_arith: codes must be float8_e4m3fn or integer bits, got {codes.dtype}")
        codes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    b = codes.astype(jnp.int32)
    if codes.dtype != jnp.uint8:  # a signed integer holding the byte (a kernel's widened int8 load)
        b = b & 0xFF
    low = b & 0x7F
    normal = jax.lax.bitcast_convert_type((low << 20) + (120 << 23), jnp.float32)
    subnormal = jax.lax.bitcast_convert_type(((b & 7) << 20) + (121 << 23), jnp.float32) - 2.0**-6
    mag = jnp.where(low < 8, subnormal, jnp.where(low == 0x7F, jnp.nan, normal))
    signed = jax.lax.bitcast_convert_type(mag, jnp.int32) | ((b & 0x80) << 24)
    return jax.lax.bitcast_convert_type(signed, jnp.float32)
