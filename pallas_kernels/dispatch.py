"""Backend dispatch shared by the entry points.

The choice is staged with lax.platform_dependent rather than a Python `if` on the
default backend, so jax.export / AOT lowering for TPU or CUDA from a CPU host picks
the kernel of the target platform, and a CPU run picks the XLA reference. The staged
call is jitted (static configuration as static arguments) so eager callers do not pay
op-by-op dispatch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax import lax


@functools.partial(jax.jit, static_argnames=("ref", "tpu", "gpu", "interpret"))
def _staged(*args, ref, tpu, gpu, interpret):
    if interpret:
        return tpu(*args, interpret=interpret)
    branches = dict(tpu=functools.partial(tpu, interpret=False), default=ref)
    if gpu is not None:
        gpu_fn = functools.partial(gpu, interpret=False)
        branches.update(cuda=gpu_fn, rocm=gpu_fn)
    return lax.platform_dependent(*args, **branches)


def dispatch(*args, ref: Callable, tpu: Callable, gpu: Callable | None, interpret: Any):
    """Run `ref` (CPU/other), `tpu` (Mosaic) or `gpu` (Triton/GPU) on array `args`.

    ref/tpu/gpu must be hashable (functools.partial of module functions with hashable
    keywords) since they key the jit cache. interpret: None/False for the platform's
    own path; True or a pltpu.InterpretParams runs the TPU kernel in interpret mode.
    """
    return _staged(*args, ref=ref, tpu=tpu, gpu=gpu, interpret=interpret or None)
