"""Paged decode attention in plain jnp: the ground truth the kernels are tested against.

Gathers each sequence's pages into a contiguous KV, then runs masked dense attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.variant import SOFTMAX

HIGHEST = jax.lax.Precision.HIGHEST


def attention_over_rows(q, k, v, mask, q_pos, kv_pos, *, sm_scale, variant=SOFTMAX, sinks=None):
    """Dense attention of query rows over KV rows, the common core of the references.

    q: [T, Hq, D]; k, v: [T, S, Hkv, D] (per-query KV rows); mask: bool [T, S];
    q_pos: int32 [T]; kv_pos: int32 [T, S]; sinks: f32 [Hq] or None.
    Returns out [T, Hq, D] in q.dtype and lse f32 [T, Hq].
    """
    t, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(t, num_kv_heads, group, head_dim)
    s = jnp.einsum("thgd,tshd->thgs", qg, k.astype(jnp.float32), precision=HIGHEST)
    s = s.reshape(t, num_q_heads, -1) * sm_scale
    q_head = jnp.arange(num_q_heads, dtype=jnp.int32)[None, :, None]
    s = variant.transform(s, q_pos[:, None, None], kv_pos[:, None, :], q_head)
    mask = mask[:, None, :]
    if variant.uses_softmax:
        s = jnp.where(mask, s, -jnp.inf)
        if sinks is not None:
            s = jnp.concatenate(
                [
                    s,
                    jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (t, num_q_heads, 1)),
                ],
                axis=-1,
            )
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.where(jnp.isneginf(lse)[..., None], 0.0, jnp.exp(s - lse[..., None]))
        if sinks is not None:
            p = p[..., :-1]
    else:
        p = jnp.where(mask, variant.weight_fn(s), 0.0)
        lse = jnp.log(jnp.sum(p, axis=-1))
    pg = p.reshape(t, num_kv_heads, group, -1)
    out = jnp.einsum("thgs,tshd->thgd", pg, v.astype(jnp.float32), precision=HIGHEST)
    return out.reshape(t, num_q_heads, head_dim).astype(q.dtype), lse


def paged_attention_ref(
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
):
    """Same contract as pallas_kernels.paged_attention (arguments already validated)."""
    _, page_size, num_kv_heads, head_dim = k_pages.shape
    batch, max_pages = block_tables.shape
    k = k_pages[block_tables].reshape(batch, max_pages * page_size, num_kv_heads, head_dim)
    v = v_pages[block_tables].reshape(batch, max_pages * page_size, num_kv_heads, head_dim)
    kv_pos = jnp.broadcast_to(
        jnp.arange(max_pages * page_size, dtype=jnp.int32), (batch, max_pages * page_size)
    )
    mask = kv_pos < kv_lens[:, None]
    if sliding_window is not None:
        mask &= kv_pos >= kv_lens[:, None] - sliding_window
    return attention_over_rows(
        q, k, v, mask, kv_lens - 1, kv_pos, sm_scale=sm_scale, variant=variant, sinks=sinks
    )


def paged_attention_quantized_ref(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    sinks=None,
    *,
    kv_format,
    sm_scale,
    sliding_window=None,
    variant=SOFTMAX,
):
    """paged_attention_quantized's truth: gather each sequence's pages (only those its
    block table names, never the whole pool), dequantize them with quant's own functions
    (kv_format: a kv_formats object), then plain paged attention in f32."""
    batch, max_pages = block_tables.shape
    num_pages = kv_format.leaves(k_pages)[0].shape[0]
    # Entries past a sequence's pages may hold anything: clamp them into the pool.
    table = jnp.clip(block_tables, 0, num_pages - 1).reshape(-1)

    def gathered(pages):
        # Page-axis leaves are 3-D or 4-D; a scalar (NVFP4's tensor scale) stays as is.
        return jax.tree.map(lambda a: a[table] if a.ndim >= 3 else a, pages)

    own = jnp.arange(batch * max_pages, dtype=jnp.int32).reshape(batch, max_pages)
    return paged_attention_ref(
        q,
        kv_format.dequantize(gathered(k_pages)),
        kv_format.dequantize(gathered(v_pages)),
        own,
        kv_lens,
        sinks,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        variant=variant,
    )
