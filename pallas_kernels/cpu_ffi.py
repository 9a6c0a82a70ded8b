"""C++ kernels for XLA:CPU, called through the XLA FFI: built once per machine with the
system's C++ compiler (`-march=native`, a few seconds; `-march=$KVFOLD_CPU_MARCH` where that
is set) into a cache keyed by the source, the jaxlib headers, the compiler flags and the
CPU, then loaded with ctypes. The CPU paths of the quantized matmul (quant_matmul/cpu.py)
and of decode attention (ragged_paged_attention/cpu.py) are such kernels."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def flags_for(march: str) -> tuple[str, ...]:
    """FLAGS with -march=`march` for -march=native: a build for another instruction set than
    this CPU's, e.g. x86-64-v3 (AVX2 without AVX-512: the kernels' portable paths). ValueError
    for a value that is not one compiler word."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", march):
        raise ValueError(f"-march must be one word such as x86-64-v3, got {march!r}")
    return tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)


def default_flags() -> tuple[str, ...]:
    """FLAGS, or flags_for($KVFOLD_CPU_MARCH) where that variable is set (to measure what a
    CPU of that instruction set runs)."""
    march = os.environ.get("KVFOLD_CPU_MARCH", "")
    try:
        return flags_for(march) if march else FLAGS
    except ValueError as e:
        raise ValueError(f"KVFOLD_CPU_MARCH: {e}") from None


def cpu_flags() -> tuple[str, ...]:
    """This CPU's feature flags as Linux's /proc/cpuinfo lists them (x86's "flags" line, e.g.
    "avx512f"; ARM's "Features", e.g. "asimd"); empty where it cannot be read (another OS)."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.partition(":")[0].strip() in ("flags", "Features"))
    except (OSError, StopIteration):
        return ()
    return tuple(line.partition(":")[2].split())


def _cpu_signature() -> str:
    return " ".join((platform.machine(), *cpu_flags()))


def library_path(source: Path, flags: tuple[str, ...] | None = None) -> Path:
    """Where the compiled `source` lives: $KVFOLD_CACHE (default ~/.cache/kvfold), one file per
    source text, jaxlib, compiler flags (default_flags() when None) and CPU."""
    import jaxlib

    flags = default_flags() if flags is None else flags
    key = hashlib.sha256(b"\0".join(s.encode() for s in (
        source.read_text(), jaxlib.__version__, " ".join(flags), _cpu_signature()))).hexdigest()[:16]
    root = Path(os.environ.get("KVFOLD_CACHE", Path.home() / ".cache" / "kvfold"))
    return root / f"{source.parent.name}_cpu-{key}.so"


def build(source: Path, what: str, force: bool = False, flags: tuple[str, ...] | None = None) -> Path:
    """Compile `source` with `flags` (default_flags() when None; when not cached) and return
    the library's path.

    Raises RuntimeError naming `what` and the problem when there is no C++ compiler or it
    fails; a failed build leaves nothing in the cache."""
    flags = default_flags() if flags is None else flags
    path = library_path(source, flags)
    if path.exists() and not force:
        return path
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError(f"no C++ compiler (g++ / c++ / $CXX) to build {what}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [cxx, *flags, "-isystem", jax.ffi.include_dir(), str(source), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"building {what} failed ({' '.join(cmd)}):\n{done.stderr}")
    os.replace(tmp, path)  # atomic: concurrent builders (test workers) each write a whole file
    return path


def register(library: Path, target: str, symbol: str) -> ctypes.CDLL:
    """Load a built library and register its FFI handler `symbol` with XLA:CPU as `target`."""
    lib = ctypes.cdll.LoadLibrary(str(library))
    register_handler(lib, target, symbol)
    return lib


def register_handler(lib: ctypes.CDLL, target: str, symbol: str) -> None:
    """Register a loaded library's FFI handler `symbol` with XLA:CPU as `target`."""
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


class Kernel:
    """One C++ kernel: its source, the FFI name it is registered under (`target`), its
    handler's symbol, what messages call it, the environment variable that turns it off
    when "0" (`switch`), and (target, symbol) pairs of further handlers in the same
    library (`others`)."""

    def __init__(self, source: Path, target: str, symbol: str, what: str, switch: str,
                 others: tuple[tuple[str, str], ...] = ()):
        self.source, self.target, self.symbol, self.what, self.switch = source, target, symbol, what, switch
        self.others = others

    @functools.cached_property
    def library(self) -> ctypes.CDLL | None:
        """The built and registered library, once per process; None (with one warning) when
        it cannot be built or the switch turns it off."""
        if os.environ.get(self.switch, "1") == "0":
            return None
        try:
            library = register(build(self.source, self.what), self.target, self.symbol)
            for target, symbol in self.others:
                register_handler(library, target, symbol)
            return library
        except (RuntimeError, OSError, AttributeError) as e:  # AttributeError: a handler missing from the build
            import warnings

            warnings.warn(f"{self.what} is not available, its XLA path runs instead: {e}", stacklevel=3)
            return None

    def available(self) -> bool:
        """Whether the kernel is built (building it now if needed) and registered with XLA:CPU."""
        return self.library is not None
