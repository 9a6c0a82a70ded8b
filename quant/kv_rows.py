"""Per-row (per token and head) scaled KV formats: int8 and FP8 E4M3, one f32 scale a row.

The row is the last axis (head_dim); every leading axis is batch, so a page pool
[num_pages, page_size, num_kv_heads, head_dim] gets scales [num_pages, page_size,
num_kv_heads]. Symmetric absmax: scale = absmax(row) / qmax, x_hat = code * scale, with
qmax = 127 (int8, round to nearest) or 448 (E4M3, round to nearest even). The absmax
element maps to +-qmax exactly, so nothing saturates. An all-zero row gets scale 0.

Worst-case element error: int8 |x - x_hat| <= scale / 2 = absmax / 254; E4M3 has 3
mantissa bits, so |x - x_hat| <= 2**-4 |x| for |x / scale| >= 2**-6 (normal range) and
<= 2**-10 * scale below it (the subnormal spacing is 2**-9).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from quant.formats import E4M3_MAX, e4m3_decode, e4m3_encode

ROW_FORMATS = ("int8", "fp8")
_QMAX = {"int8": 127.0, "fp8": E4M3_MAX}
_CODE_DTYPE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


class RowQuantized(NamedTuple):
    """codes: int8 or float8_e4m3fn [..., d] (or its uint8 bits, as KV page pools keep them);
    scales: float32 [...] (x_hat = codes * scales)."""

    codes: jax.Array
    scales: jax.Array

    @property
    def fmt(self) -> str:
        return "int8" if self.codes.dtype == jnp.int8 else "fp8"


def quantize_rows(x: jax.Array, fmt: str) -> RowQuantized:
    """Float [..., d] -> RowQuantized in fmt ("int8" or "fp8") with one scale per row."""
    if fmt not in ROW_FORMATS:
        raise ValueError(
            f"quantize_rows: unknown format {fmt!r}; allowed: {', '.join(ROW_FORMATS)}"
        )
    x = jnp.asarray(x)
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize_rows: expected a float [..., d] array, got {x.dtype}{x.shape}")
    return _quantize_rows(x, fmt)


@functools.partial(jax.jit, static_argnames="fmt")
def _quantize_rows(x: jax.Array, fmt: str) -> RowQuantized:
    x = x.astype(jnp.float32)
    qmax = _QMAX[fmt]
    # Both divisions spelled as multiplications by a float32 reciprocal: what XLA:CPU makes of
    # them anyway, and what the CPU attention kernel's KV write (pallas_kernels/
    # ragged_paged_attention/cpu_kernel.cc) repeats bit for bit.
    scales = jnp.max(jnp.abs(x), axis=-1) * (np.float32(1) / np.float32(qmax))
    y = x * (1.0 / jnp.where(scales > 0, scales, 1.0))[..., None]
    if fmt == "int8":
        codes = jnp.clip(jnp.round(y), -qmax, qmax).astype(jnp.int8)
    else:
        codes = e4m3_encode(y)
    return RowQuantized(codes, scales)


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize_rows(q: RowQuantized, dtype=jnp.float32) -> jax.Array:
    """RowQuantized -> [..., d] in dtype."""
    codes = q.codes.astype(jnp.float32) if q.codes.dtype == jnp.int8 else e4m3_decode(q.codes)
    return (codes * q.scales[..., None]).astype(dtype)
