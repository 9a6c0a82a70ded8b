"""The ragged paged attention TPU kernel (run in TPU interpret mode) against
ragged_paged_attention_ref: draft-tree masks in a mixed batch, low-bit KV pages (written
quantized, read tile by tile), and lowering for TPU with a low-bit format."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from model.kv_formats import turboquant
from pallas_kernels import ragged_paged_attention
from pallas_kernels.paged_attention import kv_formats
from pallas_kernels.ragged_paged_attention import TreeMask, pack_mask
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.ref import ragged_paged_attention_ref
from pallas_kernels.variant import SOFTMAX
from quant.blockscaled import nvfp4_quantize
from quant.kv_rows import quantize_rows
from pallas_kernels.lowering import export_tpu
from tests.pallas_kernels.helpers import assert_close, spec

PAGE_SIZE = 8
NUM_Q_HEADS, NUM_KV_HEADS = 4, 2
STRICT = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")


def _reference(*args, sinks=None, tree=None, sliding_window=None, kv_format=None):
    head_dim = args[0].shape[-1]
    fmt = None if kv_format is None else kv_formats.resolve(kv_format)
    ref = functools.partial(
        ragged_paged_attention_ref,
        sm_scale=head_dim**-0.5,
        sliding_window=sliding_window,
        variant=SOFTMAX,
        kv_format=fmt,
    )
    return jax.jit(ref)(*args, sinks, tree)


def _assert_matches(got, want, kv_format=None):
    """out and lse to f32 rounding; every page-axis leaf bit for bit (the same quantizer)."""
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    fmt = kv_formats.PLAIN if kv_format is None else kv_formats.resolve(kv_format)
    for g, w in zip(got[2:], want[2:]):
        for g_leaf, w_leaf in zip(fmt.leaves(g), fmt.leaves(w), strict=True):
            np.testing.assert_array_equal(np.asarray(g_leaf), np.asarray(w_leaf))


def _scalar_tensor_scale(pages):
    """NVFP4 pages whose tensor scale is None ("1": kv_formats' pools) with a scalar 1
    instead, the same values: the form ragged_paged_attention_ref's write takes."""
    if getattr(pages, "tensor_scale", 0) is None:
        return pages._replace(tensor_scale=jnp.float32(1.0))
    return pages


def _batch(rng, q_lens, kv_lens, *, head_dim, max_pages, num_padding=2):
    """Random q/k/v and page pools; each sequence owns distinct shuffled pages, and
    block-table entries past a sequence's last page hold garbage (never read)."""
    q_lens, kv_lens = np.asarray(q_lens, np.int32), np.asarray(kv_lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    used = -(-kv_lens // PAGE_SIZE)
    num_pages = int(used.sum()) + 2  # two pages nobody owns
    perm = rng.permutation(num_pages)
    table = np.full((len(q_lens), max_pages), 10**6, np.int32)
    table[:, -1] = -3
    start = 0
    for s, n in enumerate(used):
        table[s, :n] = perm[start : start + n]
        start += n
    t = int(cu[-1]) + num_padding
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return (
        f32(t, NUM_Q_HEADS, head_dim),
        f32(t, NUM_KV_HEADS, head_dim),
        f32(t, NUM_KV_HEADS, head_dim),
        f32(num_pages, PAGE_SIZE, NUM_KV_HEADS, head_dim),
        f32(num_pages, PAGE_SIZE, NUM_KV_HEADS, head_dim),
        jnp.asarray(table),
        jnp.asarray(cu),
        jnp.asarray(kv_lens),
    )


# (q_len, kv_len, tree region start) per sequence:
#   0: verify row, a 7-node branching draft tree in slots 9..15 after a 9-token prefix;
#   1: a 10-token prefill chunk after a 5-token prefix (two query tiles, three pages);
#   2: a decode row;
#   3: a draft step growing a deep tree whose region started at slot 2: its 3 new nodes
#      at slots 36..38 have ancestors in both 32-bit words of the region;
#   4: a query whose tree hides even itself: sees nothing (out 0, lse -inf / the sink).
TREE_SEQS = [(7, 16, 9), (10, 15, 15), (1, 20, 20), (3, 39, 2), (1, 1, 0)]
PARENTS = [-1, 0, 0, 1, 1, 2, 5]  # seq 0: nodes 3 and 4 under 1, node 6 under 5 under 2


def _tree_problem(seed):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens, starts = (list(x) for x in zip(*TREE_SEQS))
    args = _batch(rng, q_lens, kv_lens, head_dim=32, max_pages=6)
    num_tokens = args[0].shape[0]
    mask = np.zeros((num_tokens, 40), bool)  # two words of bits
    for i, parent in enumerate(PARENTS):  # ancestors and self
        mask[i] = mask[parent] if parent >= 0 else False
        mask[i, i] = True
    first = sum(q_lens[:3])  # sequence 3: random ancestors among slots 2..37, and self
    for i in range(3):
        offset = 34 + i
        mask[first + i, :offset] = rng.random(offset) < 0.5
        mask[first + i, offset] = True
    assert mask[first : first + 3, 32:].any() and mask[first : first + 3, :32].any()
    # sequences 1 and 2 have no region (start = kv_len); 4 keeps its bits all zero
    tree = TreeMask(jnp.asarray(starts, jnp.int32), pack_mask(jnp.asarray(mask)))
    sinks = jnp.asarray(rng.standard_normal(NUM_Q_HEADS), jnp.float32)
    return args, tree, sinks


@pytest.mark.parametrize(
    "window,with_sinks,interpret",
    [(None, False, True), (6, True, STRICT)],
    ids=["causal", "window"],
)
def test_tree_mixed_batch_matches_reference(window, with_sinks, interpret):
    """Verify row, prefill chunk, decode row, a two-word draft tree and a query that sees
    nothing, in one call; the window (counted from a tree node's logical position) and
    sinks in one case, under NaN-filled scratch and raising out-of-bounds reads."""
    args, tree, sinks = _tree_problem(0)
    kw = dict(sinks=sinks if with_sinks else None, sliding_window=window)
    want = _reference(*args, tree=tree, **kw)
    got = ragged_paged_attention(*args, tree=tree, interpret=interpret, **kw)
    _assert_matches(got, want)
    # The tree mask did something: tree rows differ from plain causal attention...
    plain = _reference(*args, **kw)
    tree_rows = np.r_[1:7, 18:21]
    assert not np.allclose(np.asarray(got[0])[tree_rows], np.asarray(plain[0])[tree_rows])
    # ... and rows without a region are plain causal rows.
    plain_rows = np.r_[0, 7:18]
    assert_close(got[0][plain_rows], plain[0][plain_rows])
    # The query that sees nothing: out 0, lse -inf (or the sink's logit).
    np.testing.assert_array_equal(np.asarray(got[0])[21], 0.0)
    empty_lse = sinks if with_sinks else jnp.full(NUM_Q_HEADS, -jnp.inf)
    assert_close(got[1][21], empty_lse)


D = 64
FORMATS = {
    "int8": "int8",
    "fp8": "fp8",
    "nvfp4": "nvfp4",
    "nvfp4-tensor-scale": "nvfp4",
    "turboquant-3.5": turboquant(D, 3.5),  # the cache's: sparse channels, rescaled
    # E4M3 leaves as quant's quantizers make them (float8_e4m3fn), not as the pools keep them
    # (uint8 bits): new rows are stored in the container's own dtype
    "fp8-float8": "fp8",
    "nvfp4-float8": "nvfp4",
}
# (q_len, kv_len): a decode row; a chunk continuing a 7-token prefix across a page
# boundary; a fresh 11-token prefill (two query tiles); a decode row opening page 3.
MIXED_SEQS = [(1, 9), (5, 12), (11, 11), (1, 17)]


def _low_bit_problem(name, seed):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = zip(*MIXED_SEQS)
    q, k, v, k_pages, v_pages, *rest = _batch(rng, q_lens, kv_lens, head_dim=D, max_pages=4)
    # Spread the row magnitudes so per-row and per-block scales matter.
    grow = lambda x: x * jnp.exp(jnp.asarray(rng.uniform(-1, 1, (*x.shape[:-1], 1)), jnp.float32))
    k, k_pages = grow(k), grow(k_pages)
    if name == "nvfp4-tensor-scale":  # scales other than 1: new rows must use the pages' own
        kq, vq = nvfp4_quantize(k_pages, 0.004), nvfp4_quantize(v_pages, 0.002)
    elif name == "fp8-float8":
        kq, vq = quantize_rows(k_pages, "fp8"), quantize_rows(v_pages, "fp8")
    elif name == "nvfp4-float8":
        kq, vq = (nvfp4_quantize(p, 1.0)._replace(tensor_scale=None) for p in (k_pages, v_pages))
    else:
        fmt = kv_formats.resolve(FORMATS[name])
        kq, vq = fmt.quantize(k_pages), fmt.quantize(v_pages)
    sinks = jnp.asarray(rng.standard_normal(NUM_Q_HEADS), jnp.float32)
    return (q, k, v, kq, vq, *rest), sinks


def test_bfloat16_pages_under_float32_activations_match_reference():
    """float32 q over bfloat16 pages: the TPU kernel sees q, k and v in bfloat16 and gives
    out in float32; the pages hold what the reference writes, bit for bit, and out / lse
    match it to bfloat16's rounding of q."""
    rng = np.random.default_rng(4)
    q, k, v, k_pages, v_pages, *rest = _batch(rng, [1, 6, 1], [9, 14, 3], head_dim=32, max_pages=3)
    args = (q, k, v, k_pages.astype(jnp.bfloat16), v_pages.astype(jnp.bfloat16), *rest)
    want = _reference(*args)
    got = ragged_paged_attention(*args, interpret=True)
    assert got[0].dtype == jnp.float32 and got[2].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=3e-2, atol=3e-2)
    for g, w in zip(got[2:], want[2:]):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_low_bit_pages_match_reference(name):
    """Each low-bit format on a mixed batch: the new rows are quantized into their page
    slots exactly as the reference writes them, and out / lse match (sliding window and
    sinks on int8)."""
    args, sinks = _low_bit_problem(name, seed=1)
    kw = dict(sinks=sinks, sliding_window=5) if name == "int8" else {}
    q, k, v, kq, vq, *rest = args
    ref_pages = [_scalar_tensor_scale(x) for x in (kq, vq)]
    want = _reference(q, k, v, *ref_pages, *rest, kv_format=FORMATS[name], **kw)
    got = ragged_paged_attention(*args, kv_format=FORMATS[name], interpret=True, **kw)
    _assert_matches(got, want, FORMATS[name])
    assert [a.dtype for a in jax.tree.leaves(got[2:])] == [a.dtype for a in jax.tree.leaves((kq, vq))]
    # The write happened: the written slots' codes changed, the rest did not.
    fmt = kv_formats.resolve(FORMATS[name])
    before, after = fmt.leaves(args[3])[0], fmt.leaves(got[2])[0]
    table = np.asarray(args[5])
    page, slot = table[2, 1], 2  # prefill token 10 sits at position 10
    assert not np.array_equal(np.asarray(before[page, slot]), np.asarray(after[page, slot]))
    np.testing.assert_array_equal(np.asarray(before[page, 3:]), np.asarray(after[page, 3:]))


@pytest.mark.parametrize(
    "name,dtype", [("nvfp4-tensor-scale", jnp.float32), ("turboquant-3.5", jnp.bfloat16)]
)
def test_lowers_for_tpu_with_low_bit_pages_and_a_tree(name, dtype):
    """The TPU lowering of the entry with low-bit pages, a tree and a window is the Mosaic
    kernel, whose page operands are the containers' own low-bit leaves (aliased to its
    outputs: no dequantized cache, no second pool)."""
    args, sinks = _low_bit_problem(name, seed=2)
    q, k, v, kq, vq, table, cu, kv_lens = args
    num_tokens = q.shape[0]
    chunk_start = kv_lens - (cu[1:] - cu[:-1])
    tree = TreeMask(chunk_start, jnp.full((num_tokens, 1), -1, jnp.int32))
    fn = lambda q, k, v, kq, vq, table, cu, kv_lens, sinks, tree: ragged_paged_attention(
        q, k, v, kq, vq, table, cu, kv_lens, sinks=sinks, tree=tree, sliding_window=6,
        kv_format=FORMATS[name],
    )
    specs = [spec(x.astype(dtype)) for x in (q, k, v)]
    specs += [jax.tree.map(spec, x) for x in (kq, vq, table, cu, kv_lens, sinks, tree)]
    mlir = export_tpu(fn, *specs)
    assert "tpu_custom_call" in mlir
    fmt = kv_formats.resolve(FORMATS[name])
    assert "kvfold_ragged_paged_attention_" + fmt.label in mlir
    kernel = functools.partial(
        ragged_paged_attention_tpu, sm_scale=0.125, variant=SOFTMAX, kv_format=fmt, interpret=True
    )
    jaxpr = jax.make_jaxpr(kernel)(*args, sinks, tree).jaxpr
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    num_pages = fmt.leaves(kq)[0].shape[0]
    pool = lambda avals: [
        (a.shape, a.dtype) for a in avals if a.ndim >= 3 and a.shape[0] == num_pages
    ]
    leaves = [(x.shape, x.dtype) for x in fmt.leaves(kq) + fmt.leaves(vq)]
    assert pool(x.aval for x in call.invars) == leaves
    assert pool(x.aval for x in call.outvars) == leaves


def test_writes_through_bad_block_table_entries_are_dropped():
    """Inside jit nothing checks block-table values: a -1 entry in a range the step writes
    drops those rows (every leaf), as the reference does, instead of a stray DMA."""
    args, _ = _low_bit_problem("int8", seed=3)
    q, k, v, kq, vq, table, cu, kv_lens = args
    bad = table.at[1, 1].set(-1)  # sequence 1 writes positions 7..11, page 1 holds 8..11
    run = jax.jit(lambda *a: ragged_paged_attention(*a, kv_format="int8", interpret=True))
    got = run(q, k, v, kq, vq, bad, cu, kv_lens)
    want = _reference(q, k, v, kq, vq, bad, cu, kv_lens, kv_format="int8")
    for g, w in zip(jax.tree.leaves(got[2:]), jax.tree.leaves(want[2:]), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    lost = int(table[1, 1])
    np.testing.assert_array_equal(np.asarray(got[2].codes[lost]), np.asarray(kq.codes[lost]))
    others = np.r_[0, 6:18]  # sequences that do not read the bad entry
    assert_close(got[0][others], want[0][others])
