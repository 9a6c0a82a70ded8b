"""vLLM's user-facing names: SamplingParams, RequestOutput, CompletionOutput."""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np


SEED_BITS = 64


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """value must be an integer (Python or numpy; a bool is not) in [low, high]; returns it
    as an int."""
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if (low is not None and value < low) or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return int(value)


def check_number(name: str, value, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """value must be a finite real number (int or float, not bool) in [low, high] (or
    (low, high] when low_open); returns it as a float."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
        bounds = f"{'(' if low_open else '['}{low}, {high}{']' if math.isfinite(high) else ')'}"
        raise ValueError(f"{name} must be a finite number in {bounds}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_text(name: str, value) -> str:
    """value must be a str that is valid Unicode (no lone surrogates, e.g. from bytes that
    were not UTF-8)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text ({e.reason} at position {e.start})") from None
    return value


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's name and fields): exactly one of

    json: a JSON schema (dict or its JSON text); regex: a regular expression (Rust regex
    syntax); choice: a list of strings, the output is one of them; grammar: an EBNF (GBNF)
    or Lark grammar; json_object=True: any JSON object.

    Checked for shape here; the engine compiles it against its tokenizer (serving/structured.py)
    and rejects a schema, regex or grammar that does not compile with a ValueError.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured outputs json must be a schema dict or its JSON text, got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not check_text(f"structured outputs {name}", value):
                raise ValueError(f"structured outputs {name} is empty")
        if self.json_object is not None:
            check_bool("structured outputs json_object", self.json_object)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured outputs choice must be a non-empty list of strings, got "
                                 f"{self.choice!r:.80}")
            for c in self.choice:
                if not check_text("a structured outputs choice", c):
                    raise ValueError("a structured outputs choice is empty")
            object.__setattr__(self, "choice", tuple(self.choice))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's spelling and defaults, greedy when temperature=0).

    Every field is checked on construction: exact types (a bool is not an int, a float is
    not a seed), finite numbers, documented ranges; a bad one raises ValueError naming it.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    seed: int | None = None  # any int in [-2**63, 2**64), taken modulo 2**64 (as torch does)
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    logprobs: int | None = None  # top-k logprobs returned per generated token
    prompt_logprobs: int | None = None  # top-k logprobs returned per prompt token
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # Penalties and biases (vLLM's names and rules, applied in the jitted sampler in
    # vLLM's order: logit_bias, bad_words and min_tokens first, then repetition, then
    # frequency and presence). presence / frequency count generated tokens only;
    # repetition divides a positive logit (multiplies a negative one) of every token seen
    # in the prompt or the output.
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to its logit
    bad_words: tuple[str, ...] | list[str] | None = None  # never generated (as their tokens, with or without a leading space)
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens are out

    def __post_init__(self):
        checked = dict(n=check_int("n", self.n, 1), max_tokens=check_int("max_tokens", self.max_tokens, 1),
                       temperature=check_number("temperature", self.temperature, 0.0),
                       top_p=check_number("top_p", self.top_p, 0.0, 1.0, low_open=True),
                       top_k=max(check_int("top_k", self.top_k, -1), 0),
                       min_p=check_number("min_p", self.min_p, 0.0, 1.0),
                       ignore_eos=check_bool("ignore_eos", self.ignore_eos))
        checked.update(presence_penalty=check_number("presence_penalty", self.presence_penalty, -2.0, 2.0),
                       frequency_penalty=check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
                       repetition_penalty=check_number("repetition_penalty", self.repetition_penalty, 0.0,
                                                       low_open=True),
                       min_tokens=check_int("min_tokens", self.min_tokens, 0, checked["max_tokens"]))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            checked["logit_bias"] = {check_int("a logit_bias token id", t, 0):
                                     check_number(f"logit_bias[{t}]", b, -100.0, 100.0)
                                     for t, b in self.logit_bias.items()} or None
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r:.80}")
            for w in self.bad_words:
                if not check_text("a bad word", w).strip():
                    raise ValueError("a bad word is empty")
            checked["bad_words"] = tuple(self.bad_words) or None
        if self.seed is not None:
            checked["seed"] = check_int("seed", self.seed, -2**63, 2**SEED_BITS - 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                checked[name] = check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for s in stop:
            check_text("a stop string", s)
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
        checked["stop"] = stop
        checked["stop_token_ids"] = tuple(check_int("a stop token id", t, 0) for t in ids or ())
        for name, value in checked.items():
            object.__setattr__(self, name, value)


MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter a request runs under (vLLM's LoRARequest): a name, a positive
    integer id unique per adapter (the engine's handle: its prefix-cache namespace and
    device slot key), and a PEFT directory (adapter_config.json and
    adapter_model.safetensors, as peft's save_pretrained writes them)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        check_text("lora_name", self.lora_name)
        if not self.lora_name:
            raise ValueError("lora_name is empty")
        check_int("lora_int_id", self.lora_int_id, 1)
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a directory path, got {self.lora_path!r}")


def adjusts_logits(params: SamplingParams) -> bool:
    """Whether a request's penalties or biases change any logit."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.bad_words or params.min_tokens)


@dataclasses.dataclass
class CompletionOutput:
    """One sampled continuation of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}
    finish_reason: str | None = None  # "stop" (EOS / stop string / stop token), "length", "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """Everything generated for one prompt so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs: per prompt token {token_id: logprob} (its own
    # and the top ones at its position); None for the first token, which has no context
    prompt_logprobs: list[dict[int, float] | None] | None = None
