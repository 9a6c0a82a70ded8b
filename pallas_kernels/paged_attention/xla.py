"""The XLA path of paged decode attention, run where no Pallas kernel does (CPU).

ref.py states the operation densely: gather every page of a sequence, dequantize,
attend. Here each sequence's query is a tile of one for pallas_kernels/paged_blocks.py,
which walks the block table a block of pages at a time with online softmax and decodes
low-bit pages in the kernel's channel parts. Tested against ref.py.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_attention.ref import paged_attention_quantized_ref, paged_attention_ref
from pallas_kernels.paged_blocks import attend_tiles
from pallas_kernels.variant import SOFTMAX


def paged_attention_xla(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    sinks=None,
    *,
    sm_scale,
    sliding_window=None,
    variant=SOFTMAX,
    kv_format=None,
):
    """paged_attention (kv_format None) or paged_attention_quantized (a kv_formats object):
    same contract, arguments already validated. Variants without softmax (a weight_fn)
    have no running normaliser to carry, so they take the dense reference."""
    if not variant.uses_softmax:
        if kv_format is None:
            return paged_attention_ref(q, k_pages, v_pages, block_tables, kv_lens, sinks,
                                       sm_scale=sm_scale, sliding_window=sliding_window, variant=variant)
        return paged_attention_quantized_ref(q, k_pages, v_pages, block_tables, kv_lens, sinks,
                                             kv_format=kv_format, sm_scale=sm_scale,
                                             sliding_window=sliding_window, variant=variant)
    batch = q.shape[0]
    rows = jnp.arange(batch, dtype=jnp.int32)
    out, lse = attend_tiles(q, k_pages, v_pages, block_tables, rows, rows[:, None],
                            jnp.ones((batch, 1), bool), kv_lens - 1, rows, sinks,
                            sm_scale=sm_scale, sliding_window=sliding_window, variant=variant,
                            kv_format=kv_format)
    return out.astype(q.dtype), lse
