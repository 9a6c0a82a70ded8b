"""serving.lang (SGLang's frontend language) on a tiny random model: a fork computes its
prefix once, select equals log-probabilities summed by hand, batched programs equal
programs run alone, chat roles render the chat template, bad arguments raise."""

import numpy as np
import pytest

import model
from serving import fuzz
from serving.lang import TOKEN_LENGTH_NORMALIZED, assistant, function, gen, select, system, user
from serving.params import SamplingParams

PAGE = 16  # the LLM's block_size (its default)


@pytest.fixture(scope="module")
def llm(default_tokenizer):
    # one step holds every prompt here whole (no chunking across steps), so requests
    # submitted together are admitted together and cannot hit each other's pages
    return fuzz.tiny_llm(default_tokenizer, max_model_len=192, max_num_seqs=4, max_num_batched_tokens=512)


@pytest.fixture
def calls(llm, monkeypatch):
    """Every llm.generate call made: (prompts, params, outputs)."""
    made, generate = [], llm.generate

    def spy(prompts, sampling_params=None, **kwargs):
        outs = generate(prompts, sampling_params, **kwargs)
        made.append((prompts, sampling_params, outs))
        return outs

    monkeypatch.setattr(llm, "generate", spy)
    return made


def random_text(tokenizer, num_tokens, seed):
    """Text from random ordinary tokens (about num_tokens tokens once re-encoded)."""
    ids = np.random.default_rng(seed).integers(300, 40000, num_tokens)
    return tokenizer.decode(ids.tolist(), skip_special_tokens=True)


def computed(out) -> int:
    """Prompt tokens a request computed (the rest came from the prefix cache)."""
    return len(out.prompt_token_ids) - out.num_cached_tokens


def test_fork_computes_the_shared_prefix_once(llm, calls):
    prefix = random_text(llm.tokenizer, 40, seed=1)

    @function
    def branches(s, prefix):
        s += prefix
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f" Option {i}:" + gen("x", max_tokens=4, temperature=0, ignore_eos=True)
        return [f["x"] for f in forks]

    state = branches.run(prefix=prefix, llm=llm)
    prefix_ids = state.token_ids()
    P = len(prefix_ids)
    assert P >= 2 * PAGE
    assert [len(outs) for _, _, outs in calls] == [1, 4]  # the warm-up, then the 4 branches together
    (warm,), branch_outs = [outs for _, _, outs in calls]
    assert len(branch_outs) == 4 and warm.prompt_token_ids == prefix_ids and computed(warm) == P
    for out in branch_outs:
        assert out.prompt_token_ids[:P] == prefix_ids
        assert out.num_cached_tokens == P // PAGE * PAGE  # every full page of the prefix
        assert computed(out) <= len(out.prompt_token_ids) - P + PAGE - 1  # its suffix + a partial page
    total = computed(warm) + sum(computed(o) for o in branch_outs)
    suffixes = sum(len(o.prompt_token_ids) - P for o in branch_outs)
    assert total <= P + suffixes + 4 * (P % PAGE)

    # The branches' text is what each branch's prompt gives alone.
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": o.prompt_token_ids} for o in branch_outs], greedy)
    forks_text = [o.outputs[0].text for o in branch_outs]
    assert forks_text == [o.outputs[0].text for o in alone] == state.ret_value

    # Without the warm-up the same four prompts (over a prefix the cache has not seen)
    # compute the prefix four times: the bound above would fail.
    fresh = llm.tokenizer.encode(random_text(llm.tokenizer, 40, seed=2))
    cold = llm.generate([{"prompt_token_ids": fresh + o.prompt_token_ids[P:]} for o in branch_outs], greedy)
    assert sum(computed(o) for o in cold) >= 4 * len(fresh) > len(fresh) + suffixes + 4 * (len(fresh) % PAGE)


def reference_logprobs(llm, prompt_ids, continuations):
    """log p(continuation tokens | prompt) per continuation, from one padded batched
    model.forward over llm's own params, in float64."""
    rows = [prompt_ids + c for c in continuations]
    length = 64 * -(-max(map(len, rows)) // 64)
    tokens = np.zeros((len(rows), length), np.int32)
    positions = np.full((len(rows), length), -1, np.int32)  # negative: padding
    for b, row in enumerate(rows):
        tokens[b, :len(row)], positions[b, :len(row)] = row, np.arange(len(row))
    cache = model.init_cache(llm.config, len(rows), length)
    logits, _ = model.forward(llm.runner.params, llm.config, tokens, positions, cache)
    logits = np.asarray(logits, np.float64)
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    start = len(prompt_ids)
    return [[logprobs[b, start - 1 + j, t] for j, t in enumerate(c)] for b, c in enumerate(continuations)]


def test_select_scores_equal_token_logprobs_summed_by_hand(llm):
    prompt = random_text(llm.tokenizer, 24, seed=3)
    choices = [" yes", " no", " perhaps, but not today", " 42 and 17"]

    @function
    def pick(s, method):
        s += prompt
        s += select("c", choices=choices, choices_method=method)

    by_sum = pick.run(method="sum", llm=llm)
    prompt_ids = llm.tokenizer.encode(prompt)
    choice_ids = [llm.tokenizer.encode(c, add_special_tokens=False) for c in choices]
    assert {len(c) for c in choice_ids} != {1}  # choices of several lengths
    want = reference_logprobs(llm, prompt_ids, choice_ids)
    meta = by_sum.get_meta_info("c")
    for got, ref in zip(meta["token_logprobs"], want):
        np.testing.assert_allclose(got, ref, atol=1e-4)
    sums = np.array([sum(w) for w in want])
    np.testing.assert_allclose(meta["scores"], sums, atol=1e-4)
    best = choices[int(np.argmax(sums))]
    assert by_sum["c"] == best and by_sum.text() == prompt + best
    assert by_sum.token_ids() == prompt_ids + choice_ids[int(np.argmax(sums))]

    normalized = pick.run(method=TOKEN_LENGTH_NORMALIZED, llm=llm)
    means = sums / [len(c) for c in choice_ids]
    np.testing.assert_allclose(normalized.get_meta_info("c")["scores"], means, atol=1e-4)
    assert normalized["c"] == choices[int(np.argmax(means))]


def test_run_batch_sends_each_round_of_calls_together(llm, calls):
    @function
    def qa(s, question):
        s += "Question: " + question + "\nAnswer:"
        s += gen("answer", max_tokens=3, temperature=0, ignore_eos=True)
        s += "\nCorrect?" + select("ok", choices=[" yes", " not sure"])
        s += gen("why", max_tokens=2, temperature=0, ignore_eos=True)

    questions = [random_text(llm.tokenizer, n, seed=10 + n) for n in (2, 4, 6, 8)]
    states = qa.run_batch([{"question": q} for q in questions], llm=llm, num_threads=3)
    # one generate per round: the gens, the selects' choices, the second gens
    assert [len(prompts) for prompts, _, _ in calls] == [4, 4 * 2, 4]
    (first, _, answers), (scored, _, _), (second, _, whys) = calls
    encode = llm.tokenizer.encode
    for i, (q, s) in enumerate(zip(questions, states)):
        # each program's calls see its own state: nothing crossed between programs
        prompt = encode("Question: " + q + "\nAnswer:")
        assert first[i]["prompt_token_ids"] == prompt
        prompt += answers[i].outputs[0].token_ids + encode("\nCorrect?", add_special_tokens=False)
        for j, choice in enumerate([" yes", " not sure"]):
            assert scored[2 * i + j]["prompt_token_ids"] == prompt + encode(choice, add_special_tokens=False)
        prompt += encode(s["ok"], add_special_tokens=False)
        assert second[i]["prompt_token_ids"] == prompt
        assert (s["answer"], s["why"]) == (answers[i].outputs[0].text, whys[i].outputs[0].text)
        assert s.text() == f"Question: {q}\nAnswer:{s['answer']}\nCorrect?{s['ok']}{s['why']}"
        assert s.token_ids() == prompt + whys[i].outputs[0].token_ids


def test_chat_roles_render_the_chat_template(llm, calls):
    if not llm.tokenizer.chat_template:
        pytest.skip("the tokenizer has no chat template")

    @function
    def chat(s, system_prompt):
        if system_prompt is not None:
            s += system(system_prompt)
        s += user("What is 2 + 2?") + assistant("4") + user("And 3 + 3?")

    for system_prompt in ("Be brief.", None):
        state = chat.run(system_prompt=system_prompt, llm=llm)
        messages = [{"role": "system", "content": system_prompt}] * (system_prompt is not None) + [
            {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"}]
        want = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        assert state.text() == want
        assert state.token_ids() == llm.tokenizer.encode(want, add_special_tokens=False)
    assert not calls


def test_bad_arguments_raise_value_errors_naming_them(llm):
    start = random_text(llm.tokenizer, 40, seed=4)

    @function
    def prog(s, what):
        s += start
        if what == "variable":
            s += gen("x", max_tokens=1)
            s["y"]
        elif what == "append":
            s += 5
        elif what == "fork":
            s.fork(0)

    with pytest.raises(ValueError, match="no variable 'y'.*'x'"):
        prog.run(what="variable", llm=llm)
    with pytest.raises(ValueError, match="a state takes str.*got int"):
        prog.run(what="append", llm=llm)
    with pytest.raises(ValueError, match="fork n must be >= 1"):
        prog.run(what="fork", llm=llm)
    with pytest.raises(ValueError, match="unexpected keyword argument 'question'"):
        prog.run(what="append", question="?", llm=llm)
    with pytest.raises(ValueError, match="list of dicts"):
        prog.run_batch({"what": "x"}, llm=llm)
    with pytest.raises(ValueError, match="non-empty list of choices"):
        select("c", choices=[])
    with pytest.raises(ValueError, match="choice is empty"):
        select("c", choices=["a", ""])
    with pytest.raises(ValueError, match="choices_method"):
        select("c", choices=["a"], choices_method="max")
    with pytest.raises(ValueError, match="max_tokens"):
        gen("x", max_tokens=0)
    with pytest.raises(ValueError, match="variable name"):
        gen(3)

    @function
    def empty(s):
        s += gen("x", max_tokens=1)

    with pytest.raises(ValueError, match="empty state"):
        empty.run(llm=llm)
