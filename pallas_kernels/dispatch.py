"""Backend dispatch shared by the entry points.

The choice is staged with lax.platform_dependent rather than a Python `if` on the
default backend, so jax.export / AOT lowering for TPU or CUDA from a CPU host picks
the kernel of the target platform, and a CPU run picks the XLA reference. The staged
call is jitted (static configuration as static arguments) so eager callers do not pay
op-by-op dispatch, and compile once per shape and configuration: the static arguments
are `Bound` values, equal whenever their function and options are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax import lax


@dataclasses.dataclass(frozen=True)
class Bound:
    """A module-level kernel function with its static keyword options, compared by value.

    The jit cache is keyed on the static arguments' hash and equality. A functools.partial
    compares by identity, so the fresh one an entry builds on every call would compile a
    new executable every call; two Bounds of the same function and options are equal.
    """

    fn: Callable
    options: tuple[tuple[str, Any], ...]

    def __call__(self, *args, **more):
        return self.fn(*args, **dict(self.options), **more)


def bind(fn: Callable, **options) -> Bound:
    """fn with its static keyword options; every option value must be hashable."""
    return Bound(fn, tuple(sorted(options.items())))


@functools.partial(jax.jit, static_argnames=("ref", "tpu", "gpu", "cpu", "interpret"))
def _staged(*args, ref, tpu, gpu, cpu, interpret):
    if interpret:
        return tpu(*args, interpret=interpret)
    branches = dict(tpu=functools.partial(tpu, interpret=False), default=ref)
    if gpu is not None:
        gpu_fn = functools.partial(gpu, interpret=False)
        branches.update(cuda=gpu_fn, rocm=gpu_fn)
    if cpu is not None:
        branches.update(cpu=cpu)
    return lax.platform_dependent(*args, **branches)


def dispatch(*args, ref: Bound, tpu: Bound, gpu: Bound | None, interpret: Any, cpu: Bound | None = None):
    """Run `ref` (CPU/other), `tpu` (Mosaic), `gpu` (Triton/GPU) or `cpu` (a native CPU
    kernel, when given; else CPU runs `ref`) on array `args`.

    ref/tpu/gpu/cpu are `bind(module_function, **static_options)`: they key the jit cache,
    so they must compare by value (a functools.partial or a fresh lambda would compile
    on every call). interpret: None/False for the platform's own path; True or a
    pltpu.InterpretParams runs the TPU kernel in interpret mode.
    """
    return _staged(*args, ref=ref, tpu=tpu, gpu=gpu, cpu=cpu, interpret=interpret or None)
