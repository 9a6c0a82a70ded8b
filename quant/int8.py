"""LLM.int8(): vector-wise absmax int8 matmul with outlier decomposition.

y = x @ w for x [..., in] and w [in, out] (the model's layout) is computed as

    y = dequant(int8(x_regular) @ int8(w)) + x_outlier @ dequant(int8(w))

- Weights: one absmax per output channel (column of w), q = round(w * 127 / absmax).
- Activations: one absmax per row (token), taken over the non-outlier columns only.
- The int8 product accumulates in int32 and is rescaled by row_absmax * col_absmax / 127**2.
- Outlier columns: input features where any row of this call has |x| >= threshold (6.0).
  They are zeroed in the int8 operand and go through a float matmul instead.

Choice for the float path's weight rows: we multiply by the *dequantized int8* rows, as
bitsandbytes does for inference weights (has_fp16_weights=False). The outlier set depends
on the activations, so keeping exact float rows would mean keeping the whole float weight
and forfeiting the memory saving; the error that matters (an int8 activation grid
stretched by a 6.0+ outlier) is removed either way.

Cost note: under jit the outlier set is data dependent, so the float path is a masked
full-width matmul (exact, but no cheaper than the float matmul). A kernel would gather
the few outlier columns (~0.1% of features in large models) instead.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

DEFAULT_THRESHOLD = 6.0
_QMAX = 127.0


class Int8Weight(NamedTuple):
    """An int8 linear weight in the float weight's layout.

    q: int8 [..., in_features, out_features]; absmax: float32 [..., out_features], the
    per-output-channel absmax (scale = absmax / 127). Leading axes (stacked layers) are
    allowed for storage; int8_matmul takes a 2-D weight (slice the stack first, e.g. in
    a scan over layers).
    """

    q: jax.Array
    absmax: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """[..., in, out] float weight that the int8 codes represent."""
        return (self.q.astype(jnp.float32) * (self.absmax / _QMAX)[..., None, :]).astype(dtype)


def _absmax_quantize(x: jax.Array, absmax: jax.Array) -> jax.Array:
    scale = jnp.where(absmax > 0, _QMAX / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    return jnp.clip(jnp.round(x * scale), -_QMAX, _QMAX).astype(jnp.int8)


def quantize_weight(w: jax.Array) -> Int8Weight:
    """Float [..., in, out] -> Int8Weight with one absmax per output channel."""
    w = jnp.asarray(w)
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"quantize_weight: expected a float [..., in, out] array, got {w.dtype}{w.shape}")
    return _quantize_weight(w)


@jax.jit
def _quantize_weight(w: jax.Array) -> Int8Weight:
    w = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=-2)
    return Int8Weight(_absmax_quantize(w, absmax[..., None, :]), absmax)


def int8_matmul(x: jax.Array, qw: Int8Weight, threshold: float | None = DEFAULT_THRESHOLD) -> jax.Array:
    """LLM.int8() product x @ w.

    x: float [..., in]; qw: Int8Weight with q [in, out]. threshold: activation magnitude
    that marks a feature column as an outlier (None disables the decomposition).
    Returns [..., out] in x's dtype.
    """
    x = jnp.asarray(x)
    if qw.q.ndim != 2:
        raise ValueError(f"int8_matmul: weight must be 2-D [in, out], got {qw.q.shape}")
    d_in, d_out = qw.q.shape
    if x.ndim < 1 or x.shape[-1] != d_in:
        raise ValueError(f"int8_matmul: x {x.shape} does not match weight [in={d_in}, out={d_out}]")
    if threshold is not None and not threshold > 0:
        raise ValueError(f"int8_matmul: threshold must be > 0 or None, got {threshold}")
    return _int8_matmul(x, qw, None if threshold is None else float(threshold))


@functools.partial(jax.jit, static_argnames="threshold")
def _int8_matmul(x: jax.Array, qw: Int8Weight, threshold: float | None) -> jax.Array:
    d_in, d_out = qw.q.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_in).astype(jnp.float32)

    if threshold is None:
        outlier = jnp.zeros((d_in,), bool)
    else:
        outlier = jnp.any(jnp.abs(x2) >= threshold, axis=0)
    x_regular = jnp.where(outlier, 0.0, x2)
    row_absmax = jnp.max(jnp.abs(x_regular), axis=-1)
    xq = _absmax_quantize(x_regular, row_absmax[:, None])
    acc = jnp.dot(xq, qw.q, preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * (row_absmax[:, None] * qw.absmax[None, :] / (_QMAX * _QMAX))

    if threshold is not None:
        x_outlier = jnp.where(outlier, x2, 0.0)
        y = y + x_outlier @ qw.dequantize(jnp.float32)
    return y.reshape(*lead, d_out).astype(x.dtype)
