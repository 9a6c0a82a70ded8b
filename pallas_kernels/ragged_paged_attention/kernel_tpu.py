"""Ragged paged attention (mixed prefill chunks + decode rows) as a Pallas TPU kernel,
with the new K/V written into the pages inside the kernel.

Plan, then run (FlashInfer's split): outside the kernel, in XLA, each sequence's query
tokens are cut into tiles of `block_q` tokens of that one sequence (a decode row is a
tile with one live row), and q is gathered into head-major tiles [tile, Hq, block_q, D].
The number of tiles is bounded statically by ceil(T / block_q) + num_seqs; spare tiles
have length 0 and do nothing.

Grid (tile, page), both sequential ("arbitrary"): at page step 0 a tile DMAs its own
tokens' K/V rows from HBM into their page slots (k_pages/v_pages stay in HBM, aliased
input -> output, so the cache is updated in place), then every step DMAs one page of
the sequence (clamped to the causal / sliding-window range of the tile) into VMEM and
folds it into the running softmax. A later tile of the same sequence reads what an
earlier tile wrote, which is why the tile axis must not be "parallel". Page reads are
not double-buffered yet (each step waits on its own DMA).
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


def plan_tiles(cu_q_lens, num_tokens, block_q):
    """Cut each sequence's query tokens into tiles of <= block_q tokens.

    Returns int32 arrays over a static number of tiles: tile_seq (sequence id, -1 for a
    spare tile), tile_start (first query index inside the sequence's chunk), tile_len
    (live rows, 0 for a spare tile), and tile_first (index of each sequence's first tile).
    """
    num_seqs = cu_q_lens.shape[0] - 1
    num_tiles = -(-num_tokens // block_q) + num_seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tiles_per_seq = (q_lens + block_q - 1) // block_q
    tile_end = jnp.cumsum(tiles_per_seq)
    tile_first = tile_end - tiles_per_seq
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.sum(tile[:, None] >= tile_end[None, :], axis=1).astype(jnp.int32)
    live = seq < num_seqs
    s = jnp.minimum(seq, num_seqs - 1)
    start = (tile - tile_first[s]) * block_q
    length = jnp.where(live, jnp.clip(q_lens[s] - start, 0, block_q), 0)
    return (
        jnp.where(live, seq, -1),
        jnp.where(live, start, 0),
        length.astype(jnp.int32),
        tile_first.astype(jnp.int32),
    )


def _tile_range(kv_len, q_len, start, length, page_size, sliding_window):
    """Positions of the tile's first query and [first, last] pages it reads."""
    q_first = kv_len - q_len + start
    last = jnp.maximum(q_first + length - 1, 0) // page_size
    if sliding_window is None:
        return q_first, 0, last
    first = jnp.maximum(q_first - sliding_window + 1, 0) // page_size
    return q_first, jnp.minimum(first, last), last


def _kernel(
    block_tables_ref,
    cu_q_lens_ref,
    kv_lens_ref,
    tile_seq_ref,
    tile_start_ref,
    tile_len_ref,
    q_ref,
    k_new_hbm,
    v_new_hbm,
    k_pages_in,
    v_pages_in,
    *rest_refs,
    variant,
    sm_scale,
    sliding_window,
    has_sinks,
):
    # k_pages_in/v_pages_in alias k_pages/v_pages (the outputs): all page traffic goes
    # through the output refs, so reads see this call's writes.
    del k_pages_in, v_pages_in
    rest = list(rest_refs)
    sinks_ref = rest.pop(0) if has_sinks else None
    out_ref, lse_ref, k_pages, v_pages, k_buf, v_buf, sem, m_ref, l_ref, acc_ref = rest
    j, p = pl.program_id(0), pl.program_id(1)
    num_q_heads, block_q, _ = q_ref.shape
    page_size, num_kv_heads, _ = k_buf.shape
    seq = jnp.maximum(tile_seq_ref[j], 0)
    start, length = tile_start_ref[j], tile_len_ref[j]
    kv_len = kv_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq]
    q_first, first, last = _tile_range(kv_len, q_len, start, length, page_size, sliding_window)
    live = length > 0

    @pl.when(p == 0)
    def _init():
        m0, l0, acc0 = online_softmax.init_state(*acc_ref.shape)
        m_ref[...], l_ref[...], acc_ref[...] = m0, l0, acc0

    def write_copies(i):
        token = cu_q_lens_ref[seq] + start + i
        pos = q_first + i
        page = block_tables_ref[seq, pos // page_size]
        slot = pos % page_size
        return (
            pltpu.make_async_copy(k_new_hbm.at[token], k_pages.at[page, slot], sem.at[2]),
            pltpu.make_async_copy(v_new_hbm.at[token], v_pages.at[page, slot], sem.at[3]),
        )

    @pl.when((p == 0) & live)
    def _write_new_kv():
        def start_copies(i, c):
            for cp in write_copies(i):
                cp.start()
            return c

        def wait_copies(i, c):
            for cp in write_copies(i):
                cp.wait()
            return c

        lax.fori_loop(0, length, start_copies, 0)
        lax.fori_loop(0, length, wait_copies, 0)

    @pl.when(live & (p >= first) & (p <= last))
    def _step():
        page = block_tables_ref[seq, p]
        reads = (
            pltpu.make_async_copy(k_pages.at[page], k_buf, sem.at[0]),
            pltpu.make_async_copy(v_pages.at[page], v_buf, sem.at[1]),
        )
        for cp in reads:
            cp.start()
        for cp in reads:
            cp.wait()
        prec = online_softmax.dot_precision(q_ref.dtype)
        rows = num_q_heads * block_q
        q = q_ref[...].reshape(rows, q_ref.shape[-1])
        s = online_softmax.grouped_scores(q, lambda h: k_buf[:, h, :], num_kv_heads, prec)
        s = s * sm_scale
        row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        q_row = row % block_q
        q_pos = q_first + q_row
        kv_pos = p * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        s = variant.transform(s, q_pos, kv_pos, row // block_q)
        mask = (kv_pos <= q_pos) & (q_row < length)
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window
        m_new, l_new, alpha, probs = online_softmax.update(variant, m_ref[...], l_ref[...], s, mask)
        pv = online_softmax.grouped_pv(probs, lambda h: v_buf[:, h, :], num_kv_heads, prec)
        m_ref[...], l_ref[...] = m_new, l_new
        acc_ref[...] = alpha * acc_ref[...] + pv

    @pl.when(p == pl.num_programs(1) - 1)
    def _finish():
        sinks = None if sinks_ref is None else sinks_ref[...]
        out, lse = online_softmax.finalize(variant, m_ref[...], l_ref[...], acc_ref[...], sinks)
        out_ref[...] = out.reshape(out_ref.shape).astype(out_ref.dtype)
        lse_ref[...] = lse


def ragged_paged_attention_tpu(
    q,
    k,
    v,
    k_pages,
    v_pages,
    block_tables,
    cu_q_lens,
    kv_lens,
    sinks=None,
    tree_bits=None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    variant: AttentionVariant,
    kv_format=None,
    block_q: int = 8,
    interpret=False,
):
    """Shapes as pallas_kernels.ragged_paged_attention; block_q: query tokens per tile
    (a multiple of 8, the sublane tile)."""
    if tree_bits is not None:
        raise ValueError("ragged_paged_attention_tpu: tree_bits is not supported yet")
    if kv_format is not None:
        raise ValueError("ragged_paged_attention_tpu: kv_format is not supported yet")
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    num_seqs = kv_lens.shape[0]
    tile_seq, tile_start, tile_len, tile_first = plan_tiles(cu_q_lens, num_tokens, block_q)
    num_tiles = tile_seq.shape[0]
    # Head-major query tiles: token rows of a tile are contiguous per head.
    seq_c = jnp.maximum(tile_seq, 0)
    tok = cu_q_lens[seq_c][:, None] + tile_start[:, None] + jnp.arange(block_q)[None, :]
    q_tiles = q[jnp.clip(tok, 0, num_tokens - 1)].transpose(0, 2, 1, 3)

    tile_map = lambda j, p, *_: (j, 0, 0, 0)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [pl.BlockSpec((None, num_q_heads, block_q, head_dim), tile_map)] + [any_spec] * 4
    operands = [q_tiles, k, v, k_pages, v_pages]
    if sinks is not None:
        in_specs.append(pl.BlockSpec((num_q_heads * block_q, 1), lambda j, p, *_: (0, 0)))
        operands.append(jnp.repeat(sinks.astype(jnp.float32), block_q)[:, None])
    rows = num_q_heads * block_q
    kernel = functools.partial(
        _kernel,
        variant=variant,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        has_sinks=sinks is not None,
    )
    num_prefetch = 6
    out, lse, k_pages, v_pages = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_prefetch,
            grid=(num_tiles, max_pages),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, num_q_heads, block_q, head_dim), tile_map),
                pl.BlockSpec((None, rows, 1), lambda j, p, *_: (j, 0, 0)),
                any_spec,
                any_spec,
            ],
            scratch_shapes=[
                pltpu.VMEM((page_size, num_kv_heads, head_dim), k_pages.dtype),
                pltpu.VMEM((page_size, num_kv_heads, head_dim), v_pages.dtype),
                pltpu.SemaphoreType.DMA((4,)),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((num_tiles, num_q_heads, block_q, head_dim), q.dtype),
            jax.ShapeDtypeStruct((num_tiles, rows, 1), jnp.float32),
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ],
        input_output_aliases={num_prefetch + 3: 2, num_prefetch + 4: 3},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        name="kvfold_ragged_paged_attention",
    )(block_tables, cu_q_lens, kv_lens, tile_seq, tile_start, tile_len, *operands)

    # Un-tile: token t of sequence s is row (t - cu[s]) % block_q of tile
    # tile_first[s] + (t - cu[s]) // block_q. Padding tokens get out 0, lse -inf.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.sum(token[:, None] >= cu_q_lens[None, 1:], axis=1)
    padding = seq >= num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    offset = token - cu_q_lens[seq]
    tile, row = tile_first[seq] + offset // block_q, offset % block_q
    tile = jnp.clip(tile, 0, num_tiles - 1)
    out = out[tile, :, row]  # [T, Hq, D]
    lse = lse[:, :, 0].reshape(num_tiles, num_q_heads, block_q)[tile, :, row]
    out = jnp.where(padding[:, None, None], 0, out).astype(q.dtype)
    lse = jnp.where(padding[:, None], -jnp.inf, lse)
    return out, lse, k_pages, v_pages
