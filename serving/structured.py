"""Structured outputs: a request's output constrained to a JSON schema, regex, choice or
grammar, with llguidance (Microsoft's Guidance engine: a lazily built lexer automaton
and an Earley parser over the tokenizer's token trie) computing, per step, the bitmask
of the tokens the grammar allows next.

The engine side of SGLang's compressed FSM ("SGLang: Efficient Execution of Structured
Language Model Programs"), in three pieces:

- `GrammarCompiler`: checks a request's `StructuredOutputsParams` at add_request (a
  ValueError for a schema, regex or grammar that does not parse, before the request is
  scheduled) and builds its matchers in a worker thread, off the engine thread; the
  scheduler keeps the request waiting until they are ready.
- masks: one int32 bitmask row of ceil(vocab / 32) words per sampled row (bit t of
  word t // 32 set = token t allowed), and for a draft tree one row per node (the mask
  after the path to it), which the jitted sampler and the verifier apply.
- jump-forward: after the matcher takes a sampled token, `forced_tokens` are the tokens
  the grammar now admits one way only; the engine appends them without sampling and
  computes them as one chunk in the next step.

Host-only (numpy and llguidance), like the engine.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading

import llguidance
import llguidance.numpy
import numpy as np

from serving.params import StructuredOutputsParams

# JSON is written compactly (no whitespace between tokens): small models otherwise wander
# into whitespace, and fixed separators let jump-forward take whole key runs. A schema's
# own "x-guidance" options (e.g. {"whitespace_flexible": true}) override these.
JSON_OPTIONS = {"whitespace_flexible": False}
GRAMMAR_THREADS = 2  # matcher construction releases the GIL: a couple of threads suffice


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for `so`; ValueError naming what does not parse."""
    try:
        if so.json is not None:
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        elif so.json_object:
            text = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        elif so.regex is not None:
            text = llguidance.grammar_from("regex", so.regex)
        elif so.choice is not None:
            text = llguidance.grammar_from("choice", json.dumps(list(so.choice)))
        else:
            text = llguidance.grammar_from("grammar", so.grammar)
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"structured outputs {_kind(so)} does not parse: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"structured outputs {_kind(so)} is not valid: {error}")
    return text


def _kind(so: StructuredOutputsParams) -> str:
    return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(so, name) not in (None, False))


class GrammarCompiler:
    """Turns a request's structured outputs into one matcher per sequence, in worker threads.

    tokenizer: a model.Tokenizer (its Hugging Face `tokenizers` JSON is what llguidance
    reads); vocab_size: the model's logits width, which the masks cover (tokens past the
    tokenizer's vocabulary are never allowed).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, eos_token_id
        self.mask_words = -(-vocab_size // 32)
        self._ll: llguidance.LLTokenizer | None = None
        self._ll_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built once (about a second for a 50k vocabulary)."""
        with self._ll_lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(self._tokenizer._tok.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=self._eos)
            return self._ll

    def submit(self, so: StructuredOutputsParams, num_seqs: int) -> concurrent.futures.Future:
        """Check `so` now (ValueError) and build num_seqs matchers in a worker thread: a future
        of the list of them, or of the error when building one failed."""
        text = grammar_text(so)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS, "kvfold-grammar")
        return self._pool.submit(self._build, text, num_seqs)

    def _build(self, text: str, num_seqs: int) -> list[llguidance.LLMatcher]:
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs grammar failed to build: {matcher.get_error()}")
        return [matcher] + [matcher.deep_copy() for _ in range(num_seqs - 1)]

    # -- masks ----------------------------------------------------------------------

    def mask(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """int32 [mask_words]: the tokens the matcher allows next."""
        out = np.zeros((1, self.mask_words), np.int32)
        llguidance.numpy.fill_next_token_bitmask(matcher, out, 0)
        return out[0]

    def tree_masks(self, matcher: llguidance.LLMatcher, tokens, parents) -> np.ndarray:
        """int32 [N, mask_words] for a draft tree (tokens[0], its root, already consumed):
        row i is the mask after the path from the root to node i. A node the grammar
        rejects on its path is never reached by verification (its parent's mask zeroes
        its probability); its row allows everything."""
        n = len(tokens)
        out = np.full((n, self.mask_words), -1, np.int32)
        out[0] = self.mask(matcher)
        for i in range(1, n):
            path = []
            node = i
            while node > 0:
                path.append(int(tokens[node]))
                node = int(parents[node])
            path.reverse()
            taken = matcher.try_consume_tokens(path)
            if taken == len(path) and not matcher.is_error():
                llguidance.numpy.fill_next_token_bitmask(matcher, out, i)
            if taken:
                matcher.rollback(taken)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether bitmask `mask` allows `token`."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def advance(matcher: llguidance.LLMatcher, tokens, jump_forward: bool) -> list[int]:
    """Feed the matcher a sequence's new tokens; with jump_forward, return the tokens the
    grammar then forces (taken by the matcher too), else []."""
    for t in tokens:
        if not matcher.consume_token(int(t)):
            raise RuntimeError(f"the sampler emitted token {t}, which the grammar does not allow: "
                               f"{matcher.get_error()}")
    if not jump_forward or matcher.is_stopped():
        return []
    forced = matcher.compute_ff_tokens()
    if forced and not matcher.consume_tokens(forced):
        raise RuntimeError(f"the grammar's forced tokens do not parse: {matcher.get_error()}")
    return list(forced)
