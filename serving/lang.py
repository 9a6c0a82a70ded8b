"""SGLang's frontend language over the LLM API (from "SGLang: Efficient Execution of
Structured Language Model Programs"): a program appends text, `gen` and `select` calls
to a state, forks it into branches, and many programs run with their calls batched.

    from serving.lang import function, gen, select

    @function
    def qa(s, question):
        s += "Q: " + question + "\\nA:" + gen("answer", max_tokens=32, stop="\\n")
        s += "\\nSure? " + select("sure", choices=["yes", "no"])

    state = qa.run(question="Why is the sky blue?", llm=llm)
    state["answer"], state["sure"], state.text()
    states = qa.run_batch([{"question": q} for q in questions], llm=llm)

A state is a token list (what the model sees) and its text. Appending is lazy: `s += gen(...)`
queues the call, and reading (`s["name"]`, `s.text()`, `s.fork(n)`) waits for it. That is
what batches calls: program instances run in worker threads, and once every worker is
waiting, the first queued call of every state (every branch of every program) goes to the
engine in one `llm.generate`. docs/lang.md walks through an example.

Tokenization: each appended text is tokenized on its own and its tokens appended
(`encode(text)` with special tokens, e.g. a BOS, when the state is empty, without them
otherwise), so a state's token list is exactly the concatenation of its pieces; `gen`
appends the generated token ids (re-tokenizing the text only when a stop string cut it).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import threading
from typing import Callable, Sequence

from serving.params import SamplingParams, check_int, check_text

SUM, TOKEN_LENGTH_NORMALIZED = "sum", "token_length_normalized"
CHOICES_METHODS = (SUM, TOKEN_LENGTH_NORMALIZED)
CHAT_ROLES = ("system", "user", "assistant")
DEFAULT_NUM_THREADS = 64

# -- expressions: what `s += ...` takes ------------------------------------------------


class Expr:
    """Something a state can be extended by; `+` concatenates (with strings, too)."""

    def __add__(self, other) -> "Concat":
        return Concat((self, other))

    def __radd__(self, other) -> "Concat":
        return Concat((other, self))


@dataclasses.dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    choices_method: str = SUM


@dataclasses.dataclass(frozen=True)
class Concat(Expr):
    items: tuple


@dataclasses.dataclass(frozen=True)
class Role(Expr):
    role: str
    content: object  # anything a state takes, between the role's begin and end markers


def gen(name: str | None = None, max_tokens: int = 128, stop: str | Sequence[str] | None = None,
        temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
        seed: int | None = None, stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
        choices: Sequence[str] | None = None) -> Gen | Select:
    """Generate text into variable `name` (SamplingParams' fields and defaults, except
    max_tokens); with `choices`, the same as select(name, choices)."""
    if choices is not None:
        return select(name, choices)
    params = SamplingParams(max_tokens=max_tokens, stop=stop, temperature=temperature, top_p=top_p,
                            top_k=top_k, min_p=min_p, seed=seed, stop_token_ids=stop_token_ids,
                            ignore_eos=ignore_eos)
    return Gen(_check_name(name), params)


def select(name: str | None = None, choices: Sequence[str] | None = None,
           choices_method: str = SUM) -> Select:
    """Pick the choice the model finds most likely after the state: the largest sum of its
    tokens' log-probabilities ("sum"), or of their mean ("token_length_normalized", SGLang's
    default, which does not favour short choices)."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError(f"select needs a non-empty list of choices, got {choices!r:.80}")
    for c in choices:
        if not check_text("a select choice", c):
            raise ValueError("a select choice is empty")
    if choices_method not in CHOICES_METHODS:
        raise ValueError(f"choices_method must be one of {list(CHOICES_METHODS)}, got {choices_method!r}")
    return Select(_check_name(name), tuple(choices), choices_method)


def system(content) -> Role:
    return Role("system", content)


def user(content) -> Role:
    return Role("user", content)


def assistant(content) -> Role:
    return Role("assistant", content)


def _check_name(name) -> str | None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"a variable name must be a non-empty string, got {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class _Markup:
    """Chat-template text: tokenized without special tokens even at the state's start."""

    text: str
    opens: str | None = None  # the role whose message this text begins


@dataclasses.dataclass(frozen=True)
class _Warm:
    """Make the state's prefix resident in the prefix cache (before a fork's branches)."""


def _flatten(expr, markers: Callable[[], "ChatMarkers"], in_role: bool = False) -> list:
    """expr as the items a state queues: str, _Markup, Gen, Select."""
    if isinstance(expr, str):
        return [check_text("appended text", expr)]
    if isinstance(expr, (Gen, Select)):
        return [expr]
    if isinstance(expr, Concat):
        return [item for e in expr.items for item in _flatten(e, markers, in_role)]
    if isinstance(expr, Role):
        if in_role:
            raise ValueError(f"a {expr.role}(...) role cannot be nested inside another role")
        begin, end = markers().roles[expr.role]
        return [_Markup(begin, expr.role), *_flatten(expr.content, markers, True), _Markup(end)]
    raise ValueError(f"a state takes str, gen(...), select(...), system/user/assistant(...) or their "
                     f"sum; got {type(expr).__name__}")


# -- states ---------------------------------------------------------------------------


class ProgramState:
    """One program's (or branch's) tokens, text and captured variables."""

    def __init__(self, executor: "_Executor", program: int, tokens: Sequence[int] = (), text: str = "",
                 variables: dict | None = None, meta: dict | None = None):
        self._executor, self._program = executor, program
        self._tokens, self._text = list(tokens), [text] if text else []
        self._variables: dict[str, str] = dict(variables or {})
        self._meta: dict[str, dict] = dict(meta or {})
        self._pending: list = []  # appended items not applied yet; the head is an LLM call
        self._error: BaseException | None = None
        self.ret_value = None  # what the program returned (root states)
        executor.states.append(self)

    def __iadd__(self, expr) -> "ProgramState":
        items = _flatten(expr, lambda: self._executor.chat_markers)
        opens = items[0].opens if items and isinstance(items[0], _Markup) else None
        if opens not in (None, "system") and not self._tokens and not self._pending:
            # the template's own opening (e.g. a default system message) when a chat starts without one
            preamble = self._executor.chat_markers.preamble
            items = [_Markup(preamble)] * bool(preamble) + items
        self._pending += items
        self._advance()
        return self

    def __getitem__(self, name: str) -> str:
        self._sync()
        if name not in self._variables:
            raise ValueError(f"no variable {name!r} in this state; it has {sorted(self._variables)}")
        return self._variables[name]

    def get_meta_info(self, name: str) -> dict:
        """What the engine reported for the call that set `name`: prompt_tokens,
        cached_tokens, completion_tokens, finish_reason for gen; choices, scores,
        token_logprobs for select."""
        self._sync()
        if name not in self._meta:
            raise ValueError(f"no variable {name!r} in this state; it has {sorted(self._meta)}")
        return self._meta[name]

    def text(self) -> str:
        self._sync()
        return "".join(self._text)

    def token_ids(self) -> list[int]:
        """The tokens the model sees for this state (its next call's prompt)."""
        self._sync()
        return list(self._tokens)

    def fork(self, n: int) -> "ForkGroup":
        """n branches that continue from this state independently. The state's prefix is
        computed once: before the branches' first calls it is made resident in the prefix
        cache (one request over it), so each branch computes only its own suffix."""
        n = check_int("fork n", n, 1)
        if n > 1:
            self._pending.append(_Warm())
            self._advance()
        self._sync()
        text = "".join(self._text)
        return ForkGroup([ProgramState(self._executor, self._program, self._tokens, text, self._variables,
                                       self._meta) for _ in range(n)])

    # -- applying results ----------------------------------------------------------

    def _extend(self, tokens: Sequence[int], text: str) -> None:
        self._tokens += tokens
        self._text.append(text)

    def _advance(self) -> None:
        """Apply queued items up to the next one that needs the model."""
        tok = self._executor.tokenizer
        while self._pending:
            item = self._pending[0]
            if isinstance(item, str):
                self._extend(tok.encode(item, add_special_tokens=not self._tokens), item)
            elif isinstance(item, _Markup):
                self._extend(tok.encode(item.text, add_special_tokens=False), item.text)
            elif isinstance(item, _Warm) and not self._executor.worth_warming(len(self._tokens)):
                pass
            elif isinstance(item, (Gen, Select)) and not self._tokens:
                self._fail(ValueError(f"{type(item).__name__.lower()}({item.name!r}) on an empty state: "
                                      "append a prompt first"))
                return
            else:
                return
            self._pending.pop(0)

    def _fail(self, error: BaseException) -> None:
        self._error, self._pending = error, []

    def _sync(self) -> None:
        self._executor.sync([self])


class ForkGroup:
    """The branches of `state.fork(n)`: index them (`forks[i] += ...`), iterate, `forks += x`
    appends to each, `join()` waits for all of them."""

    def __init__(self, states: list[ProgramState]):
        self._states = states

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self):
        return iter(self._states)

    def __getitem__(self, i: int) -> ProgramState:
        return self._states[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:  # what `forks[i] += x` does last
        if state is not self._states[i]:
            raise ValueError("a fork's branches cannot be replaced; extend them with forks[i] += ...")

    def __iadd__(self, expr) -> "ForkGroup":
        for s in self._states:
            s += expr
        return self

    def join(self) -> None:
        if self._states:
            self._states[0]._executor.sync(self._states)


# -- running programs -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChatMarkers:
    """Per role, the chat template's text before and after a message's content; preamble:
    what the template puts first when a conversation opens without a system message."""

    roles: dict[str, tuple[str, str]]
    preamble: str


def chat_markers(tokenizer) -> ChatMarkers:
    """Read the role markers off the tokenizer's chat template by rendering growing
    conversations around placeholder contents."""
    if not tokenizer.chat_template:
        raise ValueError("system/user/assistant need a tokenizer with a chat template; this one has none")
    holders = {r: f"\x1e{r.upper()}-CONTENT\x1e" for r in CHAT_ROLES}
    roles, messages, before = {}, [], ""
    for role in CHAT_ROLES:
        messages.append({"role": role, "content": holders[role]})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        if not text.startswith(before) or holders[role] not in text[len(before):]:
            raise ValueError("the chat template does not render a conversation as the concatenation of "
                             "its messages; system/user/assistant cannot be used with it")
        at = text.index(holders[role], len(before))
        roles[role] = (text[len(before):at], text[at + len(holders[role]):])
        before = text
    alone = tokenizer.apply_chat_template([{"role": "user", "content": holders["user"]}],
                                          add_generation_prompt=False)
    start = alone.index(holders["user"]) - len(roles["user"][0])
    preamble = alone[:start] if start >= 0 and alone[start:].startswith(roles["user"][0]) else ""
    return ChatMarkers(roles, preamble)


class _Executor:
    """Runs programs on one LLM: worker threads run the programs; whenever every worker
    waits (or has finished), one wave sends the head call of every state with queued
    calls to the engine in one `llm.generate`."""

    def __init__(self, llm):
        for attr in ("generate", "get_tokenizer", "max_model_len", "engine"):
            if not hasattr(llm, attr):
                raise ValueError(f"llm must be a serving.LLM, got {type(llm).__name__}")
        self.llm, self.tokenizer = llm, llm.get_tokenizer()
        kv = llm.engine.kv
        self.page_size = kv.page_size if kv.radix is not None else None  # None: no prefix cache
        self.states: list[ProgramState] = []
        self._cond = threading.Condition()
        self._num_workers = 0  # live worker threads
        self._waiting: dict[int, Callable[[], bool]] = {}  # worker thread id -> what it waits for
        self._local = threading.local()  # .worker: this thread runs programs of this executor
        self._markers: ChatMarkers | None = None

    @property
    def chat_markers(self) -> ChatMarkers:
        if self._markers is None:
            self._markers = chat_markers(self.tokenizer)
        return self._markers

    def worth_warming(self, num_tokens: int) -> bool:
        """A warm-up pays when the prefix cache would keep at least one full page of it."""
        return self.page_size is not None and self.page_size <= num_tokens < self.llm.max_model_len

    # -- waiting ---------------------------------------------------------------------

    def sync(self, states: list[ProgramState]) -> None:
        """Return once none of `states` has queued work; raise the first one's error."""
        def done() -> bool:
            return not any(s._pending for s in states)

        me = threading.get_ident()
        if not done():
            if getattr(self._local, "worker", False):
                with self._cond:
                    self._waiting[me] = done
                    self._cond.notify_all()
                    self._cond.wait_for(done)
                    del self._waiting[me]
            else:  # outside a run (a state read or extended after it returned): drive waves here
                while not done():
                    self._wave()
        for s in states:
            if s._error is not None:
                raise s._error

    def _all_waiting(self) -> bool:
        return len(self._waiting) == self._num_workers and not any(d() for d in self._waiting.values())

    def run(self, func: Callable, calls: list[tuple[tuple, dict]], num_threads: int) -> list[ProgramState]:
        roots = [ProgramState(self, i) for i in range(len(calls))]
        errors: list[BaseException | None] = [None] * len(calls)
        todo = iter(range(len(calls)))
        todo_lock = threading.Lock()

        def worker():
            self._local.worker = True
            try:
                while True:
                    with todo_lock:
                        i = next(todo, None)
                    if i is None:
                        return
                    args, kwargs = calls[i]
                    try:
                        roots[i].ret_value = func(roots[i], *args, **kwargs)
                    except Exception as e:  # noqa: BLE001 - handed to the caller below
                        errors[i] = e
            finally:
                with self._cond:
                    self._num_workers -= 1
                    self._cond.notify_all()

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(num_threads, len(calls)))]
        with self._cond:
            self._num_workers = len(threads)
            for t in threads:
                t.start()
            while True:
                self._cond.wait_for(self._all_waiting)
                if not self._num_workers and not any(s._pending for s in self.states):
                    break
                try:
                    self._wave()  # workers wait only for queued work: there is some
                except Exception as e:  # noqa: BLE001 - the waiting programs raise it
                    for s in self.states:
                        if s._pending:
                            s._fail(e)
                self._cond.notify_all()
        for t in threads:
            t.join()
        for i in range(len(calls)):
            failed = [s._error for s in self.states if s._program == i and s._error is not None]
            if errors[i] is not None or failed:
                raise errors[i] or failed[0]
        return roots

    # -- one wave: every state's head call in one generate ------------------------------

    def _wave(self) -> None:
        requests = [(s, self._requests(s)) for s in self.states if s._pending]
        try:
            outs = iter(self._generate([r for _, reqs in requests for r in reqs]))
        except ValueError:
            for s, reqs in requests:  # find whose request was refused: one generate per state
                try:
                    self._apply(s, self._generate(reqs))
                except ValueError as e:
                    s._fail(e)
            return
        for s, reqs in requests:
            self._apply(s, list(itertools.islice(outs, len(reqs))))

    def _generate(self, requests: list[tuple[list[int], SamplingParams]]) -> list:
        return self.llm.generate([{"prompt_token_ids": p} for p, _ in requests], [sp for _, sp in requests])

    def _requests(self, s: ProgramState) -> list[tuple[list[int], SamplingParams]]:
        head = s._pending[0]
        if isinstance(head, Gen):
            return [(list(s._tokens), head.params)]
        if isinstance(head, Select):
            # prompt_logprobs=0: each prompt token's own logprob, no top list
            scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            return [(s._tokens + self._encode_tail(c), scoring) for c in head.choices]
        return [(list(s._tokens), SamplingParams(max_tokens=1, temperature=0.0))]  # _Warm

    def _encode_tail(self, text: str) -> list[int]:
        """Tokens of text that follows other tokens (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _apply(self, s: ProgramState, outs: list) -> None:
        head = s._pending.pop(0)
        if isinstance(head, Gen):
            out, o = outs[0], outs[0].outputs[0]
            # a stop string cuts the text but not the token that completed it
            tokens = self._encode_tail(o.text) if isinstance(o.stop_reason, str) else o.token_ids
            s._extend(tokens, o.text)
            if head.name is not None:
                s._variables[head.name] = o.text
                s._meta[head.name] = {"prompt_tokens": len(out.prompt_token_ids),
                                      "cached_tokens": out.num_cached_tokens,
                                      "completion_tokens": len(o.token_ids), "finish_reason": o.finish_reason}
        elif isinstance(head, Select):
            start = len(s._tokens)
            token_logprobs = [[lp[t] for lp, t in zip(o.prompt_logprobs[start:], o.prompt_token_ids[start:])]
                              for o in outs]
            scores = [sum(lps) for lps in token_logprobs]
            if head.choices_method == TOKEN_LENGTH_NORMALIZED:
                scores = [score / len(lps) for score, lps in zip(scores, token_logprobs)]
            best = max(range(len(scores)), key=scores.__getitem__)  # the first of equals
            choice = head.choices[best]
            s._extend(self._encode_tail(choice), choice)
            if head.name is not None:
                s._variables[head.name] = choice
                s._meta[head.name] = {"choices": head.choices, "scores": scores,
                                      "token_logprobs": token_logprobs}
        s._advance()


class Function:
    """A program: `@function def prog(s, ...)`. Call `prog.run(..., llm=llm)` for one
    instance, `prog.run_batch([kwargs, ...], llm=llm)` for many with their calls batched;
    calling it inside another program runs it on that program's state."""

    def __init__(self, func: Callable):
        if not callable(func):
            raise ValueError(f"@function decorates a function, got {type(func).__name__}")
        self.func = func
        self.signature = inspect.signature(func)
        if not self.signature.parameters:
            raise ValueError(f"{func.__name__} must take the state as its first argument")
        self.__name__, self.__doc__ = func.__name__, func.__doc__

    def __call__(self, s: ProgramState, *args, **kwargs):
        return self.func(s, *args, **kwargs)

    def _bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        try:
            self.signature.bind(None, *args, **kwargs)
        except TypeError as e:
            raise ValueError(f"{self.func.__name__}: {e}") from None
        return args, kwargs

    def run(self, *args, llm, **kwargs) -> ProgramState:
        """Run one instance; returns its state (every call done)."""
        return _Executor(llm).run(self.func, [self._bind(args, kwargs)], 1)[0]

    def run_batch(self, batch_kwargs: Sequence[dict], *, llm, num_threads: int = DEFAULT_NUM_THREADS
                  ) -> list[ProgramState]:
        """Run one instance per dict of arguments, up to num_threads at once, their calls
        batched through `llm`; returns their states in order. An instance that raised
        re-raises here once all have finished."""
        if not isinstance(batch_kwargs, (list, tuple)) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise ValueError("run_batch takes a list of dicts of arguments, got "
                             f"{type(batch_kwargs).__name__}")
        num_threads = check_int("num_threads", num_threads, 1)
        calls = [self._bind((), kwargs) for kwargs in batch_kwargs]
        return _Executor(llm).run(self.func, calls, num_threads) if calls else []


def function(func: Callable) -> Function:
    """Decorate `def prog(s, ...)` into a program (SGLang's `@sgl.function`)."""
    return Function(func)
