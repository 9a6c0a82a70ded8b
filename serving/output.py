"""The engine's one output processor: tokens in, text, stops and finish reasons out.

Every token a runner emits for a sequence passes through `OutputProcessor.append`, in
order, and nothing else decides when a sequence ends:

- EOS (unless ignore_eos) and stop token ids end it with "stop" and are not output;
- a stop string ends it with "stop" at the token whose text completes it; the text is
  cut before the stop string (vLLM's default), the token ids keep that token;
- max_tokens or max_model_len end it with "length".

Text is detokenized incrementally (the prefix / read offsets of Hugging Face's
text-generation-inference and vLLM): each token decodes a window of the few tokens
since the last emitted text, so the work per token stays flat as the text grows, and
a character whose bytes span several tokens is emitted once it is whole. Host-only.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from serving.params import SamplingParams

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """The text of a growing token list, one token at a time.

    `push(token)` returns the text the token completes ("" while a multi-byte character
    is still partial); the pieces concatenate to decode(all tokens), which `flush` ends
    with whatever is still held back.
    """

    def __init__(self, decode: Decode):
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix = 0  # window start: context for the next token's leading space
        self._read = 0  # tokens before this are already emitted as text

    def push(self, token: int) -> str:
        self._tokens.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end), as decode shows it."""
        return self._emit(final=True) if self._read < len(self._tokens) else ""

    def _emit(self, final: bool) -> str:
        before = self._decode(self._tokens[self._prefix:self._read])
        after = self._decode(self._tokens[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return after[len(before):]


@dataclasses.dataclass
class SeqOutput:
    """What one sequence has produced: tokens, their logprobs, text, and how it ended."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[tuple[float, dict[int, float]]] = dataclasses.field(default_factory=list)
    text_pieces: list[str] = dataclasses.field(default_factory=list)  # concatenated: the text
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    detokenizer: IncrementalDetokenizer | None = None
    # Text not yet in text_pieces: its last len(longest stop string) - 1 characters, where
    # a stop string may still begin (so streamed text never has to be taken back).
    pending: str = ""

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)


class OutputProcessor:
    """Appends a sequence's emitted tokens, detokenizes them and decides when it ends.

    decode: token ids -> text (special tokens skipped), or None for a token-level engine
    (the simulator), which then rejects stop strings.
    """

    def __init__(self, eos_token_id: int | None, max_model_len: int, decode: Decode | None = None):
        self.eos_token_id, self.max_model_len, self.decode = eos_token_id, max_model_len, decode

    def check(self, params: SamplingParams) -> None:
        if params.stop and self.decode is None:
            raise ValueError("stop strings need an engine with a tokenizer")

    def new(self) -> SeqOutput:
        detok = IncrementalDetokenizer(self.decode) if self.decode is not None else None
        return SeqOutput(detokenizer=detok)

    def append(self, out: SeqOutput, params: SamplingParams, prompt_len: int, tokens: Sequence[int],
               logprobs: Sequence[tuple[float, dict[int, float]]] | None = None) -> int:
        """Take `tokens` (one step's, in order) until one ends the sequence; returns how many
        were taken (the scheduler counts them all: their KV was computed). Sets
        out.finish_reason / stop_reason when the sequence ended; the caller frees it."""
        if out.finish_reason is not None:
            return 0
        for i, tok in enumerate(tokens):
            if (tok == self.eos_token_id and not params.ignore_eos) or tok in params.stop_token_ids:
                self.finish(out, "stop", tok if tok in params.stop_token_ids else None, params)
                return i + 1
            out.tokens.append(tok)
            if logprobs is not None:
                out.logprobs.append(logprobs[i])
            if out.detokenizer is not None:
                self._add_text(out, params.stop, out.detokenizer.push(tok))
            if out.finish_reason is None and (len(out.tokens) >= params.max_tokens
                                              or prompt_len + len(out.tokens) >= self.max_model_len):
                self.finish(out, "length", None, params)
            if out.finish_reason is not None:
                return i + 1
        return len(tokens)

    def finish(self, out: SeqOutput, reason: str, stop_reason: int | str | None = None,
               params: SamplingParams | None = None) -> None:
        """End the sequence (also from outside: abort), releasing the text held back."""
        if out.finish_reason is not None:
            return
        if out.detokenizer is not None:
            self._add_text(out, params.stop if params is not None else (), out.detokenizer.flush())
            if out.finish_reason is not None:  # the last characters completed a stop string
                return
        if out.pending:
            out.text_pieces.append(out.pending)
            out.pending = ""
        out.finish_reason, out.stop_reason = reason, stop_reason

    @staticmethod
    def _add_text(out: SeqOutput, stops: Sequence[str], new: str) -> None:
        if not new:
            return
        text = out.pending + new
        hits = [(at, stop) for stop in stops if (at := text.find(stop)) >= 0]
        if hits:
            at, stop = min(hits)
            if at:
                out.text_pieces.append(text[:at])
            out.pending, out.finish_reason, out.stop_reason = "", "stop", stop
            return
        keep = max((len(s) for s in stops), default=1) - 1
        ready = len(text) - keep
        if ready > 0:
            out.text_pieces.append(text[:ready])
        out.pending = text[max(ready, 0):]
