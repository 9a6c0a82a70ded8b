"""The CPU kernel of ragged paged attention (pallas_kernels/ragged_paged_attention/
cpu_kernel.cc, through the XLA FFI) against ref.write_new_kv's pages and a float64 oracle
over them, decode rows and prefill chunks (its tiles), and the entry's choice of it: steps
of float32 q (decode rows, chunks, draft-tree nodes) over float32 or
bfloat16 pages, int8 / fp8 row-scaled ones, NVFP4 ones or TurboQuant ones of at most 4
bits a code, nothing else."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_ffi, ragged_paged_attention
from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.ragged_paged_attention import cpu
from pallas_kernels.ragged_paged_attention.ref import ragged_paged_attention_ref, token_layout, write_new_kv
from pallas_kernels.tree_mask import TreeMask, ancestor_mask, pack_mask, visible
from model.kv_formats import turboquant
from quant.blockscaled import nvfp4_quantize
from quant.kv_rows import quantize_rows
from quant.turboquant import TurboQuant, TurboQuantSplit
from tests.pallas_kernels.helpers import assert_close, assert_written_in_place, dense_attention_f64

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel runs on a CPU backend")

PAGE_SIZE = 4


def _decode_batch(seed, kv_lens, *, num_q_heads=6, num_kv_heads=2, head_dim=64, padding=1, width=None, q_lens=None):
    """Decode rows (one token each, or q_lens) over pages in a shuffled pool, tables wider
    than the live pages with garbage past them, and `padding` tokens past the last row."""
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, np.int32)
    used = -(-kv_lens // PAGE_SIZE)
    width = width or int(used.max()) + 2
    num_pages = int(used.sum()) + 2
    perm = rng.permutation(num_pages)
    table = np.full((len(kv_lens), width), -1, np.int32)
    table[:, -1] = 10**6
    start = 0
    for s, n in enumerate(used):
        table[s, :n] = perm[start:start + n]
        start += n
    q_lens = np.ones_like(kv_lens) if q_lens is None else np.asarray(q_lens, np.int32)
    t = int(q_lens.sum()) + padding
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = (f32(t, num_q_heads, head_dim), f32(t, num_kv_heads, head_dim), f32(t, num_kv_heads, head_dim),
            f32(num_pages, PAGE_SIZE, num_kv_heads, head_dim), f32(num_pages, PAGE_SIZE, num_kv_heads, head_dim),
            jnp.asarray(table), cu, jnp.asarray(kv_lens))
    return args, f32(num_q_heads)


def _sees(p, window, tree):
    """bool [p + 1]: which positions token t at position p sees, by tree_mask's docstring
    read as plain rules (start, bits: numpy; none: causal in the window)."""
    j = np.arange(p + 1)
    if tree is None or p < tree[0]:
        return j > (p - window if window else -1)
    start, bits = tree
    ancestor = np.array([(int(bits[o // 32]) >> (o % 32)) & 1 for o in range(32 * len(bits))], bool)
    logical = start - 1 + int(ancestor.sum())
    offset = j - start
    inside = ancestor[np.clip(offset, 0, len(ancestor) - 1)]
    return np.where(offset < 0, j > (logical - window if window else -1),
                    np.where(offset < len(ancestor), inside, True))


def _oracle(q, k_pages, v_pages, table, seq, pos, sm_scale, window=None, cap=None, sinks=None, tree=None):
    """Per token: its sequence's positions gathered from the pages by a plain loop, then
    float64 softmax attention over those it sees (`_sees`; tree: a TreeMask); padding
    tokens out 0, lse -inf."""
    q, k_pages, v_pages, table = (np.asarray(x) for x in (q, k_pages, v_pages, table))
    outs, lses = [], []
    for t, (s, p) in enumerate(zip(np.asarray(seq), np.asarray(pos))):
        if s >= table.shape[0] or p < 0:
            outs.append(np.zeros(q.shape[1:])), lses.append(np.full(q.shape[1], -np.inf))
            continue
        rows = [(table[s, i // PAGE_SIZE], i % PAGE_SIZE) for i in range(p + 1)]
        k = np.stack([k_pages[page, slot] for page, slot in rows])
        v = np.stack([v_pages[page, slot] for page, slot in rows])
        mask = _sees(p, window, None if tree is None else (int(tree.start[s]), np.asarray(tree.bits[t])))
        logits_fn = None if cap is None else (lambda x: cap * np.tanh(x / cap))
        out, lse = dense_attention_f64(q[t], k, v, mask, sm_scale, sinks, logits_fn)
        outs.append(out), lses.append(lse)
    return np.stack(outs), np.stack(lses)


def _bytes(x):
    return np.asarray(x).view(np.uint8)


def _check_kernel(args, sinks, sm_scale, window=None, cap=None, page_dtype=jnp.float32, target=None, tree=None):
    """The kernel against the reference's page writes (equal pages: bfloat16 pages round the
    new rows as XLA's convert does; page_dtype "int8" / "fp8" / "nvfp4": the pages quantized
    as quant.quantize_rows / quant.nvfp4_quantize do, codes and scales byte for byte; a
    TurboQuant or TurboQuantSplit: its own codes, written through XLA) and the oracle's
    attention over them (TurboQuant pages dequantized by the quantizer: its rows in the
    channel basis, where the kernel reads them in the rotated one). target: the FFI name of
    the build to call (its TurboQuant handler's is target + "_turbo"). tree: a TreeMask for
    the kernel and the oracle."""
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    turbo = isinstance(page_dtype, (TurboQuant, TurboQuantSplit))
    fmt = kv_formats.resolve(page_dtype) if isinstance(page_dtype, str) or turbo else None
    call = cpu.decode_attention_turbo_cpu if turbo else cpu.decode_attention_cpu
    target = (cpu.TURBO_TARGET if turbo else cpu.TARGET) if target is None else target + ("_turbo" if turbo else "")
    if fmt is None:
        k_pages, v_pages = k_pages.astype(page_dtype), v_pages.astype(page_dtype)
    else:
        k_pages, v_pages = fmt.quantize(k_pages), fmt.quantize(v_pages)
    args = (q, k, v, k_pages, v_pages, table, cu, kv_lens)
    seq, pos = token_layout(cu, kv_lens, q.shape[0])
    want_k, want_v = write_new_kv(k_pages, v_pages, k, v, table, seq, pos, fmt)
    out, lse, got_k, got_v = call(*args, sinks, sm_scale=sm_scale, sliding_window=window, soft_cap=cap,
                                  kv_format=page_dtype if fmt else None, tree=tree, target=target)
    for got, want in zip(jax.tree.leaves((got_k, got_v)), jax.tree.leaves((want_k, want_v))):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(_bytes(got), _bytes(want))
    # (for TurboQuant pages the step above compares write_new_kv with itself; this checks the writes)
    if fmt is not None:  # each live token's slot holds the quantizer's codes of its row, leaf by leaf
        for new, pages in ((k, got_k), (v, got_v)):
            # the step's rows quantized at once (XLA's rounding of TurboQuant's rotation can
            # move a code by one between a row alone and the same row among many)
            rows = fmt.quantize(new)
            for t, (s, p) in enumerate(zip(np.asarray(seq), np.asarray(pos))):
                if s < table.shape[0] and p >= 0:
                    page, slot = int(table[s, p // PAGE_SIZE]), p % PAGE_SIZE
                    for got, want in zip(jax.tree.leaves(pages), jax.tree.leaves(rows)):
                        np.testing.assert_array_equal(_bytes(got[page, slot]), _bytes(want[t]))
        want_k, want_v = fmt.dequantize(want_k), fmt.dequantize(want_v)
    if tree is not None:  # the oracle's reading of tree_mask's rules is tree_mask.visible's
        seen = np.asarray(visible(tree, seq, pos, jnp.arange(table.shape[1] * PAGE_SIZE)[None], window))
        for t, (s, p) in enumerate(zip(np.asarray(seq), np.asarray(pos))):
            if s < table.shape[0] and p >= 0:
                np.testing.assert_array_equal(_sees(int(p), window, (int(tree.start[s]), np.asarray(tree.bits[t]))),
                                              seen[t, :p + 1])
    want_out, want_lse = _oracle(q, want_k.astype(jnp.float32), want_v.astype(jnp.float32), table, seq, pos,
                                 sm_scale, window, cap, sinks, tree)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-5, atol=2e-5)


PAGES = [jnp.float32, jnp.bfloat16, "int8", "fp8", "nvfp4"]
PAGE_IDS = ["f32", "bf16", "int8", "fp8", "nvfp4"]
# TurboQuant pages for head_dim 64: the KV cache's turboquant-3.5 and -2.5 (outlier and
# regular halves of 4 + 3 and 3 + 2 bits, one sparse channel each), and a plain 4-bit one.
TURBO = [turboquant(64, 3.5), turboquant(64, 2.5), TurboQuant(64, 4)]
TURBO_IDS = ["tq3.5", "tq2.5", "tq4"]


@dataclasses.dataclass(frozen=True)
class Build:
    """A build of the kernel registered under its own FFI name: `target` (its TurboQuant
    handler's is target + "_turbo") and the loaded library, for its counters."""

    target: str
    library: ctypes.CDLL


# The builds the tests run: this CPU's (-march=native), and two without AVX-512 whose tiles
# take the compiler's portable vectors, 4 lanes wide (SSE) and 8 (AVX2).
BUILDS = ["native", "x86-64-v2", "x86-64-v3"]
V3_FLAGS = {"abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}  # what x86-64-v3 code may use


@functools.cache
def _portable(march: str) -> Build:
    target = f"kvfold_decode_attention_{march.replace('-', '_')}"
    flags = cpu_ffi.flags_for(march)
    library = cpu_ffi.register(cpu_ffi.build(cpu.SOURCE, f"the {march} CPU decode-attention kernel", flags=flags),
                               target, cpu.KERNEL.symbol)
    (_, turbo_symbol), = cpu.KERNEL.others
    cpu_ffi.register_handler(library, target + "_turbo", turbo_symbol)
    return Build(target, library)


def _build(name: str) -> Build:
    """One of BUILDS: the native kernel, or one built for an x86-64 level without AVX-512
    (skipped on other hosts, and x86-64-v3 on a CPU that lacks what it may use)."""
    if name == "native":
        return Build(cpu.TARGET, cpu.KERNEL.library)
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the portable builds target x86-64 levels")
    if name == "x86-64-v3" and not V3_FLAGS <= set(cpu_ffi.cpu_flags()):
        pytest.skip("this CPU cannot run x86-64-v3 code")
    return _portable(name)


@pytest.mark.parametrize("page_dtype", PAGES + [turboquant(32, 3.5), TurboQuant(32, 2)],
                         ids=PAGE_IDS + ["tq3.5", "tq2"])
@pytest.mark.parametrize("build", BUILDS[1:])
def test_portable_builds_match_the_float64_oracle(build, page_dtype):
    """What a CPU without AVX-512 runs: every page format, a run split in two, sinks."""
    args, sinks = _decode_batch(13, [1, 9, 70], num_q_heads=6, num_kv_heads=2, head_dim=32)
    _check_kernel(args, sinks, 32 ** -0.5, page_dtype=page_dtype, target=_build(build).target)


def test_the_kernel_builds_here():
    """CI installs a C++ compiler (Makefile setup): a silent fallback to the XLA path would
    hide a broken build."""
    assert cpu.available()


@pytest.mark.parametrize("heads,head_dim,page_dtype", [
    *(pytest.param((6, 2), 64, p, id=f"gqa-64-{i}") for p, i in zip(PAGES + TURBO, PAGE_IDS + TURBO_IDS)),
    *(pytest.param((3, 3), 40, p, id=f"mha-40-{i}") for p, i in zip(PAGES, PAGE_IDS) if p != "nvfp4"),
    pytest.param((4, 2), 272, "nvfp4", id="gqa-272-nvfp4")])
@pytest.mark.parametrize("window,cap,with_sinks", [(None, None, False), (5, None, True), (None, 2.0, False)])
def test_kernel_matches_the_float64_oracle(window, cap, with_sinks, heads, head_dim, page_dtype):
    """Contexts of one position, a partial page, whole pages and several pages; GQA groups
    of 3 and plain multi-head; a head_dim that is not a multiple of the kernel's 16 lanes;
    sliding window, soft cap, sinks; a padding token; float32 and bfloat16 pages, and int8
    and fp8 codes with a scale per position and head, NVFP4 codes with a scale per 16, and
    TurboQuant codes (whose head_dim must be a multiple of 16, so they have no mha-40
    case); NVFP4 rows of head_dim 272, past what the AVX-512 paths read, which every build
    decodes through decode_row."""
    args, sinks = _decode_batch(1, [1, 6, 8, 13], num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim)
    _check_kernel(args, sinks if with_sinks else None, head_dim ** -0.5, window, cap, page_dtype)


@pytest.mark.parametrize("page_dtype", PAGES + TURBO[:1], ids=PAGE_IDS + TURBO_IDS[:1])
def test_tokens_of_one_row_each_see_their_own_causal_prefix(page_dtype):
    """Rows of several query tokens (the kernel lays tokens out as ref.token_layout does):
    all of a step's rows are written before any token attends, and token i of a row of q
    tokens sits at kv_len - q + i."""
    args, _ = _decode_batch(8, [5, 9, 4], q_lens=[2, 3, 1], padding=2)
    _check_kernel(args, None, 0.125, page_dtype=page_dtype)


def _count(name: str, library=None) -> int:
    """One of the kernel's counters so far in this process (its KvfoldDecodeAttention<name>),
    of the native build or of `library`."""
    counter = getattr(library or cpu.KERNEL.library, f"KvfoldDecodeAttention{name}")
    counter.restype = ctypes.c_int64
    return counter()


@pytest.mark.parametrize("page_dtype", PAGES + TURBO, ids=PAGE_IDS + TURBO_IDS)
@pytest.mark.parametrize("window,cap,with_sinks", [(None, None, False), (5, 2.0, True)])
def test_prefill_chunks_cut_into_tiles_match_the_oracle(window, cap, with_sinks, page_dtype):
    """A mixed step: a chunk of 37 tokens after a 30-position prefix (tiles of 16, 16 and 5
    tokens, the last cut first), one of 8 from position 0 (kTileMin: one tile), a sequence
    with no token this step, one of 7 (below kTileMin: a run per token) and a decode row.
    Every tile token sees its own causal prefix, in a sliding window of 5 narrower than a
    tile too; the kernel counts the four tiles."""
    args, sinks = _decode_batch(21, [67, 8, 12, 20, 40], q_lens=[37, 8, 0, 7, 1])
    before = _count("TileItems")
    _check_kernel(args, sinks if with_sinks else None, 0.125, window, cap, page_dtype)
    assert _count("TileItems") - before == 4


@pytest.mark.parametrize("heads,head_dim", [((7, 1), 128), ((4, 2), 32), ((2, 1), 256), ((5, 1), 80), ((3, 3), 48)],
                         ids=["gqa7-128", "gqa2-32", "gqa2-256", "gqa5-80", "mha-48"])
@pytest.mark.parametrize("build", BUILDS)
def test_tiles_of_every_head_dim_match_the_oracle(build, heads, head_dim):
    """head_dim 128, 32, 256, 80 and 48 (a tile row's output in 8, 2, 16, 5 and 3 AVX-512
    vectors; in the portable builds' 32 or 64 columns at a time and what is left), GQA
    groups of 7, 5 and 2 (scores of several rows at a time, a short last group) and plain
    multi-head, with sinks; float32 and NVFP4 pages."""
    build = _build(build)
    args, sinks = _decode_batch(22, [40, 19], q_lens=[33, 19], num_q_heads=heads[0], num_kv_heads=heads[1],
                                head_dim=head_dim)
    before = _count("TileItems", build.library)
    for pages in (jnp.float32, "nvfp4"):
        _check_kernel(args, sinks[:heads[0]], head_dim ** -0.5, page_dtype=pages, target=build.target)
    assert _count("TileItems", build.library) - before == 2 * 5  # 16 + 16 + 1 and 16 + 3 tokens a call


def _tile_parts() -> int:
    """Parts that tiles cut in several have made so far in this process."""
    return _count("TileParts")


@pytest.mark.parametrize("page_dtype", [jnp.float32, "nvfp4", TURBO[0]], ids=["f32", "nvfp4", "tq3.5"])
def test_a_short_chunk_over_a_long_context_splits_its_tile_over_the_threads(page_dtype):
    """A tile of 13 tokens after a 1,000-position prefix, with a decode row, on a machine of
    two threads or more: fewer tiles than threads, so the tile is cut into parts of 256
    positions or more, merged per token (with the sinks, the soft cap and a sliding window
    of 600 that drops the first parts' positions for some tokens and not others)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one thread: a tile is never cut")
    args, sinks = _decode_batch(25, [1013, 30], q_lens=[13, 1])
    before = _tile_parts()
    _check_kernel(args, sinks, 0.125, 600, 3.0, page_dtype)
    assert _tile_parts() - before >= 2


@pytest.mark.parametrize("build", BUILDS)
def test_a_nan_reaches_only_the_tile_tokens_that_see_it(build):
    """In a tile of 16 tokens from position 0 (one block of 16 positions), a NaN in the last
    token's new V row makes that channel of its KV head's query heads NaN, and a NaN in its
    K row all of the other KV head's: no earlier token's output, though its position is in
    their block; in every build."""
    build = _build(build)
    args, _ = _decode_batch(23, [16], q_lens=[16], padding=0)
    q, k, v, *rest = args
    v = v.at[15, 0, 3].set(jnp.nan)
    k = k.at[15, 1, 7].set(jnp.nan)
    before = _count("TileItems", build.library)
    out, lse, *_ = cpu.decode_attention_cpu(q, k, v, *rest, sm_scale=0.125, target=build.target)
    assert _count("TileItems", build.library) - before == 1
    nan = np.zeros(out.shape, bool)
    nan[15, :3, 3] = True  # channel 3 of KV head 0's three query heads
    nan[15, 3:] = True  # every channel of KV head 1's: their scores are NaN
    np.testing.assert_array_equal(np.isnan(np.asarray(out)), nan)
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), nan[:, :, 0] & (np.arange(6) >= 3))


def test_chunks_out_of_order_are_left_to_token_runs():
    """cu_q_lens that go back (a bad step: the entry refuses it, a direct call does not)
    never make a tile holding another sequence's tokens, nor two tiles of the same tokens
    (two threads writing one output): the kernel cuts only the chunk whose tokens are all
    its own (sequence 3's 12), and the call's outputs are those of the same step run a
    token at a time (where every token of sequence 3 is its own row of one)."""
    args, _ = _decode_batch(24, [40, 30, 30, 12], q_lens=[20, 10, 10, 12], padding=0)
    q, k, v, kp, vp, table, cu, kv_lens = args
    cu = jnp.asarray([0, 20, 10, 30, 42], jnp.int32)  # tokens 10..19 count as sequence 1's
    before = _count("TileItems")
    out, lse, *_ = cpu.decode_attention_cpu(q, k, v, kp, vp, table, cu, kv_lens, sm_scale=0.125)
    assert _count("TileItems") - before == 1
    want_out, want_lse, *_ = cpu.decode_attention_cpu(q[:30], k[:30], v[:30], kp, vp, table[:3], cu[:4],
                                                      kv_lens[:3], sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(out[:30]), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse[:30]), np.asarray(want_lse))


def _ancestor_bits(rng, nodes, words):
    """int32 [nodes, words]: a random draft tree's ancestor-or-self bits (node 0 the root,
    node i's parent one of the nodes before it), as tree_mask packs them."""
    mask = ancestor_mask([-1] + [int(rng.integers(0, i)) for i in range(1, nodes)])
    return np.asarray(pack_mask(jnp.asarray(np.pad(mask, ((0, 0), (0, 32 * words - nodes))))))


def _tree_step(seed, kv_lens, q_lens, starts, words=2, padding=1, **kw):
    """A step over _decode_batch whose sequence s has a draft tree region from starts[s]
    (its kv_len: none; the region's nodes must all be tokens of this step): the tokens there
    get a random tree's bits, the others zeros."""
    rng = np.random.default_rng(seed + 1000)
    args, sinks = _decode_batch(seed, kv_lens, q_lens=q_lens, padding=padding, **kw)
    bits = np.zeros((args[0].shape[0], words), np.int32)
    first = np.concatenate([[0], np.cumsum(q_lens)])
    for s, (kv_len, q_len, start) in enumerate(zip(kv_lens, q_lens, starts)):
        assert kv_len - start <= q_len
        if start < kv_len:
            bits[first[s + 1] - (kv_len - start):first[s + 1]] = _ancestor_bits(rng, kv_len - start, words)
    return args, sinks, TreeMask(jnp.asarray(starts, jnp.int32), jnp.asarray(bits))


@pytest.mark.parametrize("page_dtype", PAGES + TURBO[:1], ids=PAGE_IDS + TURBO_IDS[:1])
@pytest.mark.parametrize("build,window,cap,with_sinks", [("native", None, None, False), ("native", 3, 2.0, True),
                                                         *((b, 3, 2.0, True) for b in BUILDS[1:])])
def test_draft_tree_nodes_see_the_prefix_their_ancestors_and_themselves(build, window, cap, with_sinks, page_dtype):
    """A verify step: 40 nodes after a 21-position prefix (two words of bits; tiles of 8,
    16 and 16), 5 after 9 (a run per node), a decode row with no tree and a chunk of 20
    whose last 10 are nodes (tiles of plain tokens and nodes together). Each node sees the
    prefix (on a sliding layer from its logical position start - 1 + depth, so a deep
    node of a window of 3 sees none of it), its ancestors and itself, as the oracle reads
    tree_mask's rules; the kernel counts the five tiles. The builds without AVX-512 run it
    too, with the window, cap and sinks."""
    build = _build(build)
    args, sinks, tree = _tree_step(26, [61, 14, 12, 60], [40, 5, 1, 20], [21, 9, 12, 50])
    before = _count("TileItems", build.library)
    _check_kernel(args, sinks if with_sinks else None, 0.125, window, cap, page_dtype, target=build.target, tree=tree)
    assert _count("TileItems", build.library) - before == 5


@pytest.mark.parametrize("build", BUILDS)
def test_a_nan_value_reaches_only_the_nodes_below_it(build):
    """A NaN in one node's new V row (channel 3 of KV head 0) reaches the nodes it is an
    ancestor of (itself included) and no sibling or other branch, in a tile (16 nodes) and
    in runs (5 nodes), in every build: a node's positions are filtered before its scores
    and weights."""
    build = _build(build)
    args, _, tree = _tree_step(27, [30, 12], [16, 5], [14, 7], words=1, padding=0)
    q, k, v, *rest = args
    bits = np.asarray(tree.bits)[:, 0]
    for first, count, node in ((0, 16, 5), (16, 5, 2)):  # node 5 of the 16-node tree, node 2 of the 5-node one
        t = first + node
        bad = v.at[t, 0, 3].set(jnp.nan)
        before = _count("TileItems", build.library)
        out, *_ = cpu.decode_attention_cpu(q, k, bad, *rest, sm_scale=0.125, tree=tree, target=build.target)
        assert _count("TileItems", build.library) - before == 1  # the 16 nodes' tile (the 5 run alone)
        below = np.zeros(q.shape[0], bool)
        rows = np.arange(first, first + count)
        below[rows] = (bits[rows] >> node) & 1 == 1
        assert below[t] and below.sum() < count  # not every node is below it
        np.testing.assert_array_equal(np.isnan(np.asarray(out[:, :3, 3])), np.repeat(below[:, None], 3, 1))
        assert not np.isnan(np.asarray(out[:, 3:])).any()


def test_a_tree_after_a_long_context_splits_its_tile_over_the_threads():
    """13 nodes after a 1,000-position prefix and a decode row, with a sliding window of 600
    (from each node's logical position), the soft cap and sinks: the one tile is cut into
    parts of 256 positions or more (two threads or more), merged per node."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one thread: a tile is never cut")
    args, sinks, tree = _tree_step(28, [1013, 30], [13, 1], [1000, 30], words=1)
    before = _tile_parts()
    _check_kernel(args, sinks, 0.125, 600, 3.0, tree=tree)
    assert _tile_parts() - before >= 2


@pytest.mark.parametrize("window", [None, 600, 3])
def test_nodes_over_a_long_context_split_their_runs(window):
    """Five nodes (below kTileMin: a run each) after 1,000 positions, so each node's positions
    are cut into several items (without a window or with one of 600; a window of 3 leaves
    one), merged per node; the same nodes in a region of 1,024 from position 0 whose bits
    name only the tree (so most of a node's items see nothing and merge as -inf parts); and
    a tree whose start is negative (runtime data: its nodes read only their own table's
    positions, every one past the region causally)."""
    args, sinks, tree = _tree_step(32, [1005, 40], [5, 6], [1000, 34], words=1)
    _check_kernel(args, sinks, 0.125, window, tree=tree)
    _check_kernel(args, None, 0.125, window, tree=TreeMask(jnp.asarray([1000, -3], jnp.int32), tree.bits))
    wide = np.zeros((tree.bits.shape[0], 32), np.int32)  # offsets 1,000 + i: word 31, bit 8 + i
    wide[:5, 31] = np.asarray(tree.bits[:5, 0]) << 8
    wide[5:, 0] = np.asarray(tree.bits[5:, 0])
    _check_kernel(args, sinks, 0.125, window, tree=TreeMask(jnp.asarray([0, 34], jnp.int32), jnp.asarray(wide)))


def test_rows_past_the_table_read_nothing_beyond_it():
    """kv_lens past the table's width (which the entry refuses, a direct call does not): a
    plain row's window and a node's (start past the table) are measured from their own
    positions, as ref.py measures them, so they see nothing of the table, and neither reads
    past it."""
    args, _ = _decode_batch(33, [20, 20], q_lens=[1, 3], padding=0)
    q, k, v, kp, vp, table, cu, _ = args
    kv_lens = jnp.asarray([30, 30], jnp.int32)  # 8 pages of 4: positions up to 31
    table = table[:, :4]  # 16 positions
    tree = TreeMask(jnp.asarray([30, 18], jnp.int32), jnp.asarray([[0], [1], [3], [5]], jnp.int32))
    step = (q, k, v, kp, vp, table, cu, kv_lens)
    for window in (2, None):
        got = cpu.decode_attention_cpu(*step, sm_scale=0.125, sliding_window=window, tree=tree)
        want = ragged_paged_attention_ref(*step, sm_scale=0.125, sliding_window=window, tree=tree)
        for g, w in zip(got, want):
            assert_close(g, w)
        if window:
            np.testing.assert_array_equal(np.asarray(got[1]), -np.inf)


@pytest.mark.parametrize("nodes", [3, 10], ids=["runs", "tile"])
def test_a_node_that_sees_nothing_gives_zeros_as_the_reference_does(nodes):
    """Nodes at the start of a sequence whose bits name no position (not even themselves,
    which no engine tree does) see nothing: out 0 and lse -inf, or the sink's logit with
    sinks, as ref.py and the oracle give; the nodes beside them that see themselves (and
    position 0) are unharmed. Three nodes run a token at a time, ten in a tile."""
    args, sinks = _decode_batch(29, [nodes], q_lens=[nodes], padding=0)
    bits = [[0], [0]] + [[(1 << i) | 1] for i in range(2, nodes)]
    tree = TreeMask(jnp.zeros(1, jnp.int32), jnp.asarray(bits, jnp.int32))
    for with_sinks in (False, True):
        _check_kernel(args, sinks if with_sinks else None, 0.125, tree=tree)
        out, lse, *_ = cpu.decode_attention_cpu(*args, sinks if with_sinks else None, sm_scale=0.125, tree=tree)
        np.testing.assert_array_equal(np.asarray(out[:2]), 0.0)
        np.testing.assert_array_equal(np.asarray(lse[:2]), np.broadcast_to(sinks if with_sinks else -np.inf, (2, 6)))
        assert np.isfinite(np.asarray(lse[2:])).all()


def test_bfloat16_pages_round_new_rows_as_xla_converts_them():
    """Ties to even both ways, the largest float (to inf), infinities, NaN and subnormals
    land in bfloat16 pages as XLA's convert rounds them (ref.write_new_kv)."""
    args, _ = _decode_batch(9, [1], num_q_heads=2, num_kv_heads=1, head_dim=16, padding=0)
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    tie = np.float32(1 + 2.0 ** -8)  # between 1 and 1 + 2^-7: to 1
    edges = np.array([tie, 1 + 3 * 2.0 ** -8, -tie, np.finfo(np.float32).max, np.inf, -np.inf, np.nan, 1e-40,
                      -1e-42, 3.0e38, 1.0 / 3, -2.0 / 3, 65504.0, 0.0, -0.0, 7.5], np.float32)
    k = jnp.asarray(edges.reshape(k.shape))
    pages = k_pages.astype(jnp.bfloat16), v_pages.astype(jnp.bfloat16)
    _, _, got_k, _ = cpu.decode_attention_cpu(q, k, v, *pages, table, cu, kv_lens, sm_scale=0.25)
    seq, pos = token_layout(cu, kv_lens, q.shape[0])
    want_k, _ = write_new_kv(*pages, k, v, table, seq, pos)
    np.testing.assert_array_equal(np.asarray(got_k.astype(jnp.float32)), np.asarray(want_k.astype(jnp.float32)))
    assert float(want_k[int(table[0, 0]), 0, 0, 0]) == 1.0 and float(want_k[int(table[0, 0]), 0, 0, 1]) > 1.0


@pytest.mark.parametrize("page_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_a_nan_key_makes_its_rows_output_nan_and_none_other(page_dtype):
    """A NaN in one sequence's cached K reaches that row's output as NaN (as in the oracle
    and the XLA path), and the other rows are untouched; a step of no tokens is empty."""
    args, _ = _decode_batch(10, [6, 9], padding=0)
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    k_pages = k_pages.at[int(table[0, 0]), 2, 0, 5].set(jnp.nan)
    args = (q, k, v, k_pages, v_pages, table, cu, kv_lens)
    _check_kernel(args, None, 0.125, page_dtype=page_dtype)
    out, *_ = cpu.decode_attention_cpu(*args, sm_scale=0.125)
    assert np.isnan(np.asarray(out[0])).any() and not np.isnan(np.asarray(out[1])).any()
    none = (q[:0], k[:0], v[:0], k_pages, v_pages, table, jnp.zeros_like(cu), jnp.zeros_like(kv_lens))
    out, lse, got_k, _ = cpu.decode_attention_cpu(*none, sm_scale=0.125)
    assert out.shape == (0,) + q.shape[1:] and lse.shape == (0, q.shape[1])
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(k_pages))


def test_long_contexts_spread_over_threads_match_the_oracle():
    """A call's items (runs of positions) run on the quantized matmul's crew of helper
    threads, which the kernel gets once both are loaded; without the crew, on XLA's pool when
    the call holds enough work. Either way they match the oracle, and every row's out, lse
    and pages are the same bits: the runs follow the context alone, not the threads."""
    args, _ = _decode_batch(2, [300, 517, 9, 260, 400], num_q_heads=8, num_kv_heads=2)
    assert int(jnp.sum(args[-1])) * 8 * 64 >= 1 << 18  # live positions: the kernel's threshold for XLA's pool
    lib = cpu.KERNEL.library
    lib.KvfoldDecodeAttentionCrewCalls.restype = ctypes.c_int64
    _check_kernel(args, None, 0.125)
    before = lib.KvfoldDecodeAttentionCrewCalls()
    with_crew = [np.asarray(x) for x in cpu.decode_attention_cpu(*args, sm_scale=0.125)]
    assert lib.KvfoldDecodeAttentionCrewCalls() == before + 1  # the crew ran this call's items
    lib.KvfoldDecodeAttentionUseCrew(None)
    try:
        _check_kernel(args, None, 0.125)
        without = [np.asarray(x) for x in cpu.decode_attention_cpu(*args, sm_scale=0.125)]
        assert lib.KvfoldDecodeAttentionCrewCalls() == before + 1  # XLA's pool ran these
    finally:
        cpu._join_crew.cache_clear()
    assert cpu.available()  # the crew handed over again
    for a, b in zip(with_crew, without):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((7, 1), 128)], ids=["gqa3-64", "gqa7-128"])
@pytest.mark.parametrize("window,cap,with_sinks", [(None, None, True), (520, 2.0, True), (None, None, False)])
def test_a_long_row_split_into_runs_merges_its_parts(window, cap, with_sinks, heads, head_dim):
    """One decode row over 600 positions is split into the kernel's most runs (eight, of 75
    positions, 65 in a window of 520, on a machine of up to eight threads), whose softmax
    parts are merged; the merge keeps the sinks, the soft cap and the window the oracle has. Seven query heads of 128
    per KV head weigh the values in chunks of two heads, then one."""
    args, sinks = _decode_batch(6, [600], num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                                padding=0)
    for pages in PAGES + [turboquant(head_dim, 3.5)]:
        _check_kernel(args, sinks if with_sinks else None, head_dim ** -0.5, window, cap, pages)


@pytest.mark.parametrize("name", ["int8", "fp8", "nvfp4"])
def test_low_bit_writes_round_every_code_as_the_quantizers_do(name):
    """New rows spanning 2^-30 .. 2^10 inside one row (fp8 subnormals, int8 codes of 0, NVFP4
    blocks with subnormal or zero scales), exact int8 ties, an all-zero row (scale 0), a row
    that saturates E4M3's 448, an NVFP4 block of scale 1 holding every E2M1 midpoint (ties
    to the even code), NaN and infinite elements land in the codes and scales
    quant.quantize_rows / quant.nvfp4_quantize give, byte for byte; attention over them is
    the oracle's, NaN where it is NaN."""
    args, _ = _decode_batch(11, [3, 7], num_q_heads=4, num_kv_heads=2, head_dim=64, padding=0)
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    rng = np.random.default_rng(12)
    wide = rng.standard_normal(k.shape) * 2.0 ** rng.uniform(-30, 10, k.shape)
    wide[0, 0] = 0.0  # an all-zero row
    wide[0, 1] = rng.uniform(-100, 100, 64).round() + 0.5  # with 127: int8's scale is 1, all ties
    wide[0, 1, :8] = [127.0, 0.5, 1.5, 2.5, -0.5, -3.5, 100.5, -126.5]
    wide[1, 0] = 448.0 * 2.0 ** rng.uniform(-16, 0, 64)  # fp8's scale is 1: codes down to subnormals
    wide[1, 0, :4] = [448.0, 447.0, 2.0 ** -9 * 1.5, 2.0 ** -9 * 2.5]
    wide[1, 1, 16:32] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 5.5, 0.0, -0.0, 1e-3, 2.9]
    wide[1, 1, :2] = [np.nan, -np.nan]  # a NaN row (block) scale
    wide[1, 1, 32:34] = [np.inf, -np.inf]
    k = jnp.asarray(wide, jnp.float32)
    wide = wide[:, ::-1].copy()
    wide[0, 0, 5] = np.inf  # an inf under a finite absmax elsewhere: its code is NaN
    v = jnp.asarray(wide, jnp.float32)
    _check_kernel((q, k, v, k_pages, v_pages, table, cu, kv_lens), None, 0.125, page_dtype=name)


def _reference(args, kv_format=None, **kw):
    """ref.py's dense attention over a step given as the entry takes it (its default sm_scale)."""
    fmt = None if kv_format is None else kv_formats.resolve(kv_format)
    return ragged_paged_attention_ref(*args, sm_scale=args[0].shape[-1] ** -0.5, kv_format=fmt, **kw)


def _lowered(args, **kw):
    return jax.jit(lambda *a: ragged_paged_attention(*a, **kw)).lower(*args).as_text()


def test_the_entry_runs_the_kernel_for_decode_steps_over_float32_pages():
    """A decode-only step (max_q_len 1; with tiles, chunks too) of float32 q over float32 or
    bfloat16 pages, int8 / fp8 row-scaled ones, NVFP4 ones or turboquant-3.5 ones lowers to
    the kernel and gives the dense reference's outputs, lse and pages; E4M3 leaves as the
    pools keep them (uint8 bits) and as quant's quantizers make them (float8_e4m3fn) give
    the same, each kept in its own dtype; bfloat16 q, MXFP4 pages, TurboQuant codes wider
    than 4 bits and other variants stay on the XLA path. A step with a draft tree goes to
    the kernel as the step without one would, and gives ref.py's results."""
    args, sinks = _decode_batch(3, [5, 11, 2], width=40)
    kw = dict(sliding_window=6, sinks=sinks)
    half_pages = args[:3] + (args[3].astype(jnp.bfloat16), args[4].astype(jnp.bfloat16)) + args[5:]
    row_scaled = {name: args[:3] + (kv_formats.resolve(name).quantize(args[3]),
                                    kv_formats.resolve(name).quantize(args[4])) + args[5:]
                  for name in ("int8", "fp8", "nvfp4")}
    assert row_scaled["fp8"][3].codes.dtype == row_scaled["nvfp4"][3].scales.dtype == jnp.uint8
    as_quant = {"fp8": args[:3] + tuple(quantize_rows(p, "fp8") for p in args[3:5]) + args[5:],
                "nvfp4": args[:3] + tuple(nvfp4_quantize(p, 1.0)._replace(tensor_scale=None) for p in args[3:5])
                + args[5:]}
    assert as_quant["fp8"][3].codes.dtype == as_quant["nvfp4"][3].scales.dtype == jnp.float8_e4m3fn
    tq = turboquant(64, 3.5)
    turbo = args[:3] + tuple(tq.quantize(p) for p in args[3:5]) + args[5:]
    results = {}
    for pages, fmt in [(args, None), (half_pages, None), *((p, name) for name, p in row_scaled.items()),
                       *((p, name) for name, p in as_quant.items()), (turbo, tq)]:
        assert (cpu.TURBO_TARGET if fmt is tq else cpu.TARGET) in _lowered(pages, max_q_len=1, kv_format=fmt, **kw)
        want = _reference(pages, kv_format=fmt, **kw)
        got = ragged_paged_attention(*pages, max_q_len=1, kv_format=fmt, **kw)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == w.dtype
            assert_close(g.astype(jnp.float32), w.astype(jnp.float32))
        assert [a.dtype for a in jax.tree.leaves(got[2:])] == [a.dtype for a in jax.tree.leaves(pages[3:5])]
        results.setdefault(fmt, []).append(got)
    with pytest.raises(ValueError, match="v_pages leaf dtypes differ"):  # one container of each
        ragged_paged_attention(*row_scaled["fp8"][:4], as_quant["fp8"][4], *args[5:], max_q_len=1, kv_format="fp8")
    for name in as_quant:  # one read of the same bits, whichever dtype holds them
        bits, floats = (jax.tree.leaves(r) for r in results[name])
        for b, f in zip(bits, floats):
            np.testing.assert_array_equal(np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1 else b,
                                          np.asarray(f).view(np.uint8) if f.dtype.itemsize == 1 else f)
    mxfp4 = args[:3] + tuple(kv_formats.resolve("mxfp4").quantize(p) for p in args[3:5]) + args[5:]
    assert cpu.TARGET not in _lowered(mxfp4, max_q_len=1, kv_format="mxfp4")
    wide = TurboQuantSplit(64, 5.5, tq.outliers)  # 6-bit codes: past the kernel's 16-entry lookup
    wide_pages = args[:3] + tuple(wide.quantize(p) for p in args[3:5]) + args[5:]
    assert cpu.TURBO_TARGET not in _lowered(wide_pages, max_q_len=1, kv_format=wide)
    with pytest.raises(ValueError, match="at most 4 bits"):
        cpu.decode_attention_turbo_cpu(*wide_pages, sm_scale=0.1, kv_format=wide)
    # chunks go to the kernel (cut into tiles), with or without a tree
    assert cpu.TARGET in _lowered(args, max_q_len=2, max_chunks=1)
    tree_args, _, tree = _tree_step(30, [20, 9, 12], [10, 1, 4], [12, 9, 9], words=1)
    one_node, _, root = _tree_step(31, [5, 9], [1, 1], [4, 9], words=1)  # a tree of one node: a decode step
    assert cpu.TARGET in _lowered(one_node, max_q_len=1, tree=root)
    assert cpu.TARGET in _lowered(tree_args, max_q_len=10, max_chunks=2, tree=tree)
    for window in (None, 3):
        want = _reference(tree_args, tree=tree, sliding_window=window)
        got = ragged_paged_attention(*tree_args, tree=tree, sliding_window=window, max_q_len=10, max_chunks=2)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(g, w)
    bf16 = tuple(a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args)
    assert cpu.TARGET not in _lowered(bf16, max_q_len=1)
    from pallas_kernels.variant import AttentionVariant
    sigmoid = AttentionVariant(weight_fn=jax.nn.sigmoid)
    assert cpu.TARGET not in _lowered(args, max_q_len=1, variant=sigmoid)
    with pytest.raises(ValueError, match="v_pages"):
        ragged_paged_attention(*args[:4], half_pages[4], *args[5:], max_q_len=1)
    fp8 = args[:3] + (args[3].astype(jnp.float8_e4m3fn), args[4].astype(jnp.float8_e4m3fn)) + args[5:]
    with pytest.raises(ValueError, match="k_pages"):  # raw fp8 pages need kv_format="fp8" (its scales)
        ragged_paged_attention(*fp8, max_q_len=1)


def test_lowering_for_cuda_and_tpu_never_names_the_cpu_kernel():
    """The kernel is the entry's CPU branch only: an export for CUDA (whose decode kernel
    needs pages of at least 16 here, so these take the XLA path) or TPU from this host
    holds no call to it."""
    from pallas_kernels.lowering import export_cuda, export_tpu
    from tests.pallas_kernels.helpers import spec

    args, sinks = _decode_batch(5, [5, 11, 2])
    fn = lambda *a: ragged_paged_attention(*a[:8], sinks=a[8], max_q_len=1)
    for pages in (jnp.float32, jnp.bfloat16):  # bfloat16 pages: the kernels see q in bfloat16
        args = args[:3] + (args[3].astype(pages), args[4].astype(pages)) + args[5:]
        specs = [spec(x) for x in args] + [spec(sinks)]
        assert cpu.TARGET in jax.jit(fn).lower(*args, sinks).as_text()
        assert cpu.TARGET not in export_cuda(fn, *specs)
        assert cpu.TARGET not in export_tpu(fn, *specs)


def test_a_bad_table_entry_drops_the_write_and_never_touches_another_page():
    """A row whose page entry is -1 or past the pool writes nothing (the reference drops it
    too; a -1 must not wrap to the last page), and the row with good entries lands where the
    reference puts it and attends as the oracle says."""
    args, _ = _decode_batch(7, [3, 6, 2], padding=2)
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    table = table.at[0, 0].set(-1).at[2, 0].set(k_pages.shape[0])
    out, lse, got_k, got_v = cpu.decode_attention_cpu(q, k, v, k_pages, v_pages, table, cu, kv_lens, sm_scale=0.125)
    seq, pos = token_layout(cu, kv_lens, q.shape[0])
    want_k, want_v = write_new_kv(k_pages, v_pages, k, v, table, seq, pos)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    changed = np.flatnonzero(np.any(np.asarray(got_v) != np.asarray(v_pages), axis=(1, 2, 3)))
    assert list(changed) == [int(table[1, 1])]  # row 1 alone (position 5: its second page)
    want_out, want_lse = _oracle(q[1:2], want_k, want_v, table, seq[1:2], pos[1:2], 0.125)
    np.testing.assert_allclose(np.asarray(out[1:2]), want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse[1:2]), want_lse, rtol=2e-5, atol=2e-5)


def test_mismatched_buffers_are_refused_by_the_kernel():
    args, _ = _decode_batch(4, [3])
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    with pytest.raises(Exception, match="page shapes do not match"):
        cpu.decode_attention_cpu(q, k[..., :32], v[..., :32], k_pages[..., :32], v_pages[..., :32], table, cu,
                                 kv_lens, sm_scale=0.1)[0].block_until_ready()
    with pytest.raises(Exception, match="new K/V rows do not match"):
        cpu.decode_attention_cpu(q, k[:1], v[:1], k_pages, v_pages, table, cu, kv_lens,
                                 sm_scale=0.1)[0].block_until_ready()
    with pytest.raises(Exception, match="lengths do not match"):
        cpu.decode_attention_cpu(q, k, v, k_pages, v_pages, table, cu[:1], kv_lens,
                                 sm_scale=0.1)[0].block_until_ready()
    for start, bits in ((jnp.zeros(2, jnp.int32), jnp.zeros((q.shape[0], 1), jnp.int32)),
                        (jnp.zeros(1, jnp.int32), jnp.zeros((q.shape[0] + 1, 1), jnp.int32))):
        with pytest.raises(Exception, match="a tree needs start"):
            cpu.decode_attention_cpu(q, k, v, k_pages, v_pages, table, cu, kv_lens, sm_scale=0.1,
                                     tree=TreeMask(start, bits))[0].block_until_ready()


def _raw_call(q, k, v, pages, scales, table, cu, kv_lens):
    """The kernel's FFI target called with these page and scale buffers as they are (what
    decode_attention_cpu's own checks would stop first)."""
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    call = jax.ffi.ffi_call(cpu.TARGET, (like(q), jax.ShapeDtypeStruct(q.shape[:2], jnp.float32), like(pages),
                                         like(pages), like(scales), like(scales)))
    return call(q, k, v, pages, pages, scales, scales, table, cu, kv_lens, jnp.zeros((1,), jnp.float32),
                *cpu._tree_operands(None), sm_scale=np.float32(0.1),
                sliding_window=np.int64(0), soft_cap=np.float32(0), has_sinks=np.int64(0),
                has_tree=np.int64(0))[0].block_until_ready()


def test_low_bit_buffers_that_do_not_fit_are_refused_by_the_kernel():
    """Packed uint8 pages are read as NVFP4 only beside E4M3 scales (float8_e4m3fn or their
    uint8 bits) of head_dim / 16 per row: MXFP4's scales (head_dim / 32), float32 ones or a
    wrong count are refused, as are uint8 pages of another width than head_dim (E4M3 codes)
    or its half (NVFP4), and row
    scales of the wrong count beside int8 codes; NVFP4 pages with a tensor scale (or int8
    codes without their RowQuantized) are a ValueError before the kernel, and the entry
    keeps them on the XLA path."""
    assert cpu.available()  # the handlers registered: this calls them by their FFI names
    args, _ = _decode_batch(4, [3, 6], head_dim=32)
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    nvfp4 = kv_formats.resolve("nvfp4").quantize(k_pages)
    mxfp4 = kv_formats.resolve("mxfp4").quantize(k_pages)
    int8 = kv_formats.resolve("int8").quantize(k_pages)
    for scales in (mxfp4.scales, nvfp4.scales.astype(jnp.float32), nvfp4.scales[..., :1]):
        with pytest.raises(Exception, match="NVFP4 pages E4M3 ones"):
            _raw_call(q, k, v, nvfp4.packed, scales, table, cu, kv_lens)
    with pytest.raises(Exception, match="page shapes do not match"):
        _raw_call(q, k, v, nvfp4.packed[..., :-1], nvfp4.scales, table, cu, kv_lens)
    with pytest.raises(Exception, match="int8 / fp8 pages need float32 scales"):
        _raw_call(q, k, v, int8.codes, int8.scales[:1], table, cu, kv_lens)
    scaled = nvfp4._replace(tensor_scale=jnp.float32(0.5))
    with pytest.raises(ValueError, match="without a tensor scale"):
        cpu.decode_attention_cpu(q, k, v, scaled, scaled, table, cu, kv_lens, sm_scale=0.1, kv_format="nvfp4")
    with pytest.raises(ValueError, match="not k_pages ndarray|not k_pages ArrayImpl"):
        cpu.decode_attention_cpu(q, k, v, int8.codes, int8.codes, table, cu, kv_lens, sm_scale=0.1,
                                 kv_format="int8")
    step = args[:3] + (scaled, scaled) + args[5:]
    assert cpu.TARGET not in _lowered(step, max_q_len=1, kv_format="nvfp4")
    want = _reference(step, kv_format="nvfp4")
    got = ragged_paged_attention(*step, max_q_len=1, kv_format="nvfp4")
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g.astype(jnp.float32), w.astype(jnp.float32))



def test_turboquant_buffers_that_do_not_fit_are_refused_by_the_kernel():
    """The TurboQuant handler checks what cpu.py's checks would stop first: codes of more
    than 4 bits, codes whose width does not match the bits, scales of another count, and
    sparse channels without their indices or with bfloat16 values (not their bits)."""
    assert cpu.available()  # the handlers registered: this calls them by their FFI names
    args, _ = _decode_batch(4, [3, 6], head_dim=32)
    q, _, _, k_pages, _, table, cu, kv_lens = args
    codes = TurboQuant(32, 4, sparse=1).quantize(k_pages)
    placeholder = (jnp.zeros((1,), jnp.uint8), jnp.zeros((1,), jnp.uint16))

    def call(group, bits=4, sparse=1, codebooks=jnp.zeros((1, 16), jnp.float32)):
        leaves = list(group) * 4  # K and V, each one group given twice
        return jax.ffi.ffi_call(cpu.TURBO_TARGET, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                                   jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)))(
            q, *leaves, codebooks, jnp.zeros((1, 32, 32), jnp.float32), table, cu, kv_lens,
            jnp.zeros((1,), jnp.float32), *cpu._tree_operands(None), sm_scale=np.float32(0.1),
            sliding_window=np.int64(0), soft_cap=np.float32(0), has_sinks=np.int64(0), has_tree=np.int64(0),
            groups=np.int64(1), bits0=np.int64(bits), bits1=np.int64(0), sparse=np.int64(sparse))[0].block_until_ready()

    good = (codes.idx, codes.norm, codes.sparse_idx, codes.sparse_val)
    call(good)  # what fits runs
    with pytest.raises(Exception, match="1 to 4 bits"):
        call(good, bits=5)
    with pytest.raises(Exception, match="1 to 4 bits"):
        call(good, bits=2)  # 16 bytes of codes are 4-bit codes of 32 channels, not 2-bit ones
    with pytest.raises(Exception, match="float32 scales"):
        call((codes.idx, codes.norm[:1], codes.sparse_idx, codes.sparse_val))
    with pytest.raises(Exception, match="sparse channels need"):
        call((codes.idx, codes.norm, *placeholder))
    with pytest.raises(Exception, match="sparse channels need"):
        call((codes.idx, codes.norm, codes.sparse_idx, jax.lax.bitcast_convert_type(codes.sparse_val, jnp.bfloat16)))
    with pytest.raises(Exception, match="codebooks must be"):
        call(good, codebooks=jnp.zeros((2, 16), jnp.float32))


def test_a_turboquant_step_over_donated_pages_copies_no_pool():
    """XLA writes a step's TurboQuant rows (the kernel only reads them): over donated pages
    every leaf is scattered into in place, and nothing else in the compiled step is as large
    as a pool's leaf (a bfloat16 leaf of sparse values was copied, moved as its bits, at every
    write: a layer's call grew with the pool, from 0.27 ms at 257 pages to 2.3 ms at 16,385)."""
    args, _ = _decode_batch(16, [5, 40, 17])
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    num_pages = 1024  # the pool's leaves far larger than anything else in the step
    k_pages, v_pages = (jnp.concatenate([p, jnp.zeros((num_pages - p.shape[0], *p.shape[1:]), p.dtype)])
                        for p in (k_pages, v_pages))
    tq = turboquant(64, 3.5)
    step = jax.jit(lambda kp, vp: cpu.decode_attention_turbo_cpu(q, k, v, kp, vp, table, cu, kv_lens,
                                                                 sm_scale=0.125, kv_format=tq), donate_argnums=(0, 1))
    text = step.lower(tq.quantize(k_pages), tq.quantize(v_pages)).compile().as_text()
    assert_written_in_place(text, num_pages * PAGE_SIZE * k_pages.shape[2], 16)  # every leaf of K and V


@pytest.mark.parametrize("bits", [3.5, 2.5])
def test_turboquant_pages_of_head_dim_128_match_the_oracle(bits):
    """The KV cache's TurboQuant formats at head_dim 128 (halves of 64 channels, which the
    kernel decodes on its own unrolled path, as it does head_dim 64's halves of 32; other
    shapes and sparse counts take its general path); a sparse index past its half in a live
    K row and a live V row, which no write makes, adds nothing (as quant's dequantize reads
    it)."""
    args, sinks = _decode_batch(15, [1, 21, 40], num_q_heads=4, num_kv_heads=2, head_dim=128)
    tq = turboquant(128, bits)
    _check_kernel(args, sinks, 128 ** -0.5, page_dtype=tq)
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    k_codes, v_codes = tq.quantize(k_pages), tq.quantize(v_pages)
    row = (int(table[2, 1]), 3, 1)  # a live row of sequence 2
    k_codes = dataclasses.replace(k_codes, outlier=dataclasses.replace(
        k_codes.outlier, sparse_idx=k_codes.outlier.sparse_idx.at[row].set(200)))
    v_codes = dataclasses.replace(v_codes, regular=dataclasses.replace(
        v_codes.regular, sparse_idx=v_codes.regular.sparse_idx.at[row].set(64)))
    seq, pos = token_layout(cu, kv_lens, q.shape[0])
    out, lse, got_k, got_v = cpu.decode_attention_turbo_cpu(q, k, v, k_codes, v_codes, table, cu, kv_lens,
                                                            sinks, sm_scale=128 ** -0.5, kv_format=tq)
    want_out, want_lse = _oracle(q, tq.dequantize(got_k), tq.dequantize(got_v), table, seq, pos, 128 ** -0.5,
                                 sinks=np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("build", BUILDS)
def test_turboquant_codes_of_one_bit_and_many_sparse_channels_match_the_oracle(build):
    """1-bit codes; six sparse channels a half (AVX-512: four added as the codes are decoded,
    the others in a pass of their own; the portable decode: the first, then the others); a
    sparse index past its half in the first sparse slot, which no write makes and which adds
    nothing (as quant's dequantize and the XLA path read it); and decode_attention_cpu, the
    handler for the other pages, refuses TurboQuant ones."""
    target = _build(build).target
    args, sinks = _decode_batch(14, [1, 6, 40], num_q_heads=6, num_kv_heads=2, head_dim=64)
    _check_kernel(args, sinks, 0.125, page_dtype=TurboQuant(64, 1), target=target)
    many = TurboQuantSplit(64, 3.5, turboquant(64, 3.5).outliers, sparse=6, rescale=True)
    _check_kernel(args, None, 0.125, page_dtype=many, target=target)
    q, k, v, k_pages, v_pages, table, cu, kv_lens = args
    seq, pos = token_layout(cu, kv_lens, q.shape[0])
    for tq in (turboquant(64, 3.5), many):  # one sparse channel a half; six, the first past its half
        pages = tq.quantize(k_pages)
        past = pages.outlier.sparse_idx.at[int(table[2, 1]), 1, 0, 0].set(200)  # a live row of sequence 2
        pages = dataclasses.replace(pages, outlier=dataclasses.replace(pages.outlier, sparse_idx=past))
        out, lse, got_k, got_v = cpu.decode_attention_turbo_cpu(q, k, v, pages, tq.quantize(v_pages), table, cu,
                                                                kv_lens, sm_scale=0.125, kv_format=tq,
                                                                target=target + "_turbo")
        want_out, want_lse = _oracle(q, tq.dequantize(got_k), tq.dequantize(got_v), table, seq, pos, 0.125)
        np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="decode_attention_turbo_cpu TurboQuant ones"):
        cpu.decode_attention_cpu(*args[:3], pages, pages, *args[5:], sm_scale=0.1, kv_format=tq)
