"""ragged_paged_attention: mixed prefill + decode batch with the fused KV write."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from model import kv_formats
from pallas_kernels import AttentionVariant, ragged_paged_attention, validate
from pallas_kernels.paged_attention import kv_formats as pk_formats
from pallas_kernels.ragged_paged_attention import TreeMask, pack_mask
from pallas_kernels.tree_mask import ancestor_mask
from pallas_kernels.ragged_paged_attention.kernel_gpu import ragged_paged_attention_gpu
from pallas_kernels.lowering import TRITON_CALL, export_cuda, export_tpu
from tests.pallas_kernels.helpers import assert_close, dense_attention_f64, spec

PAGE_SIZE = 8
# (q_len, kv_len after the step): a decode row; a chunk continuing a 7-token prefix
# across the page boundary at 8; a fresh 6-token prefill; a decode row opening page 3.
SEQS = [(1, 9), (5, 12), (6, 6), (1, 17)]
NUM_PADDING = 2


def _mixed_batch(seed, *, num_q_heads=4, num_kv_heads=2, head_dim=64, max_pages=3):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = (np.array(x, np.int32) for x in zip(*SEQS))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    used = -(-kv_lens // PAGE_SIZE)
    num_pages = int(used.sum()) + 3  # three pages nobody owns
    perm = rng.permutation(num_pages)
    table = np.full((len(SEQS), max_pages), 10**6, np.int32)  # garbage past the last page
    start = 0
    for s, n in enumerate(used):
        table[s, :n] = perm[start : start + n]
        start += n
    t = int(cu[-1]) + NUM_PADDING
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, k, v = (
        f32(t, num_q_heads, head_dim),
        f32(t, num_kv_heads, head_dim),
        f32(t, num_kv_heads, head_dim),
    )
    k_pages = f32(num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    v_pages = f32(num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    sinks = f32(num_q_heads) + 1.0
    return (
        q,
        k,
        v,
        k_pages,
        v_pages,
        jnp.asarray(table),
        jnp.asarray(cu),
        jnp.asarray(kv_lens),
    ), sinks


def _numpy_scatter(args):
    """Pages after the step, by a plain loop; also each token's (seq, position)."""
    q, k, v, k_pages, v_pages, table, cu, kv_lens = (np.asarray(x) for x in args)
    k_pages, v_pages = k_pages.astype(np.float64), v_pages.astype(np.float64)
    tokens = []
    for s in range(len(kv_lens)):
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            t, pos = cu[s] + i, kv_lens[s] - q_len + i
            page, slot = table[s, pos // PAGE_SIZE], pos % PAGE_SIZE
            k_pages[page, slot], v_pages[page, slot] = k[t], v[t]
            tokens.append((t, s, pos))
    return k_pages, v_pages, tokens


def _assert_pages(got_k, got_v, args):
    want_k, want_v, _ = _numpy_scatter(args)
    np.testing.assert_array_equal(np.asarray(got_k), want_k.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(got_v), want_v.astype(np.float32))
    table = np.asarray(args[5])
    owned = {int(p) for p in table.ravel() if p < want_k.shape[0]}
    untouched = [p for p in range(want_k.shape[0]) if p not in owned]
    assert untouched  # pages outside every table keep their contents
    np.testing.assert_array_equal(np.asarray(got_k)[untouched], np.asarray(args[3])[untouched])


@pytest.mark.parametrize("window,cap,with_sinks", [(None, None, False), (4, 5.0, True)])
def test_ref_matches_float64_and_numpy_scatter(window, cap, with_sinks):
    args, sinks = _mixed_batch(0)
    sinks = sinks if with_sinks else None
    out, lse, k_pages, v_pages = ragged_paged_attention(
        *args, sliding_window=window, soft_cap=cap, sinks=sinks
    )  # CPU: the XLA reference
    _assert_pages(k_pages, v_pages, args)
    k64, v64, tokens = _numpy_scatter(args)
    table, d = np.asarray(args[5]), args[0].shape[-1]
    fn = (lambda s: cap * np.tanh(s / cap)) if cap else None
    for t, s, pos in tokens:
        rows = np.arange(pos + 1)
        kr = k64[table[s, rows // PAGE_SIZE], rows % PAGE_SIZE]
        vr = v64[table[s, rows // PAGE_SIZE], rows % PAGE_SIZE]
        mask = rows > pos - window if window else np.ones(pos + 1, bool)
        o64, lse64 = dense_attention_f64(args[0][t], kr, vr, mask, d**-0.5, sinks, fn)
        assert_close(out[t], o64)
        assert_close(lse[t], lse64)
    pad = slice(len(tokens), None)  # padding tokens: out 0, lse -inf
    np.testing.assert_array_equal(np.asarray(out)[pad], 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[pad]))


def test_kernel_matches_ref():
    args, _ = _mixed_batch(1)
    want = ragged_paged_attention(*args)
    got = ragged_paged_attention(*args, interpret=True)
    for g, w in zip(got, want):
        assert_close(g, w)
    _assert_pages(got[2], got[3], args)


def test_kernel_window_sinks_functor_gqa_under_tpu_interpret_checks():
    """GQA 8:1, sliding window, sinks, soft-cap then a position/head-dependent functor;
    NaN-filled scratch and out-of-bounds reads raising."""
    args, sinks = _mixed_batch(2, num_q_heads=8, num_kv_heads=1, head_dim=128)
    var = AttentionVariant(logits_fn=lambda s, qp, kp, h: s + 0.1 * h - 0.05 * jnp.abs(qp - kp))
    kw = dict(sliding_window=5, soft_cap=4.0, sinks=sinks, variant=var)
    want = ragged_paged_attention(*args, **kw)
    plain = ragged_paged_attention(*args, sliding_window=5, soft_cap=4.0, sinks=sinks)
    assert not np.allclose(want[0], plain[0])  # the functor did something
    # DMAs run at their wait (default) or at their start (eager): either way the page
    # prefetched into the other buffer slot is the one the next step attends
    for dma in ("on_wait", "eager"):
        params = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise",
                                       dma_execution_mode=dma)
        got = ragged_paged_attention(*args, interpret=params, **kw)
        for g, w in zip(got, want):
            assert_close(g, w)


def test_validation_errors():
    args, sinks = _mixed_batch(3)
    q, k, v, kp, vp, bt, cu, kl = args
    with pytest.raises(ValueError, match="cu_q_lens must have shape"):
        ragged_paged_attention(q, k, v, kp, vp, bt, cu[:-1], kl)
    with pytest.raises(ValueError, match="k must have shape"):
        ragged_paged_attention(q, k[:-1], v, kp, vp, bt, cu, kl)
    with pytest.raises(ValueError, match="v_pages must have dtype"):
        ragged_paged_attention(q, k, v, kp, vp.astype(jnp.bfloat16), bt, cu, kl)
    with pytest.raises(ValueError, match="kv_lens must have dtype"):
        ragged_paged_attention(q, k, v, kp, vp, bt, cu, kl.astype(jnp.float32))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention(q[:, :3], k, v, kp, vp, bt, cu, kl)
    with pytest.raises(ValueError, match="sinks must have shape"):
        ragged_paged_attention(*args, sinks=sinks[:2])
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = -1 is not a page"):
        ragged_paged_attention(q, k, v, kp, vp, bt.at[1, 1].set(-1), cu, kl)


def test_reference_drops_writes_through_bad_block_table_entries():
    """Inside jit nothing checks values: a -1 entry must not wrap to the last page."""
    args, _ = _mixed_batch(5)
    q, k, v, kp, vp, bt, cu, kl = args
    bad = bt.at[1, 1].set(-1)  # sequence 1 writes positions 7..11, page 1 holds 8..11
    run = jax.jit(lambda *a: ragged_paged_attention(*a, interpret=None))
    _, _, k_new, v_new = run(q, k, v, kp, vp, bad, cu, kl)
    _, _, k_ok, _ = run(q, k, v, kp, vp, bt, cu, kl)
    lost = int(bt[1, 1])
    untouched = np.ones(kp.shape[0], bool)
    untouched[lost] = False
    np.testing.assert_array_equal(np.asarray(k_new)[untouched], np.asarray(k_ok)[untouched])
    np.testing.assert_array_equal(np.asarray(v_new)[lost], np.asarray(vp)[lost])  # not written


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu_and_cuda(dtype):
    """Mosaic on TPU; on CUDA the Triton ragged kernel where its tiles fit (page 16) and
    the XLA path where they do not (page 8 is below Triton's smallest dot)."""
    for page_size in (PAGE_SIZE, GPU_PAGE):
        args, sinks = _gpu_batch(4) if page_size == GPU_PAGE else _mixed_batch(4)
        specs = [spec(x.astype(dtype)) for x in args[:5]] + [spec(x) for x in args[5:]]
        fn = lambda *a: ragged_paged_attention(*a[:8], sinks=a[8], sliding_window=4, soft_cap=30.0)
        assert "tpu_custom_call" in export_tpu(fn, *specs, spec(sinks))
        triton = TRITON_CALL in export_cuda(fn, *specs, spec(sinks))
        assert triton == (page_size == GPU_PAGE)


# The Triton kernel's tiles: page_size and head_dim powers of two >= 16.
GPU_PAGE = 16
# (q_len, kv_len after the step): decode; a 20-token chunk over a 20-token prefix crossing
# two page boundaries (two query tiles of 16); a fresh prefill; decode opening page 3.
GPU_SEQS = [(1, 9), (20, 40), (6, 6), (1, 33)]


def _gpu_batch(seed, *, num_q_heads=6, num_kv_heads=2, head_dim=32):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = (np.array(x, np.int32) for x in zip(*GPU_SEQS))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_pages = 14  # 9 used, 5 nobody owns
    table = rng.permutation(num_pages)[:12].reshape(4, 3).astype(np.int32)
    t = int(cu[-1]) + NUM_PADDING
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    args = (f32(t, num_q_heads, head_dim), f32(t, num_kv_heads, head_dim), f32(t, num_kv_heads, head_dim),
            f32(num_pages, GPU_PAGE, num_kv_heads, head_dim), f32(num_pages, GPU_PAGE, num_kv_heads, head_dim),
            jnp.asarray(table), jnp.asarray(cu), jnp.asarray(kv_lens))
    return args, f32(num_q_heads) + 1.0


def _gpu_kernel(*args, sinks=None, tree=None, sliding_window=None, soft_cap=None, variant=None,
                kv_format=None, block_q=16):
    head_dim, num_q_heads = args[0].shape[-1], args[0].shape[1]
    opts = validate.attention_options(head_dim, num_q_heads, None, soft_cap, sinks, variant)
    fmt = None if kv_format is None else pk_formats.resolve(kv_format)
    return ragged_paged_attention_gpu(*args, sinks, tree, sliding_window=sliding_window, kv_format=fmt,
                                      block_q=block_q, interpret=True, **opts)


@pytest.mark.parametrize("block_q,window,cap,with_sinks", [(16, None, None, False), (4, 5, 3.0, True)])
def test_gpu_kernel_matches_ref(block_q, window, cap, with_sinks):
    """The Triton ragged kernel (interpreted): outputs, lse and pages equal the reference
    for a mixed step, with query tiles smaller than a chunk (4) or as large as it can be (16),
    GQA 3:1 padded to the smallest dot, window, soft-cap and sinks."""
    args, sinks = _gpu_batch(10)
    kw = dict(sliding_window=window, soft_cap=cap, sinks=sinks if with_sinks else None)
    want = _ref(*args, **kw)
    got = _gpu_kernel(*args, block_q=block_q, **kw)
    for g, w in zip(got, want):
        assert_close(g, w)


@pytest.mark.parametrize("fmt_name", ["int8", "fp8", "nvfp4", "mxfp4"])
def test_gpu_kernel_reads_low_bit_pages(fmt_name):
    """int8 / fp8 rows, and nvfp4 / mxfp4 read one nibble part at a time (scales
    repeated by reshape, not by the TPU's 0/1 matmul): the reference's outputs and pages."""
    args, _ = _gpu_batch(11)
    q, k, v, kp, vp, table, cu, kl = args
    fmt = pk_formats.resolve(fmt_name)
    low = (q, k, v, fmt.quantize(kp), fmt.quantize(vp), table, cu, kl)
    want = _ref(*low, kv_format=fmt_name)
    got = _gpu_kernel(*low, kv_format=fmt_name)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 7])
def test_gpu_kernel_tree_rows(window):
    """A 6-node draft tree at slots 20..25 beside a chunk and a decode row: the kernel's
    ancestor bits and logical windows equal the reference."""
    args, tree, _, _ = _tree_batch(12, page_size=GPU_PAGE, root=20, decode_len=40)
    want = _ref(*args, tree=tree, sliding_window=window)
    got = _gpu_kernel(*args, tree=tree, sliding_window=window, block_q=8)
    for g, w in zip(got, want):
        assert_close(g, w)


def _ref(*args, **kw):
    """The dense reference (no max_q_len: the XLA path defers to it)."""
    return ragged_paged_attention(*args, **kw)


@pytest.mark.parametrize("max_q_len,max_chunks,window,with_sinks",
                         [(6, 2, None, False), (8, None, 4, True), (64, 2, 3, False)])
def test_blocked_xla_path_matches_the_reference(max_q_len, max_chunks, window, with_sinks):
    """Query tiles of one sequence and a page-block scan give the dense reference's
    outputs, lse and pages, for tiles smaller than, equal to and larger than a chunk,
    with decode rows in tiles of their own and the chunk tiles bounded by max_chunks."""
    args, sinks = _mixed_batch(6, max_pages=5)
    kw = dict(sliding_window=window, sinks=sinks if with_sinks else None)
    want = _ref(*args, **kw)
    got = ragged_paged_attention(*args, max_q_len=max_q_len, max_chunks=max_chunks, **kw)
    for g, w in zip(got, want):
        assert_close(g, w)
    _assert_pages(got[2], got[3], args)


def test_blocked_xla_path_walks_only_the_blocks_its_queries_see():
    """A block table 40 pages wide whose entries past the first block of 8 pages (64
    positions; the longest sequence holds 17) name a page of NaNs: the serving path never
    reads it (outputs and pages as the dense reference's over the 3-page tables), while
    the differentiable walk over every block does (0 * NaN), so the stop is what keeps it out."""
    from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

    args, _ = _mixed_batch(7, max_pages=3)
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    nan = lambda pages: jnp.concatenate([jnp.full_like(pages[:1], jnp.nan), pages])  # page 0: NaN
    wide = np.zeros((table.shape[0], 40), np.int32)  # past the first block: the NaN page
    wide[:, :3] = np.asarray(table) + 1
    wide[:, 3:8] = 10**6  # inside the first block: garbage, clamped to a finite page and masked
    wide_args = (q, k, v, nan(k_pages), nan(v_pages), jnp.asarray(wide), cu, kv_lens)
    want = _ref(*args)
    got = ragged_paged_attention(*wide_args, max_q_len=8, max_chunks=2)
    for g, w in zip(got[:2], want[:2]):
        assert_close(g, w)
    for g, w in zip(got[2:], want[2:]):
        np.testing.assert_array_equal(np.asarray(g)[1:], np.asarray(w))
    every_block = ragged_paged_attention_xla(*wide_args, sm_scale=q.shape[-1] ** -0.5, max_q_len=8, max_chunks=2,
                                             differentiable=True)
    assert np.isnan(np.asarray(every_block[0])).any()


def _tree_batch(seed, page_size=PAGE_SIZE, root=9, decode_len=20):
    """Sequence 0 verifies a branching 6-node tree rooted at position `root` (slots 9..14
    by default); sequence 1 is a plain 5-token chunk; sequence 2 a decode row at
    `decode_len`; one padding token; three pages of `page_size` per sequence."""
    rng = np.random.default_rng(seed)
    parents = [-1, 0, 0, 1, 1, 2]  # node 3 and 4 under 1, node 5 under 2
    anc = ancestor_mask(parents)
    q_lens, kv_lens = np.array([6, 5, 1], np.int32), np.array([root + 6, 12, decode_len], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t, num_pages, hq, hkv, d = int(cu[-1]) + 1, 12, 4, 2, 32
    table = rng.permutation(num_pages)[:9].reshape(3, 3).astype(np.int32)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    args = (f32(t, hq, d), f32(t, hkv, d), f32(t, hkv, d), f32(num_pages, page_size, hkv, d),
            f32(num_pages, page_size, hkv, d), jnp.asarray(table), jnp.asarray(cu),
            jnp.asarray(kv_lens))
    mask = np.zeros((t, 6), bool)
    mask[:6] = anc
    start = jnp.asarray([root, 12, decode_len], jnp.int32)  # no region for the others: start = kv_len
    tree = TreeMask(start, pack_mask(jnp.asarray(mask)))
    depth = anc.sum(1) - 1
    return args, tree, anc, depth


@pytest.mark.parametrize("window", [None, 7])
def test_tree_rows_see_their_prefix_and_their_ancestors(window):
    """A verify row attends to the accepted prefix (window counted from its RoPE
    position, 9 + depth) and to its ancestors only; other rows stay causal. Checked
    against float64 attention over exactly those positions, for the reference and the
    blocked XLA path."""
    args, tree, anc, depth = _tree_batch(7)
    want = _ref(*args, tree=tree, sliding_window=window)
    got = ragged_paged_attention(*args, tree=tree, sliding_window=window, max_q_len=8)
    for g, w in zip(got, want):
        assert_close(g, w)
    k64, v64, tokens = _numpy_scatter(args)
    table, d = np.asarray(args[5]), args[0].shape[-1]
    for t, s, pos in tokens:
        if s == 0:  # node t: prefix 0..8, then its ancestors among slots 9..14
            logical = 9 + depth[t]
            rows = np.concatenate([np.arange(9), 9 + np.flatnonzero(anc[t])])
            mask = (rows >= 9) | (rows > logical - window) if window else np.ones(len(rows), bool)
        else:
            rows = np.arange(pos + 1)
            mask = rows > pos - window if window else np.ones(len(rows), bool)
        kr = k64[table[s, rows // PAGE_SIZE], rows % PAGE_SIZE]
        vr = v64[table[s, rows // PAGE_SIZE], rows % PAGE_SIZE]
        o64, _ = dense_attention_f64(args[0][t], kr, vr, mask, d**-0.5, None, None)
        assert_close(want[0][t], o64)


def test_pack_mask_bits():
    mask = np.random.default_rng(0).random((3, 40)) < 0.5
    bits = np.asarray(pack_mask(jnp.asarray(mask))).view(np.uint32)
    assert bits.shape == (3, 2)
    unpacked = (bits[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    np.testing.assert_array_equal(unpacked.reshape(3, 64)[:, :40], mask)
    assert not unpacked.reshape(3, 64)[:, 40:].any()


def _quantized(fmt_name, pages):
    if fmt_name == "turboquant-3.5":
        return kv_formats.turboquant(pages.shape[-1], 3.5)
    return fmt_name


@pytest.mark.parametrize("fmt_name", ["int8", "fp8", "nvfp4", "turboquant-3.5"])
def test_low_bit_pages_are_written_quantized_and_read_as_their_values(fmt_name):
    """The new rows land in the pages as the format's own quantize makes them, and the
    attention equals float attention over the dequantized pages (the new rows
    dequantized too); the blocked XLA path equals the reference."""
    args, _ = _mixed_batch(8, max_pages=5)
    q, k, v, kp, vp, table, cu, kl = args
    fmt_arg = _quantized(fmt_name, kp)
    fmt = pk_formats.resolve(fmt_arg)
    qk, qv = fmt.quantize(kp), fmt.quantize(vp)
    want = _ref(q, k, v, qk, qv, table, cu, kl, kv_format=fmt_arg)
    got = ragged_paged_attention(q, k, v, qk, qv, table, cu, kl, kv_format=fmt_arg, max_q_len=8)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w)
    # float attention over the dequantized pages, with the new rows quantized round trip
    rt = lambda x: fmt.dequantize(fmt.quantize(x)).astype(jnp.float32)
    plain = ragged_paged_attention(q, rt(k), rt(v), fmt.dequantize(qk).astype(jnp.float32),
                                   fmt.dequantize(qv).astype(jnp.float32), table, cu, kl)
    assert_close(want[0], plain[0])
    assert_close(fmt.dequantize(want[2]), plain[2])
    assert_close(fmt.dequantize(want[3]), plain[3])
