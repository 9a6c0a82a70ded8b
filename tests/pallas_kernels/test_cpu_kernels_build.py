"""The C++ CPU kernels (pallas_kernels/*/cpu_kernel.cc) compile for AArch64 as well as for
this host: ARM Linux machines build them with their own g++ at first use, and a kernel that
does not compile there silently leaves every step to XLA. Checked with Debian's cross
compiler (make setup installs g++-aarch64-linux-gnu), syntax and templates only."""

from __future__ import annotations

import shutil
import subprocess

import jax
import pytest

from pallas_kernels.first_max import cpu as first_max
from pallas_kernels.quant_matmul import cpu as quant_matmul
from pallas_kernels.ragged_paged_attention import cpu as attention

CROSS = "aarch64-linux-gnu-g++"


@pytest.mark.parametrize("source", [first_max.SOURCE, quant_matmul.SOURCE, attention.SOURCE],
                         ids=["first_max", "quant_matmul", "ragged_paged_attention"])
def test_the_cpu_kernels_compile_for_aarch64(source):
    cxx = shutil.which(CROSS)
    if cxx is None:
        pytest.skip(f"no {CROSS} here (make setup installs g++-aarch64-linux-gnu)")
    cmd = [cxx, "-fsyntax-only", "-std=c++17", "-march=armv8.2-a", "-w", "-isystem", jax.ffi.include_dir(),
           str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stderr[-4000:]}"
