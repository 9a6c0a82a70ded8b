"""pallas_kernels.ragged_paged_attention: the one entry for mixed prefill + decode steps."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import validate
from pallas_kernels.dispatch import bind, dispatch
from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.ragged_paged_attention import cpu
from pallas_kernels.ragged_paged_attention.kernel_gpu import (
    decode_supported,
    ragged_decode_gpu,
    ragged_paged_attention_gpu,
    ragged_supported,
)
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from pallas_kernels.tree_mask import TreeMask
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla
from pallas_kernels.variant import AttentionVariant


def ragged_paged_attention(
    q,
    k,
    v,
    k_pages,
    v_pages,
    block_tables,
    cu_q_lens,
    kv_lens,
    *,
    sm_scale=None,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
    variant: AttentionVariant | None = None,
    tree: TreeMask | None = None,
    kv_format=None,
    max_q_len: int | None = None,
    max_chunks: int | None = None,
    interpret=None,
):
    """One step of a mixed batch: prefill chunks and decode rows, with the KV write fused.

    Sequence s owns query tokens [cu_q_lens[s], cu_q_lens[s+1]) (q_len_s of them; a decode
    row has q_len 1). Its token i sits at position kv_lens[s] - q_len_s + i; its new K/V
    row is written to that position's page slot, and it attends causally to positions
    [0, its own] of the sequence (cached prefix plus the chunk's earlier tokens).

    Args:
      q: [total_q_tokens, num_q_heads, head_dim], float. Tokens past cu_q_lens[-1] are
        padding (out 0, lse -inf, nothing written).
      k, v: [total_q_tokens, num_kv_heads, head_dim], q's dtype: the new tokens' K/V.
      k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim], float (q's dtype, or
        another: bfloat16 pages under float32 activations store the new rows rounded, and
        the kernels that want one dtype see q, k and v in the pages' and give out in q's);
        or, with kv_format, that format's containers (as paged_attention_quantized): the
        new rows are quantized into them and pages are read low-bit.
      block_tables: int32 [num_seqs, max_pages_per_seq]; the first ceil(kv_len / page_size)
        entries of a sequence must be pages in [0, num_pages) (checked when concrete; the
        reference drops writes to any other entry), later ones are never read. Written
        slots must not be shared with another sequence.
      cu_q_lens: int32 [num_seqs + 1], nondecreasing from 0, cu_q_lens[-1] <= total_q_tokens.
      kv_lens: int32 [num_seqs], tokens of each sequence after this step (including the
        new ones), q_len_s <= kv_len_s <= max_pages_per_seq * page_size.
      sm_scale, sliding_window, soft_cap, sinks, variant: as paged_attention (q_pos and
        kv_pos seen by the variant are absolute positions in the sequence).
      interpret: True or a pltpu.InterpretParams runs the TPU kernel in TPU interpret mode
        (it uses DMAs, so True means InterpretParams()); None runs Mosaic on TPU; on GPU
        the Triton paged decode kernel for decode-only steps (max_q_len 1, float pages, no
        tree), the Triton ragged kernel (kernel_gpu.py) for other steps over float, int8
        or fp8 pages with power-of-two page_size and head_dim >= 16, and the XLA path
        otherwise; on CPU the C++ kernel (cpu.py) for steps of float32 q (decode-only
        ones, or any where head_dim is a multiple of 16 up to 256; draft trees included)
        over float32 or bfloat16 pages, int8 / fp8 ones, NVFP4 ones without a tensor
        scale or TurboQuant ones of at most 4 bits a code (kv_format), the XLA path
        (xla.py) for the rest.

    Returns:
      out [total_q_tokens, num_q_heads, head_dim] in q.dtype, lse f32 [total_q_tokens,
      num_q_heads], and the updated k_pages, v_pages. On TPU the pages are aliased to the
      outputs: call this inside a jit that donates them and the update is in place.
    """
    validate.check_ndim("q", q, 3, "[total_q_tokens, num_q_heads, head_dim]")
    validate.check_float("q", q)
    num_tokens, num_q_heads, head_dim = q.shape
    fmt = None if kv_format is None else kv_formats.resolve(kv_format)
    if fmt is None:
        validate.check_ndim("k_pages", k_pages, 4, "[num_pages, page_size, num_kv_heads, head_dim]")
        if k_pages.shape[-1] != head_dim:
            raise ValueError(f"k_pages head_dim {k_pages.shape[-1]} != q head_dim {head_dim}")
        validate.check_shape("v_pages", v_pages, k_pages.shape)
        lead = k_pages.shape
    else:
        fmt.check(k_pages, head_dim, "k_pages")
        fmt.check(v_pages, head_dim, "v_pages")
        k_shapes = [x.shape for x in fmt.leaves(k_pages)]
        if [x.shape for x in fmt.leaves(v_pages)] != k_shapes:
            raise ValueError(f"v_pages leaf shapes differ from k_pages leaf shapes {k_shapes}")
        k_dtypes = [x.dtype.name for x in fmt.leaves(k_pages)]
        if [x.dtype.name for x in fmt.leaves(v_pages)] != k_dtypes:  # E4M3 as float8 in one, bits in the other
            raise ValueError(f"v_pages leaf dtypes differ from k_pages leaf dtypes {k_dtypes}")
        lead = k_shapes[0]
    num_pages, page_size, num_kv_heads = lead[:3]
    validate.check_shape("k", k, (num_tokens, num_kv_heads, head_dim))
    validate.check_shape("v", v, (num_tokens, num_kv_heads, head_dim))
    for name, x in (("k", k), ("v", v)):
        validate.check_dtype(name, x, [q.dtype])
    mixed = fmt is None and k_pages.dtype != q.dtype  # float pages of another dtype than q
    if mixed:  # fp8 pages need a kv_format: its scales
        validate.check_dtype("k_pages", k_pages, [jnp.float32, jnp.bfloat16, jnp.float16])
    if fmt is None:
        validate.check_dtype("v_pages", v_pages, [k_pages.dtype])
    validate.check_heads(num_q_heads, num_kv_heads)
    validate.check_ndim("block_tables", block_tables, 2, "[num_seqs, max_pages_per_seq]")
    validate.check_dtype("block_tables", block_tables, [jnp.int32])
    num_seqs = block_tables.shape[0]
    if num_seqs == 0:
        raise ValueError("block_tables must have at least one sequence")
    validate.check_shape("cu_q_lens", cu_q_lens, (num_seqs + 1,))
    validate.check_dtype("cu_q_lens", cu_q_lens, [jnp.int32])
    validate.check_shape("kv_lens", kv_lens, (num_seqs,))
    validate.check_dtype("kv_lens", kv_lens, [jnp.int32])
    validate.check_positive("sliding_window", sliding_window)
    validate.check_block_tables(block_tables, num_pages, kv_lens, page_size)
    if tree is not None:
        if not isinstance(tree, TreeMask):
            raise ValueError(f"tree must be a ragged_paged_attention.TreeMask, got {type(tree).__name__}")
        validate.check_shape("tree.start", tree.start, (num_seqs,))
        validate.check_dtype("tree.start", tree.start, [jnp.int32])
        validate.check_ndim("tree.bits", tree.bits, 2, "[total_q_tokens, words]")
        validate.check_shape("tree.bits", tree.bits, (num_tokens, tree.bits.shape[1]))
        validate.check_dtype("tree.bits", tree.bits, [jnp.int32])
    if max_q_len is not None and (not isinstance(max_q_len, int) or max_q_len < 1):
        raise ValueError(f"max_q_len must be a positive int or None, got {max_q_len!r}")
    if max_chunks is not None and (not isinstance(max_chunks, int) or max_chunks < 0):
        raise ValueError(f"max_chunks must be an int >= 0 or None, got {max_chunks!r}")
    static = dict(
        sliding_window=None if sliding_window is None else int(sliding_window),
        kv_format=fmt,
        **validate.attention_options(head_dim, num_q_heads, sm_scale, soft_cap, sinks, variant),
    )
    gpu = None  # GPU: the paged decode kernel for decode-only steps, else the ragged one
    if decode_supported(num_tokens, num_seqs, page_size, head_dim, tree, fmt, max_q_len):
        gpu = _at_page_dtype(mixed, ragged_decode_gpu, **{k: x for k, x in static.items() if k != "kv_format"})
    elif ragged_supported(page_size, head_dim, fmt):
        block_q = 16 if max_q_len is None else min(16, 1 << (max_q_len - 1).bit_length())
        gpu = _at_page_dtype(mixed, ragged_paged_attention_gpu, block_q=block_q, **static)
    native = (bind(cpu.ragged_decode_cpu, **static)
              if cpu.supports(q, k_pages, v_pages, static["variant"], fmt, max_q_len) else None)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    return dispatch(
        q,
        k,
        v,
        k_pages,
        v_pages,
        block_tables,
        cu_q_lens,
        kv_lens,
        sinks,
        tree,
        ref=bind(ragged_paged_attention_xla, max_q_len=max_q_len, max_chunks=max_chunks, **static),
        tpu=_at_page_dtype(mixed, ragged_paged_attention_tpu, **static),
        gpu=gpu,
        cpu=native,
        interpret=interpret,
    )


def _at_page_dtype(mixed: bool, kernel, **static):
    """The bound `kernel`; over float pages of another dtype than q (mixed), bound through
    `_in_page_dtype`, for kernels that take one dtype."""
    return bind(_in_page_dtype, kernel=kernel, **static) if mixed else bind(kernel, **static)


def _in_page_dtype(q, k, v, k_pages, v_pages, *rest, kernel, **options):
    """`kernel` with q and the new rows in the pages' dtype, and its out back in q's."""
    dtype = k_pages.dtype
    out, lse, k_pages, v_pages = kernel(q.astype(dtype), k.astype(dtype), v.astype(dtype), k_pages, v_pages, *rest,
                                        **options)
    return out.astype(q.dtype), lse, k_pages, v_pages
