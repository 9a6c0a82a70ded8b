"""DeepSeek-V4.1 (CSA2) served by the engine: LLM("deepseek-v4.1-tiny") against a plain
model.forward greedy loop, its pool's bytes, the refused configurations, and one engine
step of the Flash plan lowered for TPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model.deepseek import paged, preset
from model.deepseek.replay import persistent_part, resume
from serving import LLM, SamplingParams
from serving.bench import flash_pallas_calls
from serving.engine import Row
from tests.model.deepseek_tiny import tiny

MAX_LEN, NEW = 128, 16
PROMPT_LENS = (5, 37, 20, 11)
# 14 pages of 8 positions: four sequences of 21 to 53 tokens (19 pages) make the scheduler
# preempt; 32 tokens a step: long prompts are chunked
ENGINE = dict(seed=0, max_model_len=MAX_LEN, block_size=8, num_kv_blocks=14, max_num_seqs=4,
              max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def llm():
    return LLM("deepseek-v4.1-tiny", **ENGINE)


def _prompts(seed, *lens):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lens]


REF_ROWS, REF_LEN = 4, 96  # the reference's one prefill shape (rows padded, positions -1)


def _references(prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens after each prompt from plain model.forward calls: the prompts padded
    into one [4, 96] prefill (one compile for every test), then one token per call."""
    config, params = tiny(0)
    tokens, positions = np.zeros((REF_ROWS, REF_LEN), np.int32), np.full((REF_ROWS, REF_LEN), -1, np.int32)
    lens = np.zeros(REF_ROWS, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)], positions[i, :len(p)], lens[i] = p, np.arange(len(p)), len(p)
    cache = model.init_cache(config, REF_ROWS, MAX_LEN)
    logits, cache = model.forward(params, config, tokens, positions, cache, logits_indices=np.maximum(lens - 1, 0))
    out = [np.asarray(jnp.argmax(logits, axis=-1))]
    for i in range(n - 1):
        pos = np.where(lens > 0, lens + i, -1)[:, None].astype(np.int32)
        logits, cache = model.forward(params, config, out[-1][:, None].astype(np.int32), pos, cache)
        out.append(np.asarray(jnp.argmax(logits[:, -1], axis=-1)))
    return [np.stack(out, 1)[i].tolist() for i in range(len(prompts))]


@functools.cache
def _reference(prompt: tuple[int, ...], n: int) -> list[int]:
    return _references([list(prompt)], n)[0]


def test_greedy_tokens_equal_a_forward_loop_batched_chunked_and_preempted(llm):
    config, params = tiny(0)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), llm.runner.params, params))
    prompts = _prompts(0, *PROMPT_LENS)
    params_ = SamplingParams(temperature=0, max_tokens=NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_)
    assert llm.engine.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == _references(prompts, NEW)
    # the same work again hits the prefix cache (its replays are new shapes); a third time
    # meets no new shape: a warm engine compiles nothing
    for i in range(2):
        compiled = llm.runner.num_compilations()
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params_)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert sum(o.num_cached_tokens for o in again) > 0
    assert llm.runner.num_compilations() == compiled


def test_a_prefix_hit_reuses_the_cached_rows_and_replays_the_windows_exactly(llm):
    """The second prompt finds 64 cached tokens (8 pages of compressed rows and index keys);
    its window rings and pending compressor token are rebuilt by replaying the receptive
    field, num_layers * (W - 1) + 1 = 57 tokens (not the whole prefix), before it computes."""
    shared, = _prompts(1, 67)
    first, second = (shared + tail for tail in _prompts(2, 5, 9))
    sp = SamplingParams(temperature=0, max_tokens=12)
    assert llm.runner.replay_len(64) == 57
    a = llm.generate([{"prompt_token_ids": first}], sp)[0]
    b = llm.generate([{"prompt_token_ids": second}], sp)[0]
    assert b.num_cached_tokens == 64
    assert [list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)] == _references([first, second], 12)


@pytest.mark.parametrize("prompt_len", [49, 50])  # the forks recompute an odd or an even position
def test_n_samples_fork_on_their_parents_pages_with_its_state(llm, prompt_len):
    prompt, = _prompts(3, prompt_len)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, n=3))[0]
    want = _reference(tuple(prompt), 8)
    assert [list(c.token_ids) for c in out.outputs] == [want] * 3


def test_swap_preemption_and_a_host_tier_hit_restore_the_state_from_the_pages():
    """Only pages are swapped out and copied down to the host tier: a swapped-in sequence
    and one that hits the host tier both replay their windows before going on."""
    swap = LLM("deepseek-v4.1-tiny", preemption_mode="swap", **ENGINE)
    prompts = _prompts(0, *PROMPT_LENS)
    outs = swap.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=NEW))
    assert swap.engine.num_preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == _references(prompts, NEW)

    tiered = LLM("deepseek-v4.1-tiny", enable_hierarchical_cache=True, host_cache_bytes=1 << 20,
                 hicache_write_policy="write_through", **ENGINE)
    shared, filler = _prompts(6, 67, 90)
    first, second = shared + [1, 2, 3, 4, 5], shared + [9, 8, 7]
    sp = SamplingParams(temperature=0, max_tokens=12)
    for prompt in (first, filler):  # the filler's pages evict the first prompt's from the device
        tiered.generate([{"prompt_token_ids": prompt}], sp)
    out = tiered.generate([{"prompt_token_ids": second}], sp)[0]
    assert out.num_cached_tokens == 64 and tiered.engine.kv.hits["host"] == 64
    assert list(out.outputs[0].token_ids) == _reference(tuple(second), 12)
    tiered.close()


def test_bounded_replay_equals_model_deepseek_replay():
    """window_replay="bounded" rebuilds the windows from the last W tokens only (DeepSeek's
    bounded replay, approximate): the engine's tokens after a prefix hit are those of
    model.deepseek.replay.resume on the same cached rows, then plain forward calls."""
    config, params = tiny(0)
    llm = LLM("deepseek-v4.1-tiny", window_replay="bounded", **ENGINE)
    shared, = _prompts(4, 66)
    first, second = (shared + tail for tail in _prompts(5, 3, 6))
    sp = SamplingParams(temperature=0, max_tokens=8)
    llm.generate([{"prompt_token_ids": first}], sp)
    got = llm.generate([{"prompt_token_ids": second}], sp)[0]
    assert got.num_cached_tokens == 64 and llm.runner.replay_len(64) == config.window

    cache = model.init_cache(config, 1, MAX_LEN)
    _, cache = model.forward(params, config, jnp.asarray([second[:64]]), jnp.arange(64)[None], cache)
    cache = resume(params, config, jnp.asarray([second]), 64, persistent_part(cache))
    logits, cache = model.forward(params, config, jnp.asarray([second[64:]]), jnp.arange(64, len(second))[None],
                                  cache)
    want = [int(jnp.argmax(logits[0, -1]))]
    while len(want) < 8:
        pos = jnp.asarray([[len(second) + len(want) - 1]])
        logits, cache = model.forward(params, config, jnp.asarray([[want[-1]]]), pos, cache)
        want.append(int(jnp.argmax(logits[0, -1])))
    assert list(got.outputs[0].token_ids) == want


def test_prompt_logprobs_and_logprobs_equal_the_forward(llm):
    """Every prompt token's logprob (the non-CED path, each chunk alone beside a decoding
    row) and the sampled tokens' logprobs equal one forward over the whole text, float64."""
    config, params = tiny(0)
    prompt, other = _prompts(7, 45, 6)
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], sp)[0]
    text = prompt + list(out.outputs[0].token_ids)
    logits, _ = model.forward(params, config, np.asarray([text], np.int32), np.arange(len(text), dtype=np.int32)[None],
                              model.init_cache(config, 1, MAX_LEN))
    logits = np.asarray(logits[0], np.float64)
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    want = logprobs[np.arange(len(text) - 1), text[1:]]
    got = [lp[t] for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    got += [lp[t] for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_engine_pool_holds_the_global_budget_per_token(llm):
    config = llm.config
    assert paged.global_bytes_per_token(llm.runner.pool["target"], 8) == config.kv_bytes_per_token
    assert jax.tree.leaves(llm.runner.state)[0].shape[0] == 4  # a state slot per max_num_seqs


def test_text_in_text_out_with_the_byte_tokenizer(llm):
    out = llm.generate("CSA2", SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids == list(b"CSA2") and len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be 'auto'"),
    (dict(block_size=1), "does not fit compression ratio 2"),
    (dict(window_replay="none"), "window_replay"),
    (dict(enable_lora=True), "enable_lora"),
])
def test_unsupported_configurations_are_value_errors(kwargs, match):
    config, params = tiny(0)
    with pytest.raises(ValueError, match=match):
        LLM.from_loaded(config, params, model.tokenizer.byte_tokenizer(), max_model_len=MAX_LEN, **kwargs)


def test_bad_requests_and_rows_are_value_errors(llm):
    with pytest.raises(ValueError, match="distinct state slots"):
        llm.runner.step_batch([Row((1,), 0, (0,), sample=True, slot=1), Row((2,), 0, (1,), sample=True, slot=1)])
    with pytest.raises(ValueError, match="weights_dtype"):
        model.load("deepseek-v4.1-tiny", weights_dtype="int8")


def test_a_flash_engine_step_lowers_to_pallas_kernels_for_tpu():
    """The Flash plan's shapes (abstract arrays only): every layer one sparse-attention
    kernel, every index source (Full and Reindex layers) one indexer kernel, in a decode
    step; twice that in a step with one prefill chunk (CED: decoder layers on the chunk's
    tail), which runs the chunk and the other rows apart."""
    config = preset("deepseek-v4.1-flash")
    for lens, passes in (((1, 1, 1, 1), 1), ((128, 1), 2)):
        calls = flash_pallas_calls(lens)
        assert calls["all"] == passes * (config.num_layers + len(config.index_sources))
        assert calls["sparse_attention"] == passes * config.num_layers
        assert calls["indexer"] == passes * len(config.index_sources)
