"""Speculative decoding through LLM: lossless against plain decoding, greedy and sampled.

A tiny random target with an 8-token vocabulary and a random (untrained) EAGLE-3 draft:
losslessness must not depend on the draft's quality, and a tree with top-k = vocabulary
always holds the target's next token, so every step accepts, moves KV and catches the
draft up (deeper acceptance is covered by tests/serving/test_speculative.py)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model import eagle3
from model.config import ModelConfig
from serving import LLM, SamplingParams
from tests.compiles import counting

VOCAB = 8


@pytest.fixture(scope="module")
def target():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_heads=4,
                         num_kv_heads=2, head_dim=8, layer_kinds=("attention",) * 4,
                         max_position_embeddings=256, eos_token_id=2)
    return config, model.init_params(config, jax.random.key(0))


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    config, params = target
    draft_config = eagle3.Eagle3Config(config, VOCAB, eagle3.feature_layers(4), "tiny")
    path = str(tmp_path_factory.mktemp("draft"))
    eagle3.save_draft(path, draft_config, eagle3.init_draft_params(
        draft_config, params, np.arange(VOCAB), jax.random.key(1)))
    return path


@pytest.fixture(scope="module")
def make_llm(target, draft_dir, default_tokenizer):
    def make(speculative=True, **kw):
        # 12 pages: too few for every sequence at once, so sequences get preempted (and every
        # test shares one pool shape: one compile of each step per batch bucket)
        kw = {"max_model_len": 96, "max_num_seqs": 4, "max_num_batched_tokens": 64, "num_kv_blocks": 12,
              **kw}
        if speculative:
            kw["speculative_config"] = {"method": "eagle3", "model": draft_dir,
                                        "num_speculative_tokens": 12, "depth": 3, "top_k": 8}
        return LLM.from_loaded(*target, default_tokenizer, **kw)
    return make


@pytest.fixture(scope="module")
def spec_llm(make_llm):
    with counting() as startup:
        llm = make_llm(precompile=True)
    assert len(startup) >= len(llm.runner.buckets(64))
    return llm


def test_step_shapes_with_verify_rows(spec_llm):
    """A speculative step packs verify rows (a tree's 13 nodes each) with chunks and
    decode rows: a step without chunks has one shape per power-of-two row count; a step
    with chunks one per token bucket, times one-or-several multi-token rows, its rows
    padded to max_num_seqs (4)."""
    runner = spec_llm.runner
    assert runner.shape([13], 1) == (13, 1, 13, 1) and runner.shape([13, 1, 13], 2) == (52, 4, 13, 4)
    assert runner.shape([1]) == (13, 1, 13, 1)  # a decode row without a tree (after a fork)
    assert runner.shape([13, 1], 1) == (26, 2, 13, 2)
    assert runner.shape([9, 13], 1) == runner.shape([19, 2]) == (32, 4, 32, 4) and runner.shape([20]) == (32, 4, 32, 1)
    buckets = runner.buckets(64)
    assert list(buckets) == [(13, 1, 13, 1), (26, 2, 13, 2), (52, 4, 13, 4), (16, 4, 16, 1), (16, 4, 16, 4),
                             (32, 4, 32, 1), (32, 4, 32, 4), (64, 4, 64, 1), (64, 4, 64, 4)]
    for shape, (lens, trees) in buckets.items():
        assert runner.shape(lens, trees) == shape and sum(lens) <= 64 and len(lens) <= 4


def test_greedy_speculation_equals_plain_greedy(make_llm, spec_llm):
    """Speculative greedy output equals plain greedy output, through batched prefill,
    recompute preemption and a prefix hit; the precompiled engine compiles nothing while
    serving them, nor a sampled request with n = 2 (forks)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, 7 + 5 * i).tolist() for i in range(4)]
    prompts.append(prompts[3][:20] + [1, 2, 3])  # a prefix-cache hit: cached target and draft KV
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 17, 30, 25, 30)]
    plain = [o.outputs[0].token_ids for o in make_llm(speculative=False).generate(requests, params)]
    with counting() as serving:
        got = spec_llm.generate(requests[:4], params[:4]) + spec_llm.generate(requests[4], params[4])
        twins = spec_llm.generate(requests[0], SamplingParams(n=2, temperature=0.8, max_tokens=12, seed=0,
                                                              ignore_eos=True))
    assert serving == []
    assert [len(o.token_ids) for o in twins[0].outputs] == [12, 12]
    assert [o.outputs[0].token_ids for o in got] == plain
    assert [len(t) for t in plain] == [30, 17, 30, 25, 30]  # max_tokens cuts a multi-token step
    assert got[4].num_cached_tokens == 16
    assert spec_llm.engine.num_preemptions > 0  # losslessness held through recompute preemption
    stats = spec_llm.engine.speculative_stats()
    # every tree holds the target's next token (top-k = vocabulary): each step emits >= 2
    assert stats["num_trees"] > 0 and stats["acceptance_by_position"][0] == 1.0
    spec_llm.engine.kv.check()  # every page of the rejected branches came back


def test_speculation_reads_the_same_pages_through_wide_tables(make_llm):
    """Attention walks a block table only as far as its queries see, and verify rows
    reach past the sequence's last token (tree slots), as do KV compaction, the draft's
    catch-up and its tree growth: over tables 2.5x wider (max_model_len 256 against 96, in
    4-token pages: 9 blocks of 8 pages against 4), the output is still lossless and every
    draft tree equals the one grown over the narrow tables."""
    rng = np.random.default_rng(1)
    requests = [{"prompt_token_ids": rng.integers(0, VOCAB, n).tolist()} for n in (14, 30)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(speculative=False).generate(requests, params)]
    trees = []
    for max_model_len in (96, 256):
        spec = make_llm(max_model_len=max_model_len, block_size=4, num_kv_blocks=48)
        grown, execute = [], spec.runner.execute

        def recording(rows, execute=execute, grown=grown):
            results = execute(rows)
            grown.extend(r.tree for r in results if r is not None and r.tree is not None)
            return results
        spec.runner.execute = recording
        assert [o.outputs[0].token_ids for o in spec.generate(requests, params)] == plain
        spec.engine.kv.check()
        trees.append(grown)
    assert len(trees[0]) == len(trees[1]) > 10
    for cut, full in zip(*trees):
        np.testing.assert_array_equal(cut.tokens, full.tokens)
        np.testing.assert_array_equal(cut.parents, full.parents)
        np.testing.assert_allclose(cut.scores, full.scores, rtol=1e-5, atol=1e-5)


def test_engine_tree_equals_a_draft_run_from_scratch(target, draft_dir, spec_llm):
    """After prefill, prefix hits and several verify steps (each moving KV and catching
    the draft up in pieces), the tree the engine holds equals `grow_tree` driven by the
    draft run from scratch over the whole sequence: features aligned, draft KV in place."""
    from serving.draft_tree import grow_tree

    config, params = target
    draft_config, draft_params = eagle3.load_draft(draft_dir)
    engine = spec_llm.engine
    engine.add_request("tree", [5, 1, 0, 3, 3, 7, 2, 6, 1, 4, 0, 2, 5, 7, 1, 6, 3, 0],
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seq = engine.seqs["tree#0"]
    for _ in range(40):
        if len(seq.output.tokens) >= 12:
            break
        engine.step()
    tokens = list(engine.tokens("tree#0"))
    assert len(tokens) >= 18 + 12
    n = len(tokens)
    cache = model.init_cache(config, 1, n)
    _, _, captured = model.forward_hidden(params, config, jnp.asarray([tokens[:-1]]),
                                          jnp.arange(n - 1)[None], cache, draft_config.target_layer_ids)
    features = eagle3.fuse_features(draft_params, jnp.concatenate(captured, -1))

    def run(path):  # draft logits after the chain prefix -> path (EAGLE's recurrence)
        dcache = eagle3.init_draft_cache(draft_config, 1, n + 8)
        logits, hidden, dcache = eagle3.draft_forward(draft_params, draft_config, features,
                                                      jnp.asarray([tokens[1:]]), jnp.arange(n - 1)[None], dcache)
        for i, tok in enumerate(path):
            logits, hidden, dcache = eagle3.draft_forward(draft_params, draft_config, hidden[:, -1:],
                                                          jnp.asarray([[tok]]), jnp.asarray([[n - 1 + i]]), dcache)
        return jax.nn.log_softmax(logits[0, -1])

    def expand(frontier, tree):
        paths = []
        for node in frontier:
            path = []
            while node > 0:
                assert tree.parents[node] < node, "parents precede their children"
                path.insert(0, int(tree.tokens[node]))
                node = tree.parents[node]
            paths.append(path)
        return np.stack([np.asarray(run(p)) for p in paths])

    spec = spec_llm.runner.draft.spec
    want = grow_tree(tokens[-1], expand, spec.depth, spec.top_k, spec.num_tokens)
    np.testing.assert_allclose(seq.tree.scores, want.scores, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(seq.tree.tokens, want.tokens)
    np.testing.assert_array_equal(seq.tree.parents, want.parents)
    engine.abort("tree")
    engine.release("tree")


def test_stop_token_inside_accepted_drafts(make_llm, spec_llm):
    """A stop token among several accepted drafts ends the output there, as without speculation."""
    request = {"prompt_token_ids": [1, 5, 3, 7, 0, 4, 6, 2, 5]}
    free = spec_llm.generate(request, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    stop = tokens[len(tokens) // 2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    got = spec_llm.generate(request, params)[0].outputs[0]
    assert got.token_ids == tokens[:tokens.index(stop)] and got.stop_reason == stop
    # n = 2: the second sequence forks off the prompt's pages (no tree yet) and catches up
    twins = spec_llm.generate(request, SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in twins[0].outputs] == [tokens, tokens]
    spec_llm.engine.kv.check()


class Letters:
    """A tokenizer spelling token i as the i-th letter, so stop strings can match."""

    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join("abcdefgh"[i] for i in ids)


def test_stop_string_completed_inside_accepted_drafts(target, make_llm):
    """The output ends at the token that completes the stop string, as plain decoding would,
    even when the step accepted more drafts after it."""
    request = {"prompt_token_ids": [1, 5, 3, 7, 0, 4, 6, 2, 5]}
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    text = Letters().decode(make_llm().generate(request, free)[0].outputs[0].token_ids)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    outs = []
    for speculative in (False, True):
        llm = make_llm(speculative=speculative)
        llm.tokenizer = Letters()
        outs.append(llm.generate(request, params)[0].outputs[0])
    plain, spec = outs
    assert spec.token_ids == plain.token_ids and spec.text == plain.text == text[:text.index(stop)]
    assert spec.finish_reason == "stop" and spec.stop_reason == stop


def test_parallel_samples_fork_without_sharing_lookahead_pages(make_llm):
    """n = 4 in the 12-page pool, too small for all: children share only the prompt's pages, so the
    scheduler counts every page they write (preempting instead of running out)."""
    llm = make_llm(enable_prefix_caching=False)
    out = llm.generate({"prompt_token_ids": [1, 5, 3, 7, 0, 4, 6, 2, 5]},
                       SamplingParams(n=4, temperature=1.0, max_tokens=40, ignore_eos=True, seed=0))
    assert [len(o.token_ids) for o in out[0].outputs] == [40] * 4
    assert llm.engine.num_preemptions > 0
    llm.engine.kv.check()


def exact_distributions(target, prompt, temperature):
    """p(t1, t2) and p(t3) of the target after `prompt`, by enumerating continuations."""
    config, params = target
    seqs = np.array([prompt + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)])
    n, t = seqs.shape
    cache = model.init_cache(config, n, t)
    logits, _ = model.forward(params, config, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(t), (n, t)),
                              cache)
    probs = np.asarray(jax.nn.softmax(logits / temperature, axis=-1), np.float64)
    p1 = probs[0, t - 3]
    p2 = probs[::VOCAB, t - 2]  # [a, b]: given t1 = a
    joint = p1[:, None] * p2
    p3 = np.einsum("ab,abc->c", joint, probs[:, t - 1].reshape(VOCAB, VOCAB, VOCAB))
    return joint, p3


def test_sampled_speculation_keeps_the_target_distribution(target, spec_llm):
    """Rejection-sampling verification: the first three sampled tokens follow the target's
    own distribution (joint of the first two, marginal of the third; the second and third
    come from verified trees)."""
    prompt, n, temperature = [3, 1, 4, 1, 5, 6], 1200, 0.1
    joint, p3 = exact_distributions(target, prompt, temperature)
    params = [SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(n)]
    before = spec_llm.engine.speculative_stats()["num_trees"]
    outs = [o.outputs[0].token_ids for o in spec_llm.generate([{"prompt_token_ids": prompt}] * n, params)]
    assert spec_llm.engine.speculative_stats()["num_trees"] - before >= n
    samples = np.array(outs)
    got_joint = np.zeros((VOCAB, VOCAB))
    np.add.at(got_joint, (samples[:, 0], samples[:, 1]), 1 / n)
    got3 = np.bincount(samples[:, 2], minlength=VOCAB) / n
    for got, want in ((got_joint.ravel(), joint.ravel()), (got3, p3)):
        bound = 4.5 * np.sqrt(want * (1 - want) / n) + 2e-3
        assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) - bound)
    # The bounds have power: the target is far from uniform at this temperature.
    assert np.abs(p3 - 1 / VOCAB).max() > 6 * np.sqrt(1 / VOCAB / n)


@pytest.mark.parametrize("change, match", [
    ({"method": "medusa"}, "method"),
    ({"colour": 1}, "unknown speculative_config keys"),
    ({"num_speculative_tokens": 0}, "positive int"),
    ({"num_speculative_tokens": 40}, "fewer than"),
    ({"model": "/nonexistent"}, "not an EAGLE-3 draft"),
    ({"top_k": 9, "num_speculative_tokens": 8}, "exceeds the draft vocabulary"),
])
def test_speculative_config_validation(target, draft_dir, default_tokenizer, change, match):
    config = {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": 8, "depth": 3, "top_k": 4,
              **change}
    with pytest.raises(ValueError, match=match):
        LLM.from_loaded(*target, default_tokenizer, max_model_len=96, speculative_config=config)


def test_speculation_rejects_a_draft_for_another_target(draft_dir, default_tokenizer):
    other = ModelConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_heads=4,
                        num_kv_heads=2, head_dim=12, layer_kinds=("attention",) * 4,
                        max_position_embeddings=256)
    with pytest.raises(ValueError, match="another target"):
        LLM.from_loaded(other, model.init_params(other, jax.random.key(0)), default_tokenizer,
                        max_model_len=96, speculative_config={"method": "eagle3", "model": draft_dir,
                                                              "num_speculative_tokens": 8})


def test_logprobs_equal_plain_decoding(make_llm, spec_llm):
    """Every emitted token, accepted draft or bonus, reports the target's logprobs."""
    request = {"prompt_token_ids": [4, 4, 1, 7, 2, 0, 3]}
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=3)
    want = make_llm(speculative=False).generate(request, params)[0].outputs[0]
    got = spec_llm.generate(request, params)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == 14
    for g, w in zip(got.logprobs, want.logprobs):
        assert g.keys() == w.keys()
        np.testing.assert_allclose([g[k] for k in w], list(w.values()), atol=1e-4)


def test_small_token_budget_rejected(make_llm):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_llm(max_num_batched_tokens=4)


def test_penalties_are_refused_with_speculation_before_scheduling(spec_llm):
    for kw in (dict(frequency_penalty=0.5), dict(logit_bias={5: 1.0}), dict(min_tokens=2), dict(bad_words=["a"])):
        with pytest.raises(ValueError, match="not supported with speculative decoding"):
            spec_llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, **kw))
    assert not spec_llm.engine.has_unfinished()
