"""pallas_kernels.paged_attention: the one entry for paged decode attention, over plain
pages (paged_attention) or quantized ones (paged_attention_quantized); both share the
checks, the Pallas TPU kernel and the XLA path (xla.py, blocked online softmax; ref.py
is the dense statement it and the kernels are tested against)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import validate as v
from pallas_kernels.dispatch import bind, dispatch
from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.paged_attention.kernel_gpu import gpu_supported, paged_attention_gpu
from pallas_kernels.paged_attention.kernel_tpu import paged_attention_tpu
from pallas_kernels.paged_attention.xla import paged_attention_xla
from pallas_kernels.variant import AttentionVariant


def paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    *,
    sm_scale=None,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
    variant: AttentionVariant | None = None,
    interpret=None,
):
    """Decode attention of one query token per sequence over a paged KV cache.

    Args:
      q: [batch, num_q_heads, head_dim], float.
      k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim], q's dtype.
        num_q_heads must be a multiple of num_kv_heads (GQA; MQA when num_kv_heads = 1).
      block_tables: int32 [batch, max_pages_per_seq]; page ids of each sequence in order.
        Entries past a sequence's last page are never read (any value is safe).
      kv_lens: int32 [batch], 0 <= kv_len <= max_pages_per_seq * page_size. The query
        sits at position kv_len - 1 and attends to KV positions [0, kv_len).
      sm_scale: logit scale, default head_dim ** -0.5.
      sliding_window: attend only to the last `sliding_window` positions.
      soft_cap: soft_cap * tanh(logits / soft_cap), applied before variant.logits_fn.
      sinks: f32 [num_q_heads] attention-sink logits added to the softmax denominator.
      variant: an AttentionVariant (logits transform and/or weighting), traced into the kernel.
      interpret: True or a pltpu.InterpretParams runs the Pallas TPU kernel in interpret
        mode (any backend); None runs Mosaic on TPU, Triton on GPU, the XLA path on CPU.

    Returns:
      out: [batch, num_q_heads, head_dim] in q.dtype.
      lse: f32 [batch, num_q_heads], natural log of the softmax denominator (including the
        sink). A sequence with kv_len = 0 gets out = 0 and lse = -inf (lse = sink with sinks).
    """
    v.check_ndim("q", q, 3, "[batch, num_q_heads, head_dim]")
    v.check_ndim("k_pages", k_pages, 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    v.check_float("q", q)
    head_dim = q.shape[2]
    _, page_size, num_kv_heads, _ = k_pages.shape
    if k_pages.shape[-1] != head_dim:
        raise ValueError(f"k_pages head_dim {k_pages.shape[-1]} != q head_dim {head_dim}")
    v.check_shape("v_pages", v_pages, k_pages.shape)
    v.check_dtype("k_pages", k_pages, [q.dtype])
    v.check_dtype("v_pages", v_pages, [q.dtype])
    static = _check_common(
        q, num_kv_heads, block_tables, kv_lens, sliding_window, soft_cap, sinks, variant, sm_scale
    )
    gpu = (
        bind(paged_attention_gpu, **static)
        if gpu_supported(page_size, head_dim)
        else None
    )
    return dispatch(
        q,
        k_pages,
        v_pages,
        block_tables,
        kv_lens,
        sinks,
        ref=bind(paged_attention_xla, **static),
        tpu=bind(paged_attention_tpu, **static),
        gpu=gpu,
        interpret=interpret,
    )


def paged_attention_quantized(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    *,
    kv_format,
    sm_scale=None,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
    variant: AttentionVariant | None = None,
    interpret=None,
):
    """paged_attention over low-bit KV pages, decoded tile by tile inside the kernel.

    Args:
      kv_format: "int8" | "fp8" (quant.RowQuantized: codes [num_pages, page_size,
        num_kv_heads, head_dim] int8 / E4M3, scales f32 [num_pages, page_size,
        num_kv_heads]); "nvfp4" (quant.NVFP4: packed uint8 [..., head_dim / 2], E4M3 scales
        [..., head_dim / 16], scalar tensor_scale); "mxfp4" (quant.MXFP4: packed uint8
        [..., head_dim / 2], UE8M0 scales [..., head_dim / 32]); or an mse-mode
        quant.TurboQuant with bits 1, 2 or 4 (quant.TurboCodes: idx uint8
        [..., head_dim * bits / 8], norm f32 [num_pages, page_size, num_kv_heads]); or a
        quant.TurboQuantSplit, the KV cache's turboquant-3.5 / -2.5 (quant.SplitCodes:
        outlier and regular TurboCodes of head_dim / 2 channels each).
        kv_formats.resolve(kv_format).quantize(pages) builds such a container. E4M3 leaves
        come as float8_e4m3fn (quant's quantizers) or as their uint8 bits (such a container).
      k_pages, v_pages: containers of kv_format with the same leaf shapes.
      Everything else as paged_attention (q may be f32 or bf16, any float).

    Returns (out, lse) as paged_attention, equal to paged_attention on the dequantized pages.
    On TPU (or interpret=...) the Pallas kernel reads only the low-bit bytes; elsewhere
    (CPU, GPU) the XLA path gathers and dequantizes a block of the table's pages at a time
    (xla.py), never the whole pool.
    """
    fmt = kv_formats.resolve(kv_format)
    v.check_ndim("q", q, 3, "[batch, num_q_heads, head_dim]")
    v.check_float("q", q)
    head_dim = q.shape[2]
    fmt.check(k_pages, head_dim, "k_pages")
    fmt.check(v_pages, head_dim, "v_pages")
    k_shapes = [x.shape for x in fmt.leaves(k_pages)]
    v_shapes = [x.shape for x in fmt.leaves(v_pages)]
    if k_shapes != v_shapes:
        raise ValueError(f"v_pages leaf shapes {v_shapes} != k_pages leaf shapes {k_shapes}")
    static = _check_common(
        q, k_shapes[0][2], block_tables, kv_lens, sliding_window, soft_cap, sinks, variant, sm_scale
    )
    return dispatch(
        q,
        k_pages,
        v_pages,
        block_tables,
        kv_lens,
        sinks,
        ref=bind(paged_attention_xla, kv_format=fmt, **static),
        tpu=bind(paged_attention_tpu, kv_format=fmt, **static),
        gpu=None,  # CUDA runs the reference (see tests: no Triton kernel for these formats)
        interpret=interpret,
    )


def _check_common(
    q, num_kv_heads, block_tables, kv_lens, sliding_window, soft_cap, sinks, variant, sm_scale
):
    """Checks shared by both entries; returns the kernels' static keyword arguments."""
    batch, num_q_heads, head_dim = q.shape
    v.check_heads(num_q_heads, num_kv_heads)
    v.check_ndim("block_tables", block_tables, 2, "[batch, max_pages_per_seq]")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables batch {block_tables.shape[0]} != q batch {batch}")
    v.check_dtype("block_tables", block_tables, [jnp.int32])
    v.check_shape("kv_lens", kv_lens, (batch,))
    v.check_dtype("kv_lens", kv_lens, [jnp.int32])
    v.check_positive("sliding_window", sliding_window)
    return dict(
        sliding_window=None if sliding_window is None else int(sliding_window),
        **v.attention_options(head_dim, num_q_heads, sm_scale, soft_cap, sinks, variant),
    )
