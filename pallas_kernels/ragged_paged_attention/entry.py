"""pallas_kernels.ragged_paged_attention: the one entry for mixed prefill + decode steps."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import validate
from pallas_kernels.dispatch import dispatch
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.ref import ragged_paged_attention_ref
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
      k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim], q's dtype.
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
        (it uses DMAs, so True means InterpretParams()); None runs Mosaic on TPU and the XLA
        reference elsewhere (no GPU kernel yet: CUDA runs the reference).

    Returns:
      out [total_q_tokens, num_q_heads, head_dim] in q.dtype, lse f32 [total_q_tokens,
      num_q_heads], and the updated k_pages, v_pages. On TPU the pages are aliased to the
      outputs: call this inside a jit that donates them and the update is in place.
    """
    validate.check_ndim("q", q, 3, "[total_q_tokens, num_q_heads, head_dim]")
    validate.check_float("q", q)
    num_tokens, num_q_heads, head_dim = q.shape
    validate.check_ndim("k_pages", k_pages, 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    _, page_size, num_kv_heads, _ = k_pages.shape
    if k_pages.shape[-1] != head_dim:
        raise ValueError(f"k_pages head_dim {k_pages.shape[-1]} != q head_dim {head_dim}")
    validate.check_shape("v_pages", v_pages, k_pages.shape)
    validate.check_shape("k", k, (num_tokens, num_kv_heads, head_dim))
    validate.check_shape("v", v, (num_tokens, num_kv_heads, head_dim))
    for name, x in (("k", k), ("v", v), ("k_pages", k_pages), ("v_pages", v_pages)):
        validate.check_dtype(name, x, [q.dtype])
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
    validate.check_block_tables(block_tables, k_pages.shape[0], kv_lens, page_size)
    static = dict(
        sliding_window=None if sliding_window is None else int(sliding_window),
        **validate.attention_options(head_dim, num_q_heads, sm_scale, soft_cap, sinks, variant),
    )
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
        ref=functools.partial(ragged_paged_attention_ref, **static),
        tpu=functools.partial(ragged_paged_attention_tpu, **static),
        gpu=None,
        interpret=interpret,
    )
