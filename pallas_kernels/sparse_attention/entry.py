"""pallas_kernels.sparse_attention: attention over explicitly selected KV rows."""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels import validate as v
from pallas_kernels.dispatch import bind, dispatch
from pallas_kernels.sparse_attention.kernel_tpu import sparse_attention_tpu
from pallas_kernels.sparse_attention.ref import sparse_attention_ref
from pallas_kernels.variant import AttentionVariant


def sparse_attention(
    q,
    k_rows,
    v_rows,
    indices,
    *,
    window=None,
    sm_scale=None,
    sinks=None,
    soft_cap=None,
    variant: AttentionVariant | None = None,
    interpret=None,
):
    """Each query attends to its own list of KV rows (DeepSeek CSA2 / top-k sparse attention).

    o = sum_t e^{s_t - m} v_t / (sum_t e^{s_t - m} + e^{sink - m}) over the selected rows
    followed by the window rows, s_t = q . k_t * sm_scale.

    Args:
      q: [num_tokens, num_q_heads, head_dim], float.
      k_rows, v_rows: [num_rows, num_kv_heads, head_dim], q's dtype (pass the same array
        twice for K = V, as in CSA2's single latent).
      indices: int32 [num_tokens, num_selected]; row ids into k_rows, -1 = empty slot.
      window: optional (window_k, window_v, window_indices), same layout and -1 rule, for
        the sliding-window part (e.g. the last 128 tokens' own KV rows).
      sm_scale: default head_dim ** -0.5. soft_cap / variant: as paged_attention, with
        q_pos = token index and kv_pos = row id.
      sinks: f32 [num_q_heads] sink logits, added once to the denominator.
      interpret: True or pltpu.InterpretParams runs the TPU kernel in TPU interpret mode
        (it uses DMAs, so True means InterpretParams()).

    Returns:
      out [num_tokens, num_q_heads, head_dim] in q.dtype; lse f32 [num_tokens, num_q_heads].
      A token with no valid row gets out = 0 and lse = -inf (lse = sink with sinks).
      On GPU this runs the XLA reference (gather + dense); there is no GPU kernel yet.
    """
    v.check_ndim("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    v.check_float("q", q)
    num_tokens, num_q_heads, head_dim = q.shape
    segments = [(k_rows, v_rows, indices)]
    if window is not None:
        segments.append(tuple(window))
    for name, (k, vv, idx) in zip(["", "window_"], segments):
        v.check_ndim(f"{name}k_rows", k, 3, "[num_rows, num_kv_heads, head_dim]")
        v.check_shape(f"{name}v_rows", vv, k.shape)
        v.check_dtype(f"{name}k_rows", k, [q.dtype])
        v.check_dtype(f"{name}v_rows", vv, [q.dtype])
        if k.shape[-1] != head_dim or k.shape[1] != segments[0][0].shape[1]:
            raise ValueError(
                f"{name}k_rows shape {k.shape} does not match q head_dim {head_dim}"
                f" / num_kv_heads {segments[0][0].shape[1]}"
            )
        v.check_ndim(f"{name}indices", idx, 2, "[num_tokens, num_selected]")
        if idx.shape[0] != num_tokens:
            raise ValueError(f"{name}indices has {idx.shape[0]} rows, q has {num_tokens} tokens")
        v.check_dtype(f"{name}indices", idx, [jnp.int32])
    v.check_heads(num_q_heads, segments[0][0].shape[1])
    static = v.attention_options(head_dim, num_q_heads, sm_scale, soft_cap, sinks, variant)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    return dispatch(
        q,
        tuple(segments),
        sinks,
        ref=bind(sparse_attention_ref, **static),
        tpu=bind(sparse_attention_tpu, **static),
        gpu=None,
        interpret=interpret,
    )
