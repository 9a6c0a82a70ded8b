"""Bit packing of small integer codes into uint8 along the last axis.

On CPU (and in XLA generally) 4-bit dtypes occupy a whole byte each, so every sub-byte
format in quant/ stores its codes through these functions.

Layout (one rule for every width): the codes form a little-endian bit stream. Code i of
width b occupies stream bits [i*b, (i+1)*b), least significant bit first, and stream bit j
lives in byte j // 8 at bit j % 8. For b = 4 this puts element 2i in the low nibble and
element 2i+1 in the high nibble of byte i (the convention of torch.float4_e2m1fn_x2 and of
the NVFP4/MXFP4 hardware layouts); for b = 1 it equals numpy.packbits(bitorder="little").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_WIDTHS = tuple(range(1, 9))


def _check(n: int, bits: int, what: str) -> None:
    if not isinstance(bits, int) or bits not in _WIDTHS:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    if (n * bits) % 8:
        raise ValueError(
            f"{what}: last axis of length {n} at {bits} bits is {n * bits} bits, "
            "which must be a multiple of 8 (pad the axis)"
        )


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Packs integer codes of width `bits` into bytes along the last axis.

    codes: integer [..., n] with values in [0, 2**bits); higher bits are ignored.
    Returns uint8 [..., n * bits // 8]. Requires n * bits % 8 == 0.
    """
    codes = jnp.asarray(codes)
    if codes.ndim < 1:
        raise ValueError("pack_bits: codes must have a last axis to pack along, got a scalar")
    _check(codes.shape[-1], bits, "pack_bits")
    return _pack(codes, bits)


@functools.partial(jax.jit, static_argnames="bits")
def _pack(codes: jax.Array, bits: int) -> jax.Array:
    n = codes.shape[-1]
    codes = codes.astype(jnp.uint8) & jnp.uint8((1 << bits) - 1)
    lead = codes.shape[:-1]
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
        grouped = codes.reshape(*lead, n // per_byte, per_byte) << shifts
        # Fields are disjoint, so the sum is a bitwise OR and cannot overflow.
        return jnp.sum(grouped, axis=-1, dtype=jnp.uint8)
    # Widths that straddle bytes (3, 5, 6, 7): go through the explicit bit stream.
    stream = (codes[..., None] >> jnp.arange(bits, dtype=jnp.uint8)) & jnp.uint8(1)
    stream = stream.reshape(*lead, n * bits // 8, 8) << jnp.arange(8, dtype=jnp.uint8)
    return jnp.sum(stream, axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array, bits: int, n: int | None = None) -> jax.Array:
    """Inverse of pack_bits.

    packed: uint8 [..., m]. Returns uint8 [..., n] with n = m * 8 // bits by default
    (pass n to drop trailing padding codes).
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8 or packed.ndim < 1:
        raise ValueError(f"packed codes must be uint8 [..., m], got {packed.dtype}{packed.shape}")
    if not isinstance(bits, int) or bits not in _WIDTHS:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    total = packed.shape[-1] * 8 // bits
    n = total if n is None else n
    if not 0 <= n <= total:
        raise ValueError(f"{packed.shape[-1]} bytes hold {total} codes of {bits} bits, asked for {n}")
    return _unpack(packed, bits, n)


@functools.partial(jax.jit, static_argnames=("bits", "n"))
def _unpack(packed: jax.Array, bits: int, n: int) -> jax.Array:
    m = packed.shape[-1]
    total = m * 8 // bits
    lead = packed.shape[:-1]
    mask = jnp.uint8((1 << bits) - 1)
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits).astype(jnp.uint8)
        codes = (packed[..., None] >> shifts) & mask
        return codes.reshape(*lead, m * per_byte)[..., :n]
    if m % bits == 0:
        # Whole groups of 8 codes in `bits` bytes: code j starts at bit bits * j of its
        # group, in one byte or straddling into the next. Shifts of the group's bytes
        # cost a fraction of the explicit bit stream below (8x the bytes, then a sum).
        group = packed.reshape(*lead, m // bits, bits).astype(jnp.int32)
        codes = []
        for j in range(8):
            first, shift = divmod(bits * j, 8)
            word = group[..., first]
            if shift + bits > 8:
                word = word | (group[..., first + 1] << 8)
            codes.append((word >> shift) & ((1 << bits) - 1))
        return jnp.stack(codes, axis=-1).astype(jnp.uint8).reshape(*lead, total)[..., :n]
    stream = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & jnp.uint8(1)
    stream = stream.reshape(*lead, m * 8)[..., : total * bits]
    stream = stream.reshape(*lead, total, bits) << jnp.arange(bits, dtype=jnp.uint8)
    return jnp.sum(stream, axis=-1, dtype=jnp.uint8)[..., :n]


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Two 4-bit codes per byte: uint8 [..., 2n] -> uint8 [..., n] (element 2i low)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last axis, got {codes.shape}")
    return pack_bits(codes, 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., n] -> uint8 [..., 2n], each code in [0, 16)."""
    return unpack_bits(packed, 4)
