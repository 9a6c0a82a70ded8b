"""Ragged paged attention on GPU for decode-only steps: every sequence is a chunk of one.

There is no Triton ragged kernel yet. A decode-only step (max_q_len 1, one query token
per sequence, float pages, no tree) is exactly what the paged decode kernel computes once
the new K/V rows sit in their slots, so the rows are scattered in XLA and the Triton
decode kernel (pallas_kernels/paged_attention/kernel_gpu.py) attends. Other steps take
the XLA path on GPU (entry.py decides, statically).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.paged_attention.kernel_gpu import gpu_supported, paged_attention_gpu
from pallas_kernels.ragged_paged_attention.ref import token_layout, write_new_kv


def decode_supported(num_tokens, num_seqs, page_size, head_dim, tree, kv_format, max_q_len) -> bool:
    """Whether a step can run as paged decode: one token per sequence slot, float pages."""
    return (max_q_len == 1 and num_tokens == num_seqs and tree is None and kv_format is None
            and gpu_supported(page_size, head_dim))


def ragged_decode_gpu(q, k, v, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, sinks=None,
                      tree=None, *, sm_scale, sliding_window=None, variant, interpret=False):
    """Same contract as ragged_paged_attention for a decode_supported step: token i is
    sequence i's new token (or padding when that sequence has no query)."""
    seq, pos = token_layout(cu_q_lens, kv_lens, q.shape[0])
    k_pages, v_pages = write_new_kv(k_pages, v_pages, k, v, block_tables, seq, pos)
    # token i belongs to sequence i when it has a query; otherwise it is padding
    live = (cu_q_lens[1:] - cu_q_lens[:-1]) > 0
    out, lse = paged_attention_gpu(q, k_pages, v_pages, block_tables, jnp.where(live, kv_lens, 0),
                                   sinks, sm_scale=sm_scale, sliding_window=sliding_window,
                                   variant=variant, interpret=interpret)
    out = jnp.where(live[:, None, None], out, 0).astype(q.dtype)
    return out, jnp.where(live[:, None], lse, -jnp.inf), k_pages, v_pages
