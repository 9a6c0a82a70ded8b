"""CSA2 caches in the engine's page pool: forward_rows on shuffled pages equals model.forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model.deepseek import paged, preset
from model.deepseek.config import window_bytes_per_sequence
from model.deepseek.cache import decode_index_key, encode_kv, encode_window
from model.transformer import lm_head
from pallas_kernels import indexer_topk
from tests.model.deepseek_tiny import positions, tiny
from tests.pallas_kernels.helpers import assert_written_in_place

PAGE_SIZE, NUM_PAGES, B, L = 4, 40, 2, 37
# Chunk ends: odd ones leave ratio-2 groups pending across steps; 20 -> 21 a one-token step.
CUTS = (0, 7, 19, 20, 21, L)


@pytest.fixture(scope="module")
def run():
    """The whole sequence through model.forward (contiguous caches), and chunk by chunk
    through forward_rows on pages in a shuffled order and state slots 2 and 0."""
    config, params = tiny()
    tokens = jax.random.randint(jax.random.key(1), (B, L), 0, config.vocab_size)
    full, full_cache = model.forward(params, config, tokens, positions(B, 0, L), model.init_cache(config, B, L))
    pages, state = paged.init_pool(config, NUM_PAGES, PAGE_SIZE, num_slots=3)
    tables = np.random.default_rng(0).permutation(NUM_PAGES)[:B * 10].reshape(B, 10).astype(np.int32)
    slots = jnp.asarray([2, 0], jnp.int32)
    step = jax.jit(paged.forward_rows, static_argnames=("config", "page_size", "ced"))
    logits, last = [], []
    for a, b in zip(CUTS, CUTS[1:]):
        width = -(-b // PAGE_SIZE)  # the pages the rows see so far, as the engine cuts its tables
        args = (params, config, tokens[:, a:b], positions(B, a, b))
        if b == L:  # the last chunk the CED way too (a prefill step that samples its last token)
            hidden, _, _ = step(*args, pages, state, tables[:, :width], slots, PAGE_SIZE, ced=True)
            last = np.asarray(lm_head(params, config, hidden))
        hidden, pages, state = step(*args, pages, state, tables[:, :width], slots, PAGE_SIZE, ced=False)
        logits.append(np.asarray(lm_head(params, config, hidden)))
    return config, np.asarray(full), full_cache, np.concatenate(logits, 1), last, pages, tables, state, slots


def test_chunked_steps_on_shuffled_pages_equal_the_full_forward(run):
    _, full, _, got, last, *_ = run
    np.testing.assert_allclose(got, full, atol=1e-5)
    np.testing.assert_allclose(last, full[:, -1], atol=1e-5)


def test_pages_hold_the_rows_of_the_contiguous_cache_bit_for_bit(run):
    """Row j of a ratio-r source sits in page table[j r // P], slot (j r % P) / r; the
    indexer and attention therefore read what model.forward's cache holds."""
    config, _, full_cache, _, _, pages, tables, *_ = run
    for i in config.kv_sources:
        r = config.compress_ratios[i]
        per_page = PAGE_SIZE // r
        for got, want in zip(jax.tree.leaves(pages[i]), jax.tree.leaves(full_cache.layers[i]["global"])):
            got, want = np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
            for b in range(B):
                rows = got[tables[b]].reshape((-1,) + got.shape[2:])[:L // r]
                np.testing.assert_array_equal(rows, want[b, :L // r])
                assert rows.shape[0] == L // r and per_page * len(tables[b]) >= L // r
    for i, kind in enumerate(config.layer_kinds):  # Reuse and SWA layers own no pages
        assert bool(pages[i]) == (i in config.kv_sources), kind


@pytest.mark.parametrize("layer", [2, 4])  # a ratio-2 source, the ratio-1 candidate source
def test_indexer_top_k_over_gathered_pages_equals_a_float64_reference(run, layer):
    """What a serving step's indexer selects (pallas_kernels.indexer_topk over the keys it
    gathers from the pages) equals the top-k of I(t, s) = sum_h w_h ReLU(q_h . k_s) computed
    in float64 over model.forward's own keys, rows visible iff s < (p + 1) / r."""
    config, _, full_cache, _, _, pages, tables, state, slots = run
    r, top_k = config.compress_ratios[layer], config.index_top_k
    view = paged._gather(pages, state, jnp.asarray(tables), slots)[layer]["global"]["index_keys"]
    keys = decode_index_key(view, jnp.float32)  # [B, R, Di]
    want_keys = np.asarray(decode_index_key(full_cache.layers[layer]["global"]["index_keys"], jnp.float32), np.float64)
    kq, kw = jax.random.split(jax.random.key(layer))
    q = jax.random.normal(kq, (B, L, config.index_heads, config.index_dim))
    w = jax.random.normal(kw, (B, L, config.index_heads))
    pos = jnp.arange(L, dtype=jnp.int32)
    for b in range(B):
        got, _ = indexer_topk(q[b], w[b], keys[b], pos, top_k=top_k, compress_ratio=r)
        scores = np.einsum("th,ths->ts", np.asarray(w[b], np.float64),
                           np.maximum(np.einsum("thd,sd->ths", np.asarray(q[b], np.float64), want_keys[b]), 0))
        for t in range(L):
            visible = (t + 1) // r
            best = np.sort(np.argsort(-scores[t, :visible], kind="stable")[:top_k])
            np.testing.assert_array_equal(np.asarray(got[t]), np.pad(best, (0, top_k - len(best)),
                                                                     constant_values=-1))


def test_pool_allocates_the_global_budget_per_token_and_the_window_per_slot():
    """Pages hold config.kv_bytes_per_token (model.kv_budget's figure: 890 B for the Flash
    plan, from abstract arrays); a state slot holds the FP8 window of every layer, its end
    and the ratio-2 sources' pending token."""
    tiny_config = tiny()[0]
    flash = preset("deepseek-v4.1-flash")
    for config, build in ((tiny_config, lambda c: paged.init_pool(c, 8, 16, 2)),
                          (flash, lambda c: jax.eval_shape(lambda: paged.init_pool(c, 8, 16, 2)))):
        pages, state = build(config)
        assert paged.global_bytes_per_token(pages, 16) == config.kv_bytes_per_token
        pending = sum(2 * config.head_dim * 4 for i in config.kv_sources if config.compress_ratios[i] == 2)
        assert paged.state_bytes_per_slot(state) == (window_bytes_per_sequence(config) + 4 * config.num_layers
                                                     + pending)
    assert flash.kv_bytes_per_token == 890


def test_a_page_must_hold_whole_compressed_rows():
    with pytest.raises(ValueError, match="compression ratio 2"):
        paged.init_pool(tiny()[0], 8, 3, 2)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto'"):
        paged.init_pool(tiny()[0], 8, 4, 2, kv_cache_dtype="fp8")


@pytest.mark.parametrize("rows,tokens", [(1, 1), (2, 5)])  # a batch-1 decode step, a two-row chunk step
def test_a_step_writes_the_donated_pool_in_place(rows, tokens):
    """forward_rows over a donated pool scatters into every page and state leaf and copies
    none: the step's cost follows its rows, not the pool's size. XLA:CPU computes a float8
    scatter in a wider float over the whole leaf (so the E4M3 leaves are stored as their
    bits, the dtype the encoders give), and turns a one-row scatter or gather into an update
    or a slice that copy insertion copies the leaf for (kv_cache.scatter_rows, take_rows)."""
    config, params = tiny()
    # The smallest leaves, ratio-2 MXFP4 scales [P, 2, 1] and window_end [S], outsize every param.
    num_pages, num_slots = 16384, 32768
    assert max(a.size for a in jax.tree.leaves(params)) < 2 * num_pages
    pages, state = jax.eval_shape(lambda: paged.init_pool(config, num_pages, PAGE_SIZE, num_slots))
    leaves = jax.tree.leaves((pages, state))
    assert all(not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype == jnp.float32 for a in leaves)
    rows_of = lambda encode, d: jax.eval_shape(encode, jax.ShapeDtypeStruct((1, d), jnp.float32))
    source = config.kv_sources[0]
    assert jax.tree.map(lambda a: a.dtype, rows_of(encode_kv, config.head_dim)) == \
        jax.tree.map(lambda a: a.dtype, pages[source]["kv"])
    assert jax.tree.map(lambda a: a.dtype, rows_of(encode_window, config.head_dim)) == \
        jax.tree.map(lambda a: a.dtype, state[source]["window"])
    tables = jnp.arange(rows * 4, dtype=jnp.int32).reshape(rows, 4)
    step = jax.jit(paged.forward_rows, static_argnames=("config", "page_size"), donate_argnames=("pages", "state"))
    text = step.lower(params, config, jnp.ones((rows, tokens), jnp.int32), positions(rows, 11 - tokens, 11), pages,
                      state, tables, jnp.arange(rows, dtype=jnp.int32), PAGE_SIZE).compile().as_text()
    assert_written_in_place(text, 2 * num_pages, len(leaves))
