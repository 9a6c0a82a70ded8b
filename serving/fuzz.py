"""Fuzzing the LLM API: random mixes of valid and invalid requests, after each of which
nothing is left behind and a fixed greedy request still gives the same tokens.

An example is a short list of actions on one `LLM` (generate, stream broken off after k
deltas, chat, an LLM built with bad arguments). Each input is drawn from menus of valid
and invalid values whose validity is known, so an action has an expected outcome:
invalid input must raise ValueError (rejected cleanly) and valid input must run; any
other exception is a crash, a run past its step bound a hang, a request or page left
behind a leak, and a changed baseline a corruption.

tests/serving/test_fuzz.py draws actions with hypothesis (shrinking failures); `python -m
serving.bench fuzz --examples N` draws them with numpy for long runs and prints the counts.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math

import numpy as np

from serving import scheduler as sched
from serving.engine import PREEMPTION_MODES
from serving.params import LoRARequest, SamplingParams, StructuredOutputsParams

VOCAB = 49152  # the default model's tokenizer: text prompts and stop strings are real
MAX_MODEL_LEN = 64
STEP_BOUND = 2_000  # engine steps one action may take before it counts as a hang

# (value, valid) menus. A valid prompt can still be rejected for capacity; an invalid one
# must always be.
PROMPTS = [
    ([5, 17, 300, 4000], True), ({"prompt_token_ids": [1] * 30}, True), ("Hello there, robot.", True),
    ({"prompt": "naïve café 東京 🙂"}, True), ({"prompt_token_ids": [7, 7, 7, 9, 9], "prompt": "x"}, True),
    (None, False), ("", False), ({"prompt_token_ids": None}, False), ({"prompt_token_ids": []}, False),
    ({"prompt_token_ids": [True, False]}, False), ({"prompt_token_ids": [VOCAB]}, False),
    ({"prompt_token_ids": [-1, 3]}, False), ({"prompt_token_ids": [2.5]}, False), ("abc \ud800", False),
    (42, False), ({"x": 1}, False), ({"prompt_token_ids": [3] * MAX_MODEL_LEN}, False),
    ({"prompt_token_ids": "abc"}, False),
]
PARAMS = [
    (dict(temperature=0, max_tokens=6), True), (dict(temperature=0.8, top_p=0.9, seed=3, max_tokens=8), True),
    (dict(n=3, temperature=1.0, top_k=20, max_tokens=5), True), (dict(n=2, temperature=0, max_tokens=4), True),
    (dict(temperature=0, max_tokens=12, stop=[" the", "e"]), True),
    (dict(temperature=0, max_tokens=10, stop_token_ids=[11, 13], logprobs=3), True),
    (dict(temperature=0.5, min_p=0.1, seed=2**63 + 5, max_tokens=7, ignore_eos=True), True),
    (dict(max_tokens=24, ignore_eos=True, seed=-7), True),
    (dict(temperature=0.7, seed=4, max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.3,
          repetition_penalty=1.2), True),
    (dict(temperature=0, max_tokens=8, logit_bias={11: 5.0, 13: -100.0}, bad_words=["the", " robot"],
          min_tokens=3), True),
    (dict(presence_penalty=2.5), False), (dict(repetition_penalty=0.0), False),
    (dict(logit_bias={VOCAB: 1.0}), False), (dict(logit_bias={5: 101.0}), False),
    (dict(logit_bias=[(5, 1.0)]), False), (dict(min_tokens=-1), False), (dict(bad_words="the"), False),
    (dict(bad_words=[" "]), False),
    (dict(temperature=0.9, seed=5, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[a-z]{1,6}!")),
     True),
    (dict(n=2, temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no way"])),
     True),
    (dict(structured_outputs=StructuredOutputsParams(regex="([")), False),
    (dict(structured_outputs=StructuredOutputsParams(json={"type": 5})), False),
    (dict(structured_outputs={"regex": "a+"}), False),
    (dict(seed=1.5), False), (dict(logprobs=2.5), False), (dict(temperature="0.5"), False),
    (dict(stop=5), False), (dict(temperature=math.nan), False), (dict(top_k=2.5), False),
    (dict(seed=2**64), False), (dict(ignore_eos="no"), False), (dict(stop_token_ids="ab"), False),
    (dict(max_tokens=0), False), (dict(n=True), False), (dict(top_p=0.0), False),
    (dict(temperature=math.inf), False), (dict(logprobs=99), False), (dict(stop=[""]), False),
]
MESSAGES = [
    ([{"role": "user", "content": "Hi!"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], True),
    ({"role": "user", "content": "Hi"}, False), ([], False), ([{"role": "robot", "content": "x"}], False),
    ([{"role": "user", "content": 5}], False), ([{"content": "x"}], False), ("Hi", False),
]
LLM_ARGS = [
    dict(max_model_len=256.5), dict(max_model_len=0), dict(max_num_batched_tokens=0), dict(block_size=12),
    dict(num_kv_blocks=-1), dict(max_num_seqs=True), dict(enable_prefix_caching="yes"),
    dict(kv_cache_dtype=3), dict(capacity_policy="fast"), dict(preemption_mode=None), dict(seed="1"),
    dict(speculative_config="eagle"), dict(model="x"), dict(bogus=1),
]
# LoRA adapters per request (LORAS[i] names an adapter made by lora_dirs): none, two good
# ones (one slot: they take turns), and bad ones
LORAS = [(None, True), ("a", True), ("b", True), ("rank32", False), ("other-model", False),
         ("missing", False), ("a-other-id", False), ("not-a-request", False)]
LORA_RANK = 8
# Engines the examples run on: every capacity policy, both preemption modes, small pools.
ENGINES = [
    dict(capacity_policy=sched.MAX_UTILIZATION, preemption_mode="recompute", num_kv_blocks=6),
    dict(capacity_policy=sched.MAX_UTILIZATION, preemption_mode="swap", num_kv_blocks=6),
    dict(capacity_policy=sched.GUARANTEED_NO_EVICT, preemption_mode="recompute", num_kv_blocks=16),
    dict(capacity_policy=sched.STATIC_BATCH, preemption_mode="swap", num_kv_blocks=16,
         scheduling_policy="lpm"),
]
assert {e["preemption_mode"] for e in ENGINES} == set(PREEMPTION_MODES)
BASELINE = ({"prompt_token_ids": [11, 22, 33, 44, 55]}, SamplingParams(temperature=0, max_tokens=6))


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # "generate", "stream", "chat" or "llm_args"
    inputs: tuple = ()  # indices into PROMPTS (or MESSAGES for chat)
    params: tuple = ()  # indices into PARAMS, one per input, or one for all
    break_after: int = 0  # stream: deltas read before closing the stream
    as_dict: bool = False  # pass the first params as a plain dict (not SamplingParams)
    loras: tuple = (0,)  # indices into LORAS: the adapter of each input, or one for all

    def valid(self) -> bool:
        menu = MESSAGES if self.kind == "chat" else PROMPTS
        return (self.kind != "llm_args" and not self.as_dict and all(menu[i][1] for i in self.inputs)
                and all(PARAMS[j][1] for j in self.params) and len(self.params) in (1, len(self.inputs))
                and all(LORAS[i][1] for i in self.loras)
                and (self.kind == "chat" and len(self.loras) == 1 or len(self.loras) in (1, len(self.inputs))))


class Hang(Exception):
    pass


def tiny_config(hidden_size: int = 32):
    import model

    return model.ModelConfig(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=64, num_heads=4,
                             num_kv_heads=2, head_dim=8, layer_kinds=("attention",) * 2,
                             max_position_embeddings=512, eos_token_id=2)


_LORA_DIRS: dict[str, str] = {}


def lora_dirs() -> dict[str, str]:
    """PEFT adapters for tiny_config (written once per process to a temporary directory):
    "a" and "b" fit, "rank32" is above LORA_RANK, "other-model" has another hidden size."""
    if not _LORA_DIRS:
        import tempfile

        from model import lora

        root = tempfile.mkdtemp(prefix="kvfold-fuzz-lora-")
        rng = np.random.default_rng(0)
        for name, rank, config in (("a", 4, tiny_config()), ("b", LORA_RANK, tiny_config()),
                                   ("rank32", 32, tiny_config()), ("other-model", 4, tiny_config(48))):
            weights = {(layer, proj): (rng.normal(0, 0.3, (rank, d_in)), rng.normal(0, 0.3, (d_out, rank)))
                       for layer in range(config.num_layers)
                       for proj, (d_in, d_out) in lora.projection_shapes(config).items()}
            lora.save_peft_adapter(f"{root}/{name}", weights, rank, rank)
        _LORA_DIRS.update({name: f"{root}/{name}" for name in ("a", "b", "rank32", "other-model")},
                          missing=f"{root}/missing")
    return _LORA_DIRS


def lora_request(i: int):
    """The LoRARequest (or bad value) LORAS[i] stands for."""
    name = LORAS[i][0]
    if name is None:
        return None
    if name == "not-a-request":
        return {"lora_name": "a", "lora_int_id": 1}
    ids = {"a": 1, "b": 2, "rank32": 3, "other-model": 4, "missing": 5, "a-other-id": 1}
    path = lora_dirs()["b" if name == "a-other-id" else name]
    return LoRARequest(name, ids[name], path)


def tiny_llm(tokenizer, **kwargs):
    """A tiny random model (fast to compile) over the default tokenizer."""
    import jax

    import model
    from serving.llm import LLM

    config = tiny_config()
    params = model.init_params(config, jax.random.key(0))
    kwargs = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4, "max_num_batched_tokens": 32,
              "enable_lora": True, "max_loras": 1, "max_lora_rank": LORA_RANK, **kwargs}
    return LLM.from_loaded(config, params, tokenizer, **kwargs)


def make_engines(tokenizer) -> list:
    llms = [tiny_llm(tokenizer, **kw) for kw in ENGINES]
    for llm in llms:  # ids 1 and 2 name "a" and "b" from the start, so "a-other-id" is always a clash
        llm.add_lora(lora_request(1))
        llm.add_lora(lora_request(2))
    return [(llm, llm.generate(*BASELINE)[0].outputs[0].token_ids) for llm in llms]


def _params(action: Action):
    made = []
    for j in action.params:
        kwargs = PARAMS[j][0]
        made.append(dict(kwargs) if action.as_dict else SamplingParams(**kwargs))
    return made[0] if len(made) == 1 else made


def apply(llm, action: Action) -> None:
    """Run one action on `llm` (ValueError: rejected)."""
    if action.kind == "llm_args":
        from serving.llm import LLM

        kwargs = LLM_ARGS[action.inputs[0]]
        LLM.from_loaded(llm.config, llm.runner.params, llm.tokenizer, **kwargs)
        raise AssertionError(f"LLM accepted {kwargs}")
    params = _params(action)
    loras = [lora_request(i) for i in action.loras]
    lora = loras[0] if len(loras) == 1 else loras
    if action.kind == "chat":
        llm.chat(MESSAGES[action.inputs[0]][0], params, lora_request=lora)
        return
    prompts = [PROMPTS[i][0] for i in action.inputs]
    if action.kind == "generate":
        llm.generate(prompts, params, lora_request=lora)
        return
    stream = llm.stream(prompts, params, lora_request=lora)
    try:
        for k, _ in enumerate(stream):
            if k + 1 >= action.break_after:
                break
    finally:
        stream.close()


@contextlib.contextmanager
def step_bound(engine, bound: int = STEP_BOUND):
    """Within it, each `engine.step()` past `bound` raises Hang; `reset()` restarts the count."""
    step = type(engine).step
    steps = [0]

    def bounded_step(self):
        steps[0] += 1
        if steps[0] > bound:
            raise Hang(f"more than {bound} engine steps")
        return step(self)
    engine.step = bounded_step.__get__(engine)
    try:
        yield lambda: steps.__setitem__(0, 0)
    finally:
        del engine.step


def run_example(llm, baseline: list[int], actions: list[Action]) -> collections.Counter:
    """Apply `actions` to `llm`, classifying each; then check nothing is left behind and the
    baseline still holds. Returns counts by outcome."""
    counts: collections.Counter = collections.Counter()
    engine = llm.engine
    with step_bound(engine) as reset:
        for action in actions:
            reset()
            counts["inputs"] += 1
            try:
                apply(llm, action)
                counts["ran" if action.valid() else "accepted invalid input"] += 1
            except ValueError:
                counts["rejected cleanly"] += 1
            except Hang:
                counts["hangs"] += 1
            except Exception as e:  # noqa: BLE001 - what the fuzzer counts
                counts["crashes"] += 1
                counts[f"crash: {type(e).__name__}: {str(e)[:80]}"] += 1
    leaks = []
    try:
        engine.kv.check()
    except AssertionError as e:
        leaks.append(str(e))
    if engine.requests or engine.has_unfinished() or engine.kv.tables:
        leaks.append("requests or block tables left behind")
    if engine.kv.num_available != engine.kv.pool.num_pages:
        leaks.append("pages neither free nor evictable")
    counts["leaks"] += bool(leaks)
    if llm.generate(*BASELINE)[0].outputs[0].token_ids != baseline:
        counts["baseline changed"] += 1
    return counts


def random_actions(rng: np.random.Generator, max_actions: int = 4) -> list[Action]:
    """Actions drawn with numpy (what `python -m serving.bench fuzz` runs)."""
    actions = []
    for _ in range(int(rng.integers(1, max_actions + 1))):
        kind = str(rng.choice(["generate", "generate", "stream", "chat", "llm_args"]))
        if kind == "llm_args":
            actions.append(Action(kind, (int(rng.integers(len(LLM_ARGS))),)))
            continue
        menu = MESSAGES if kind == "chat" else PROMPTS
        n = 1 if kind == "chat" else int(rng.integers(1, 4))
        # mostly valid inputs, so that requests run and interact
        inputs = tuple(int(rng.choice([i for i, (_, ok) in enumerate(menu) if ok]))
                       if rng.random() < 0.8 else int(rng.integers(len(menu))) for _ in range(n))
        per = n if rng.random() < 0.3 else 1
        params = tuple(int(rng.choice([j for j, (_, ok) in enumerate(PARAMS) if ok]))
                       if rng.random() < 0.8 else int(rng.integers(len(PARAMS))) for _ in range(per))
        loras = tuple(int(rng.integers(3)) if rng.random() < 0.9 else int(rng.integers(len(LORAS)))
                      for _ in range(n if rng.random() < 0.5 else 1))
        actions.append(Action(kind, inputs, params, break_after=int(rng.integers(1, 6)),
                              as_dict=bool(rng.random() < 0.03), loras=loras))
    return actions


FAILURES = ("crashes", "hangs", "leaks", "baseline changed", "accepted invalid input")
