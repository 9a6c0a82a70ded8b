"""Selected-row sparse attention as a Pallas TPU kernel (manual row DMAs).

Grid (token, chunk): the chunks of every segment follow each other on the second axis.
Indices are scalar-prefetched into SMEM; each step DMAs its `chunk` selected rows of K
and V from HBM into VMEM (all copies in flight, then waited), and folds them into the
running softmax. An empty slot (-1) copies row 0 and is masked out, so a DMA never goes
out of bounds. Sinks enter once, at the last step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax
from pallas_kernels.variant import AttentionVariant


def _kernel(*refs, num_segments, chunks, chunk, variant, sm_scale, has_sinks):
    idx_refs = refs[:num_segments]
    q_ref = refs[num_segments]
    kv_refs = refs[num_segments + 1 : 3 * num_segments + 1]
    rest = refs[3 * num_segments + 1 :]
    sinks_ref = rest[0] if has_sinks else None
    out_ref, lse_ref, k_buf, v_buf, sem, m_ref, l_ref, acc_ref = rest[int(has_sinks) :]
    t, c = pl.program_id(0), pl.program_id(1)
    num_q_heads, _ = q_ref.shape
    num_kv_heads = k_buf.shape[1]
    group = num_q_heads // num_kv_heads
    prec = online_softmax.dot_precision(q_ref.dtype)

    @pl.when(c == 0)
    def _init():
        m0, l0, acc0 = online_softmax.init_state(*acc_ref.shape)
        m_ref[...], l_ref[...], acc_ref[...] = m0, l0, acc0

    def segment_step(seg, local_c):
        idx_ref, k_hbm, v_hbm = idx_refs[seg], kv_refs[2 * seg], kv_refs[2 * seg + 1]

        def copies(j):
            row = jnp.maximum(idx_ref[t, local_c * chunk + j], 0)
            return (
                pltpu.make_async_copy(k_hbm.at[row], k_buf.at[j], sem.at[0]),
                pltpu.make_async_copy(v_hbm.at[row], v_buf.at[j], sem.at[1]),
            )

        for j in range(chunk):
            for cp in copies(j):
                cp.start()
        for j in range(chunk):
            for cp in copies(j):
                cp.wait()
        ids = jnp.concatenate(
            [jnp.full((1, 1), idx_ref[t, local_c * chunk + j], jnp.int32) for j in range(chunk)],
            axis=1,
        )  # [1, chunk]
        q = q_ref[...]
        s = (
            jnp.concatenate(
                [
                    lax.dot_general(
                        q[h * group : (h + 1) * group],
                        k_buf[:, h, :],
                        (((1,), (1,)), ((), ())),
                        precision=prec,
                        preferred_element_type=jnp.float32,
                    )
                    for h in range(num_kv_heads)
                ],
                axis=0,
            )
            * sm_scale
        )
        q_head = lax.broadcasted_iota(jnp.int32, (num_q_heads, 1), 0)
        s = variant.transform(s, t, ids, q_head)
        mask = jnp.broadcast_to(ids >= 0, s.shape)
        m_new, l_new, alpha, p = online_softmax.update(variant, m_ref[...], l_ref[...], s, mask)
        pv = jnp.concatenate(
            [
                lax.dot_general(
                    p[h * group : (h + 1) * group].astype(v_buf.dtype),
                    v_buf[:, h, :],
                    (((1,), (0,)), ((), ())),
                    precision=prec,
                    preferred_element_type=jnp.float32,
                )
                for h in range(num_kv_heads)
            ],
            axis=0,
        )
        m_ref[...], l_ref[...] = m_new, l_new
        acc_ref[...] = alpha * acc_ref[...] + pv

    start = 0
    for seg, n in enumerate(chunks):
        pl.when((c >= start) & (c < start + n))(functools.partial(segment_step, seg, c - start))
        start += n

    @pl.when(c == pl.num_programs(1) - 1)
    def _finish():
        sinks = None if sinks_ref is None else sinks_ref[...]
        out, lse = online_softmax.finalize(variant, m_ref[...], l_ref[...], acc_ref[...], sinks)
        out_ref[...] = out.astype(out_ref.dtype)
        lse_ref[...] = lse


def sparse_attention_tpu(
    q,
    segments,
    sinks=None,
    *,
    sm_scale: float,
    variant: AttentionVariant,
    chunk: int = 8,
    interpret=False,
):
    """Shapes as sparse_attention_ref. Each segment's index count is padded to `chunk`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = segments[0][0].shape[1]
    indices, kv, chunks = [], [], []
    for k_rows, v_rows, idx in segments:
        pad = -idx.shape[1] % chunk
        indices.append(jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1))
        chunks.append(indices[-1].shape[1] // chunk)
        kv += [k_rows, v_rows]
    row_map = lambda t, c, *_: (t, 0, 0)
    in_specs = [pl.BlockSpec((None, num_q_heads, head_dim), row_map)]
    in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * len(kv)
    operands = [q, *kv]
    if sinks is not None:
        in_specs.append(pl.BlockSpec((num_q_heads, 1), lambda t, c, *_: (0, 0)))
        operands.append(sinks.astype(jnp.float32).reshape(num_q_heads, 1))
    kernel = functools.partial(
        _kernel,
        num_segments=len(segments),
        chunks=tuple(chunks),
        chunk=chunk,
        variant=variant,
        sm_scale=sm_scale,
        has_sinks=sinks is not None,
    )
    dtype = segments[0][0].dtype
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(segments),
            grid=(num_tokens, sum(chunks)),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, num_q_heads, head_dim), row_map),
                pl.BlockSpec((None, num_q_heads, 1), row_map),
            ],
            scratch_shapes=[
                pltpu.VMEM((chunk, num_kv_heads, head_dim), dtype),
                pltpu.VMEM((chunk, num_kv_heads, head_dim), dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((num_q_heads, 1), jnp.float32),
                pltpu.VMEM((num_q_heads, 1), jnp.float32),
                pltpu.VMEM((num_q_heads, head_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), q.dtype),
            jax.ShapeDtypeStruct((num_tokens, num_q_heads, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kvfold_sparse_attention",
    )(*indices, *operands)
    return out, lse[..., 0]
