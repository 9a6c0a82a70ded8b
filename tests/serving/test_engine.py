"""The engine and the LLM API on a tiny random model (fast to compile) that shares the
default model's tokenizer; one test on the real default model."""

import jax
import numpy as np
import pytest

import model
from model.config import ModelConfig
from serving import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model():
    config = ModelConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_heads=4,
                         num_kv_heads=2, head_dim=8, layer_kinds=("attention",) * 2,
                         max_position_embeddings=512, eos_token_id=2)
    return config, model.init_params(config, jax.random.key(0))


@pytest.fixture
def make_llm(tiny_model, default_tokenizer):
    def make(**kw):
        kw = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 64, **kw}
        return LLM.from_loaded(*tiny_model, default_tokenizer, **kw)
    return make


def prompts(n, length=20, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 49152, length + 3 * i).tolist()} for i in range(n)]


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_identical_alone_batched_preempted_and_after_prefix_hit(make_llm):
    ps = prompts(4)
    alone = [ids(make_llm(enable_prefix_caching=False).generate(p, GREEDY))[0] for p in ps]
    assert ids(make_llm().generate(ps, GREEDY)) == alone  # full batch
    # A pool so small that requests get preempted (recompute) and resumed.
    small = make_llm(num_kv_blocks=5)
    assert ids(small.generate(ps, GREEDY)) == alone
    assert small.engine.num_preemptions > 0
    swap = make_llm(num_kv_blocks=5, preemption_mode="swap")
    assert ids(swap.generate(ps, GREEDY)) == alone
    assert swap.engine.num_preemptions > 0
    cached = make_llm()
    cached.generate(ps, GREEDY)
    again = cached.generate(ps, GREEDY)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert ids(again) == alone


def test_precompiled_engine_compiles_nothing_while_serving(make_llm):
    """LLM(precompile=True) compiles every step shape at start-up (ModelRunner.buckets)
    and the page copies and swaps: a mixed workload after it — chunked prefill, decode,
    swap preemption, prefix hits, n > 1 (forks, copy-on-write), greedy and sampled, every
    sequence count — compiles nothing at all (counted by jax's compile events). A request
    of more samples than max_num_seqs is refused (it could never run)."""
    from tests.compiles import counting

    with counting() as startup:
        llm = make_llm(precompile=True, num_kv_blocks=9, preemption_mode="swap")
    assert len(startup) >= len(llm.runner.buckets(64)) == 9
    rng = np.random.default_rng(0)
    ps = [{"prompt_token_ids": rng.integers(3, 49152, n).tolist()} for n in (5, 20, 70, 33)]
    hit = {"prompt_token_ids": ps[2]["prompt_token_ids"][:40] + [7, 8]}
    with counting() as serving:
        greedy = llm.generate(ps, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert llm.engine.num_preemptions > 0  # 9 pages of 16 tokens do not hold all four
        llm.generate(ps[2], GREEDY)
        sampled = llm.generate([hit, ps[0]], SamplingParams(temperature=0.8, n=3, max_tokens=10, seed=1,
                                                            ignore_eos=True))
    assert serving == []
    assert sampled[0].num_cached_tokens == 32 and all(len(o.outputs) == 3 for o in sampled)
    assert ids(greedy)[1][:12] == ids(make_llm(enable_prefix_caching=False).generate(ps[1], GREEDY))[0]
    with pytest.raises(ValueError, match="n=5 samples are more sequences than max_num_seqs=4"):
        llm.generate(ps[0], SamplingParams(n=5))


def test_update_weights_follows_the_new_weights_without_recompiling(make_llm, tiny_model,
                                                                   default_tokenizer):
    """RL rollouts: after update_weights the engine answers as one built on the new
    weights, misses the prefix cache it had (stale K/V), and compiles nothing new; bad
    pytrees and in-flight requests are ValueErrors that keep the weights."""
    import jax.numpy as jnp

    config, _ = tiny_model
    other = model.init_params(config, jax.random.key(1))
    ps = prompts(3)
    fresh = LLM.from_loaded(config, other, default_tokenizer, max_model_len=128, max_num_seqs=4,
                            max_num_batched_tokens=64)
    want = ids(fresh.generate(ps, GREEDY))
    llm = make_llm()
    assert ids(llm.generate(ps, GREEDY)) != want
    warm = llm.runner.num_compilations()
    llm.update_weights(jax.tree.map(np.asarray, other))  # host arrays are put on device
    again = llm.generate(ps, GREEDY)
    assert ids(again) == want
    assert all(o.num_cached_tokens == 0 for o in again)
    assert llm.runner.num_compilations() == warm
    narrow = {**other, "embed": other["embed"][:, :16]}
    with pytest.raises(ValueError, match=r"params\['embed'\] has shape \(49152, 16\)"):
        llm.update_weights(narrow)
    with pytest.raises(ValueError, match="differ in structure"):
        llm.update_weights({"embed": other["embed"]})
    stream = llm.stream(ps[0], GREEDY)
    next(stream)
    with pytest.raises(ValueError, match="in flight"):
        llm.update_weights(other)
    list(stream)
    assert ids(llm.generate(ps, GREEDY)) == want
    assert llm.runner.params["embed"].dtype == jnp.float32


def test_step_shapes_are_few_and_tables_full_width(make_llm):
    """A step's shape depends on its rows' token counts only through a few buckets
    (ModelRunner.shape): decode-only steps by row count, steps with chunks by token
    count and one-or-several chunks, rows padded to max_num_seqs; block tables are always
    max_model_len wide (attention stops at the live pages, tests/pallas_kernels)."""
    from serving.engine import Row

    runner = make_llm(max_model_len=512).runner  # max_num_seqs 4, max_num_batched_tokens 64
    assert runner.shape([1]) == (1, 1, 1, 0) and runner.shape([1, 1, 1]) == (4, 4, 1, 0)
    assert runner.shape([20]) == (32, 4, 32, 1) and runner.shape([3]) == (16, 4, 16, 1)
    assert runner.shape([20, 1, 1]) == (32, 4, 32, 1) and runner.shape([20, 9, 1]) == (32, 4, 32, 4)
    assert list(runner.buckets(64)) == [(1, 1, 1, 0), (2, 2, 1, 0), (4, 4, 1, 0), (16, 4, 16, 1), (16, 4, 16, 4),
                                        (32, 4, 32, 1), (32, 4, 32, 4), (64, 4, 64, 1), (64, 4, 64, 4)]
    for shape, (lens, trees) in runner.buckets(64).items():
        assert runner.shape(lens) == shape and trees == 0 and sum(lens) <= 64 and len(lens) <= 4
    table = list(range(100, 132))
    rows = [Row([1] * 20, 0, table, sample=True), Row([1], 40, table[:3], sample=True)]
    tables = np.asarray(runner.step_batch(rows).block_tables)
    assert tables.shape == (4, 32) and tables[0].tolist() == table and tables[1, :4].tolist() == [100, 101, 102, 0]


def test_abort_frees_pages_immediately(make_llm):
    llm = make_llm(enable_prefix_caching=False)
    stream = llm.stream(prompts(2), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    assert llm.engine.kv.tables  # pages are held mid-generation
    stream.close()  # abandoning the stream aborts its requests
    assert not llm.engine.kv.tables
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_pages
    llm.engine.kv.check()


def test_parallel_sampling_shares_prompt_pages_copy_on_write(make_llm):
    llm = make_llm(block_size=8)
    copies = []
    original = llm.runner.copy_pages
    llm.runner.copy_pages = lambda pairs: (copies.extend(pairs), original(pairs))
    p = prompts(1, length=21)[0]  # 21 tokens: the last prompt page is partial and shared
    out = llm.generate(p, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs) == 3
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3  # independent samples
    assert len(copies) == 2  # each child copied the shared partial page once
    greedy = llm.generate(p, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == ids([out])[0][:0] + \
        ids(make_llm().generate(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))[0]


def test_seeded_sampling_is_reproducible_across_batches(make_llm):
    sp = SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=10, ignore_eos=True)
    p = prompts(3)
    alone = ids(make_llm().generate(p[1], sp))[0]
    assert ids(make_llm().generate(p, sp))[1] == alone


def test_stream_deltas_add_up_to_generate(make_llm):
    llm = make_llm()
    p = {"prompt_token_ids": prompts(1)[0]["prompt_token_ids"]}
    full = llm.generate(p, GREEDY)[0].outputs[0]
    text, toks = "", []
    for delta in llm.stream(p, GREEDY):
        text += delta.outputs[0].text
        toks += delta.outputs[0].token_ids
    assert (text, toks) == (full.text, full.token_ids)


def reference_prompt_logprobs(config, params, prompt):
    """log p(prompt[i] | prompt[:i]) for i >= 1 from one whole-prompt forward, in float64."""
    cache = model.init_cache(config, 1, 64 * -(-len(prompt) // 64))
    logits, _ = model.forward(params, config, np.asarray([prompt], np.int32),
                              np.arange(len(prompt), dtype=np.int32)[None], cache)
    logits = np.asarray(logits[0], np.float64)
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return logprobs[np.arange(len(prompt) - 1), prompt[1:]], logprobs


def test_prompt_logprobs_equal_a_whole_prompt_forward(make_llm, tiny_model):
    """Prompt logprobs, computed chunk by chunk (chunks of 16 here), equal one forward over
    the whole prompt; a request asking for them computes its whole prompt even when the
    prefix cache holds it, and streaming reports them once."""
    prompt = prompts(1, length=40)[0]["prompt_token_ids"]
    want, full = reference_prompt_logprobs(*tiny_model, prompt)
    llm = make_llm(max_num_batched_tokens=16)
    llm.generate({"prompt_token_ids": prompt}, GREEDY)  # the prompt's pages are now cached
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    np.testing.assert_allclose([lp[t] for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])], want, atol=1e-4)
    for i, lp in enumerate(out.prompt_logprobs[1:]):
        top = np.argsort(-full[i])[:2]
        assert set(top) <= set(lp) and len(lp) <= 3
    streamed = [o.prompt_logprobs for o in llm.stream({"prompt_token_ids": prompt}, params)]
    assert streamed[0] == out.prompt_logprobs and all(s is None for s in streamed[1:])
    assert llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].prompt_logprobs is None


def test_stop_token_ids_stop_strings_and_logprobs(make_llm):
    llm = make_llm()
    p = prompts(1)[0]
    free = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3))[0]
    out = free.outputs[0]
    assert len(out.logprobs) == 12 and all(len(lp) >= 3 for lp in out.logprobs)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert max(lp.values()) == lp[tok] and all(v <= 0 for v in lp.values())  # greedy = top-1
    stop_tok = out.token_ids[5]
    first = out.token_ids.index(stop_tok)
    res = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                         stop_token_ids=[stop_tok]))[0].outputs[0]
    assert res.token_ids == out.token_ids[:first] and res.finish_reason == "stop"
    assert res.stop_reason == stop_tok
    stop_str = out.text[len(out.text) // 2:][:3]
    assert len(stop_str) == 3, out.text  # twelve greedy tokens spell more than six characters
    res = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                         stop=[stop_str]))[0].outputs[0]
    assert res.finish_reason == "stop" and res.stop_reason == stop_str
    assert res.text == out.text[:out.text.index(stop_str)]  # cut before the stop string's first match
    assert res.token_ids == out.token_ids[:len(res.token_ids)] and len(res.token_ids) < 12
    assert free.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("prompt,params,match", [
    ("", GREEDY, "empty"),
    ({"prompt_token_ids": []}, GREEDY, "no tokens"),
    ({"prompt_token_ids": [1] * 128}, GREEDY, "max_model_len"),
    ({"prompt_token_ids": [5, 49152]}, GREEDY, "vocab|\\[0, 49152\\)"),
    ({"prompt_token_ids": [5, -1]}, GREEDY, "\\[0, 49152\\)"),
    (42, GREEDY, "prompt is a string"),
])
def test_bad_input_rejected_before_scheduling(make_llm, prompt, params, match):
    llm = make_llm()
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], params)
    assert not llm.engine.requests and not llm.engine.has_unfinished()


@pytest.mark.parametrize("kw,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(n=0), "n must"),
    (dict(min_p=2.0), "min_p"), (dict(logprobs=99), "logprobs"), (dict(stop=[""]), "stop")])
def test_sampling_params_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw,match", [(dict(max_model_len=10**6), "max_model_len"),
                                      (dict(block_size=12), "block_size"),
                                      (dict(kv_cache_dtype="int3"), "kv_cache_dtype"),
                                      (dict(kv_cache_dtype="kivi-int4"), "KIVI"),
                                      (dict(scheduling_policy="random"), "scheduling_policy"),
                                      (dict(bogus=1), "unknown"), (dict(model="x"), "unknown")])
def test_llm_argument_validation(make_llm, kw, match):
    with pytest.raises(ValueError, match=match):
        make_llm(**kw)


# mxfp4: tests/model/test_kv_formats.py; bfloat16 pages under float32 activations
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "nvfp4", "bfloat16", "turboquant-3.5"])
def test_quantized_kv_cache_engine_matches_a_plain_greedy_loop(tiny_model, default_tokenizer, kv_cache_dtype):
    """The engine's paged, batched, chunked path reads the same stored codes as a
    one-sequence greedy loop over model.forward with the same kv_cache_dtype (on CPU its
    decode steps run the C++ kernel, which writes and reads int8, fp8 and NVFP4 pages
    itself), both with the key centers the engine takes for quantized pages."""
    import dataclasses

    import jax.numpy as jnp

    from model import key_centers

    config, params = tiny_model
    if kv_cache_dtype in ("nvfp4", "turboquant-3.5"):  # rows of whole 16-element blocks / halves of 8
        config = dataclasses.replace(config, head_dim=16)
        params = model.init_params(config, jax.random.key(0))
    # weights large enough that attention decides the greedy tokens (at std 0.02 they come
    # out the same with wk zeroed, or with the loop's key centers off by a factor of -50)
    params = jax.tree.map(lambda a: a * 10, params)
    ps = prompts(2, length=20, seed=5)
    llm = LLM.from_loaded(config, params, default_tokenizer, max_model_len=128, max_num_seqs=4,
                          max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    got = ids(llm.generate(ps, GREEDY))
    centered = kv_cache_dtype in key_centers.CENTERED_FORMATS
    assert all(("k_center" in layer) == centered for layer in llm.runner.params["layers"])
    assert all(("k_basis" in layer) == (kv_cache_dtype in key_centers.BASIS_FORMATS)
               for layer in llm.runner.params["layers"])
    params = key_centers.for_kv_cache(params, config, default_tokenizer, kv_cache_dtype)
    for p, want_ids in zip(ps, got):
        toks = list(p["prompt_token_ids"])
        cache = model.init_cache(config, 1, 64, kv_cache_dtype=kv_cache_dtype)
        logits, cache = model.forward(params, config, jnp.asarray([toks]), jnp.arange(len(toks))[None],
                                      cache, jnp.asarray([len(toks) - 1]))
        out = []
        for _ in range(GREEDY.max_tokens):
            out.append(int(jnp.argmax(logits[0])))
            logits, cache = model.forward(params, config, jnp.asarray([[out[-1]]]),
                                          jnp.asarray([[len(toks) + len(out) - 1]]), cache,
                                          jnp.asarray([0]))
        assert out == want_ids


def test_update_weights_takes_the_key_centers_of_the_new_weights(tiny_model, default_tokenizer):
    from model import key_centers

    config, params = tiny_model
    other = model.init_params(config, jax.random.key(1))
    llm = LLM.from_loaded(config, params, default_tokenizer, max_model_len=64, max_num_seqs=2, kv_cache_dtype="int8")
    centers = lambda p: [np.asarray(layer["k_center"]) for layer in p["layers"]]
    before = centers(key_centers.for_kv_cache(params, config, default_tokenizer, "int8"))
    np.testing.assert_allclose(centers(llm.runner.params), before, rtol=1e-6)
    llm.update_weights(other)
    after = centers(key_centers.for_kv_cache(other, config, default_tokenizer, "int8"))
    np.testing.assert_allclose(centers(llm.runner.params), after, rtol=1e-6)
    assert not np.allclose(before, after, rtol=0.1)
    # params that already carry centers (another engine's) are taken, and centered anew
    llm.update_weights(key_centers.set_key_centers(params, [c * 0 for c in after]))
    np.testing.assert_allclose(centers(llm.runner.params), before, rtol=1e-6)
    again = LLM.from_loaded(config, llm.runner.params, default_tokenizer, max_model_len=64, max_num_seqs=2)
    assert all("k_center" not in layer for layer in again.runner.params["layers"])  # a float pool
    again.update_weights(params)


def test_default_model_chat_names_paris(default_model, default_tokenizer):
    llm = LLM.from_loaded(*default_model, default_tokenizer, max_model_len=256, max_num_seqs=2)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_penalties_and_biases_follow_a_numpy_statement_of_each(make_llm, tiny_model):
    """Greedy decoding with presence, frequency and repetition penalties and a logit_bias
    picks, at every step, the argmax of the numpy-adjusted logits of one whole-sequence
    forward (tests/serving/test_sampling.py's numpy_adjusted); the penalties change the
    output. min_tokens holds back a heavily favoured EOS exactly that long; bad_words
    never appear; ids outside the vocabulary are a ValueError."""
    from tests.serving.test_sampling import numpy_adjusted

    llm = make_llm()
    prompt = prompts(1, length=12)[0]["prompt_token_ids"]
    favoured = prompt[3]  # in the prompt: the repetition penalty also reaches it
    kw = dict(presence_penalty=0.4, frequency_penalty=1.5, repetition_penalty=1.4, logit_bias={favoured: 6.0})
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **kw)
    got = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids
    plain = ids(llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10,
                                                                          ignore_eos=True, logit_bias={favoured: 6.0})))[0]
    assert got != plain and got.count(favoured) < plain.count(favoured)
    seq = prompt + got  # raw logits (the repetition penalty is not shift-invariant)
    config, params = tiny_model
    full, _ = model.forward(params, config, np.asarray([seq], np.int32), np.arange(len(seq), dtype=np.int32)[None],
                            model.init_cache(config, 1, 64))
    full = np.asarray(full[0], np.float64)
    for i, token in enumerate(got):
        logits = full[len(prompt) - 1 + i]
        adjusted = numpy_adjusted(logits, got[:i], prompt, presence=0.4, frequency=1.5, repetition=1.4,
                                  bias={favoured: 6.0})
        assert token == int(np.argmax(adjusted)), i

    eos = tiny_model[0].eos_token_id
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=10, min_tokens=4, logit_bias={eos: 100.0}, stop_token_ids=[9]))[0].outputs[0]
    # EOS (favoured by 100) ends the sequence at the first step it is allowed; it is not output
    assert len(out.token_ids) == 4 and out.finish_reason == "stop" and out.stop_reason is None

    base = ids(llm.generate({"prompt_token_ids": prompt}, GREEDY))[0]
    word = llm.tokenizer.decode([base[1]])  # e.g. " spiral": banned with and without the space
    banned = ids(llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word])))[0]
    assert base[1] not in banned and banned[0] == base[0] and banned[1] != base[1]
    pair = llm.tokenizer.decode(base[:2])  # two tokens: only the second is banned, after the first
    assert llm.tokenizer.encode(pair.lstrip(), add_special_tokens=False) != base[:2]
    assert llm.tokenizer.encode(" " + pair.lstrip(), add_special_tokens=False) == base[:2]
    banned = ids(llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, bad_words=[pair])))[0]
    assert banned[0] == base[0] and banned[1] != base[1]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 1.0}))


def test_multi_step_decode_samples_what_single_steps_sample(make_llm, monkeypatch):
    """num_scheduler_steps=4 runs four decode steps per call while every row is a plain
    decode row, and the engine ends up with exactly the single-step engine's tokens:
    greedy and seeded sampling (each step's key is the sequence's seed and token count),
    max_tokens that are not multiples of 4, sequences finishing at different steps, a stop
    token in the middle of a call (the tokens after it are dropped), a request arriving
    while others decode (that step has a chunk, so it runs alone), a sequence reaching
    max_model_len inside a call, and rows that ask for logprobs (single steps: the host
    reads them token by token)."""
    from serving import runner as runner_module

    calls = []
    multi_calls = runner_module._decode_steps
    monkeypatch.setattr(runner_module, "_decode_steps", lambda *a: calls.append(a[-1]) or multi_calls(*a))
    ps = prompts(3)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    one, multi = make_llm(), make_llm(num_scheduler_steps=4)
    want = one.generate(ps, params)
    got = multi.generate(ps, params)
    assert ids(got) == ids(want) and [len(t) for t in ids(got)] == [10, 13, 6]
    assert calls and set(calls) == {4}
    stop = want[0].outputs[0].token_ids[5]
    stopping = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop], ignore_eos=True)
    a, b = one.generate(ps[0], stopping)[0].outputs[0], multi.generate(ps[0], stopping)[0].outputs[0]
    assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason) and b.finish_reason == "stop"
    assert len(b.token_ids) <= 6

    def staggered(llm):  # request r1 arrives after r0 has decoded a few tokens
        engine = llm.engine
        engine.add_request("r0", ps[0]["prompt_token_ids"], params[0])
        for _ in range(3):
            engine.step()
        engine.add_request("r1", ps[1]["prompt_token_ids"], params[1])
        while engine.has_unfinished():
            engine.step()
        out = [tuple(engine.seqs[f"r{i}#0"].output.tokens) for i in range(2)]
        for i in range(2):
            engine.release(f"r{i}")
        return out

    assert staggered(multi) == staggered(one)
    # a sequence that reaches max_model_len in the middle of a call
    edge = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    short = {"prompt_token_ids": ps[0]["prompt_token_ids"][:17]}
    a = make_llm(max_model_len=27).generate(short, edge)[0].outputs[0]
    b = make_llm(max_model_len=27, num_scheduler_steps=4).generate(short, edge)[0].outputs[0]
    assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason) and len(b.token_ids) == 10
    calls.clear()
    logprobs = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
    a, b = one.generate(ps[2], logprobs)[0].outputs[0], multi.generate(ps[2], logprobs)[0].outputs[0]
    assert b.token_ids == a.token_ids and len(b.logprobs) == 5 and not calls


def test_multi_step_decode_is_refused_where_it_does_not_apply(make_llm):
    for bad in (0, 2.0, "4"):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            make_llm(num_scheduler_steps=bad)
    with pytest.raises(ValueError, match="num_scheduler_steps > 1 is not supported"):
        make_llm(num_scheduler_steps=4, tensor_parallel_size=2)
