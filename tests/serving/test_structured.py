"""Structured outputs on a tiny random model over the default tokenizer: sampled JSON
validates against its schema (checked by the `jsonschema` package), regex / choice /
grammar outputs match, constrained rows leave unconstrained rows' greedy output alone,
jump-forward changes nothing but the step count, EAGLE-3 stays lossless under a
grammar, and bad specs are ValueErrors before anything is scheduled."""

import json
import re

import jax
import jsonschema
import numpy as np
import pytest

import model
from model import eagle3
from serving import LLM, fuzz
from serving.params import SamplingParams, StructuredOutputsParams
from serving.structured import GrammarCompiler, allows, grammar_text

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(default_tokenizer):
    return fuzz.tiny_llm(default_tokenizer, max_model_len=160, max_num_seqs=8, max_num_batched_tokens=256)


def constrained(max_tokens=120, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=spec.pop("temperature", 1.0), seed=spec.pop("seed", None),
                          structured_outputs=StructuredOutputsParams(**spec))


def test_sampled_json_validates_against_its_schema(llm):
    params = [constrained(json=PERSON, seed=i) for i in range(8)]
    outs = llm.generate(["A person as JSON:"] * len(params), params)
    texts = set()
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
        texts.add(o.text)
    assert len(texts) == len(outs)  # sampled, not one forced answer
    # json_object: any object
    for out in llm.generate(["{"] * 4, [constrained(json_object=True, seed=i, max_tokens=60) for i in range(4)]):
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text), dict)


def test_regex_choice_and_grammar_outputs_match(llm):
    regex = r"(0|[1-9][0-9]{0,2})\.[0-9]{2} (EUR|USD)"
    grammar = 'root ::= "(" num (op num)* ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*"'
    choices = ["red", "green", "light blue"]
    params = ([constrained(regex=regex, seed=i, max_tokens=12) for i in range(6)]
              + [constrained(choice=choices, seed=i) for i in range(6)]
              + [constrained(grammar=grammar, seed=i, max_tokens=40) for i in range(6)])
    outs = [o.outputs[0] for o in llm.generate(["Answer:"] * len(params), params)]
    for o in outs[:6]:
        assert re.fullmatch(regex, o.text) and o.finish_reason == "stop", o.text
    assert {o.text for o in outs[6:12]} <= set(choices)
    for o in outs[12:]:
        if o.finish_reason == "stop":  # a long sum may run out of max_tokens
            assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)", o.text), o.text


def test_constrained_rows_leave_unconstrained_greedy_output_unchanged(llm):
    prompts = ["The weather today", "Numbers:", "Once upon a time", "Digits please"]
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.generate(prompts, plain)
    mixed = llm.generate(prompts + prompts, [plain] * 4 + [constrained(regex="[0-9]{4,8}", temperature=0)] * 4)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[4:]:
        assert re.fullmatch("[0-9]{4,8}", o.outputs[0].text)


def test_jump_forward_takes_forced_runs_without_sampling_them(llm, monkeypatch):
    """With and without jump-forward the same seeds give the same outputs (a forced token
    has probability one under the mask), but the forced runs ("name":" after "{" ...)
    are computed as chunks: fewer sampled rows, fewer steps."""
    params = [constrained(json=PERSON, seed=i) for i in range(4)]
    sampled, execute = [], llm.runner.execute

    def counting(rows):
        sampled.append(sum(r.sample for r in rows))
        return execute(rows)

    monkeypatch.setattr(llm.runner, "execute", counting)
    results = {}
    for jump in (True, False):
        monkeypatch.setattr(llm.engine, "jump_forward", jump)
        sampled.clear()
        outs = llm.generate(["A person as JSON:"] * 4, params)
        results[jump] = ([o.outputs[0].token_ids for o in outs], sum(sampled), len(sampled))
    (with_tokens, with_rows, with_steps), (without_tokens, without_rows, without_steps) = results[True], results[False]
    assert with_tokens == without_tokens
    total = sum(map(len, with_tokens))
    assert without_rows == total  # one sampled row per token (EOS ends on a sampled row, not output)
    assert with_rows < without_rows - 4 * 5  # at least the five keys' runs were forced
    assert with_steps < without_steps


def test_bad_specs_are_value_errors_before_scheduling(llm):
    bad = [{"regex": "(["}, {"json": {"type": 5}}, {"json": "{not json"}, {"json": "[1, 2]"},
           {"grammar": "root ::= ( unclosed"}]
    for spec in bad:
        with pytest.raises(ValueError, match="structured outputs"):
            llm.generate(["x", "y"], [SamplingParams(max_tokens=2), constrained(**spec)])
        assert not llm.engine.requests and not llm.engine.has_unfinished()
    for spec, match in (({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
                        ({"choice": []}, "non-empty list"), ({"json": 3}, "schema dict")):
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_tree_masks_follow_each_path(default_tokenizer):
    """Row i of a draft tree's masks is the mask after the path root -> i, from a fresh
    matcher fed that path; a node whose path the grammar rejects allows everything."""
    tok = default_tokenizer
    compiler = GrammarCompiler(tok, fuzz.VOCAB, tok.eos_token_id)
    (matcher,) = compiler.submit(StructuredOutputsParams(regex="ab(c|d)e"), 1).result()
    a, b, c, d, x = (tok.encode(s, add_special_tokens=False)[0] for s in "abcdx")
    assert matcher.consume_token(a)
    tokens, parents = [a, b, x, c, d], [-1, 0, 0, 1, 1]  # a -> (b -> (c, d), x)
    masks = compiler.tree_masks(matcher, tokens, parents)
    assert allows(masks[0], b) and not allows(masks[0], x)
    assert (masks[2] == -1).all()  # "ax" is rejected
    e = tok.encode("e", add_special_tokens=False)[0]
    for i, path in ((1, [b]), (3, [b, c]), (4, [b, d])):
        (fresh,) = compiler.submit(StructuredOutputsParams(regex="ab(c|d)e"), 1).result()
        assert fresh.consume_tokens([a, *path])
        np.testing.assert_array_equal(masks[i], compiler.mask(fresh))
    assert allows(masks[3], e) and not allows(masks[1], e)
    assert matcher.compute_ff_tokens() == [] and compiler.mask(matcher).tolist() == masks[0].tolist()  # rolled back
    assert grammar_text(StructuredOutputsParams(choice=("x",)))


@pytest.fixture(scope="module")
def spec_llms(default_tokenizer, tmp_path_factory):
    """A tiny target and an EAGLE-3 draft whose vocabulary is the ten digits: with top_k
    = 10 every tree holds the target's next digit, so trees get accepted and rolled back."""
    tok = default_tokenizer
    config = model.ModelConfig(vocab_size=fuzz.VOCAB, hidden_size=32, intermediate_size=64, num_heads=4,
                               num_kv_heads=2, head_dim=8, layer_kinds=("attention",) * 4,
                               max_position_embeddings=256, eos_token_id=2)
    params = model.init_params(config, jax.random.key(0))
    digits = np.array([tok.encode(str(i), add_special_tokens=False)[0] for i in range(10)])
    draft_config = eagle3.Eagle3Config(config, 10, eagle3.feature_layers(4), "tiny")
    path = str(tmp_path_factory.mktemp("digits_draft"))
    eagle3.save_draft(path, draft_config, eagle3.init_draft_params(draft_config, params, digits, jax.random.key(1)))
    kw = {"max_model_len": 96, "max_num_seqs": 4, "max_num_batched_tokens": 128}
    spec = {"method": "eagle3", "model": path, "num_speculative_tokens": 12, "depth": 3, "top_k": 10}
    return LLM.from_loaded(config, params, tok, **kw), LLM.from_loaded(config, params, tok, **kw,
                                                                       speculative_config=spec)


def test_speculative_decoding_under_a_grammar_is_lossless(spec_llms):
    plain, spec = spec_llms
    regex = "[0-9]{8}-[0-9]{8}"
    prompts = ["Serial:", "Code"]
    greedy = [constrained(regex=regex, temperature=0, max_tokens=24)] * 2
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    got = spec.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == want
    for o in got:
        assert re.fullmatch(regex, o.outputs[0].text)
    stats = spec.engine.speculative_stats()
    assert stats["num_trees"] > 0 and stats["tau"] > 1.5  # digits were accepted from the trees
    sampled = spec.generate(prompts, [constrained(regex=regex, seed=i, max_tokens=24) for i in range(2)])
    for o in sampled:
        assert re.fullmatch(regex, o.outputs[0].text)
