"""The CPU path of greedy decoding's pick: a C++ kernel (cpu_kernel.cc) called through the
XLA FFI, one pass for each row's maximum and one to its first copy. Built like the other
CPU kernels (pallas_kernels/cpu_ffi.py); `available()` says whether that worked."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
TARGET = "kvfold_first_max"
KERNEL = cpu_ffi.Kernel(SOURCE, TARGET, "KvfoldFirstMax", "the CPU greedy-pick kernel", "KVFOLD_FIRST_MAX_CPU")


def available() -> bool:
    """Whether the kernel is built (building it now if needed) and registered with XLA:CPU;
    KVFOLD_FIRST_MAX_CPU=0 turns it off."""
    return KERNEL.available()


def first_max_cpu(logits):
    """int32 [B]: ref.first_max of float32 logits [B, V] (V >= 1). RuntimeError when the
    kernel is not available."""
    if not available():
        raise RuntimeError(f"{KERNEL.what} is not available (no compiler, a failed build, or KVFOLD_FIRST_MAX_CPU=0)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32), vmap_method="sequential")
    return call(logits)
