"""The engine's output processor: incremental text against whole-sequence decoding, stops
in one place, and flat work per token as the text grows."""

import numpy as np
import pytest

from serving import scheduler as sched
from serving.engine import EngineCore
from serving.output import IncrementalDetokenizer, OutputProcessor
from serving.params import SamplingParams
from serving.simulator import CostModel, SimRunner

TEXT = "naïve café 東京 🙂 ok — größer als 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, नमस्ते!"


class CountingDecode:
    """A decode function that records how many token ids each call reads."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, ids):
        self.calls.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Letters:
    """Token i spells the i-th letter; 8 and 9 are multi-letter tokens."""

    WORDS = list("abcdefgh") + ["xy", "yz"]

    def __call__(self, ids):
        return "".join(self.WORDS[i] for i in ids)


def test_incremental_text_equals_decoding_the_whole_sequence(default_tokenizer):
    """Characters whose bytes span several tokens (CJK, emoji, math letters) come out once
    whole, never as replacement characters, and the pieces add up to decode(all)."""
    ids = default_tokenizer.encode(TEXT * 3, add_special_tokens=False)
    decode = CountingDecode(default_tokenizer)
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == default_tokenizer.decode(ids, skip_special_tokens=True) == TEXT * 3
    assert not any("\ufffd" in p for p in pieces)
    assert sum(p == "" for p in pieces) > 3  # some tokens held a partial character back


def test_a_cut_character_is_flushed_as_decode_shows_it(default_tokenizer):
    ids = default_tokenizer.encode("東京", add_special_tokens=False)
    detok = IncrementalDetokenizer(CountingDecode(default_tokenizer))
    text = "".join(detok.push(t) for t in ids[:-1]) + detok.flush()
    assert text == default_tokenizer.decode(ids[:-1], skip_special_tokens=True)


def test_detokenizing_work_per_token_is_flat(default_tokenizer):
    """Each token decodes a window of the last few tokens: the tokens read per push are
    bounded, the same at token 1000 as at token 10 (re-decoding the text would read 1000)."""
    ids = default_tokenizer.encode(TEXT * 40, add_special_tokens=False)
    assert len(ids) > 1000
    decode = CountingDecode(default_tokenizer)
    detok = IncrementalDetokenizer(decode)
    per_token = []
    for t in ids:
        before = sum(decode.calls)
        detok.push(t)
        per_token.append(sum(decode.calls) - before)
    early, late = max(per_token[:len(ids) // 4]), max(per_token[-len(ids) // 4:])
    assert late <= early <= 16


def make_processor():
    return OutputProcessor(eos_token_id=7, max_model_len=100, decode=Letters())


def test_eos_and_stop_tokens_end_the_sequence_and_are_not_output():
    proc = make_processor()
    out = proc.new()
    taken = proc.append(out, SamplingParams(max_tokens=10), 3, [0, 1, 7, 2])
    assert (taken, out.tokens, out.text, out.finish_reason, out.stop_reason) == (3, [0, 1], "ab", "stop", None)
    out = proc.new()
    taken = proc.append(out, SamplingParams(max_tokens=10, stop_token_ids=[2]), 3, [0, 2, 1])
    assert (taken, out.tokens, out.finish_reason, out.stop_reason) == (2, [0], "stop", 2)
    out = proc.new()  # ignore_eos: 7 is an ordinary token
    taken = proc.append(out, SamplingParams(max_tokens=3, ignore_eos=True), 3, [7, 7, 7, 7])
    assert (taken, out.tokens, out.text, out.finish_reason) == (3, [7, 7, 7], "hhh", "length")


def test_length_counts_max_tokens_and_max_model_len():
    proc = make_processor()
    out = proc.new()
    assert proc.append(out, SamplingParams(max_tokens=50), 98, [0, 1, 2]) == 2  # 98 + 2 = max_model_len
    assert out.finish_reason == "length" and out.tokens == [0, 1]


@pytest.mark.parametrize("steps", [[[0], [8], [9], [3]], [[0, 8, 9, 3]]])
def test_stop_string_across_tokens_ends_at_the_completing_token(steps):
    """"xyyz" spells tokens 8, 9; the stop "yy" is completed by token 9, whether the tokens
    come one per step or all in one (a speculative step): token 3 after it is never taken."""
    proc = make_processor()
    out = proc.new()
    params = SamplingParams(max_tokens=10, stop=["zz", "yy"])
    taken = [proc.append(out, params, 3, s) for s in steps]
    assert sum(taken) == 3 and out.tokens == [0, 8, 9]
    assert (out.text, out.finish_reason, out.stop_reason) == ("ax", "stop", "yy")


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    proc = make_processor()
    out = proc.new()
    params = SamplingParams(max_tokens=4, stop=["bcd"])
    proc.append(out, params, 3, [0, 1])
    assert out.text == "" and out.pending == "ab"  # the last len("bcd") - 1 characters wait
    proc.append(out, params, 3, [2])
    assert out.text == "a"  # "bc" may begin "bcd"
    proc.append(out, params, 3, [4])
    assert out.text == "abce" and out.finish_reason == "length"  # released at the end


def test_engine_stream_work_per_step_is_independent_of_output_length(default_tokenizer):
    """The engine's output path (detokenize, stop strings) reads a bounded number of tokens
    per step however long the output already is."""
    decode = CountingDecode(default_tokenizer)
    vocab = default_tokenizer.vocab_size
    engine = EngineCore(SimRunner(CostModel((0, 0, 0), (0, 0, 0)), vocab_size=vocab),
                        sched.SchedulerConfig(page_size=16), num_pages=64, max_model_len=1024,
                        eos_token_id=None, decode=decode)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=900, stop=["never appears ¤¤"],
                                                      ignore_eos=True))
    per_step = []
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        before = sum(decode.calls)
        engine.step()
        per_step.append(sum(decode.calls) - before)
    assert engine.seqs["r#0"].output.finish_reason == "length"
    text = engine.seqs["r#0"].output.text
    assert text == default_tokenizer.decode(engine.seqs["r#0"].output.tokens, skip_special_tokens=True)
    assert max(per_step[-200:]) <= max(per_step[:200]) <= 32
    assert np.mean(per_step[-200:]) <= 2 * np.mean(per_step[1:201])
