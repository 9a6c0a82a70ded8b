"""DeepSeek-V4.1 (CSA2) served by the engine: LLM("deepseek-v4.1-tiny") against a plain
model.forward greedy loop, its pool's bytes, the refused configurations, and one engine
step of the Flash plan lowered for TPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model.deepseek import paged, preset
from model.deepseek.replay import persistent_part, resume
from serving import LLM, SamplingParams
from serving.engine import Row
from serving.runner import ModelRunner, _step
from tests.model.deepseek_tiny import tiny
from pallas_kernels.lowering import export_tpu, kernel_calls
from tests.pallas_kernels.helpers import spec

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


def _greedy(config, params, prompt, n):
    """n greedy tokens of model.forward: the prompt in one call, then one token per call."""
    cache = model.init_cache(config, 1, MAX_LEN)
    logits, cache = model.forward(params, config, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], cache)
    out = [int(jnp.argmax(logits[0, -1]))]
    while len(out) < n:
        pos = jnp.asarray([[len(prompt) + len(out) - 1]])
        logits, cache = model.forward(params, config, jnp.asarray([[out[-1]]]), pos, cache)
        out.append(int(jnp.argmax(logits[0, -1])))
    return out


def test_greedy_tokens_equal_a_forward_loop_batched_chunked_and_preempted(llm):
    config, params = tiny(0)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), llm.runner.params, params))
    prompts = _prompts(0, *PROMPT_LENS)
    params_ = SamplingParams(temperature=0, max_tokens=NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_)
    assert llm.engine.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == _greedy(config, params, prompt, NEW)
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
    config, params = tiny(0)
    shared, = _prompts(1, 67)
    first, second = (shared + tail for tail in _prompts(2, 5, 9))
    sp = SamplingParams(temperature=0, max_tokens=12)
    assert llm.runner.replay_len(64) == 57
    a = llm.generate([{"prompt_token_ids": first}], sp)[0]
    b = llm.generate([{"prompt_token_ids": second}], sp)[0]
    assert b.num_cached_tokens == 64
    assert list(a.outputs[0].token_ids) == _greedy(config, params, first, 12)
    assert list(b.outputs[0].token_ids) == _greedy(config, params, second, 12)


@pytest.mark.parametrize("prompt_len", [49, 50])  # the forks recompute an odd or an even position
def test_n_samples_fork_on_their_parents_pages_with_its_state(llm, prompt_len):
    config, params = tiny(0)
    prompt, = _prompts(3, prompt_len)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, n=3))[0]
    want = _greedy(config, params, prompt, 8)
    assert [list(c.token_ids) for c in out.outputs] == [want] * 3


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
    (dict(preemption_mode="swap"), "swap"),
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
    step and in a prefill step (CED: decoder layers on the chunk's tail)."""
    config = preset("deepseek-v4.1-flash")
    params = jax.eval_shape(lambda k: model.init_params(config, k, jnp.bfloat16), jax.random.key(0))
    pages, state = jax.eval_shape(lambda: paged.init_pool(config, 64, 16, 4))
    runner = ModelRunner.__new__(ModelRunner)  # its batch packing only: a Flash pool does not fit here
    runner.__dict__.update(config=config, draft=None, lora=None, csa2=True, max_num_seqs=4, max_pages_per_seq=64,
                           page_size=16, mask_words=-(-config.vocab_size // 32))
    for lens, start in (((1, 1, 1, 1), 300), ((128,), 0)):
        batch = runner.step_batch([Row((0,) * n, start, tuple(range(32)), sample=True, slot=i)
                                   for i, n in enumerate(lens)])
        mlir = export_tpu(lambda p, pool, b: _step(p, config, 16, pool, b, False, False), params,
                          {"target": pages, "state": state}, jax.tree.map(lambda a: spec(np.asarray(a)), batch))
        assert kernel_calls(mlir, "tpu_custom_call") == config.num_layers + len(config.index_sources)
        assert kernel_calls(mlir, "kvfold_sparse_attention") == config.num_layers
        assert kernel_calls(mlir, "kvfold_indexer_scores") == len(config.index_sources)
