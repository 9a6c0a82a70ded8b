"""Data parallelism: one engine per data-parallel rank behind the one engine interface.

`LLM(data_parallel_size=dp)` builds dp EngineCores, as vLLM runs one engine core per DP
rank: each owns a ModelRunner on its own devices (a row of the ("data", "expert", "model") mesh,
tensor-parallel inside it), its own KV page pool, radix prefix cache and scheduler. A
request lives on one rank for its whole life; `route` picks the rank whose prefix cache
holds the longest prefix of its prompt (SGLang's cache-aware routing), then the least
loaded one. `step()` steps every rank that has work, each in its own thread, so one rank's
host work (scheduling, packing the batch, detokenizing) overlaps the others' device steps;
the step returns when every rank's has.

`DataParallelEngine` answers what the LLM API, AsyncLLM and the server read of an
EngineCore (requests, seqs, state, kv, add_request, step, abort, release, ...), so the
layers above need no other change. Host-side only: no jax here.
"""

from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
from typing import Sequence

from serving import scheduler as sched
from serving.engine import EngineCore
from serving.params import LoRARequest, SamplingParams


class _Union(collections.abc.Mapping):
    """The union of the ranks' dicts (their keys never overlap), read live."""

    def __init__(self, parts):
        self._parts = parts

    def __getitem__(self, key):
        for part in self._parts():
            if key in part:
                return part[key]
        raise KeyError(key)

    def __iter__(self):
        for part in self._parts():
            yield from part

    def __len__(self):
        return sum(len(part) for part in self._parts())


class _PoolTotals:
    def __init__(self, kvs):
        self._kvs = kvs

    @property
    def num_pages(self) -> int:
        return sum(kv.pool.num_pages for kv in self._kvs)

    @property
    def num_free(self) -> int:
        return sum(kv.pool.num_free for kv in self._kvs)


class _KVTotals:
    """Every rank's KV manager, summed where the engine's readers count pages."""

    def __init__(self, kvs):
        self._kvs = kvs
        self.pool = _PoolTotals(kvs)
        self.tables = _Union(lambda: [kv.tables for kv in kvs])

    @property
    def page_size(self) -> int:
        return self._kvs[0].page_size

    @property
    def radix(self):
        return self._kvs[0].radix  # whether prefix caching is on (the same on every rank)

    @property
    def num_available(self) -> int:
        return sum(kv.num_available for kv in self._kvs)

    @property
    def hits(self) -> collections.Counter:
        return sum((kv.hits for kv in self._kvs), collections.Counter())

    def flush_prefix_cache(self, namespace: int | None = None) -> int:
        return sum(kv.flush_prefix_cache(namespace) for kv in self._kvs)

    def check(self) -> None:
        for kv in self._kvs:
            kv.check()


class DataParallelEngine:
    """dp EngineCores (see the module docstring); `ranks[r]` is rank r's engine."""

    def __init__(self, ranks: Sequence[EngineCore]):
        if not ranks:
            raise ValueError("a data-parallel engine needs at least one rank")
        self.ranks = list(ranks)
        self.config = self.ranks[0].config
        self.max_model_len = self.ranks[0].max_model_len
        self.requests = _Union(lambda: [e.requests for e in self.ranks])
        self.seqs = _Union(lambda: [e.seqs for e in self.ranks])
        self.kv = _KVTotals([e.kv for e in self.ranks])
        self._rank_of: dict[str, int] = {}  # request id -> its rank
        self._threads = concurrent.futures.ThreadPoolExecutor(len(self.ranks), "kvfold-dp-rank")

    # -- routing -----------------------------------------------------------------

    def route(self, prompt_ids: Sequence[int], lora_id: int = 0) -> int:
        """The rank a new request goes to: the longest cached prefix of its prompt, then the
        fewest tokens still to compute, then the lowest rank."""
        def load(engine: EngineCore) -> int:
            seqs = engine.state.running + engine.state.waiting
            return sum(s.max_total_tokens - s.num_computed_tokens for s in seqs)
        return min(range(len(self.ranks)),
                   key=lambda r: (-self.ranks[r].kv.cached_prefix_len(prompt_ids, lora_id), load(self.ranks[r]), r))

    def rank_of(self, request_id: str) -> int:
        return self._rank_of[request_id]

    # -- EngineCore's interface --------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    arrival: float | None = None, lora_request: LoRARequest | None = None) -> None:
        if request_id in self._rank_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora_id = lora_request.lora_int_id if lora_request is not None else 0
        rank = self.route(tuple(prompt_ids), lora_id)
        self.ranks[rank].add_request(request_id, prompt_ids, params, arrival, lora_request)
        self._rank_of[request_id] = rank

    def step(self) -> set[str]:
        """One step of every rank with work, concurrently (each rank's state is its own; the
        grammar compiler they share is thread-safe); the request ids that made progress.
        Every rank's step has ended when this returns or raises."""
        busy = [e for e in self.ranks if e.has_unfinished()]
        if len(busy) == 1:
            return busy[0].step()
        steps = [self._threads.submit(e.step) for e in busy]
        concurrent.futures.wait(steps)
        return set().union(*(f.result() for f in steps))

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.ranks)

    def request_finished(self, request_id: str) -> bool:
        return self.ranks[self._rank_of[request_id]].request_finished(request_id)

    def abort(self, request_id: str) -> None:
        if request_id in self._rank_of:
            self.ranks[self._rank_of[request_id]].abort(request_id)

    def release(self, request_id: str) -> None:
        self.ranks[self._rank_of.pop(request_id)].release(request_id)

    @property
    def state(self) -> sched.SchedulerState:
        """The ranks' scheduler states side by side (waiting and running of every rank)."""
        states = [e.state for e in self.ranks]
        return sched.SchedulerState(sum((s.waiting for s in states), ()), sum((s.running for s in states), ()),
                                    max(s.step for s in states))

    @property
    def num_preemptions(self) -> int:
        return sum(e.num_preemptions for e in self.ranks)
