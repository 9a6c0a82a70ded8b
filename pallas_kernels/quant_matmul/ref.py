"""The truth for the quantized matmul: dequantize the whole weight, then one float32 matmul
(of the per-token int8-rounded activations for w8a8, of x rounded per activation block for
a weight with int8_activations)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from quant.packed import ACTIVATION_INT8, PackedWeight, quantize_activations, round_activation_blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 like the reference models: the norm
    the entry's `norm` argument applies to x before the matmul (model.layers uses this one)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def quant_matmul_ref(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x [T, in] float times the packed weight [in, out]: float32 [T, out]."""
    x = x.astype(jnp.float32)
    if w.fmt in ACTIVATION_INT8:
        xq, scale = quantize_activations(x)
        x = xq.astype(jnp.float32) * scale
    if w.int8_activations:
        x = round_activation_blocks(x, w.fmt, w.group)
    return jnp.matmul(x, w.dequantize(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
