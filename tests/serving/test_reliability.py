"""Regression tests for the reliability findings: every input gets a clear answer (a
ValueError naming the field), and nothing one request does harms the next."""

import json
import math
import threading

import pytest

from serving import SamplingParams, fuzz

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPT = {"prompt_token_ids": [11, 22, 33, 44, 55]}


@pytest.fixture(scope="module")
def llm(default_tokenizer):
    return fuzz.tiny_llm(default_tokenizer, num_kv_blocks=16)


def assert_clean(llm):
    """No request, block table or held page is left, and the baseline is unchanged."""
    engine = llm.engine
    engine.kv.check()
    assert not engine.requests and not engine.has_unfinished() and not engine.kv.tables
    assert engine.kv.num_available == engine.kv.pool.num_pages


def test_a_step_budget_below_the_chunk_unit_still_makes_progress(default_tokenizer):
    """Finding 1: max_num_batched_tokens=8 (< the 16-token chunk unit) used to round every
    prefill chunk down to 0 tokens and spin forever."""
    small = fuzz.tiny_llm(default_tokenizer, max_num_batched_tokens=8, num_kv_blocks=16)
    with fuzz.step_bound(small.engine, 100):
        out = small.generate({"prompt_token_ids": list(range(100, 120))}, GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 6
    assert_clean(small)


def test_a_failing_request_in_a_batch_leaves_nothing_behind(default_tokenizer):
    """Finding 3: when a later prompt of a batch is rejected (here for capacity: more pages
    than the 3-page pool has), the earlier ones are not left queued, holding pages."""
    small = fuzz.tiny_llm(default_tokenizer, num_kv_blocks=3)
    want = small.generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="needs 4 KV pages, the pool has 3"):
        small.generate([PROMPT, PROMPT], [GREEDY, SamplingParams(max_tokens=50, ignore_eos=True)])
    assert_clean(small)
    assert small.generate(PROMPT, GREEDY)[0].outputs[0].token_ids == want


def test_two_threads_share_one_llm(llm):
    """Finding 4: generate and stream from two threads at once each get what they would get
    alone (the engine steps one at a time and each step serves both)."""
    prompts = [{"prompt_token_ids": [7 + i, 300, 4000 + i, 9]} for i in range(4)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    got, errors = {}, []

    def run(i):
        try:
            if i % 2:
                toks = []
                for delta in llm.stream(prompts[i], GREEDY):
                    toks += delta.outputs[0].token_ids
                got[i] = toks
            else:
                got[i] = llm.generate(prompts[i], GREEDY)[0].outputs[0].token_ids
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and [got[i] for i in range(4)] == alone
    assert_clean(llm)


def test_stream_never_sends_text_a_stop_string_takes_back(llm):
    """Finding 5: characters that could still begin a stop string are held back, so the
    stream's deltas add up to generate's text for every stop string cut from the output."""
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) > 12
    for start in (2, len(text) // 2, len(text) - 4):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[text[start:start + 3]])
        final = llm.generate(PROMPT, params)[0].outputs[0]
        streamed = "".join(d.outputs[0].text for d in llm.stream(PROMPT, params))
        assert streamed == final.text == text[:text.index(text[start:start + 3])]
    assert_clean(llm)


@pytest.mark.parametrize("kw,field", [
    # finding 6: wrong types
    (dict(seed=1.5), "seed"), (dict(logprobs=2.5), "logprobs"), (dict(temperature="0.5"), "temperature"),
    (dict(stop=5), "stop"), (dict(n=True), "n"), (dict(max_tokens=3.0), "max_tokens"),
    # finding 7: silently accepted
    (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(top_k=2.5), "top_k"), (dict(seed=2**64), "seed"), (dict(ignore_eos="no"), "ignore_eos"),
    (dict(stop_token_ids="ab"), "stop_token_ids"), (dict(stop_token_ids=[True]), "stop token id"),
    (dict(top_p=math.nan), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(stop=["ok\udc80"]), "stop"),
])
def test_sampling_params_reject_wrong_types_and_values(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_seeds_use_all_64_bits(llm):
    """Finding 7: seeds used to be cut to 32 bits (2**32 sampled like 0, 2**64 like 0)."""
    prompt = {"prompt_token_ids": [5, 6, 7]}

    def sample(seed):
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)
        return llm.generate(prompt, params)[0].outputs[0].token_ids
    assert sample(2**32) != sample(0) and sample(2**40 + 1) != sample(1)
    assert sample(-1) == sample(2**64 - 1) and sample(3) == sample(3)  # modulo 2**64, as torch


@pytest.mark.parametrize("prompts,match", [
    (None, "prompts must be"), ([{"prompt_token_ids": None}], "prompt_token_ids must be a list"),
    ([{"prompt_token_ids": [True, False]}], "token ids must be ints"),
    (["abc \ud800"], "not valid Unicode"), ([PROMPT, 42], "a prompt is a string"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list"),
])
def test_bad_prompts_are_rejected_and_nothing_is_queued(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY)
    assert_clean(llm)


def test_sampling_params_of_the_wrong_type_are_named(llm):
    """Finding 8: a dict passed as sampling params used to be reported as "got str"."""
    with pytest.raises(ValueError, match="got dict"):
        llm.generate(PROMPT, {"temperature": 0})
    with pytest.raises(ValueError, match="got dict"):
        llm.generate([PROMPT], [{"temperature": 0}])
    assert_clean(llm)


@pytest.mark.parametrize("messages,match", [
    ({"role": "user", "content": "Hi"}, "messages must be"), ([], "messages must be"),
    ([{"role": "robot", "content": "x"}], "role must be one of"), ([{"role": "user", "content": 5}], "content"),
    ([{"content": "x"}], "'role' and 'content'"),
])
def test_bad_chat_messages_are_rejected(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY)
    assert_clean(llm)


@pytest.mark.parametrize("kw,field", [
    (dict(max_model_len=256.5), "max_model_len"), (dict(max_model_len=0), "max_model_len"),
    (dict(num_kv_blocks=0), "num_kv_blocks"), (dict(max_num_seqs=True), "max_num_seqs"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching"), (dict(kv_cache_dtype=3), "kv_cache_dtype"),
    (dict(preemption_mode=None), "preemption_mode"), (dict(seed="1"), "seed"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"), (dict(dtype="int8"), "dtype"),
    (dict(dtype=object()), "dtype"),
])
def test_llm_arguments_are_checked(llm, kw, field):
    from serving import LLM

    with pytest.raises(ValueError, match=field):
        LLM.from_loaded(llm.config, llm.runner.params, llm.tokenizer, **kw)


def test_hf_config_without_a_required_field_names_it(tmp_path):
    from model.hf_loader import read_hf_config

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
              "vocab_size": 100, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_attention_heads"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_hf_config(str(tmp_path))


def test_cli_rejects_a_prompt_that_is_not_utf8(capsys):
    """Bytes that are not UTF-8 reach argv as lone surrogates: a usage error, no traceback."""
    from serving import generate

    with pytest.raises(SystemExit) as exit_:
        generate.main(["abc \udcff"])
    assert exit_.value.code == 2 and "not valid Unicode" in capsys.readouterr().err
