"""The engine core: scheduler + KV manager + output processor + a runner, one `step()`
at a time (docs/serving.md draws the request and KV paths through it).

Each request has n sequences: sequence 0 prefills the prompt; once it samples its
first token, the other n - 1 fork off sharing its prompt pages and recompute only the
last prompt position, so the page they write first is copied on write. The runner is
the model (serving.runner.ModelRunner) or, in the simulator, a cost model: both meet
the engine-runner contract defined here (`Row`, `RowResult`, `Runner`). This module
and everything it imports run on the host without jax.

Speculative decoding (sched_config.num_lookahead_slots > 0): the runner returns a
draft tree with each result; the sequence's next decode row carries it to be
verified, and its result is the accepted draft tokens plus a bonus token. Pages are
reserved for the lookahead slots the tree writes past the sequence's end.
"""

from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import dataclasses
import math
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from serving import scheduler as sched
from serving.draft_tree import DraftTree
from serving.kv_manager import KVManager, pages_for
from serving.kv_tiers import (PREFETCH_BEST_EFFORT, PREFETCH_WAIT_COMPLETE, PageCodec, TierConfig, Tiers,
                              host_rows_memory)
from serving.output import Decode, OutputProcessor, SeqOutput
from serving.params import SEED_BITS, LoRARequest, SamplingParams, adjusts_logits
from serving.structured import GrammarCompiler, advance

RECOMPUTE, SWAP = "recompute", "swap"
GRAMMAR_GATHER_S = 0.5  # an idle engine waits this long for every pending grammar
REMOTE_POLL_S = 0.05  # an engine with only remote-KV requests waits this long for one per step
PREEMPTION_MODES = (RECOMPUTE, SWAP)

# -- the engine-runner contract ------------------------------------------------------


def bucket(n: int, minimum: int = 1) -> int:
    """n rounded up to a power of two, at least `minimum`: how the runner pads a step's
    tokens and rows (so a warm engine meets few shapes)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


# The fewest tokens a step with a prefill chunk is padded to.
MIN_CHUNK_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class RemoteKV:
    """A prompt's K/V on its way from another engine (disaggregated prefill,
    serving/kv_transfer.py's `KVReceiver.pull_later`). future: its result is the callable
    that caches the pages, which the engine calls between steps with the key of the pages
    it reserved (EngineCore.import_prefix's reservation); num_pages: the full pages it
    brings, reserved in the pool when the request is added."""
    future: concurrent.futures.Future
    num_pages: int = 0


@dataclasses.dataclass(frozen=True)
class Row:
    """One sequence's work in a step."""

    tokens: tuple[int, ...]  # the new tokens to compute
    start: int  # position of tokens[0]
    block_table: tuple[int, ...]  # the sequence's pages, in position order
    sample: bool  # the row reaches the end of the sequence: sample a token
    params: SamplingParams = SamplingParams(temperature=0.0)
    seed: int = 0
    counter: int = 0  # tokens generated so far (with the seed, the step's sampling key)
    next_token: int | None = None  # the token after the row when known (a prompt's)
    tree: DraftTree | None = None  # verify this draft tree (its root is tokens[0])
    # structured outputs: the grammar's bitmask (serving/structured.py) for the sampled
    # token, int32 [words]; for a tree, one row per node [N, words]; None: unconstrained
    token_mask: np.ndarray | None = dataclasses.field(default=None, compare=False)
    # penalties and biases of a sampled row (SamplingParams.presence_penalty ...): the
    # tokens whose logit changes, as (ids int32, output counts int32, seen in prompt or
    # output bool, bias float32 with -inf = banned), each [k]; None: nothing to adjust
    adjust: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = dataclasses.field(
        default=None, compare=False)
    lora: int = 0  # the LoRA adapter's lora_int_id (0: the base model)
    # the sequence's state slot while it runs, in [0, max_num_seqs): where a model with
    # per-sequence state outside the pages keeps it (DeepSeek-V4.1's window rings)
    slot: int = -1


@dataclasses.dataclass(frozen=True)
class RowResult:
    """A row's outcome: the tokens a sampled row emits in order (after a verified tree, the
    accepted draft tokens then the bonus token), their logprobs when the row asked for
    them, the draft tree grown for the next step (speculative decoding), and, when its
    params ask for prompt logprobs, those of the prompt tokens that follow its tokens
    (entry j scores the token at position start + j + 1). A row that does not sample
    returns a result only for its prompt logprobs."""

    tokens: tuple[int, ...]
    logprobs: tuple[tuple[float, dict[int, float]], ...] | None = None  # (logprob, top logprobs)
    tree: DraftTree | None = None
    prompt_logprobs: tuple[tuple[float, dict[int, float]], ...] | None = None


class Runner(Protocol):
    """What the engine needs of a model (serving.runner.ModelRunner) or a cost model
    (serving.simulator.SimRunner)."""

    def execute(self, rows: list[Row]) -> list[RowResult | None]: ...
    def copy_pages(self, pairs: list[tuple[int, int]]) -> None: ...
    # host copy of pages; wait=False: a function that waits for it (the copy is dispatched)
    def read_pages(self, pages: list[int], wait: bool = True): ...
    # host page data moved toward the device (from any thread), for write_pages
    def upload_pages(self, data): ...
    # data: host page data, or upload_pages' or upload_rows' result
    def write_pages(self, pages: list[int], data) -> None: ...
    # a pinned_host Sharding page rows can live in, or None (then the next two are not called)
    host_memory: object | None
    # pages as page-first rows in host_memory, copied down asynchronously
    def read_rows(self, pages: list[int]) -> list: ...
    # read_rows' rows moved toward the device (from any thread), for write_pages
    def upload_rows(self, rows) -> object: ...
    # with LoRA (sched_config.max_loras > 0): read and check an adapter (ValueError if bad)
    def add_lora(self, request: LoRARequest) -> None: ...


@dataclasses.dataclass
class SeqState:
    """Host-side state of one sequence beyond what the scheduler keeps (its tokens)."""

    seq_id: str
    request_id: str
    index: int
    params: SamplingParams
    seed: int
    output: SeqOutput
    swapped: object = None  # host copy of its pages while swapped out
    tree: DraftTree | None = None  # the draft tree to verify next (speculative decoding)
    matcher: object = None  # structured outputs: its llguidance matcher, at the output's end

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    arrival: float
    seq_ids: list[str]
    num_cached_tokens: int = 0  # prompt tokens the cache served at its first admission (as vLLM counts)
    admitted: bool = False
    forked: bool = False
    # per prompt position (params.prompt_logprobs): (logprob, top logprobs); None at 0
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    # structured outputs: the matchers being built (a future), None once handed to the seqs
    grammar: concurrent.futures.Future | None = None
    # SamplingParams.bad_words as token sequences (each word alone and after a space)
    bad_words: tuple[tuple[int, ...], ...] = ()
    lora_id: int = 0  # its LoRA adapter's lora_int_id (0: the base model)


class _OnAccess(collections.abc.Mapping):
    """A mapping over `keys` whose values fn(key) are computed when read."""

    def __init__(self, fn, keys):
        self._fn, self._keys = fn, keys

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        return self._fn(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)


class EngineCore:
    """Requests in, sequences scheduled, rows run, tokens out: one `step()` at a time.

    Each piece of state has one home: a request's prompt in RequestState, a sequence's
    generated tokens, text and finish in its SeqOutput (written only by the output
    processor), its progress (token and computed counts) in the scheduler's Seq, and
    its pages in the KV manager.
    """

    def __init__(self, runner: Runner, sched_config: sched.SchedulerConfig, num_pages: int,
                 max_model_len: int, eos_token_id: int | None, enable_prefix_caching: bool = True,
                 preemption_mode: str = RECOMPUTE, seed: int = 0, clock=time.monotonic,
                 decode: Decode | None = None, grammars: GrammarCompiler | None = None,
                 jump_forward: bool = True, encode: Callable[[str], list[int]] | None = None,
                 vocab_size: int | None = None, tiers: TierConfig | None = None, fingerprint: bytes = b"",
                 state_slots: bool = False):
        """state_slots: the runner keeps per-sequence state outside the pages (DeepSeek-V4.1's
        window rings): each running sequence gets a slot (Row.slot); a sequence that goes on
        from pages it did not just compute (a prefix-cache hit from any tier, a fork, a
        swap-in) has its state rebuilt by the runner's `restore_state` first: pages are all
        that is cached, swapped or moved between tiers."""
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if not sched_config.enable_chunked_prefill and sched_config.max_num_batched_tokens < max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens "
                             f"({sched_config.max_num_batched_tokens}) must be >= max_model_len "
                             f"({max_model_len}): a longer sequence could never be scheduled")
        self.runner, self.config = runner, sched_config
        # structured outputs (None: the engine has no tokenizer and refuses them); with
        # jump_forward, tokens the grammar forces are taken without sampling each
        self.grammars, self.jump_forward = grammars, jump_forward
        # penalties and biases: bad_words are tokenized with `encode`, logit_bias ids checked
        # against vocab_size (None: the engine has no tokenizer / vocabulary to check with)
        self.encode, self.vocab_size = encode, vocab_size
        # host / disk tiers under the prefix cache: pages move as rows of the runner's page data
        self.tiers = None
        if tiers is not None:
            codec = PageCodec(runner.read_pages([0]))
            memory = host_rows_memory(tiers.host_memory, getattr(runner, "host_memory", None))
            self.tiers = Tiers(tiers, codec, codec.page_nbytes * num_pages, fingerprint, memory)
        self.kv = KVManager(num_pages, sched_config.page_size, enable_prefix_caching, self.tiers)
        self._loading: dict[str, tuple[list, float]] = {}  # deferred seq -> (prefetch reads, deadline)
        self._prefetch_seen: set[str] = set()  # waiting sequences that started or joined their prefetch
        self._remote: dict[str, concurrent.futures.Future] = {}  # request id -> its K/V from another engine
        self._orphans: list[concurrent.futures.Future] = []  # K/V still coming for aborted requests
        # delayed hits: pages of tier loads each admission of this step started (seq -> pages),
        # and running sequences whose loads land at a later clock time (the simulator's copy
        # lane sets these; the engine's own loads land before the next step)
        self.step_loads: dict[str, int] = {}
        self.load_ready: dict[str, float] = {}
        self._uploader = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvfold-load")
                          if self.tiers is not None else None)
        # how the engine waits for prefetch reads when nothing else can run (the simulator's
        # reads finish in simulated time: it passes time instead)
        self.wait_for_reads: Callable = concurrent.futures.wait
        self.output = OutputProcessor(eos_token_id, max_model_len, decode)
        self.max_model_len = max_model_len
        self.preemption_mode, self.seed, self.clock = preemption_mode, seed, clock
        self.state = sched.SchedulerState()
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[str, SeqState] = {}
        self.num_preemptions = 0
        # speculative decoding: how many verified trees accepted k draft tokens
        self.accepted_counts: collections.Counter = collections.Counter()
        self._next_seed = seed
        # state slots (state_slots=True): each running sequence's, and the free ones
        self.state_slots = state_slots
        self._slots: dict[str, int] = {}
        self._free_slots = list(range(sched_config.max_num_seqs))[::-1]
        self._restore: dict[str, int] = {}  # sequences whose state restore_state rebuilds: cached tokens

    # -- requests ----------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    arrival: float | None = None, lora_request: LoRARequest | None = None,
                    remote_kv: RemoteKV | concurrent.futures.Future | None = None) -> None:
        """remote_kv: the prompt's K/V on its way from another engine (a `RemoteKV`, or
        its future alone: nothing reserved). Its pages are reserved in the pool now (when
        they fit), so the K/V lands in pages allocated beforehand; the request waits until
        it has landed (the scheduler passes it over); if the transfer or the write fails,
        the reservation goes back and the request computes its prompt."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.output.check(params)
        lora_id = 0
        if lora_request is not None:
            if not self.config.max_loras:
                raise ValueError("a LoRA request needs an engine with LoRA enabled (LLM(enable_lora=True))")
            if self.config.tokens_per_decode > 1:
                raise ValueError("LoRA adapters are not supported with speculative decoding yet")
            self.runner.add_lora(lora_request)  # reads and checks the adapter
            lora_id = lora_request.lora_int_id
        prompt = tuple(prompt_ids)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} samples are more sequences than max_num_seqs={self.config.max_num_seqs}")
        if not 0 < len(prompt) < self.max_model_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit max_model_len={self.max_model_len} "
                             "with room to generate")
        arrival = self.clock() if arrival is None else arrival
        seq = self._sched_seq(f"{request_id}#0", prompt, params, arrival, num_forks=params.n - 1,
                              lora_id=lora_id)
        need = pages_for(seq.max_total_tokens + self.config.num_lookahead_slots, self.kv.page_size)
        what = "prompt + max_tokens"
        if self.config.capacity_policy != sched.MAX_UTILIZATION:
            need, what = sched.reserved_pages(seq, self.config), f"{what} (all n={params.n} samples)"
        if need > self.kv.pool.num_pages:
            raise ValueError(f"{what} needs {need} KV pages, the pool has {self.kv.pool.num_pages}; "
                             f"lower max_tokens or raise num_kv_blocks")
        bad_words = self._check_adjustments(params)
        grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need an engine with a tokenizer")
            grammar = self.grammars.submit(params.structured_outputs, params.n)  # checked here, built off-thread
        seq_ids = [f"{request_id}#{i}" for i in range(params.n)]
        self.requests[request_id] = RequestState(
            request_id, prompt, params, arrival, seq_ids,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(prompt), grammar=grammar,
            bad_words=bad_words, lora_id=lora_id)
        for i, sid in enumerate(seq_ids):
            seed = (params.seed + i) % 2**SEED_BITS if params.seed is not None else self._fresh_seed()
            self.seqs[sid] = SeqState(sid, request_id, i, params, seed, self.output.new())
        self.state = sched.add(self.state, seq)
        if remote_kv is not None:
            if not isinstance(remote_kv, RemoteKV):
                remote_kv = RemoteKV(remote_kv)
            self._remote[request_id] = remote_kv.future
            if remote_kv.num_pages and self.kv.radix is not None:
                self.kv.reserve(request_id, min(remote_kv.num_pages, (len(prompt) - 1) // self.kv.page_size))

    def _check_adjustments(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Check a request's penalties and biases against this engine; returns its bad
        words as token sequences."""
        if not adjusts_logits(params):
            return ()
        if self.config.tokens_per_decode > 1:
            raise ValueError("penalties, logit_bias, bad_words and min_tokens are not supported with "
                             "speculative decoding yet")
        if params.logit_bias and self.vocab_size is not None:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if not params.bad_words:
            return ()
        if self.encode is None:
            raise ValueError("bad_words need an engine with a tokenizer")
        words = {tuple(self.encode(text)) for w in params.bad_words for text in (w.lstrip(), " " + w.lstrip())}
        return tuple(sorted(w for w in words if w))

    def _adjustments(self, seq: SeqState):
        """Row.adjust for a sampled row of `seq`, from its tokens so far (None when its
        params change no logit)."""
        p = seq.params
        if not adjusts_logits(p):
            return None
        req = self.requests[seq.request_id]
        out = seq.output.tokens
        bias = dict(p.logit_bias or {})
        banned = set()
        if len(out) < p.min_tokens:
            banned.update(p.stop_token_ids)
            if self.output.eos_token_id is not None:
                banned.add(self.output.eos_token_id)
        for word in req.bad_words:  # vLLM's rule: ban the last token once the rest was just generated
            if len(word) == 1 or (len(out) >= len(word) - 1 and tuple(out[len(out) - len(word) + 1:]) == word[:-1]):
                banned.add(word[-1])
        counted = np.asarray(out, np.int64) if (p.presence_penalty or p.frequency_penalty
                                                or p.repetition_penalty != 1.0) else np.zeros(0, np.int64)
        out_ids, out_counts = np.unique(counted, return_counts=True)
        seen = np.unique(np.concatenate([np.asarray(req.prompt_ids, np.int64), counted])) \
            if p.repetition_penalty != 1.0 else np.zeros(0, np.int64)
        ids = np.union1d(np.union1d(out_ids, seen), np.fromiter(set(bias) | banned, np.int64))
        if not len(ids):
            return None
        counts = np.zeros(len(ids), np.int32)
        counts[np.searchsorted(ids, out_ids)] = out_counts
        values = np.asarray([bias.get(int(t), 0.0) for t in ids], np.float32)
        values[np.isin(ids, np.fromiter(banned, np.int64))] = -np.inf
        return ids.astype(np.int32), counts, np.isin(ids, seen), values

    def _fresh_seed(self) -> int:
        self._next_seed += 1
        return self._next_seed

    def _sched_seq(self, seq_id: str, prompt: tuple[int, ...], params: SamplingParams, arrival: float,
                   **kwargs) -> sched.Seq:
        total = min(len(prompt) + params.max_tokens, self.max_model_len)
        return sched.Seq(seq_id, prompt, total, arrival, **kwargs)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for sid in req.seq_ids:
            self.finish_seq(sid, "abort")

    def finish_seq(self, seq_id: str, reason: str) -> None:
        """Finish one sequence from outside (an abort, a client's own stop rule)."""
        seq = self.seqs[seq_id]
        if not seq.finished:
            self.output.finish(seq.output, reason)
            self._release_seq(seq)

    def _slot(self, seq_id: str) -> int:
        """The running sequence's state slot (-1 without state_slots); taken on first use."""
        if not self.state_slots:
            return -1
        if seq_id not in self._slots:
            self._slots[seq_id] = self._free_slots.pop()  # at most max_num_seqs run at once
        return self._slots[seq_id]

    def _free_slot(self, seq_id: str) -> None:
        self._restore.pop(seq_id, None)
        if seq_id in self._slots:
            self._free_slots.append(self._slots.pop(seq_id))

    def _restore_states(self, scheduled: list[str]) -> None:
        """Rebuild the state of scheduled sequences that start on cached pages: each replays
        the runner's replay_len tokens before its first computed position, pages frozen."""
        rows = []
        for sid in scheduled:
            if (cached := self._restore.pop(sid, None)) is not None:
                n = self.runner.replay_len(cached)
                rows.append(Row(self.tokens(sid, cached - n, cached), cached - n, tuple(self.kv.tables[sid]),
                                sample=False, slot=self._slot(sid)))
        if rows:
            self.runner.restore_state(rows)

    def _release_seq(self, seq: SeqState) -> None:
        seq.swapped = None
        self._free_slot(seq.seq_id)
        if seq.seq_id in self.kv.tables:
            self.kv.free(seq.seq_id)
        self.state = sched.remove(self.state, [seq.seq_id])

    def request_finished(self, request_id: str) -> bool:
        return all(self.seqs[s].finished for s in self.requests[request_id].seq_ids)

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        for sid in self.requests.pop(request_id).seq_ids:
            del self.seqs[sid]

    def speculative_stats(self) -> dict:
        """Mean accepted length tau (tokens per target forward of a verified tree) and the
        acceptance rate by draft position, over every tree verified so far."""
        n = sum(self.accepted_counts.values())
        if n == 0:
            return {"num_trees": 0, "tau": float("nan"), "acceptance_by_position": []}
        depth = max(self.accepted_counts)
        by_position = [sum(c for k, c in self.accepted_counts.items() if k > i) / n for i in range(depth)]
        tau = 1 + sum(k * c for k, c in self.accepted_counts.items()) / n
        return {"num_trees": n, "tau": tau, "acceptance_by_position": by_position}

    def close(self) -> None:
        """Let go of what the engine holds beyond its arrays: the tiers (copies down land
        first; disk files stay; a Mooncake client leaves its pool, taking the pages it
        lent with it) and the load thread. Idempotent; the engine takes no step after."""
        if self.tiers is not None and not self.tiers.closed:
            self.tiers.close()
            self._uploader.shutdown()

    def has_unfinished(self) -> bool:
        return bool(self.state.waiting or self.state.running)

    def tokens(self, seq_id: str, start: int = 0, end: int | None = None) -> tuple[int, ...]:
        """Tokens [start, end) of a sequence: its prompt, then what it generated."""
        seq = self.seqs[seq_id]
        prompt, out = self.requests[seq.request_id].prompt_ids, seq.output.tokens
        end = len(prompt) + len(out) if end is None else end
        if end <= len(prompt):
            return prompt[start:end]
        return prompt[start:] + tuple(out[max(start - len(prompt), 0):end - len(prompt)])

    # -- one step ---------------------------------------------------------------

    def step(self) -> set[str]:
        """Schedule and run one batch; returns the request ids that made progress."""
        blocked = (self._grammars_pending() | self._prefetches_pending() | self._loads_landing()
                   | self._remote_pending())
        self.step_loads = {}
        self.state, plan = sched.schedule(self.state, self.config, self._kv_view(blocked),
                                          preempt_keeps_computed=self.preemption_mode == SWAP,
                                          blocked=blocked)
        for sid in plan.preempted:
            self._preempt(sid)
        running = {s.seq_id: s for s in self.state.running}
        holds = [self.kv.hold(self.tokens(sid), running[sid].lora_id, running[sid].num_computed_tokens)
                 for sid in plan.admitted if self._looks_up_prefix(sid)]
        for sid in plan.admitted:
            self._admit(running[sid])
        for node in holds:
            self.kv.release(node)
        rows, copies = [], []
        for sid, n in plan.scheduled:
            s, seq = running[sid], self.seqs[sid]
            start, end = s.num_computed_tokens, s.num_computed_tokens + n
            copies += self.kv.prepare(sid, start, end + self.config.num_lookahead_slots)
            last = end == s.num_tokens
            tree = seq.tree if last and n == 1 else None
            mask = None
            if last and seq.matcher is not None:
                mask = (self.grammars.mask(seq.matcher) if tree is None
                        else self.grammars.tree_masks(seq.matcher, tree.tokens, tree.parents))
            rows.append(Row(self.tokens(sid, start, end), start, tuple(self.kv.tables[sid]), sample=last,
                            params=seq.params, seed=seq.seed, counter=len(seq.output.tokens),
                            next_token=None if last else self.tokens(sid, end, end + 1)[0],
                            tree=tree, token_mask=mask, adjust=self._adjustments(seq) if last else None,
                            lora=s.lora_id, slot=self._slot(sid)))
        pending = self._move_tiered_pages([sid for sid, _ in plan.scheduled])  # before anything writes the pool
        try:
            self.runner.copy_pages(copies)
            if self._restore:
                self._restore_states([sid for sid, _ in plan.scheduled])
            results = self.runner.execute(rows) if rows else []
        finally:  # the loaded pages are in the prefix cache: they land whatever the step did
            if pending is not None:
                self._land(*pending)
        taken: dict[str, int] = {}
        forced: dict[str, int] = {}  # jump-forward: tokens appended without being computed
        for (sid, _), row, res in zip(plan.scheduled, rows, results):
            if res is None:
                continue
            seq = self.seqs[sid]
            if res.prompt_logprobs:
                table = self.requests[seq.request_id].prompt_logprobs
                table[row.start + 1:row.start + 1 + len(res.prompt_logprobs)] = res.prompt_logprobs
            if not row.sample:
                continue
            if row.tree is not None:
                self.accepted_counts[len(res.tokens) - 1] += 1
            prompt_len = len(self.requests[seq.request_id].prompt_ids)
            taken[sid] = self.output.append(seq.output, seq.params, prompt_len, res.tokens, res.logprobs)
            seq.tree = res.tree
            if seq.matcher is not None and not seq.finished:
                forced[sid] = self._follow_grammar(seq, res.tokens[:taken[sid]], prompt_len)
        self.state = sched.update(self.state, plan, taken)
        self.state = sched.extend(self.state, forced)
        running = {s.seq_id: s for s in self.state.running}
        for sid, _ in plan.scheduled:
            s = running[sid]
            self.kv.cache_computed(sid, self.tokens(sid, 0, s.num_computed_tokens), s.num_computed_tokens)
        for sid in taken:
            self._maybe_fork(sid)  # before finishing: the samples share the prompt's pages
        for sid in taken:
            if self.seqs[sid].finished:
                self._release_seq(self.seqs[sid])
        if self.tiers is not None:
            self._move_tiered_pages()  # what this step cached is copied down now, not at the next step
            self.tiers.end_step()
        return {self.seqs[sid].request_id for sid in taken}

    def export_prefix(self, tokens: Sequence[int]) -> tuple[int, object]:
        """The cached prefix of `tokens` for another engine (disaggregated prefill,
        serving/kv_transfer.py): (pages, a device copy of them: `runner.take_pages`'
        form); (0, None) when nothing is cached."""
        pages = self.kv.cached_pages(tuple(tokens))
        return len(pages), (self.runner.take_pages(pages) if pages else None)

    def import_prefix(self, tokens: Sequence[int], num_pages: int, data, reservation=None) -> int:
        """Cache the first num_pages full pages of `tokens` from another engine's
        export_prefix data, so a request for them is a prefix hit; returns the pages
        written (those not cached here already), into the pages reserved under
        `reservation` first (a request id: add_request's remote_kv). Call it between steps."""
        pages, first, node = self.kv.adopt_prefix(tuple(tokens), num_pages, reservation)
        if self.tiers is not None:
            self._move_tiered_pages()  # copies down of what the allocation evicted read it before the write
        if pages:
            self.runner.put_pages(pages, data, first)
        self.kv.filled(node)
        return len(pages)

    def _move_tiered_pages(self, scheduled: Sequence[str] | None = None):
        """Run the KV manager's queued tier copies: device pages down to the tiers, then
        tier pages into their new device pages. Called before anything else writes the
        pool, so a page copied down still holds what it held when it was queued.

        scheduled: the step about to run. Loads none of its sequences reads (the delayed
        hits it admitted without tokens) overlap it: their host side (gather, unpack,
        transfer) runs on a worker thread while the step computes, and `_land` writes
        them into the pool after it. Returns (pages, upload) for `_land`, or None."""
        offloads, loads = self.kv.take_offloads(), self.kv.take_loads()
        if not offloads and not loads:
            return None
        if offloads:
            self.tiers.settle()  # the last copies down land first (timed there)
        start = time.perf_counter()
        pinned = self.tiers.host.memory is not None  # rows packed on the device, kept in pinned_host memory
        if offloads:  # dispatched now, stored in the host tier by the next call (or a lookup)
            keys, pages = zip(*offloads)
            if pinned:
                rows = self.runner.read_rows(list(pages))
                self.tiers.copy_down(list(keys), lambda: rows)
            else:
                fetch = self.runner.read_pages(list(pages), wait=False)
                self.tiers.copy_down(list(keys), lambda: self.tiers.codec.pack(fetch()))
        pending = None
        if loads:
            pages, rows = list(zip(*loads))
            if pinned:
                upload = lambda: self.runner.upload_rows(rows)
            else:
                upload = lambda: self.runner.upload_pages(self.tiers.codec.unpack(np.stack(rows)))
            if scheduled is None or any(not set(pages).isdisjoint(self.kv.tables[s]) for s in scheduled):
                self.runner.write_pages(list(pages), upload())
            else:  # the host rows stay put: the step's tier pages are pinned, nothing else runs
                pending = list(pages), self._uploader.submit(upload)
        self.tiers.copy_s += time.perf_counter() - start
        self.tiers.pages_moved += len(offloads) + len(loads)
        return pending

    def _land(self, pages: list[int], upload: concurrent.futures.Future) -> None:
        """Write loads `_move_tiered_pages` started into the pool (after the step they overlapped)."""
        start = time.perf_counter()
        self.runner.write_pages(pages, upload.result())
        self.tiers.copy_s += time.perf_counter() - start

    def _loads_landing(self) -> frozenset[str]:
        """Running sequences whose loaded pages land later (`load_ready`, the simulator's):
        they compute nothing until then."""
        if not self.load_ready:
            return frozenset()
        now, running = self.clock(), {s.seq_id for s in self.state.running}
        self.load_ready = {sid: t for sid, t in self.load_ready.items() if t > now and sid in running}
        return frozenset(self.load_ready)

    def _follow_grammar(self, seq: SeqState, tokens: Sequence[int], prompt_len: int) -> int:
        """Feed the matcher the sequence's new tokens; end the sequence once the grammar is
        complete; jump forward over the tokens it then forces (not when the request wants
        logprobs, which forced tokens would not have). Returns how many forced tokens the
        output took: the next step computes them as one chunk."""
        forced = advance(seq.matcher, tokens, self.jump_forward and seq.params.logprobs is None)
        taken = self.output.append(seq.output, seq.params, prompt_len, forced) if forced else 0
        if taken:
            seq.tree = None  # grown from the sampled token; the chunk grows the next one
        if seq.matcher.is_stopped():
            self.output.finish(seq.output, "stop", None, seq.params)
        return taken

    def _grammars_pending(self) -> frozenset[str]:
        """Hand built matchers to their sequences; returns the waiting sequences whose
        grammar is still being built (the scheduler does not start them). A grammar that
        failed to build ends its request with "abort". When nothing else can run, waits
        for the grammars instead of spinning: all of them for up to GRAMMAR_GATHER_S (so
        requests added together start together, in the same step shapes), then the first."""
        pending = [r for r in self.requests.values()
                   if r.grammar is not None and not self.request_finished(r.request_id)]
        if pending and not self.state.running and all(
                self.requests[self.seqs[s.seq_id].request_id].grammar is not None for s in self.state.waiting):
            futures = [r.grammar for r in pending]
            if concurrent.futures.wait(futures, timeout=GRAMMAR_GATHER_S).not_done:
                concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
        blocked = set()
        for req in pending:
            if not req.grammar.done():
                blocked.update(req.seq_ids)
                continue
            future, req.grammar = req.grammar, None
            try:
                matchers = future.result()
            except ValueError:
                for sid in req.seq_ids:
                    self.finish_seq(sid, "abort")
                continue
            for sid, matcher in zip(req.seq_ids, matchers):
                self.seqs[sid].matcher = matcher
        return frozenset(blocked)

    def _remote_pending(self) -> frozenset[str]:
        """Sequences whose prompt's K/V is still on its way from another engine
        (add_request's remote_kv); what has arrived is cached now, before scheduling. When
        nothing else can run, waits a moment for an arrival instead of spinning."""
        if self._orphans:
            self._adopt_orphans()
        if not self._remote:
            return frozenset()
        blocked = self._adopt_arrived()
        if blocked and not self.state.running and len(blocked) == len(self.state.waiting):
            concurrent.futures.wait(list(self._remote.values()), timeout=REMOTE_POLL_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            blocked = self._adopt_arrived()
        return blocked

    def _adopt_orphans(self) -> None:
        """K/V pulled for requests aborted meanwhile is cached all the same when it lands
        (a later prompt may hit it), which also ends its transfer."""
        for future in [f for f in self._orphans if f.done()]:
            self._orphans.remove(future)
            try:
                future.result()(None)
            except Exception:  # noqa: BLE001 (the transfer recorded why; nobody waits for it)
                pass

    def _adopt_arrived(self) -> frozenset[str]:
        for rid, future in list(self._remote.items()):
            if rid not in self.requests or self.request_finished(rid):  # aborted meanwhile
                del self._remote[rid]
                self.kv.unreserve(rid)
                self._orphans.append(future)
            elif future.done():
                del self._remote[rid]
                try:
                    future.result()(rid)
                except Exception:  # noqa: BLE001 (the transfer recorded why; the prompt is computed)
                    pass
                finally:
                    self.kv.unreserve(rid)  # what the write did not take
        return frozenset(sid for rid in self._remote for sid in self.requests[rid].seq_ids)

    def _prefetches_pending(self) -> frozenset[str]:
        """Waiting sequences deferred while their prefix loads from the tier under the host
        (Strata's delayed hits; HiCache's prefetch, `KVManager.prefetch`): each waiting
        sequence starts or joins a prefetch once, then waits, by the tiers' policy, until
        its reads are done or its timeout passes; the others run meanwhile. When nothing
        else can run, waits for the first read or timeout instead of spinning."""
        tiers = self.tiers
        if tiers is None or tiers.disk is None:
            return frozenset()
        while True:
            tiers.land()
            waiting = {s.seq_id: s for s in self.state.waiting
                       if self._looks_up_prefix(s.seq_id)}
            for sid in set(self._loading) - set(waiting):  # admitted or gone
                del self._loading[sid]
            self._prefetch_seen &= set(waiting)  # a preempted sequence looks again when it is back
            now = self.clock()
            for sid, s in waiting.items():
                if sid in self._prefetch_seen:
                    continue
                self._prefetch_seen.add(sid)
                reads = self.kv.prefetch(self.tokens(sid), s.lora_id)
                if reads and tiers.config.prefetch_policy != PREFETCH_BEST_EFFORT:
                    wait = (math.inf if tiers.config.prefetch_policy == PREFETCH_WAIT_COMPLETE
                            else tiers.prefetch_timeout(len(reads) * self.kv.page_size))
                    self._loading[sid] = (reads, now + wait)
            for sid, (reads, deadline) in list(self._loading.items()):
                if all(r.done() for r in reads) or now >= deadline:
                    del self._loading[sid]  # admission takes what has landed; the rest is recomputed
            if not self._loading or self.state.running or len(self._loading) < len(self.state.waiting):
                return frozenset(self._loading)
            timeout = min(d for _, d in self._loading.values()) - now
            self.wait_for_reads([r for rs, _ in self._loading.values() for r in rs],
                                timeout=None if math.isinf(timeout) else max(timeout, 0.0),
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def _kv_view(self, blocked: frozenset[str] = frozenset()) -> sched.KVView:
        """The KV manager's pages as the scheduler sees them this step (not for the
        sequences it may not start: their prefixes are not looked up or staged)."""
        cached, loading = {}, {}
        if self.kv.radix is not None:
            for s in self.state.waiting:
                if self._looks_up_prefix(s.seq_id) and s.seq_id not in blocked:
                    device, tiers = self.kv.cached_prefix(self.tokens(s.seq_id), s.lora_id)
                    cached[s.seq_id] = device + tiers
                    if tiers:
                        loading[s.seq_id] = tiers
        writable = {s.seq_id: self.kv.writable_pages(s.seq_id, s.num_computed_tokens)
                    for s in self.state.running}
        freeable = _OnAccess(self.kv.freeable_pages, writable)  # read only when preempting
        return sched.KVView(self.kv.num_available, writable, cached, freeable, loading)

    def _admit(self, s: sched.Seq) -> None:
        seq = self.seqs[s.seq_id]
        if seq.swapped is not None:
            self.kv.admit(s.seq_id, (), use_cache=False, namespace=s.lora_id)
            self.kv.ensure(s.seq_id, s.num_computed_tokens)
            self._move_tiered_pages()  # ensure may have evicted pages queued to be copied down
            self.runner.write_pages(self.kv.tables[s.seq_id], seq.swapped)
            seq.swapped = None
            if self.state_slots:  # its slot went back when it was swapped out
                self._restore[s.seq_id] = s.num_computed_tokens
            return
        queued = len(self.kv.loads)
        hit = self.kv.admit(s.seq_id, self.tokens(s.seq_id), use_cache=self._reads_cache(s.seq_id),
                            namespace=s.lora_id, limit=s.num_computed_tokens)
        assert hit == s.num_computed_tokens, (hit, s.num_computed_tokens)
        if hit and self.state_slots:
            self._restore[s.seq_id] = hit
        if len(self.kv.loads) > queued:
            self.step_loads[s.seq_id] = len(self.kv.loads) - queued
        req = self.requests[seq.request_id]
        if seq.index == 0 and not req.admitted:  # not again after a preemption: its own pages
            req.num_cached_tokens, req.admitted = hit, True

    def _looks_up_prefix(self, seq_id: str) -> bool:
        """Its admission matches the prefix cache: not swapped out (its pages come back
        from the swap), and reading the cache (`_reads_cache`)."""
        return self.seqs[seq_id].swapped is None and self._reads_cache(seq_id)

    def _reads_cache(self, seq_id: str) -> bool:
        """Prompt logprobs need every prompt position computed: such a request does not
        read the prefix cache (as in vLLM); it still fills it."""
        return self.seqs[seq_id].params.prompt_logprobs is None

    def _preempt(self, seq_id: str) -> None:
        self.num_preemptions += 1
        seq = self.seqs[seq_id]
        if self.preemption_mode == SWAP:
            # the tree stays valid: its KV is rewritten when it is verified
            computed = next(s for s in self.state.waiting if s.seq_id == seq_id).num_computed_tokens
            table = self.kv.tables[seq_id][:pages_for(computed, self.kv.page_size)]
            seq.swapped = self.runner.read_pages(table)
        else:
            seq.tree = None  # recomputing the prompt grows a new one
        self.kv.free(seq_id)
        self._free_slot(seq_id)  # recomputed from position 0: the state starts over

    def _maybe_fork(self, seq_id: str) -> None:
        """After sequence 0 of a request samples its first token, its n - 1 siblings start:
        they share its prompt pages (the KV manager copies the one each writes first) and
        recompute only the last prompt position, to sample their own first token."""
        seq = self.seqs[seq_id]
        req = self.requests[seq.request_id]
        if req.forked or seq.index != 0:
            return
        req.forked = True
        for sid in req.seq_ids[1:]:
            self.kv.fork(seq_id, sid, len(req.prompt_ids))
            if self.state_slots:  # it starts on its parent's pages at the last prompt position
                self._restore[sid] = len(req.prompt_ids) - 1
            child = self._sched_seq(sid, req.prompt_ids, req.params, req.arrival,
                                    num_computed_tokens=len(req.prompt_ids) - 1, started=self.state.step,
                                    lora_id=req.lora_id)
            self.state = sched.fork(self.state, seq_id, child)
