"""What the TPU and GPU kernels of the quantized matmul share: the activation planes, the
tile dequantizer and the tile product (each kernel module compiles for its own platform
alone, so neither imports the other).

A K tile of the weight covers whole groups and is dequantized in the kernel, never the
whole weight. The tile arrives as its stored bytes bitcast to int8 and is widened to
int32 and decoded with int32 ops: 4-bit codes are `b & 15` and `(b >> 4) & 15`, fp8 codes
are rebuilt from their E4M3 bits. int8 loads and int32 ops lower on every Mosaic TPU and
Triton GPU; 8-bit arithmetic and float8 conversions do not (TPU v5e and Ampere have no
float8 hardware).

Nibble planes. Within a group, byte j holds row j (low nibble) and row j + group / 2
(high nibble), quant/packed.py. Interleaving the two nibble planes back into row order inside
a kernel needs a sublane concatenate (which Triton lacks) or a strided reshape; instead
the kernels keep them apart and split x's columns the same way once, outside the kernel
(`planes`): y = x_lo @ W_lo + x_hi @ W_hi, where W_lo holds the low nibbles' weights in
byte order and x_lo the matching columns of x. The split is per group, so it does not
depend on the tile size.

Scales. A group's scale row is repeated over its rows of a plane by a broadcast and a
reshape that only merges leading rows (no lane movement). A weight with one scale per
output channel (int8, fp8; a grouped format whose group is the whole input) is scaled
after the dot instead: one multiply per output element of the tile, not per weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from quant.formats import e4m3_decode_arith
from quant.packed import FORMATS


def num_planes(fmt: str) -> int:
    """Codes per stored byte: 2 for 4-bit formats, 1 for 8-bit ones."""
    return 8 // FORMATS[fmt].bits


def planes(x, fmt: str, group: int) -> tuple[jax.Array, ...]:
    """x [T, in] -> the planes its columns pair with: (x,) for 8-bit formats; for 4-bit
    ones (x_lo, x_hi), each [T, in / 2], column (g, j) = x[:, g * group + j] and
    x[:, g * group + group / 2 + j], the rows of stored byte (g, j)'s two nibbles."""
    if num_planes(fmt) == 1:
        return (x,)
    t, d_in = x.shape
    split = x.reshape(t, d_in // group, 2, group // 2)
    return split[:, :, 0].reshape(t, d_in // 2), split[:, :, 1].reshape(t, d_in // 2)


def as_bytes(codes):
    """The stored codes as int8 (a bitcast: uint8 nibble pairs and float8 bits alike)."""
    if codes.dtype == jnp.int8:
        return codes
    return lax.bitcast_convert_type(codes, jnp.int8)


def decode_codes(codes, fmt: str) -> tuple[jax.Array, ...]:
    """int8 stored bytes [rows, n] -> float32 planes of code - zero, each [rows, n]: one
    for 8-bit formats, (low nibbles, high nibbles) for 4-bit ones."""
    f = FORMATS[fmt]
    b = codes.astype(jnp.int32)
    if f.bits == 4:
        ints = (b & 15, (b >> 4) & 15)
    elif f.codes_dtype == "int8":
        ints = (b,)
    else:
        return (e4m3_decode_arith(b),)
    return tuple((q - f.zero if f.zero else q).astype(jnp.float32) for q in ints)


def repeat_rows(a, rows: int):
    """[G, n] -> [G * rows, n]: row g repeated `rows` times (a broadcast, then a reshape
    merging leading dims; [1, n] is returned as is and broadcasts)."""
    groups, n = a.shape
    if groups == 1:
        return a
    return jnp.broadcast_to(a[:, None, :], (groups, rows, n)).reshape(groups * rows, n)


def tile_product(xs, codes, scale, offset, *, fmt: str):
    """The kernels' work on one (token, output, K) tile: float32 [bt, bn].

    xs: the tile's x planes (`planes`), each float32 [bt, rows]. codes: int8 [rows, bn],
    the stored bytes of the K tile (whole groups). scale: [G, bn] float16 / float32, the
    tile's scale rows (G = 1: one scale for every row of the tile); offset: the same
    shape, or None. The dots are float32 at HIGHEST precision (Triton would otherwise
    take TF32, Mosaic single bf16 passes).
    """
    qs = decode_codes(codes, fmt)
    scale = scale.astype(jnp.float32)
    if scale.shape[0] == 1 and offset is None:
        return _dots(xs, qs) * scale
    rows = codes.shape[0] // scale.shape[0]
    s = repeat_rows(scale, rows)
    if offset is None:
        return _dots(xs, [q * s for q in qs])
    m = repeat_rows(offset.astype(jnp.float32), rows)
    return _dots(xs, [q * s + m for q in qs])


def _dots(xs, ws):
    """sum_p xs[p] @ ws[p] in float32."""
    acc = None
    for x, w in zip(xs, ws):
        y = jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        acc = y if acc is None else acc + y
    return acc
