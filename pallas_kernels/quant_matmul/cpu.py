"""The CPU path of the quantized matmul: a C++ kernel (cpu_kernel.cc) called through the XLA
FFI, which reads the packed codes as they are stored and decodes a few rows at a time.

XLA:CPU has no dequantizing matmul: the XLA path (xla.py) turns the whole packed weight
into a float temporary at every step, which costs several times the float32 matmul, while
llama.cpp reads the same blocks directly. This kernel reads them directly too, for steps of
a few tokens (decode). It keeps activations in float32, so its result is the reference's
up to the order of float additions, except for weights packed with int8_activations
(weights_dtype "gguf_a8"): where the CPU has AVX-512 VNNI it then rounds x per
activation block itself and multiplies int8 codes by int8 activations as llama.cpp does
(integer dot products: 4x the multiply-adds of a float instruction); without it the entry
rounds x first and the float tiles run.

The kernel is compiled once per machine with the system's C++ compiler (`-march=native`,
about 5 s; pallas_kernels/cpu_ffi.py) into a cache keyed by the source, the jaxlib headers
and the CPU, then registered with jax.ffi. `available()` says whether that worked; without
a compiler the CPU path stays on xla.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
TARGET = "kvfold_quant_matmul"
KERNEL = cpu_ffi.Kernel(SOURCE, TARGET, "KvfoldQuantMatmul", "the CPU quantized-matmul kernel",
                        "KVFOLD_QUANT_MATMUL_CPU")
# Above this many rows xla.py's dequantize + float matmul is faster (measured on this
# project's CPU, q4_1: 576 x 1536 at 64 tokens 0.65 ms here vs 0.99, at 128 1.28 vs 1.07;
# 1536 x 576 at 64 0.85 vs 1.03, at 128 1.69 vs 1.10). With int8 activations the crossover
# is about twice as far (576 x 1536 at 128: 0.86 vs 1.13 ms; at 256: 1.66 vs 1.93). The
# portable loops (a build without AVX-512, compiled for AVX2) even with xla.py at 8 tokens.
MAX_TOKENS = 64
INT8_MAX_TOKENS = 128
PORTABLE_MAX_TOKENS = 8
# Every packed format but fp8 (no E4M3 decoder here) and w8a8, whose int8 x int8 matmul on
# XLA's path (xla.py) ran faster than this kernel (70 vs 80 us at one token, 76 vs 266 us at
# 16 on 576 x 1536: `python -m pallas_kernels.bench`).
CPU_FORMATS = frozenset({"q8_0", "q4_0", "q4_1", "q5_0", "int8", "int4", "q4_k", "q5_k", "q6_k"})


def build(force: bool = False, flags: tuple[str, ...] | None = None) -> Path:
    """Compile cpu_kernel.cc with `flags` (cpu_ffi.default_flags() when None; when not cached) and
    return the library's path; RuntimeError naming the problem when it cannot."""
    return cpu_ffi.build(SOURCE, KERNEL.what, force, flags)


def available() -> bool:
    """Whether the kernel is built (building it now if needed) and registered with XLA:CPU;
    KVFOLD_QUANT_MATMUL_CPU=0 turns it off."""
    return KERNEL.available()


def max_tokens(int8_tiles: bool = False) -> int:
    """The most tokens a step may have for the kernel to take it: MAX_TOKENS with AVX-512
    (INT8_MAX_TOKENS on its int8-activation tiles, `int8_tiles`), and PORTABLE_MAX_TOKENS
    for the portable loops."""
    lib = KERNEL.library
    if lib is None or not lib.KvfoldQuantMatmulAvx512():
        return PORTABLE_MAX_TOKENS
    return INT8_MAX_TOKENS if int8_tiles else MAX_TOKENS


def vnni() -> bool:
    """Whether the built kernel has the int8-activation tiles (AVX-512 VNNI)."""
    lib = KERNEL.library
    return lib is not None and bool(lib.KvfoldQuantMatmulVnni())


def int8_tiles(fmt: str, group: int) -> bool:
    """Whether the kernel can round x itself and run integer dot products for this weight:
    a build with `vnni()`, and activation blocks of whole dot-product lanes (4 inputs)."""
    from quant.packed import activation_block_size

    return vnni() and activation_block_size(fmt, group) % 4 == 0


def register(library: Path, target: str) -> ctypes.CDLL:
    """Register a built kernel library with XLA:CPU under the FFI name `target`."""
    return cpu_ffi.register(library, target, KERNEL.symbol)


def supports(fmt: str, num_tokens: int, d_out: int, int8_tiles: bool = False) -> bool:
    """Whether the kernel takes this matmul: a format it decodes, few rows (`max_tokens`),
    whole 16-column strips, a CPU backend (a GPU or TPU host never builds it) and a built
    kernel."""
    return (fmt in CPU_FORMATS and d_out % 16 == 0 and jax.default_backend() == "cpu" and available()
            and num_tokens <= max_tokens(int8_tiles))


def quant_matmul_cpu(x, codes, scale, offset, *, fmt: str, group: int, target: str = TARGET,
                     int8_activations: bool = False, norm=None):
    """x [T, in] float32 times the packed weight (codes in `quant.packed.interleave_rows`'
    order, float scale and offset per group, as PackedWeight.float_scales gives them) of a
    weight-only format: float32 [T, out]. The one-weight case of `quant_matmuls_cpu`."""
    return quant_matmuls_cpu(x, [(codes, scale, offset)], fmt=fmt, group=group, target=target,
                             int8_activations=int8_activations, norm=norm)[0]


def quant_matmuls_cpu(x, weights, *, fmt: str, group: int, target: str = TARGET, int8_activations: bool = False,
                      norm=None):
    """x [T, in] float32 times each packed weight of `weights`, (codes, scale, offset)
    triples of one format, group and input width (a layer's q / k / v projections), in one
    kernel call: a list of float32 [T, out_i]. x's blocks are summed (or rounded) once, and
    the weights' columns are one job for the kernel's threads.
    target: the FFI name of a registered build (`register`); the default one is built and
    registered here if it is not yet (RuntimeError when it cannot be). int8_activations:
    round x per activation block first and multiply int8 codes (quant.packed
    round_activation_blocks; a build without `vnni()` refuses it). norm: (weight [in], eps)
    to RMS-normalize x first inside the kernel (ref.rms_norm), as the norm before a layer's
    projections."""
    from quant.packed import FORMATS

    if target == TARGET and not available():
        raise RuntimeError("the CPU quantized-matmul kernel is not available (no compiler, a failed build, "
                           "or KVFOLD_QUANT_MATMUL_CPU=0)")
    f = FORMATS[fmt]
    flat = []
    for codes, scale, offset in weights:
        if scale.dtype not in (jnp.float16, jnp.float32):
            scale = scale.astype(jnp.float32)
        flat += [codes, scale, scale if offset is None else offset.astype(scale.dtype)]
    results = [jax.ShapeDtypeStruct((x.shape[0], codes.shape[1]), jnp.float32) for codes, _, _ in weights]
    eps = 0.0
    if norm is not None:
        flat.append(norm[0].astype(jnp.float32))
        eps = norm[1]
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential")
    return list(call(x.astype(jnp.float32), *flat, group=np.int64(group), bits=np.int64(f.bits),
                     zero=np.float32(f.zero), has_offset=np.int64(f.offset),
                     int8_activations=np.int64(int8_activations), norm=np.int64(norm is not None),
                     eps=np.float32(eps)))
