"""vLLM's user-facing names: SamplingParams, RequestOutput, CompletionOutput."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's spelling and defaults, greedy when temperature=0)."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    logprobs: int | None = None  # top-k logprobs returned per generated token
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be an integer > 0, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or > 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "top_k", max(self.top_k, 0))


MAX_LOGPROBS = 20


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
