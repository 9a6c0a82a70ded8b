"""The C++ CPU kernels (pallas_kernels/*/cpu_kernel.cc) compile for AArch64 as well as for
this host: ARM Linux machines build them with their own g++ at first use, and a kernel that
does not compile there silently leaves every step to XLA. Checked with Debian's cross
compiler (make setup installs g++-aarch64-linux-gnu), syntax and templates only. Also
cpu_ffi.cpu_flags, the CPU features a build's cache key (and the tests' skips) go by."""

from __future__ import annotations

import shutil
import subprocess

import jax
import pytest

from pallas_kernels import cpu_ffi
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


def test_cpu_flags_are_the_cpuinfo_flags_and_empty_where_it_cannot_be_read(monkeypatch, tmp_path):
    """cpu_flags reads the flags line's words (x86's "flags", ARM's "Features": what the
    builds' cache key and the tests' skips go by); with no such line or no readable
    /proc/cpuinfo (another OS) it is empty, not an error."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f\nbogomips\t: 1\n")
    real = cpu_ffi.Path
    monkeypatch.setattr(cpu_ffi, "Path", lambda p: real(info) if p == "/proc/cpuinfo" else real(p))
    assert cpu_ffi.cpu_flags() == ("fpu", "sse2", "avx2", "avx512f")
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd aes sha2\nCPU part\t: 0xd0c\n")  # ARM
    assert cpu_ffi.cpu_flags() == ("fp", "asimd", "aes", "sha2")
    info.write_text("processor\t: 0\nmodel name\t: a CPU without a flags line\n")
    assert cpu_ffi.cpu_flags() == ()
    monkeypatch.setattr(cpu_ffi, "Path", lambda p: real(tmp_path / "absent"))
    assert cpu_ffi.cpu_flags() == ()
