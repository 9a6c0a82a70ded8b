"""kv_cache_dtype: stored bytes, rounding error, and prefill/decode reading the same codes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
import quant
from model import kv_formats
from model.config import ModelConfig
from model.context import ForwardContext
from model.kv_cache import CacheLayout, slot_mapping
from quant.lloyd_max import sphere_codebook_mse

FORMATS = kv_formats.KV_CACHE_DTYPES
QUANTIZED = tuple(f for f in FORMATS if f not in kv_formats.FLOAT_FORMATS)
D = 32  # tiny head_dim: every format's blocks and groups divide it

# Bytes one (token, kv head) row of K (or V) takes, from each format's definition:
# codes d*bits/8 + scales. Independent of the code that allocates the pools.
def spec_row_bytes(fmt: str, d: int) -> int:
    return {"auto": 4 * d, "float32": 4 * d, "bfloat16": 2 * d,
            "fp8": d + 4, "int8": d + 4,                      # codes + f32 row scale
            "nvfp4": d // 2 + d // 16,                        # E2M1 nibbles + E4M3 per 16
            "mxfp4": d // 2 + d // 32,                        # E2M1 nibbles + UE8M0 per 32
            "kivi-int4": d // 2 + 2 * 2 * d // 32,            # f16 scale+min: keys per channel
            "kivi-int2": d // 4 + 2 * 2 * d // 32,            # per 32 tokens, values per 32 ch
            # + per half: f32 norm, one sparse channel (uint8 index, bf16 value)
            "turboquant-3.5": (d // 2 * 4 + d // 2 * 3) // 8 + 2 * (4 + 1 + 2),
            "turboquant-2.5": (d // 2 * 3 + d // 2 * 2) // 8 + 2 * (4 + 1 + 2)}[fmt]


# Upper bound on the rms relative error of a row, from each format's rounding: bf16 2^-8;
# int8 sqrt(d)/254 (|err| <= absmax/254); fp8 2^-4 (3 mantissa bits); nvfp4 E2M1 steps of
# 1/3..1/2 within a binade; mxfp4 the same steps on a power-of-two scale per 32 that
# puts the block max in [4, 8), saturating above 6; KIVI (max-min)/(2^b - 1)/2 per element over groups of 32;
# TurboQuant sqrt of the Lloyd-Max MSE of its two halves, with room for the sample.
ROW_RMS_BOUND = {"auto": 0.0, "float32": 0.0, "bfloat16": 2 ** -8, "int8": D ** 0.5 / 254,
                 "fp8": 2 ** -4, "nvfp4": 0.2, "mxfp4": 0.25, "kivi-int4": 0.15, "kivi-int2": 0.6,
                 "turboquant-3.5": 0.2, "turboquant-2.5": 0.35}


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_heads=4,
                         num_kv_heads=2, head_dim=D, layer_kinds=("attention", "sliding_attention"),
                         max_position_embeddings=256, sliding_window=24)
    return config, model.init_params(config, jax.random.key(0))


def context(positions, block_tables, page_size, num_pages):
    return ForwardContext(positions, (None, None), block_tables,
                          slot_mapping(positions, block_tables, page_size, num_pages), page_size)


def write_read(fmt, k, v, chunks, page_size=32, pages_per_seq=3, spare=2, seed=0):
    """Write k, v [B, T, H, D] in the given chunk lengths into shuffled pages, read back."""
    b, t, h, d = k.shape
    num_pages = b * pages_per_seq + spare
    tables = np.random.default_rng(seed).permutation(num_pages)[:b * pages_per_seq]
    tables = jnp.asarray(tables.reshape(b, pages_per_seq), jnp.int32)
    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_heads=h,
                         num_kv_heads=h, head_dim=d, layer_kinds=("attention",), max_position_embeddings=256)
    cache = kv_formats.init_kv_pages(config, CacheLayout(b, num_pages, page_size, fmt), jnp.float32)
    start = 0
    for n in chunks:
        pos = jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (b, n))
        ctx = context(pos, tables, page_size, num_pages)
        cache = kv_formats.write_kv(cache, k[:, start:start + n], v[:, start:start + n], ctx)
        start += n
    got_k, got_v = kv_formats.read_kv(cache, ctx, jnp.float32)
    return cache, np.asarray(got_k)[:, :t], np.asarray(got_v)[:, :t]


def random_kv(t=70, seed=1):
    kk, kv = jax.random.split(jax.random.key(seed))
    k = jax.random.normal(kk, (2, t, 2, D)) * (1 + 4 * (jnp.arange(D) == 3))  # an outlier channel
    return k, jax.random.normal(kv, (2, t, 2, D))


def rms_relative(got, want):
    err = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    return float(np.sqrt(np.mean(err ** 2)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_bytes_per_token_are_the_formats_bytes(tiny, fmt):
    config, _ = tiny
    cache = model.init_cache(config, 2, 100, kv_cache_dtype=fmt)
    pools = [layer.pages for layer in cache.layers]
    tokens = jax.tree.leaves(pools)[0].shape[0] * cache.page_size
    measured = sum(leaf.nbytes for leaf in jax.tree.leaves(pools)) / tokens
    spec = spec_row_bytes(fmt, D) * 2 * config.num_kv_heads * config.num_layers
    assert measured == spec == kv_formats.bytes_per_token(fmt, config)
    recent = sum(leaf.nbytes for layer in cache.layers for leaf in jax.tree.leaves(layer.recent))
    assert recent / cache.batch_size == kv_formats.recent_bytes_per_seq(fmt, config)


def test_default_model_bytes_per_token_table():
    """The numbers in model/kv_formats.py's table (head_dim 64), times 30 layers x 3 heads x K,V."""
    config = ModelConfig(vocab_size=8, hidden_size=576, intermediate_size=8, num_heads=9,
                         num_kv_heads=3, head_dim=64, layer_kinds=("attention",) * 30,
                         max_position_embeddings=8192)
    row = {"float32": 256, "bfloat16": 128, "fp8": 68, "int8": 68, "nvfp4": 36, "mxfp4": 34, "kivi-int4": 40,
           "kivi-int2": 24, "turboquant-3.5": 42, "turboquant-2.5": 34}
    for fmt, nbytes in row.items():
        assert nbytes == spec_row_bytes(fmt, 64)
        assert kv_formats.bytes_per_token(fmt, config) == nbytes * 180, fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_back_error_within_the_formats_rounding(fmt):
    k, v = random_kv()
    _, got_k, got_v = write_read(fmt, k, v, [70])
    err = max(rms_relative(got_k, np.asarray(k)), rms_relative(got_v, np.asarray(v)))
    assert err <= ROW_RMS_BOUND[fmt] + 1e-7
    if fmt in QUANTIZED:
        assert err > 1e-4  # the codes really are low-bit


def test_elementwise_bounds_of_row_formats():
    k, _ = random_kv()
    x = np.asarray(k, np.float64)
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    _, int8, _ = write_read("int8", k, k, [70])
    assert np.all(np.abs(int8 - x) <= amax / 254 * (1 + 1e-5))
    _, fp8, _ = write_read("fp8", k, k, [70])
    assert np.all(np.abs(fp8 - x) <= 2 ** -4 * np.abs(x) + 2 ** -10 * amax / 448 + 1e-6)
    _, nvfp4, _ = write_read("nvfp4", k, k, [70])
    block_amax = np.repeat(np.max(np.abs(x.reshape(*x.shape[:-1], -1, 16)), -1), 16, -1)
    assert np.all(np.abs(nvfp4 - x) <= block_amax * (1 + 2 ** -4) / 6 + 1e-6)


def test_turboquant_error_is_the_lloyd_max_error_of_its_channel_split():
    """The slow RoPE pairs (channels [D/4, D/2) and [3D/4, D)) get the higher rate: keys
    whose energy sits there (as real keys' does) lose what each half's rotated rest (the
    half without its largest channel, kept aside) loses at its rate, rescaled to its own
    norm: e_b = ||c/||c|| - u||^2 = 2 - 2 sqrt(1 - D(b)) of the rest's energy. The same
    keys with the energy in the fast pairs lose much more."""
    k, _ = random_kv(t=96)
    slow = np.zeros(D, bool)
    slow[D // 4:D // 2] = slow[3 * D // 4:] = True
    loss = lambda b: 2 - 2 * np.sqrt(1 - sphere_codebook_mse(D // 2, b))
    for fmt, (hi, lo) in (("turboquant-3.5", (4, 3)), ("turboquant-2.5", (3, 2))):
        errors = {}
        for name, outliers in (("slow", slow), ("fast", ~slow)):
            x = np.asarray(k, np.float64) * np.where(outliers, 3.0, 1.0)
            _, got, _ = write_read(fmt, jnp.asarray(x, jnp.float32), k, [96])
            errors[name] = np.mean(np.sum((got - x) ** 2, -1) / np.sum(x ** 2, -1))
            # each row's energy in each half, less the half's largest channel
            rest = lambda half: np.sum(half ** 2, -1) - np.max(half ** 2, -1)
            want = np.mean((rest(x[..., slow]) * loss(hi) + rest(x[..., ~slow]) * loss(lo)) / np.sum(x ** 2, -1))
            assert abs(errors[name] / want - 1) < 0.25, (fmt, name, errors, want)
        assert errors["fast"] > 1.5 * errors["slow"], (fmt, errors)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_pages_equal_kivi_compress_with_the_newest_page_exact(bits):
    """Rule: of L tokens, the first L // 32 * 32 are KIVI-quantized, the rest exact."""
    k, v = random_kv(t=70)
    _, got_k, got_v = write_read(f"kivi-int{bits}", k, v, [70])
    kv = quant.kivi_compress(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), bits, window=0)
    want_k, want_v = (np.swapaxes(np.asarray(a), 1, 2) for a in quant.kivi_decompress(kv))
    # Scales and minimums are stored as float16: 2^-11 relative on each.
    span = np.abs(np.asarray(k)).max() * 2
    np.testing.assert_allclose(got_k, want_k, atol=span * 2 ** -9)
    np.testing.assert_allclose(got_v, want_v, atol=np.abs(np.asarray(v)).max() * 2 * 2 ** -9)
    np.testing.assert_array_equal(got_k[:, 64:], np.asarray(k)[:, 64:])  # the newest page
    assert np.abs(got_k[:, :64] - np.asarray(k)[:, :64]).max() > 1e-3


# (TurboQuant is left out: its codes come from a matmul whose float rounding may differ
# with the chunk's shape, so a coordinate on a code boundary may flip.)
@pytest.mark.parametrize("fmt", ["kivi-int2", "int8", "nvfp4"])
def test_stored_codes_do_not_depend_on_chunking(fmt):
    k, v = random_kv(t=70)
    one, _, _ = write_read(fmt, k, v, [70])
    many, _, _ = write_read(fmt, k, v, [20, 1, 1, 30, 1, 17])
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def run_incremental(config, params, tokens, fmt, split):
    """Prefill tokens[:, :split] (padded to the full width), decode one token at a time up to
    the last, then the last token both as a decode step and as a padded prefill chunk."""
    b, t = tokens.shape
    cache = model.init_cache(config, b, t, kv_cache_dtype=fmt)
    pos = jnp.where(jnp.arange(t) < split, jnp.arange(t), -1)
    logits, cache = model.forward(params, config, tokens, jnp.broadcast_to(pos, (b, t)), cache)
    steps = [np.asarray(logits)[:, :split]]
    for p in range(split, t - 1):
        logits, cache = model.forward(params, config, tokens[:, p:p + 1], jnp.full((b, 1), p), cache)
        steps.append(np.asarray(logits))
    twin = jax.tree.map(jnp.copy, cache)
    decode, _ = model.forward(params, config, tokens[:, -1:], jnp.full((b, 1), t - 1), cache)
    chunk_tokens = jnp.zeros_like(tokens).at[:, 0].set(tokens[:, -1])
    chunk_pos = jnp.broadcast_to(jnp.where(jnp.arange(t) == 0, t - 1, -1), (b, t))
    chunk, _ = model.forward(params, config, chunk_tokens, chunk_pos, twin)
    return np.concatenate(steps + [np.asarray(decode)], 1), np.asarray(decode)[:, 0], np.asarray(chunk)[:, 0]


@pytest.fixture(scope="module")
def float_logits(tiny):
    config, params = tiny
    tokens = jax.random.randint(jax.random.key(5), (2, 40), 0, config.vocab_size)
    logits, _ = model.forward(params, config, tokens, jnp.broadcast_to(jnp.arange(40), (2, 40)),
                              model.init_cache(config, 2, 40))
    return tokens, np.asarray(logits)


@pytest.fixture(scope="module")
def logits_through(tiny, float_logits):
    """fmt -> the tiny model's logits on float_logits' tokens through a cache of that format
    (one forward each, computed on first use and shared; no test relies on another's run)."""
    config, params = tiny
    tokens, _ = float_logits

    @functools.cache
    def logits(fmt):
        out, _ = model.forward(params, config, tokens, jnp.broadcast_to(jnp.arange(40), (2, 40)),
                               model.init_cache(config, 2, 40, kv_cache_dtype=fmt))
        return np.asarray(out)

    return logits


def logits_error(got, want):
    """Error of logits relative to the spread of the float ones."""
    return np.linalg.norm(got - want) / np.linalg.norm(want - want.mean(-1, keepdims=True))


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_through_cache_format(tiny, float_logits, logits_through, fmt):
    """Close to the float cache (within the format's row error); decode and prefill read the
    same codes; prefill + decode equals one prefill wherever both hold the same codes."""
    config, params = tiny
    tokens, want = float_logits
    full = logits_through(fmt)
    err = logits_error(full, want)
    assert err <= ROW_RMS_BOUND[fmt] + 1e-6
    if fmt in QUANTIZED:
        assert err > 1e-5

    # Split at a page boundary: KIVI quantizes a page in the write that fills it, so a
    # query inside a page completed later in the same chunk reads it quantized, while a
    # decode step before the page fills reads it exact (the documented chunking caveat).
    steps, decode, chunk = run_incremental(config, params, tokens, fmt, split=32)
    np.testing.assert_allclose(decode, chunk, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(steps, full, atol=1e-5, rtol=1e-5)


def test_more_bits_less_error(float_logits, logits_through):
    _, want = float_logits
    err = {fmt: logits_error(logits_through(fmt), want) for fmt in
           ("kivi-int4", "kivi-int2", "turboquant-3.5", "turboquant-2.5", "bfloat16", "int8",
            "nvfp4", "mxfp4")}
    assert err["kivi-int4"] < err["kivi-int2"]
    assert err["turboquant-3.5"] < err["turboquant-2.5"]
    assert err["bfloat16"] < err["int8"] < err["nvfp4"] < err["mxfp4"]


def test_invalid_kv_cache_dtype_names_the_allowed_ones(tiny):
    config, _ = tiny
    with pytest.raises(ValueError, match="allowed: auto, float32, bfloat16, fp8, int8"):
        model.init_cache(config, 1, 16, kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        model.init_paged_cache(config, 4, 16, jnp.float32, jnp.zeros((1, 4), jnp.int32), "int3")
    with pytest.raises(ValueError, match="page_size and head_dim divisible by 32"):
        model.init_cache(config, 1, 64, page_size=16, kv_cache_dtype="kivi-int4")
    odd = dataclasses.replace(config, head_dim=24, hidden_size=96)
    with pytest.raises(ValueError, match="head_dim divisible by 16"):
        model.init_cache(odd, 1, 16, kv_cache_dtype="nvfp4")


def test_int8_weights_and_int8_kv_cache_still_answer_paris(default_model, default_tokenizer):
    config, params = default_model
    params = quant.quantize_params(params, "int8")
    tok = default_tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(text, add_special_tokens=False)
    n, steps = len(ids), 12
    cache = model.init_cache(config, 1, n + steps, kv_cache_dtype="int8")
    logits, cache = model.forward(params, config, jnp.asarray([ids]), jnp.arange(n)[None], cache)
    out = [int(jnp.argmax(logits[0, -1]))]
    for p in range(n, n + steps - 1):
        logits, cache = model.forward(params, config, jnp.asarray([[out[-1]]]), jnp.asarray([[p]]), cache)
        out.append(int(jnp.argmax(logits[0, -1])))
    assert "Paris" in tok.decode(out), tok.decode(out)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "nvfp4", "mxfp4", "turboquant-3.5", "turboquant-2.5", "kivi-int4"])
def test_quantized_pages_go_through_the_kernel_entry(tiny, monkeypatch, fmt):
    """Prefill chunks and decode rows over low-bit pages call ragged_paged_attention with
    the pages' format (the kernel on TPU); KIVI, whose newest page lives outside the
    pages, reads through read_kv."""
    import model.layers

    config, params = tiny
    calls = []
    real = model.layers.ragged_paged_attention

    def recording(*args, **kw):
        calls.append(kw["kv_format"])
        return real(*args, **kw)

    monkeypatch.setattr(model.layers, "ragged_paged_attention", recording)
    jax.clear_caches()  # the jitted forward must trace again to see the recorder
    cache = model.init_cache(config, 1, 32, kv_cache_dtype=fmt)
    tokens = jax.random.randint(jax.random.key(2), (1, 3), 0, config.vocab_size)
    model.forward(params, config, tokens, jnp.arange(3)[None], cache)
    assert len(calls) == (0 if fmt.startswith("kivi") else config.num_layers)
    assert all(c is not None for c in calls)
