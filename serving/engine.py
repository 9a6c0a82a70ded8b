"""The engine core: scheduler + KV manager + a runner, one `step()` at a time.

Token-level only (no text). Each request has n sequences: sequence 0 prefills the
prompt; once its prefill completes, the other n - 1 fork off sharing its prompt pages and
recompute only the last prompt position, so the page they write first is copied on
write. The runner is the model (serving.runner.ModelRunner) or, in the simulator, a
cost model with the same `execute` contract.

Speculative decoding (sched_config.num_lookahead_slots > 0): the runner returns a
draft tree with each sampled token; the sequence's next decode row carries it to be
verified, and its result is the accepted draft tokens plus a bonus token. Pages are
reserved for the lookahead slots the tree writes past the sequence's end.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Protocol

from serving import scheduler as sched
from serving.kv_manager import KVManager
from serving.params import SamplingParams
from serving.runner import Row, RowResult

RECOMPUTE, SWAP = "recompute", "swap"


class Runner(Protocol):
    def execute(self, rows: list[Row]) -> list[RowResult | None]: ...
    def copy_pages(self, pairs: list[tuple[int, int]]) -> None: ...
    def read_pages(self, pages: list[int]): ...
    def write_pages(self, pages: list[int], data) -> None: ...


@dataclasses.dataclass
class SeqState:
    """Host-side state of one sequence beyond what the scheduler keeps."""

    seq_id: str
    request_id: str
    index: int
    params: SamplingParams
    prompt_len: int
    seed: int
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[tuple[float, dict[int, float]]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    swapped: object = None  # host copy of its pages while swapped out
    first_token_time: float | None = None
    tree: tuple | None = None  # the draft tree to verify next (speculative decoding)


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    seq_ids: list[str]
    num_cached_tokens: int = 0
    forked: bool = False


class EngineCore:
    def __init__(self, runner: Runner, sched_config: sched.SchedulerConfig, num_pages: int,
                 max_model_len: int, eos_token_id: int | None, enable_prefix_caching: bool = True,
                 preemption_mode: str = RECOMPUTE, seed: int = 0, clock=time.monotonic):
        if preemption_mode not in (RECOMPUTE, SWAP):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        self.runner, self.config = runner, sched_config
        self.kv = KVManager(num_pages, sched_config.page_size, enable_prefix_caching)
        self.max_model_len, self.eos_token_id = max_model_len, eos_token_id
        self.preemption_mode, self.seed, self.clock = preemption_mode, seed, clock
        self.state = sched.SchedulerState()
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[str, SeqState] = {}
        self.num_preemptions = 0
        # speculative decoding: how many verified trees accepted k draft tokens
        self.accepted_counts: collections.Counter = collections.Counter()
        self._next_seed = seed

    # -- requests ----------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    arrival: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self._sched_seq(f"{request_id}#0", prompt_ids, params, 0.0)
        need = self.kv.pages_for(seq.max_total_tokens + self.config.num_lookahead_slots)
        what = "prompt + max_tokens"
        if self.config.capacity_policy != sched.MAX_UTILIZATION:
            need, what = sched.reserved_pages(seq, self.config), f"{what} (all n={params.n} samples)"
        if need > self.kv.pool.num_pages:
            raise ValueError(f"{what} needs {need} KV pages, the pool has {self.kv.pool.num_pages}; "
                             f"lower max_tokens or raise num_kv_blocks")
        arrival = self.clock() if arrival is None else arrival
        seq_ids = [f"{request_id}#{i}" for i in range(params.n)]
        self.requests[request_id] = RequestState(request_id, list(prompt_ids), params, arrival, seq_ids)
        for i, sid in enumerate(seq_ids):
            seed = params.seed + i if params.seed is not None else self._fresh_seed()
            self.seqs[sid] = SeqState(sid, request_id, i, params, len(prompt_ids), seed)
        self.state = sched.add(self.state, self._sched_seq(seq_ids[0], prompt_ids, params, arrival))

    def _fresh_seed(self) -> int:
        self._next_seed += 1
        return self._next_seed

    def _sched_seq(self, seq_id, tokens, params, arrival) -> sched.Seq:
        total = min(len(tokens) + params.max_tokens, self.max_model_len)
        return sched.Seq(seq_id, tuple(tokens), total, arrival, num_forks=params.n - 1)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for sid in req.seq_ids:
            seq = self.seqs[sid]
            if seq.finish_reason is None:
                self._finish(seq, "abort")

    def finish_seq(self, seq_id: str, reason: str, stop_reason=None, num_tokens: int | None = None) -> None:
        """Finish one sequence from outside (e.g. a stop string matched in its text),
        keeping only its first `num_tokens` output tokens when given."""
        seq = self.seqs[seq_id]
        if seq.finish_reason is None:
            if num_tokens is not None:
                del seq.output[num_tokens:], seq.logprobs[num_tokens:]
            seq.stop_reason = stop_reason
            self._finish(seq, reason)

    def _finish(self, seq: SeqState, reason: str) -> None:
        seq.finish_reason = reason
        seq.swapped = None
        if seq.seq_id in self.kv.tables:
            self.kv.free(seq.seq_id)
        self.state = sched.remove(self.state, [seq.seq_id])

    def request_finished(self, request_id: str) -> bool:
        return all(self.seqs[s].finish_reason is not None for s in self.requests[request_id].seq_ids)

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

    def has_unfinished(self) -> bool:
        return bool(self.state.waiting or self.state.running)

    # -- one step ---------------------------------------------------------------

    def step(self) -> set[str]:
        """Schedule and run one batch; returns the request ids that made progress."""
        cached = {}
        if self.kv.radix is not None:
            cached = {s.seq_id: self.kv.cached_prefix_len(s.tokens) for s in self.state.waiting
                      if self.seqs[s.seq_id].swapped is None}
        self.state, plan = sched.schedule(self.state, self.config, self.kv.num_available, cached,
                                          preempt_keeps_computed=self.preemption_mode == SWAP)
        for sid in plan.preempted:
            self._preempt(sid)
        running = {s.seq_id: s for s in self.state.running}
        for sid in plan.admitted:
            self._admit(running[sid])
        running = {s.seq_id: s for s in self.state.running}
        rows, copies = [], []
        ahead = self.config.num_lookahead_slots
        for sid, n in plan.scheduled:
            s, seq = running[sid], self.seqs[sid]
            start = s.num_computed_tokens
            self.kv.ensure(sid, start + n + ahead)
            for pos in range(start, start + n + ahead, 1):
                if pos == start or pos % self.kv.page_size == 0:
                    pair = self.kv.copy_on_write(sid, pos)
                    if pair:
                        copies.append(pair)
            p = seq.params
            end = start + n
            rows.append(Row(list(s.tokens[start:end]), start, list(self.kv.tables[sid]),
                            sample=end == s.num_tokens, temperature=p.temperature,
                            top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=seq.seed,
                            counter=len(seq.output), logprobs=p.logprobs is not None,
                            next_token=s.tokens[end] if end < s.num_tokens else None,
                            tree=seq.tree if end == s.num_tokens and n == 1 else None))
        self.runner.copy_pages(copies)
        results = self.runner.execute(rows) if rows else []
        new_tokens: dict[str, tuple[int, ...]] = {}
        progressed: set[str] = set()
        now = self.clock()
        for (sid, n), row, res in zip(plan.scheduled, rows, results):
            if res is None:
                continue
            seq = self.seqs[sid]
            if row.tree is not None:
                self.accepted_counts[len(res.accepted)] += 1
            emitted = self._until_stop(seq, running[sid], res.accepted + [res.token])
            seq.output.extend(emitted)
            seq.tree = res.tree
            if res.logprob is not None:
                seq.logprobs.extend((res.accepted_logprobs + [(res.logprob, res.top_logprobs)])[:len(emitted)])
            if seq.first_token_time is None:
                seq.first_token_time = now
            new_tokens[sid] = tuple(emitted)
            progressed.add(seq.request_id)
        pages = {sid: len(self.kv.tables[sid]) for sid, _ in plan.scheduled}
        self.state = sched.update(self.state, plan, new_tokens, pages)
        running = {s.seq_id: s for s in self.state.running}
        for sid, _ in plan.scheduled:
            self.kv.cache_computed(sid, running[sid].tokens, running[sid].num_computed_tokens)
        for sid in new_tokens:
            self._maybe_fork(sid)  # before stop checks: the samples share the prompt's pages
        for sid in new_tokens:
            self._check_stop(self.seqs[sid], running[sid])
        return progressed

    def _admit(self, s: sched.Seq) -> None:
        seq = self.seqs[s.seq_id]
        if seq.swapped is not None:
            self.kv.admit(s.seq_id, (), use_cache=False)
            self.kv.ensure(s.seq_id, s.num_computed_tokens)
            self.runner.write_pages(self.kv.tables[s.seq_id], seq.swapped)
            seq.swapped = None
            return
        hit = self.kv.admit(s.seq_id, s.tokens)
        assert hit == s.num_computed_tokens, (hit, s.num_computed_tokens)
        req = self.requests[seq.request_id]
        if seq.index == 0 and not req.forked:
            req.num_cached_tokens = hit

    def _preempt(self, seq_id: str) -> None:
        self.num_preemptions += 1
        seq = self.seqs[seq_id]
        if self.preemption_mode == SWAP:
            # the tree stays valid: its KV is rewritten when it is verified
            computed = next(s for s in self.state.waiting if s.seq_id == seq_id).num_computed_tokens
            table = self.kv.tables[seq_id][:self.kv.pages_for(computed)]
            seq.swapped = self.runner.read_pages(table)
        else:
            seq.tree = None  # recomputing the prompt grows a new one
        self.kv.free(seq_id)

    def _until_stop(self, seq: SeqState, s: sched.Seq, tokens: list[int]) -> list[int]:
        """The prefix of `tokens` up to and including the first that ends the sequence
        (speculative rows emit several; `_check_stop` then finishes on the last)."""
        p = seq.params
        for i, tok in enumerate(tokens):
            if (not p.ignore_eos and tok == self.eos_token_id) or tok in p.stop_token_ids \
                    or len(seq.output) + i + 1 >= p.max_tokens or s.num_tokens + i + 1 >= self.max_model_len:
                return tokens[:i + 1]
        return tokens

    def _check_stop(self, seq: SeqState, s: sched.Seq) -> None:
        tok, p = seq.output[-1], seq.params
        if not p.ignore_eos and tok == self.eos_token_id:
            seq.output.pop()  # EOS ends the text; it is not part of it
            if seq.logprobs:
                seq.logprobs.pop()
            self._finish(seq, "stop")
        elif tok in p.stop_token_ids:
            seq.output.pop()
            if seq.logprobs:
                seq.logprobs.pop()
            seq.stop_reason = tok
            self._finish(seq, "stop")
        elif len(seq.output) >= p.max_tokens or s.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _maybe_fork(self, seq_id: str) -> None:
        seq = self.seqs[seq_id]
        req = self.requests[seq.request_id]
        if req.forked or seq.index != 0:
            return
        req.forked = True
        prompt = tuple(req.prompt_ids)
        # The scheduler counts a child as holding only the pages before the one it writes
        # first (position len(prompt) - 1): that shared page is copied on write, so its copy
        # is a page the step needs. Sharers make n - 1 copies in all, one per child.
        held = (len(prompt) - 1) // self.kv.page_size
        for sid in req.seq_ids[1:]:
            self.kv.fork(seq_id, sid, len(prompt))
            child = sched.Seq(sid, prompt, min(len(prompt) + req.params.max_tokens, self.max_model_len),
                              req.arrival, num_computed_tokens=len(prompt) - 1, num_pages=held,
                              started=self.state.step)
            self.state = sched.fork(self.state, seq_id, child)
