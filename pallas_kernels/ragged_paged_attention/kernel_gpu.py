"""Ragged paged attention (mixed prefill chunks, decode rows, draft trees) as a Pallas GPU
kernel (Triton lowering), reading float, int8, fp8, nvfp4 and mxfp4 pages.

Plan, then run, as the TPU kernel (tiles.py): each sequence's query tokens are cut in XLA
into tiles of `block_q` tokens of that one sequence, and the new K/V rows are scattered
into their page slots (quantized by the format for low-bit pages) before the kernel runs,
so the kernel only reads pages. Grid (tile, kv_head): a program holds the query rows of
its KV head's group for its tile, head-major (row g * block_q + i is query head
kv_head * group + g, token i of the tile), padded to a power of two >= 16 rows (the
smallest Triton dot), and walks the pages the tile can see (clamped below by the
sliding window and above by its last token) with a fori_loop, loading one page of its KV
head at a time through the block table and decoding it with the format's `tile` right
before the dot: codes times the per-token scale for int8 / fp8; for nvfp4 / mxfp4 the
E2M1 nibbles times their block scales, one channel part (the low or the high nibbles)
at a time, as the TPU kernel does: the query is split into the same parts outside the
kernel, scores add over parts and each part keeps its own accumulator.

Draft trees: the rows' ancestor bits ride along as a [rows, words] block (words padded
to a power of two with zero words, which change nothing: tiles.visible), the region start
and, with a sliding window, each row's logical position as per-tile / per-row inputs.

Not covered (the entry sends these to the XLA path on GPU): page sizes or channel parts
that are not powers of two >= 16, and TurboQuant pages (their tile decode gathers code
bytes with small 0/1 matmuls, below Triton's smallest dot).

For decode-only steps (one token per sequence, no tree, float pages) the entry keeps
using the paged decode kernel (`ragged_decode_gpu`), whose programs hold a KV head's
query heads for one sequence instead of a block_q tile mostly made of padding rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import online_softmax, tree_mask
from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.paged_attention.kernel_gpu import MIN_DOT, gpu_supported, paged_attention_gpu
from pallas_kernels.paged_attention.kv_formats import merge_parts, split_parts
from pallas_kernels.ragged_paged_attention.ref import token_layout, write_new_kv
from pallas_kernels.ragged_paged_attention.tiles import lowest_seen, plan_tiles, visible
from pallas_kernels.variant import AttentionVariant

_POW2 = lambda n: 1 << max(n - 1, 0).bit_length()


def ragged_supported(page_size: int, head_dim: int, kv_format) -> bool:
    """Whether the Triton ragged kernel takes a step: float, int8, fp8, nvfp4 or mxfp4
    pages, and power-of-two tiles >= 16 (a channel part of head_dim for the fp4 formats)."""
    if kv_format is None:
        return gpu_supported(page_size, head_dim)
    if not isinstance(kv_format, (kv_formats.Rows, kv_formats.BlockFP4)):
        return False
    return head_dim % kv_format.parts == 0 and gpu_supported(page_size, head_dim // kv_format.parts)


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


def _kernel(q_first_ref, length_ref, lo_ref, region_ref, table_ref, q_ref, *refs, kv_format,
            num_leaves, block_q, group, variant, sm_scale, sliding_window, has_tree, has_sinks):
    refs = list(refs)

    def take(n):
        taken = refs[:n]
        del refs[:n]
        return taken

    bits_ref = take(1)[0] if has_tree else None
    logical_ref = take(1)[0] if has_tree and sliding_window is not None else None
    sinks_ref = take(1)[0] if has_sinks else None
    k_leaves, v_leaves = take(num_leaves), take(num_leaves)
    out_ref, lse_ref = refs

    kv_head = pl.program_id(1)
    rows, part_dim = q_ref.shape[1:]
    num_pages, page_size = k_leaves[0].shape[:2]
    q_first, length = q_first_ref[0], length_ref[0]
    last = jnp.maximum(q_first + length - 1, 0) // page_size
    first = jnp.minimum(jnp.maximum(lo_ref[0], 0) // page_size, last)
    last = jnp.where(length > 0, last, first - 1)
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    q_row = row % block_q
    q_pos = q_first + q_row
    q_head = kv_head * group + row // block_q
    live = (q_row < length) & (row < group * block_q)
    if has_tree:
        columns = [bits_ref[:, pl.ds(w, 1)] for w in range(bits_ref.shape[1])]
        logical = None if logical_ref is None else logical_ref[...]
        tree = (region_ref[0], columns, logical)
    else:
        tree = (None, None, None)
    prec = online_softmax.dot_precision(q_ref.dtype)
    parts = q_ref.shape[0]
    qs = [q_ref[part] for part in range(parts)]  # [rows, part_dim] each

    def page_tile(leaves, page, part):
        get = lambda n: leaves[n][page]
        return kv_format.tile(get, part, (), expand=kv_formats.repeat_blocks).astype(q_ref.dtype)

    def body(i, carry):
        m, l, accs = carry
        page = jnp.clip(table_ref[i], 0, num_pages - 1)
        s = sum(lax.dot_general(qs[part], page_tile(k_leaves, page, part), (((1,), (1,)), ((), ())),
                                precision=prec, preferred_element_type=jnp.float32)
                for part in range(parts)) * sm_scale
        kv_pos = i * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        s = variant.transform(s, q_pos, kv_pos, q_head)
        mask = visible(q_pos, kv_pos, sliding_window, *tree) & live
        m, l, alpha, p = online_softmax.update(variant, m, l, s, mask)
        accs = tuple(alpha * acc + lax.dot_general(
            p.astype(q_ref.dtype), page_tile(v_leaves, page, part), (((1,), (0,)), ((), ())),
            precision=prec, preferred_element_type=jnp.float32) for part, acc in enumerate(accs))
        return m, l, accs

    m0, l0, acc0 = online_softmax.init_state(rows, part_dim)
    m, l, accs = lax.fori_loop(first, last + 1, body, (m0, l0, (acc0,) * parts))
    sinks = None if sinks_ref is None else sinks_ref[...]
    for part, acc in enumerate(accs):
        out, lse = online_softmax.finalize(variant, m, l, acc, sinks)
        out_ref[part] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def _per_token_leaf(x):
    """A per-(token, head) leaf [P, ps, Hkv] as [P, ps, Hkv, 1], so a page of one head
    loads as a [ps, 1] column, the Getter contract (kv_formats)."""
    return x[..., None] if x.ndim == 3 else x


def ragged_paged_attention_gpu(
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
    block_q: int = 16,
    interpret=False,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """Shapes as pallas_kernels.ragged_paged_attention; requires ragged_supported.
    block_q: query tokens per tile (a power of two). Returns (out, lse, k_pages, v_pages)."""
    fmt = kv_formats.PLAIN if kv_format is None else kv_format
    num_tokens, num_q_heads, head_dim = q.shape
    k_leaves = fmt.leaves(k_pages)
    num_kv_heads = k_leaves[0].shape[2]
    num_seqs, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    rows = max(MIN_DOT, _POW2(group * block_q))

    seq_tok, pos_tok = token_layout(cu_q_lens, kv_lens, num_tokens)
    k_pages, v_pages = write_new_kv(k_pages, v_pages, k, v, block_tables, seq_tok, pos_tok, kv_format)
    tile_seq, tile_start, tile_len, tile_first = plan_tiles(cu_q_lens, num_tokens, block_q)
    num_tiles = tile_seq.shape[0]
    seq_c = jnp.maximum(tile_seq, 0)
    q_first = kv_lens[seq_c] - (cu_q_lens[seq_c + 1] - cu_q_lens[seq_c]) + tile_start
    tok = cu_q_lens[seq_c][:, None] + tile_start[:, None] + jnp.arange(block_q)[None, :]
    tok = jnp.clip(tok, 0, num_tokens - 1)  # [tile, block_q]: each row's token

    def head_rows(x, fill=0):
        """Per (token, q head) x [T, Hq, n] -> [tile, Hkv, rows, n], head-major rows."""
        x = x[tok].reshape(num_tiles, block_q, num_kv_heads, group, x.shape[-1])
        x = x.transpose(0, 2, 3, 1, 4).reshape(num_tiles, num_kv_heads, group * block_q, -1)
        return jnp.pad(x, ((0, 0), (0, 0), (0, rows - group * block_q), (0, 0)),
                       constant_values=fill)

    def tile_rows(x):
        """Per-token x [T, n] -> the same rows for every q head: [tile, Hkv, rows, n]."""
        return head_rows(jnp.broadcast_to(x[:, None], (num_tokens, num_q_heads, x.shape[-1])))

    parts = fmt.parts
    part_dim = head_dim // parts
    parts_block = pl.BlockSpec((None, None, parts, rows, part_dim), lambda j, h: (j, h, 0, 0, 0))
    scalar = pl.BlockSpec((1,), lambda j, h: (j,))
    row_block = lambda n: pl.BlockSpec((None, None, rows, n), lambda j, h: (j, h, 0, 0))
    operands = [q_first, tile_len]
    in_specs = [scalar, scalar]
    logical = tree_mask.logical_positions(tree, seq_tok, pos_tok)
    region_start = None
    region = jnp.zeros((num_tiles,), jnp.int32)
    if tree is not None:
        region_start = tree.start[jnp.minimum(seq_tok, num_seqs - 1)]
        region = tree.start[seq_c]
    # the query in the format's basis, split into its channel parts: [tile, Hkv, parts, rows, D / parts]
    q_parts = jnp.stack([head_rows(x) for x in split_parts(fmt.prepare_q(k_pages, q), parts)], axis=2)
    operands += [lowest_seen(tok, tile_len, pos_tok, logical, region_start, sliding_window), region,
                 block_tables[seq_c], q_parts]
    in_specs += [scalar, scalar, pl.BlockSpec((None, max_pages), lambda j, h: (j, 0)), parts_block]
    if tree is not None:
        words = tree.bits.shape[1]
        bits = jnp.pad(tree.bits, ((0, 0), (0, _POW2(words) - words)))
        operands.append(tile_rows(bits))
        in_specs.append(row_block(bits.shape[1]))
        if sliding_window is not None:
            operands.append(tile_rows(logical[:, None]))
            in_specs.append(row_block(1))
    if sinks is not None:  # [Hkv, rows, 1]: row g * block_q + i holds head kv * group + g's sink
        sink_rows = jnp.repeat(sinks.astype(jnp.float32).reshape(num_kv_heads, group), block_q, axis=1)
        sink_rows = jnp.pad(sink_rows, ((0, 0), (0, rows - group * block_q)), constant_values=-jnp.inf)
        operands.append(sink_rows[..., None])
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda j, h: (h, 0, 0)))
    for pages in (k_pages, v_pages):
        for leaf in fmt.leaves(pages):
            leaf = _per_token_leaf(leaf)
            operands.append(leaf)
            in_specs.append(pl.BlockSpec((leaf.shape[0], leaf.shape[1], None, leaf.shape[3]),
                                         lambda j, h: (0, 0, h, 0)))
    kernel = functools.partial(
        _kernel, kv_format=fmt, num_leaves=len(k_leaves), block_q=block_q, group=group,
        variant=variant, sm_scale=sm_scale, sliding_window=sliding_window,
        has_tree=tree is not None, has_sinks=sinks is not None)
    out_dtype = q.dtype if fmt is kv_formats.PLAIN else jnp.float32
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=in_specs,
        out_specs=[parts_block, row_block(1)],
        out_shape=[jax.ShapeDtypeStruct((num_tiles, num_kv_heads, parts, rows, part_dim), out_dtype),
                   jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, 1), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kvfold_ragged_paged_attention_gpu" if fmt is kv_formats.PLAIN
        else "kvfold_ragged_paged_attention_gpu_" + fmt.label,
    )(*operands)

    # Un-tile: token t of sequence s is row i = (t - cu[s]) % block_q of tile
    # tile_first[s] + (t - cu[s]) // block_q, rows g * block_q + i of every KV head.
    padding = seq_tok == num_seqs
    seq = jnp.minimum(seq_tok, num_seqs - 1)
    offset = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    tile = jnp.clip(tile_first[seq] + offset // block_q, 0, num_tiles - 1)
    i = offset % block_q

    def untile(x):
        x = x[:, :, : group * block_q].reshape(num_tiles, num_kv_heads, group, block_q, -1)
        return x[tile, :, :, i].reshape(num_tokens, num_q_heads, -1)

    out = fmt.finish_out(v_pages, merge_parts(jnp.stack([untile(out[:, :, part]) for part in range(parts)])))
    lse = untile(lse)[..., 0]
    out = jnp.where(padding[:, None, None], 0, out).astype(q.dtype)
    lse = jnp.where(padding[:, None], -jnp.inf, lse)
    return out, lse, k_pages, v_pages
