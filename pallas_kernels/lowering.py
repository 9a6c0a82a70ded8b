"""Lowering a jitted function for TPU or CUDA from any host (jax.export with an abstract
device), and counting the kernel calls in the result: how tests and benchmarks check that
a step runs Pallas kernels on an accelerator this machine does not have."""

from __future__ import annotations

import functools
import inspect
import re

import jax
from jax import export

TPU_DEVICE_KIND = "TPU v5 lite"
TRITON_CALL = "__gpu$xla.gpu.triton"


def abstract_tpu_mesh():
    fields = inspect.signature(jax.sharding.AbstractDevice).parameters
    kwargs = dict(device_kind=TPU_DEVICE_KIND)
    if "num_cores" in fields:
        kwargs["num_cores"] = 1
    if "platform" in fields:
        kwargs["platform"] = "tpu"
    device = jax.sharding.AbstractDevice(**kwargs)
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def export_tpu(fn, *args) -> str:
    """StableHLO text of fn lowered for TPU from this host; must contain the Mosaic call."""
    with jax.sharding.use_abstract_mesh(abstract_tpu_mesh()):
        exported = export.export(jax.jit(fn), platforms=["tpu"])(*args)
    return exported.mlir_module()


def export_cuda(fn, *args) -> str:
    exported = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(*args)
    return exported.mlir_module()


def kernel_calls(mlir: str, marker: str) -> int:
    """How many times a lowered module runs `marker` (a kernel's custom call): each
    occurrence counts once per path from @main to its function, since a nested jit
    called from several places (a kernel per layer) lowers to one function called
    several times. Location lines (which name the functions a call came from) are not counted."""
    mlir = "\n".join(line for line in mlir.splitlines() if not line.startswith("#loc"))  # names, not calls
    funcs = {}
    for chunk in re.split(r"\n(?=\s*func\.func )", mlir)[1:]:
        name = re.search(r"func\.func (?:public |private )?@([\w$.\-]+)", chunk).group(1)
        funcs[name] = chunk

    @functools.cache
    def runs(name: str) -> int:
        body = funcs[name]
        return body.count(marker) + sum(runs(callee) for callee in re.findall(r"call @([\w$.\-]+)\(", body)
                                        if callee in funcs)
    return runs("main")
