"""The CPU path of ragged paged attention: a C++ kernel (cpu_kernel.cc) called through the
XLA FFI, one call per layer for steps of decode rows and prefill chunks over float32 or
bfloat16 pages, int8 / fp8 pages with a scale per position and head (kv_format "int8" /
"fp8") or NVFP4 pages (kv_format "nvfp4"), which writes the step's new K/V into the pages
(aliased, so in place when the pages are donated) and attends; and its TurboQuant handler,
for pages of a TurboQuant or a TurboQuantSplit (kv_cache_dtype turboquant-3.5 / -2.5) of at
most 4 bits a code, which XLA writes (as the quantizer does) before the kernel reads them
in the rotated basis: the query is rotated once before the call and the output rotated
back once after it (pallas_kernels/paged_attention/kv_formats.py), so no row is
de-rotated.

xla.py's block walk is a while loop of small XLA thunks, which on XLA:CPU costs about 70 us
a layer at one decode row whatever the context; this kernel reads each live position's K
and V rows once (every KV head's, side by side in the page), for all the query heads, and
splits long contexts into runs merged at the end. A chunk of 8 tokens or more (head_dim a
multiple of 16, at most 256) is read in tiles of 16 tokens that share each position's
read (and, when a call has fewer tiles than threads, cut into runs of positions too), with
AVX-512 where the build has it and in the compiler's portable vectors (AVX2, SSE, NEON)
elsewhere. It computes the same function as the XLA path (results equal to float32
rounding), for softmax attention with or without soft-capping, sliding windows, sinks and
draft trees (a node sees the region's positions its ancestor bits name, tree_mask.py): the
entry's CPU branch for those steps; others (MXFP4 pages, other variants; chunks of another
head_dim) and gradients stay on xla.py.
Built like the quantized matmul's kernel (pallas_kernels/cpu_ffi.py); `available()` says
whether that worked.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi
from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.variant import SOFTMAX, soft_cap_of
from pallas_kernels.ragged_paged_attention.ref import token_layout, write_new_kv
from quant.blockscaled import NVFP4
from quant.kv_rows import RowQuantized
from quant.turboquant import SplitCodes, TurboCodes

SOURCE = Path(__file__).with_name("cpu_kernel.cc")
TARGET = "kvfold_decode_attention"
TURBO_TARGET = "kvfold_decode_attention_turbo"
KERNEL = cpu_ffi.Kernel(SOURCE, TARGET, "KvfoldDecodeAttention", "the CPU decode-attention kernel",
                        "KVFOLD_DECODE_ATTENTION_CPU", others=((TURBO_TARGET, "KvfoldDecodeAttentionTurbo"),))
TURBO_MAX_BITS = 4  # the kernel looks codes up in one 16-entry vector


def available() -> bool:
    """Whether the kernel is built (building it now if needed) and registered with XLA:CPU;
    KVFOLD_DECODE_ATTENTION_CPU=0 turns it off. It also loads the quantized-matmul kernel
    (built the same way) for its helper threads (`_join_crew`); without that kernel
    (KVFOLD_QUANT_MATMUL_CPU=0, no build) this one runs on XLA's pool."""
    if not KERNEL.available():
        return False
    _join_crew()
    return True


@functools.cache
def _join_crew() -> None:
    """Hands the quantized-matmul kernel's crew of helper threads (quant_matmul/cpu_kernel.cc,
    KvfoldCrewRun) to this kernel, where that kernel is available: the items of a call then
    run on both of them at once, as the matmuls before it did, instead of waking XLA's pool."""
    from pallas_kernels.quant_matmul import cpu as matmul_cpu

    if matmul_cpu.available():
        use = KERNEL.library.KvfoldDecodeAttentionUseCrew
        use.argtypes = [ctypes.c_void_p]
        use(ctypes.cast(matmul_cpu.KERNEL.library.KvfoldCrewRun, ctypes.c_void_p))


def _turbo(kv_format) -> bool:
    """Whether a resolved kv_format is TurboQuant's (its pages go to the TurboQuant handler)."""
    return isinstance(kv_format, (kv_formats.Turbo, kv_formats.TurboSplit))


def _groups(kv_format, pages):
    """TurboQuant pages' channel groups, [(codes, quantizer)]: one for a TurboQuant, the
    outlier and regular halves for a TurboQuantSplit."""
    if isinstance(kv_format, kv_formats.TurboSplit):
        return [(pages.outlier, kv_format.tq.hi), (pages.regular, kv_format.tq.lo)]
    return [(pages, kv_format.tq)]


def _reads(kv_format, pages) -> bool:
    """Whether the kernel reads these low-bit pages (kv_format resolved): int8 / fp8 codes with
    a float32 scale per position and KV head (quant.kv_rows), NVFP4 without a tensor
    scale, as the KV pools keep it, or TurboQuant codes of at most TURBO_MAX_BITS whose
    channel groups are multiples of 16 (the kernel decodes 16 codes of one group at once)
    in rows of at most 256 (what its vector path weighs)."""
    if isinstance(kv_format, kv_formats.Rows):
        return isinstance(pages, RowQuantized)
    if _turbo(kv_format):
        kind = SplitCodes if isinstance(kv_format, kv_formats.TurboSplit) else TurboCodes
        return (isinstance(pages, kind) and kv_format.tq.dim <= 256
                and all(inst.dim % 16 == 0 and inst.bits <= TURBO_MAX_BITS for _, inst in _groups(kv_format, pages)))
    return (isinstance(kv_format, kv_formats.BlockFP4) and kv_format.label == "nvfp4"
            and isinstance(pages, NVFP4) and pages.tensor_scale is None)


TILE_MAX_HEAD_DIM = 256  # a tile row's output in 16 AVX-512 vectors (the portable tiles: kPer <= 16 too)


def supports(q, k_pages, v_pages, variant, kv_format, max_q_len) -> bool:
    """Whether the kernel takes a ragged_paged_attention step: float32 q over float32 or
    bfloat16 pages, int8 / fp8 row-scaled ones, NVFP4 ones without a tensor scale or
    TurboQuant ones (`_reads`), softmax with at most a soft cap, and a built kernel (a GPU
    or TPU host never builds it); prefill chunks and mixed steps (max_q_len > 1), which the
    kernel cuts into tiles, where head_dim is a multiple of 16 up to TILE_MAX_HEAD_DIM. A
    draft tree's nodes (verify rows) are masked by their bits."""
    pages_ok = (_reads(kv_format, k_pages) and _reads(kv_format, v_pages) if kv_format is not None
                else k_pages.dtype in (jnp.float32, jnp.bfloat16))
    return (pages_ok and q.dtype == jnp.float32
            and (variant == SOFTMAX or soft_cap_of(variant) is not None)
            and jax.default_backend() == "cpu" and available()
            and (max_q_len == 1 or (q.shape[-1] % 16 == 0 and q.shape[-1] <= TILE_MAX_HEAD_DIM)))


def _tree_operands(tree):
    """The kernel's tree operands (start [S], bits [T, words] int32), placeholders without one."""
    if tree is None:
        return jnp.zeros((1,), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    return tree.start.astype(jnp.int32), tree.bits.astype(jnp.int32)


def ragged_decode_cpu(q, k, v, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, sinks, tree, *, sm_scale,
                      sliding_window, variant, kv_format=None):
    """ragged_paged_attention's CPU branch for the steps `supports` takes: one kernel call
    that writes the new K/V into the pages and attends (TurboQuant pages: written through
    XLA first). Same returns as the entry."""
    call = decode_attention_turbo_cpu if _turbo(kv_format) else decode_attention_cpu
    return call(q, k, v, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, sinks, sm_scale=sm_scale,
                sliding_window=sliding_window, soft_cap=soft_cap_of(variant), kv_format=kv_format, tree=tree)


def decode_attention_cpu(q, k, v, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, sinks=None, *,
                         sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                         kv_format=None, tree=None, target: str = TARGET):
    """(out [T, Hq, D] f32, lse [T, Hq] f32, k_pages, v_pages): the step's new rows k, v [T,
    Hkv, D] stored in the float32 or bfloat16 pages [num_pages, page_size, Hkv, D] (in place
    where XLA can alias them: donate the pages), as ref.write_new_kv stores them (rounded to
    the nearest bfloat16, ties to even, in bfloat16 pages; with kv_format "int8" or "fp8",
    quant.RowQuantized pages, quantized as quant.quantize_rows does, bit for bit; with
    "nvfp4", quant.NVFP4 pages without a tensor scale, as quant.nvfp4_quantize(x, 1.0) does),
    then token t (of the sequence and at the position ref.token_layout gives it) attends
    over positions [0, its own] of its sequence (the last sliding_window of them on a
    sliding layer), reading the codes: in a token's run a row-scaled position's K scale
    multiplies its scores and its V scale its weights, an NVFP4 block's scale its decoded
    values; a tile of a chunk's tokens decodes 16 positions at a time to float32, scales
    applied, for all its rows. Tokens past cu_q_lens[-1] are padding (out 0, lse -inf,
    nothing written).
    sinks: [Hq] logits that join each softmax's denominator. tree: a tree_mask.TreeMask whose
    nodes see the region's positions by their bits and the prefix by the window from their
    logical positions (tree_mask.visible). target: the FFI name of the build to call (a test
    registers a portable one under another). RuntimeError when the kernel is not available."""
    if not available():
        raise RuntimeError(f"{KERNEL.what} is not available (no compiler, a failed build, "
                           "or KVFOLD_DECODE_ATTENTION_CPU=0)")
    fmt = None if kv_format is None else kv_formats.resolve(kv_format)
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if fmt is not None and (_turbo(fmt) or not _reads(fmt, pages)):
            raise ValueError(f"decode_attention_cpu reads float pages, quant.RowQuantized pages of kv_format "
                             f"'int8' / 'fp8', or quant.NVFP4 pages without a tensor scale (the XLA path takes "
                             f"those with one; decode_attention_turbo_cpu TurboQuant ones), not {name} "
                             f"{type(pages).__name__} of kv_format {fmt.label!r}")
    none = jnp.zeros((1,), jnp.float32)  # the scales' placeholder beside float pages
    (kc, ks), (vc, vs) = (fmt.leaves(p)[:2] if fmt is not None else (p, none) for p in (k_pages, v_pages))
    num_tokens, num_q_heads, _ = q.shape
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                     jax.ShapeDtypeStruct((num_tokens, num_q_heads), jnp.float32),
                                     like(kc), like(vc), like(ks), like(vs)),
                            input_output_aliases={3: 2, 4: 3, 5: 4, 6: 5}, vmap_method="sequential")
    has_sinks = sinks is not None
    sinks = sinks.astype(jnp.float32) if has_sinks else none
    i32 = lambda x: x.astype(jnp.int32)
    out, lse, kc, vc, ks, vs = call(q, k.astype(jnp.float32), v.astype(jnp.float32), kc, vc, ks, vs,
                                    i32(block_tables), i32(cu_q_lens), i32(kv_lens), sinks, *_tree_operands(tree),
                                    sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                                    soft_cap=np.float32(soft_cap or 0.0), has_sinks=np.int64(has_sinks),
                                    has_tree=np.int64(tree is not None))
    if fmt is None:
        return out, lse, kc, vc
    if isinstance(k_pages, NVFP4):
        return out, lse, NVFP4(kc, ks, None), NVFP4(vc, vs, None)
    return out, lse, RowQuantized(kc, ks), RowQuantized(vc, vs)


def decode_attention_turbo_cpu(q, k, v, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, sinks=None, *,
                               sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                               kv_format, tree=None, target: str = TURBO_TARGET):
    """decode_attention_cpu over TurboQuant pages (kv_format a TurboQuant or TurboQuantSplit,
    or its format object; codes of at most TURBO_MAX_BITS): the new rows k, v are written
    by ref.write_new_kv (the quantizer's own codes), then the kernel scores q, rotated into
    each channel group's basis, against every live row decoded there (scale * c[code] plus
    the sparse channels' columns of Pi) and sums the values' rows in that basis, which
    finish_out rotates back. Same returns as decode_attention_cpu: (out [T, Hq, D] f32, lse
    [T, Hq] f32, k_pages, v_pages). target: the FFI name of the build to call."""
    if not available():
        raise RuntimeError(f"{KERNEL.what} is not available (no compiler, a failed build, "
                           "or KVFOLD_DECODE_ATTENTION_CPU=0)")
    fmt = kv_formats.resolve(kv_format)
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not _turbo(fmt) or not _reads(fmt, pages):
            raise ValueError(f"decode_attention_turbo_cpu reads quant.TurboCodes / quant.SplitCodes pages of a "
                             f"TurboQuant kv_format with at most {TURBO_MAX_BITS} bits a code, channel groups of "
                             f"a multiple of 16 and rows of at most 256, not {name} {type(pages).__name__} of "
                             f"kv_format {fmt.label!r}")
    seq, pos = token_layout(cu_q_lens, kv_lens, q.shape[0])
    k_pages, v_pages = write_new_kv(k_pages, v_pages, k, v, block_tables, seq, pos, fmt)
    groups = _groups(fmt, k_pages)
    sparse = groups[0][1].sparse
    leaves = []
    for pages in (k_pages, v_pages):
        these = []
        for codes, _ in _groups(fmt, pages):
            these += [codes.idx, codes.norm, *((codes.sparse_idx, codes.sparse_val) if sparse else
                                               (jnp.zeros((1,), jnp.uint8), jnp.zeros((1,), jnp.uint16)))]
        leaves += these if len(groups) == 2 else these * 2  # one group: its leaves again in group 1's places
    codebooks = jnp.stack([jnp.pad(c, (0, 16 - c.shape[0])) for c in fmt.extras()])  # zero-padded to 16
    columns = (jnp.stack([inst.rotation.T for _, inst in groups]) if sparse  # row i: Pi[:, i]
               else jnp.zeros((len(groups), 1, 1), jnp.float32))
    num_tokens, num_q_heads, _ = q.shape
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                     jax.ShapeDtypeStruct((num_tokens, num_q_heads), jnp.float32)),
                            vmap_method="sequential")
    has_sinks = sinks is not None
    sinks = sinks.astype(jnp.float32) if has_sinks else jnp.zeros((1,), jnp.float32)
    bits = [int(inst.bits) for _, inst in groups] + [0]
    i32 = lambda x: x.astype(jnp.int32)
    out, lse = call(fmt.prepare_q(k_pages, q.astype(jnp.float32)), *leaves, codebooks, columns,
                    i32(block_tables), i32(cu_q_lens), i32(kv_lens), sinks, *_tree_operands(tree),
                    sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                    soft_cap=np.float32(soft_cap or 0.0), has_sinks=np.int64(has_sinks),
                    has_tree=np.int64(tree is not None), groups=np.int64(len(groups)), bits0=np.int64(bits[0]),
                    bits1=np.int64(bits[1]), sparse=np.int64(sparse))
    return fmt.finish_out(v_pages, out), lse, k_pages, v_pages
