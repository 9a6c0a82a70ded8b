"""Lightning-indexer scores as a Pallas TPU kernel.

Grid (token tile, key tile): each step scores `block_t` queries against `block_n` index
keys, sum_h w_h * ReLU(q_h . k) accumulated in f32 over the heads (a fori_loop, one
[block_t, Dk] x [Dk, block_n] matmul per head), and masks rows that are not causally
visible. A key tile no query of the tile can see is written as -inf without any matmul.
q and w come in head-major ([H, T, Dk], [H, T, 1]) so a head is a leading-axis index.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax


def _kernel(q_ref, w_ref, k_ref, pos_ref, out_ref, *, compress_ratio, num_rows):
    n = pl.program_id(1)
    num_heads = q_ref.shape[0]
    block_n = k_ref.shape[0]
    row = n * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    n_vis = jnp.clip((pos_ref[...] + 1) // compress_ratio, 0, num_rows)  # [block_t, 1]
    visible = row < n_vis
    any_visible = n * block_n < jnp.max(n_vis)

    @pl.when(any_visible)
    def _score():
        k = k_ref[...]
        prec = online_softmax.dot_precision(k.dtype)

        def head(h, acc):
            s = lax.dot_general(
                q_ref[h],
                k,
                (((1,), (1,)), ((), ())),
                precision=prec,
                preferred_element_type=jnp.float32,
            )
            return acc + jnp.maximum(s, 0.0) * w_ref[h].astype(jnp.float32)

        acc = lax.fori_loop(0, num_heads, head, jnp.zeros(out_ref.shape, jnp.float32))
        out_ref[...] = jnp.where(visible, acc, -jnp.inf)

    @pl.when(jnp.logical_not(any_visible))
    def _skip():
        out_ref[...] = jnp.full(out_ref.shape, -jnp.inf, jnp.float32)


def indexer_scores_tpu(
    q,
    weights,
    index_keys,
    q_positions,
    *,
    compress_ratio: int,
    block_t: int = 8,
    block_n: int = 128,
    interpret=False,
):
    """Shapes as indexer_scores_ref. T is padded to block_t and N to block_n."""
    num_tokens, num_heads, dk = q.shape
    num_rows = index_keys.shape[0]
    pad_t, pad_n = -num_tokens % block_t, -num_rows % block_n
    qh = jnp.pad(q, ((0, pad_t), (0, 0), (0, 0))).transpose(1, 0, 2)
    wh = jnp.pad(weights.astype(jnp.float32), ((0, pad_t), (0, 0))).T[..., None]
    keys = jnp.pad(index_keys, ((0, pad_n), (0, 0)))
    pos = jnp.pad(q_positions, (0, pad_t), constant_values=-1)[:, None]
    tt, nn = (num_tokens + pad_t) // block_t, (num_rows + pad_n) // block_n
    kernel = functools.partial(_kernel, compress_ratio=compress_ratio, num_rows=num_rows)
    scores = pl.pallas_call(
        kernel,
        grid=(tt, nn),
        in_specs=[
            pl.BlockSpec((num_heads, block_t, dk), lambda t, n: (0, t, 0)),
            pl.BlockSpec((num_heads, block_t, 1), lambda t, n: (0, t, 0)),
            pl.BlockSpec((block_n, dk), lambda t, n: (n, 0)),
            pl.BlockSpec((block_t, 1), lambda t, n: (t, 0)),
        ],
        out_specs=pl.BlockSpec((block_t, block_n), lambda t, n: (t, n)),
        out_shape=jax.ShapeDtypeStruct((num_tokens + pad_t, num_rows + pad_n), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="kvfold_indexer_scores",
    )(qh, wh, keys, pos)
    return scores[:num_tokens, :num_rows]
