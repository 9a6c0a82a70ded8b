"""Fuzz the LLM API (serving/fuzz.py) with hypothesis: random mixes of valid and invalid
requests, streams broken off, n > 1 under every capacity policy, preemption in both
modes on small pools, LoRA adapters taking turns in one slot (and bad adapters). After each example: the KV manager's invariants hold, no request
or page is left behind, a fixed greedy request gives the same tokens; invalid input is
rejected with ValueError, never accepted, never a crash or a hang."""

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from serving import fuzz


@pytest.fixture(scope="module")
def engines(default_tokenizer):
    return fuzz.make_engines(default_tokenizer)


def _indices(menu, valid_bias=True):
    valid = [i for i, (_, ok) in enumerate(menu) if ok]
    return st.one_of(st.sampled_from(valid), st.integers(0, len(menu) - 1)) if valid_bias else \
        st.integers(0, len(menu) - 1)


@st.composite
def actions(draw):
    kind = draw(st.sampled_from(["generate", "stream", "chat", "llm_args"]))
    if kind == "llm_args":
        return fuzz.Action(kind, (draw(st.integers(0, len(fuzz.LLM_ARGS) - 1)),))
    n = 1 if kind == "chat" else draw(st.integers(1, 3))
    inputs = tuple(draw(_indices(fuzz.MESSAGES if kind == "chat" else fuzz.PROMPTS)) for _ in range(n))
    params = tuple(draw(_indices(fuzz.PARAMS)) for _ in range(draw(st.sampled_from([1, n]))))
    return fuzz.Action(kind, inputs, params, break_after=draw(st.integers(1, 5)),
                       as_dict=draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans()),
                       loras=tuple(draw(_indices(fuzz.LORAS)) for _ in range(draw(st.sampled_from([1, n])))))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(which=st.integers(0, len(fuzz.ENGINES) - 1), steps=st.lists(actions(), min_size=1, max_size=4))
def test_random_requests_leave_nothing_behind(engines, which, steps):
    llm, baseline = engines[which]
    counts = fuzz.run_example(llm, baseline, steps)
    failures = {k: v for k, v in counts.items() if k in fuzz.FAILURES or k.startswith("crash:")}
    assert not any(failures.values()), (failures, steps)
