"""Ragged paged attention (mixed prefill chunks + decode rows) as a Pallas TPU kernel,
with the new K/V written into the pages inside the kernel.

Plan, then run (FlashInfer's split): outside the kernel, in XLA, each sequence's query
tokens are cut into tiles of `block_q` tokens of that one sequence (a decode row is a
tile with one live row), and q is gathered into head-major tiles
[tile, parts, Hq, block_q, D / parts]. The number of tiles is bounded statically by
ceil(T / block_q) + num_seqs; spare tiles have length 0 and do nothing.

Grid (tile, page), both sequential ("arbitrary"): at page step 0 a tile DMAs its own
tokens' K/V rows from HBM into their page slots (the pages stay in HBM, aliased input ->
output, so the cache is updated in place; a block-table entry outside [0, num_pages)
drops the write, as the reference does), then every step DMAs one page of the sequence
(clamped to the causal / sliding-window range of the tile) into VMEM and folds it into
the running softmax. A later tile of the same sequence reads what an earlier tile wrote,
which is why the tile axis must not be "parallel". Page reads are double-buffered: a
step starts the DMA of the tile's next page into the other of two VMEM slots before it
waits on its own, so the copy overlaps the attention of the page in hand (a tile's first
page is started at its first step, after the tile's writes).

KV formats (kv_format: None for plain float pages, or a kv_formats object). The page
container's page-axis leaves (codes, scales, norms) each get their own DMA and VMEM
buffer, and every KV head's tile is decoded in VMEM with the format's `tile` right
before its dot, exactly as the paged decode kernel (pallas_kernels/paged_attention/
kernel_tpu.py) does: the query is moved into the format's basis (`prepare_q`) and split
into channel `parts` outside the kernel, and the f32 output is merged and moved back
(`finish_out`) after it. The new K/V rows are quantized in XLA before the kernel with
the format's own quantizer (NVFP4 with the pages' tensor scale), one row per (token,
head) so no row depends on another; the kernel then writes every leaf of those rows into
its page slot with the same fused DMAs as plain rows. Plain pages are the format
kv_formats.PLAIN (one leaf, one part), so both run the same kernel body.

Tree attention (tree, a tree.TreeMask; the rule is tree.py's docstring): a sequence's
region start is read in the kernel, each query's region bits ride along as a
[tile, Hq * block_q, words] block beside its query tile and, with a sliding window, its
logical (RoPE) position as a [tile, Hq * block_q, 1] block (computed in XLA: the window
of a tree node counts from it, not from its slot). The first page a tile reads comes
from the plan: the lowest position any of its rows may see.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import online_softmax
from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.paged_attention.kv_formats import merge_parts, split_parts
from pallas_kernels import tree_mask
from pallas_kernels.ragged_paged_attention.ref import token_layout
from pallas_kernels.ragged_paged_attention.tiles import lowest_seen, plan_tiles, visible
from pallas_kernels.variant import AttentionVariant
from quant.blockscaled import nvfp4_quantize


def _head_getter(bufs, h):
    """kv_formats.Getter over one page's VMEM leaf buffers, for KV head h: [page_size, n]
    for 4-D leaves, [page_size, 1] for 3-D (per-token) ones."""
    return lambda i: bufs[i][:, h, :] if len(bufs[i].shape) == 3 else bufs[i][:, h : h + 1]


def _kernel(
    block_tables_ref,
    cu_q_lens_ref,
    kv_lens_ref,
    tile_seq_ref,
    tile_start_ref,
    tile_len_ref,
    tile_lo_ref,
    q_ref,
    *refs,
    kv_format,
    num_leaves,
    num_extras,
    variant,
    sm_scale,
    sliding_window,
    has_tree,
    has_sinks,
):
    refs = list(refs)

    def take(n):
        taken = refs[:n]
        del refs[:n]
        return taken

    if has_tree:
        region_start_ref, bits_ref = take(2)
        logical_ref = take(1)[0] if sliding_window is not None else None
    sinks_ref = take(1)[0] if has_sinks else None
    extras = take(num_extras)
    new_rows = take(2 * num_leaves)  # k leaves, then v leaves: [T, Hkv, ...] in HBM
    # The aliased page inputs: all page traffic goes through the output refs, so reads
    # see this call's writes.
    take(2 * num_leaves)
    out_ref, lse_ref = take(2)
    pages = take(2 * num_leaves)
    bufs = take(2 * num_leaves)
    sem, m_ref, l_ref, acc_ref = refs

    j, p = pl.program_id(0), pl.program_id(1)
    parts, num_q_heads, block_q, _ = q_ref.shape
    num_pages = pages[0].shape[0]
    page_size, num_kv_heads = bufs[0].shape[1:3]  # [2 slots, page_size, Hkv, ...]
    rows = num_q_heads * block_q
    seq = jnp.maximum(tile_seq_ref[j], 0)
    start, length = tile_start_ref[j], tile_len_ref[j]
    kv_len = kv_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq]
    q_first = kv_len - q_len + start
    last = jnp.maximum(q_first + length - 1, 0) // page_size
    first = jnp.minimum(jnp.maximum(tile_lo_ref[j], 0) // page_size, last)
    max_pages = block_tables_ref.shape[1]
    live = length > 0

    @pl.when(p == 0)
    def _init():
        m0, l0, acc0 = online_softmax.init_state(rows, acc_ref.shape[-1])
        m_ref[...], l_ref[...] = m0, l0
        for part in range(parts):
            acc_ref[part] = acc0

    def write_copies(i):
        token = cu_q_lens_ref[seq] + start + i
        pos = q_first + i
        index = pos // page_size
        page = block_tables_ref[seq, jnp.minimum(index, max_pages - 1)]
        slot = pos % page_size
        copies = [
            pltpu.make_async_copy(src.at[token], dst.at[page, slot], sem.at[2, n])
            for n, (src, dst) in enumerate(zip(new_rows, pages))
        ]
        return (index < max_pages) & (page >= 0) & (page < num_pages), copies

    @pl.when((p == 0) & live)
    def _write_new_kv():
        def each_copy(method):
            def body(i, c):
                in_pool, copies = write_copies(i)

                @pl.when(in_pool)  # a bad block-table entry drops the row, as the reference
                def _():
                    for cp in copies:
                        getattr(cp, method)()

                return c

            return body

        lax.fori_loop(0, length, each_copy("start"), 0)
        lax.fori_loop(0, length, each_copy("wait"), 0)

    def reads(step, buffer):
        """The DMAs of page `step` of the tile's sequence into buffer slot `buffer`."""
        page = jnp.clip(block_tables_ref[seq, step], 0, num_pages - 1)
        return [
            pltpu.make_async_copy(src.at[page], buf.at[buffer], sem.at[buffer, n])
            for n, (src, buf) in enumerate(zip(pages, bufs))
        ]

    @pl.when(live & (p == first))
    def _first_read():  # after this tile's writes: it may read the rows they put there
        for cp in reads(p, p % 2):
            cp.start()

    @pl.when(live & (p >= first) & (p <= last))
    def _step():
        buffer = p % 2

        @pl.when(p < last)
        def _prefetch():  # the next page lands while this one is attended
            for cp in reads(p + 1, 1 - buffer):
                cp.start()

        for cp in reads(p, buffer):
            cp.wait()
        k_bufs = [buf.at[buffer] for buf in bufs[:num_leaves]]
        v_bufs = [buf.at[buffer] for buf in bufs[num_leaves:]]
        prec = online_softmax.dot_precision(q_ref.dtype)

        def decoded(leaf_bufs, part):
            return lambda h: kv_format.tile(_head_getter(leaf_bufs, h), part, extras).astype(
                q_ref.dtype
            )

        s = None
        for part in range(parts):
            q = q_ref[part].reshape(rows, q_ref.shape[-1])
            d = online_softmax.grouped_scores(q, decoded(k_bufs, part), num_kv_heads, prec)
            s = d if s is None else s + d
        s = s * sm_scale
        row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        q_row = row % block_q
        q_pos = q_first + q_row
        kv_pos = p * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        s = variant.transform(s, q_pos, kv_pos, row // block_q)
        if has_tree:
            logical = None if logical_ref is None else logical_ref[...]
            bits = bits_ref[...]
            columns = [bits[:, w : w + 1] for w in range(bits.shape[1])]
            tree = (region_start_ref[seq], columns, logical)
        else:
            tree = (None, None, None)
        mask = visible(q_pos, kv_pos, sliding_window, *tree) & (q_row < length)
        m_new, l_new, alpha, probs = online_softmax.update(variant, m_ref[...], l_ref[...], s, mask)
        for part in range(parts):
            pv = online_softmax.grouped_pv(probs, decoded(v_bufs, part), num_kv_heads, prec)
            acc_ref[part] = alpha * acc_ref[part] + pv
        m_ref[...], l_ref[...] = m_new, l_new

    @pl.when(p == pl.num_programs(1) - 1)
    def _finish():
        sinks = None if sinks_ref is None else sinks_ref[...]
        m, l = m_ref[...], l_ref[...]
        for part in range(parts):
            out, lse = online_softmax.finalize(variant, m, l, acc_ref[part], sinks)
            out_ref[part] = out.reshape(out_ref.shape[1:]).astype(out_ref.dtype)
        lse_ref[...] = lse


def _new_rows(kv_format, pages, x):
    """The new tokens' rows x [T, Hkv, D] as the format's leaves [T, Hkv, ...], quantized
    as the pages hold them (NVFP4 pages with a scalar tensor scale: at that scale)."""
    if kv_format is kv_formats.PLAIN:
        return (x,)
    tensor_scale = getattr(pages, "tensor_scale", None)
    new = kv_format.quantize(x) if tensor_scale is None else nvfp4_quantize(x, tensor_scale)
    return tuple(kv_formats.stored_as(n, p.dtype) for n, p in zip(kv_format.leaves(new), kv_format.leaves(pages)))


def _with_leaves(kv_format, pages, new_leaves):
    """The container `pages` with its page-axis leaves replaced by new_leaves."""
    swap = {id(old): new for old, new in zip(kv_format.leaves(pages), new_leaves)}
    flat, treedef = jax.tree.flatten(pages)
    return jax.tree.unflatten(treedef, [swap.get(id(x), x) for x in flat])


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
    tree=None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    variant: AttentionVariant,
    kv_format=None,
    block_q: int = 8,
    interpret=False,
):
    """Shapes as pallas_kernels.ragged_paged_attention; tree: a tree.TreeMask or None;
    kv_format: None (plain pages) or a kv_formats object whose containers k_pages and
    v_pages are; block_q: query tokens per tile (a multiple of 8, the sublane tile).
    Returns (out, lse, k_pages, v_pages), the pages in their own container."""
    fmt = kv_formats.PLAIN if kv_format is None else kv_format
    num_tokens, num_q_heads, head_dim = q.shape
    k_leaves, v_leaves = fmt.leaves(k_pages), fmt.leaves(v_pages)
    num_leaves = len(k_leaves)
    page_size = k_leaves[0].shape[1]
    max_pages = block_tables.shape[1]
    num_seqs = kv_lens.shape[0]
    parts = fmt.parts
    part_dim = head_dim // parts
    rows = num_q_heads * block_q
    tile_seq, tile_start, tile_len, tile_first = plan_tiles(cu_q_lens, num_tokens, block_q)
    num_tiles = tile_seq.shape[0]
    seq_c = jnp.maximum(tile_seq, 0)
    tok = cu_q_lens[seq_c][:, None] + tile_start[:, None] + jnp.arange(block_q)[None, :]
    tok = jnp.clip(tok, 0, num_tokens - 1)  # [tile, block_q]: each row's token

    def row_tiles(x):
        """Per-token x [T, n] -> [tile, Hq * block_q, n], rows head-major like the query."""
        x = jnp.broadcast_to(x[tok][:, None], (num_tiles, num_q_heads, block_q, x.shape[1]))
        return x.reshape(num_tiles, rows, x.shape[-1])

    # Head-major query tiles in the format's basis and channel parts:
    # [tile, parts, Hq, block_q, part_dim]; token rows of a tile are contiguous per head.
    qp = split_parts(fmt.prepare_q(k_pages, q), parts)  # [parts, T, Hq, part_dim]
    q_tiles = qp[:, tok].transpose(1, 0, 3, 2, 4)

    tile_map = lambda j, p, *_: (j, 0, 0, 0, 0)
    row_map = lambda j, p, *_: (j, 0, 0)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    smem_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
    in_specs = [pl.BlockSpec((None, parts, num_q_heads, block_q, part_dim), tile_map)]
    operands = [q_tiles]
    seq_tok, pos_tok = token_layout(cu_q_lens, kv_lens, num_tokens)
    logical = tree_mask.logical_positions(tree, seq_tok, pos_tok)
    region_start = None
    if tree is not None:
        region_start = tree.start[jnp.minimum(seq_tok, num_seqs - 1)]
        words = tree.bits.shape[1]
        in_specs += [smem_spec, pl.BlockSpec((None, rows, words), row_map)]
        operands += [tree.start, row_tiles(tree.bits)]
        if sliding_window is not None:
            in_specs.append(pl.BlockSpec((None, rows, 1), row_map))
            operands.append(row_tiles(logical[:, None]))
    tile_lo = lowest_seen(tok, tile_len, pos_tok, logical, region_start, sliding_window)
    if sinks is not None:
        in_specs.append(pl.BlockSpec((rows, 1), lambda j, p, *_: (0, 0)))
        operands.append(jnp.repeat(sinks.astype(jnp.float32), block_q)[:, None])
    extras = fmt.extras()
    in_specs += [smem_spec for _ in extras]
    operands += extras
    new_rows = _new_rows(fmt, k_pages, k) + _new_rows(fmt, v_pages, v)
    page_leaves = k_leaves + v_leaves
    in_specs += [any_spec] * (len(new_rows) + len(page_leaves))
    first_page_operand = len(operands) + len(new_rows)
    operands += [*new_rows, *page_leaves]

    kernel = functools.partial(
        _kernel,
        kv_format=fmt,
        num_leaves=num_leaves,
        num_extras=len(extras),
        variant=variant,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        has_tree=tree is not None,
        has_sinks=sinks is not None,
    )
    # Quantized pages: the output may still be rotated / scaled, so keep it f32 until then.
    out_dtype = q.dtype if fmt is kv_formats.PLAIN else jnp.float32
    num_prefetch = 7
    out, lse, *page_leaves = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=num_prefetch,
            grid=(num_tiles, max_pages),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, parts, num_q_heads, block_q, part_dim), tile_map),
                pl.BlockSpec((None, rows, 1), row_map),
            ]
            + [any_spec] * len(page_leaves),
            scratch_shapes=[pltpu.VMEM((2, page_size, *x.shape[2:]), x.dtype) for x in page_leaves]
            + [
                pltpu.SemaphoreType.DMA((3, len(page_leaves))),  # [read slot 0 | 1 | write, leaf]
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((parts, rows, part_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q_tiles.shape, out_dtype),
            jax.ShapeDtypeStruct((num_tiles, rows, 1), jnp.float32),
        ]
        + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in page_leaves],
        input_output_aliases={
            num_prefetch + first_page_operand + n: 2 + n for n in range(len(page_leaves))
        },
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        name="kvfold_ragged_paged_attention"
        if fmt is kv_formats.PLAIN
        else "kvfold_ragged_paged_attention_" + fmt.label,
    )(block_tables, cu_q_lens, kv_lens, tile_seq, tile_start, tile_len, tile_lo, *operands)
    k_pages = _with_leaves(fmt, k_pages, page_leaves[:num_leaves])
    v_pages = _with_leaves(fmt, v_pages, page_leaves[num_leaves:])

    # Un-tile: token t of sequence s is row (t - cu[s]) % block_q of tile
    # tile_first[s] + (t - cu[s]) // block_q. Padding tokens get out 0, lse -inf.
    padding = seq_tok == num_seqs
    seq = jnp.minimum(seq_tok, num_seqs - 1)
    offset = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    tile, row = tile_first[seq] + offset // block_q, offset % block_q
    tile = jnp.clip(tile, 0, num_tiles - 1)
    out = jnp.moveaxis(out[tile, :, :, row], 1, 0)  # [parts, T, Hq, part_dim]
    out = fmt.finish_out(v_pages, merge_parts(out))
    lse = lse[:, :, 0].reshape(num_tiles, num_q_heads, block_q)[tile, :, row]
    out = jnp.where(padding[:, None, None], 0, out).astype(q.dtype)
    lse = jnp.where(padding[:, None], -jnp.inf, lse)
    return out, lse, k_pages, v_pages
