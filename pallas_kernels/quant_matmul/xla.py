"""The XLA path of the quantized matmul: CPU steps longer than the C++ kernel takes (cpu.py:
prefill chunks), fp8 on CPU, and any backend without a kernel.

XLA:CPU does not fuse a dequantization into a matmul, and its element-wise ops over a
whole weight cost more than the float matmul itself (measured on this project's 2-core
CPU: turning 53 M int8 codes into float32 and multiplying took 7x the float32 matmul at
one token). Its int8 x int8 -> int32 matmul, though, reads a quarter of the bytes and ran
2-4x faster than float32 from two tokens up. So:

- w8a8 (int8 codes, one scale per output channel) multiplies them by int8 activations
  rounded per token (quant/packed.py quantize_activations), as llama.cpp's CPU dot products
  round activations to 8 bits; the int32 product is rescaled by the two scales. One token
  is padded to two (XLA:CPU lowers a one-row int8 matmul to a slow matrix-vector loop).
- every other format dequantizes inside the jitted step and runs a float32 matmul: the
  float copy is a temporary of that step, never kept between steps (of x rounded per
  activation block for a weight with int8_activations).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quant.packed import ACTIVATION_INT8, PackedWeight, quantize_activations, round_activation_blocks


def _int8_product(x: jax.Array, w: PackedWeight) -> jax.Array:
    t = x.shape[0]
    xq, xs = quantize_activations(jnp.pad(x, ((0, 1), (0, 0))) if t == 1 else x)
    acc = jax.lax.dot(xq, w.row_codes(), preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * xs * w.scale.astype(jnp.float32))[:t]


def quant_matmul_xla(x: jax.Array, w: PackedWeight) -> jax.Array:
    """As ref.quant_matmul_ref: x [T, in] float, w packed [in, out] -> float32 [T, out]."""
    x = x.astype(jnp.float32)
    if w.fmt in ACTIVATION_INT8:
        return _int8_product(x, w)
    if w.int8_activations:  # as the CPU kernel rounds them at decode, so every step length agrees
        x = round_activation_blocks(x, w.fmt, w.group)
    return jnp.matmul(x, w.dequantize(jnp.float32))
