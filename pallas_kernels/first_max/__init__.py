"""Greedy decoding's pick, the index of each row's first maximum: ref.py states it in XLA
(what TPU and GPU run), cpu.py is the C++ kernel a CPU runs (cpu_kernel.cc)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.first_max import cpu, ref


def first_max(logits: jnp.ndarray) -> jnp.ndarray:
    """int32 [...]: the index of the first maximum over the last axis of float logits [...,
    V] (jnp.argmax, ties to the lowest index), 0 for a row holding a NaN. On a CPU backend
    with the kernel built, the kernel (staged with lax.platform_dependent, so an export for
    TPU or GPU from a CPU host keeps the XLA statement); elsewhere ref.first_max."""
    if logits.ndim < 1 or logits.shape[-1] < 1 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"first_max needs float logits [..., V] with V >= 1, got {logits.dtype} {logits.shape}")
    if jax.default_backend() != "cpu" or not cpu.available() or logits.dtype == jnp.float64:
        return ref.first_max(logits)  # (float64 logits: the kernel's float32 could tie them)
    rows = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)
    picks = lax.platform_dependent(rows, cpu=cpu.first_max_cpu, default=ref.first_max)
    return picks.reshape(logits.shape[:-1])
