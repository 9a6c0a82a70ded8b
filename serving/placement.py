"""Placement search for disaggregated prefill and decode (DistServe, Zhong et al., OSDI
2024), with the Conductor's dispatch and early rejection (Mooncake, Qin et al., FAST 2025).

    python -m serving.placement --trace PATH --devices N --ttft-slo S --tpot-slo S \
        [--model default | --cost FILE] [--tp-sizes 1,3] [--num-requests 300] [--overload 1.5]

For every split of N devices into prefill and decode instances (one device each, or of
each --tp-sizes size per role: tensor parallel, with a cost model fitted on that many
devices), and for colocated replicas, bisect the highest request rate at which 90% of the
trace's requests meet both SLOs; print the table and the best placement. Each instance is
the engine's own scheduler and KV manager on simulated time (serving/simulator.py, a cost
model fitted on the real engine); a decode instance receives a request's prompt pages
after its prefill instance ran it plus the transfer (seconds per page) and computes only
the prompt's last partial page before decoding, as serving/router.py's instances do.

`Conductor` is the router's dispatch (the router uses it when given a cost model): it
predicts each request's TTFT on every prefill instance (its queue of predicted prefill work,
the prefill of the prompt part that instance does not cache, the transfer and the decode
instance's first step) and its TPOT on every decode instance (one decode step over the
contexts that instance runs), takes the lowest of each, and rejects the request at once
(HTTP 429) when a prediction breaks its SLO.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from serving import scheduler as sched
from serving.kv_tiers import chain
from serving.simulator import CostModel, SimRequest, simulate

ATTAINMENT = 0.9  # DistServe's goodput: the highest rate at which 90% of requests meet both SLOs
_ROOT = b"placement"
# what every simulated instance schedules with, and the engine the cost model is fitted on
SCHEDULER = sched.SchedulerConfig(page_size=16, max_num_seqs=32, max_num_batched_tokens=1024)


# -- the Conductor ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decision:
    prefill: str
    decode: str
    ttft_s: float  # predicted
    tpot_s: float  # predicted
    source: str | None = None  # a prefill instance whose longer cached prefix `prefill` pulls first
    source_pages: int = 0  # the prompt pages pulled from source (all it caches of the prompt)


@dataclasses.dataclass(frozen=True)
class Rejection:
    reason: str  # why: the prediction that breaks its SLO
    ttft_s: float
    tpot_s: float


class Conductor:
    """Predicted-TTFT / predicted-TPOT dispatch over prefill and decode instances.

    prefill and decode: instance names (router: base URLs). With colocated=True the two
    lists are the same instances, and a request's prefill and decode instance is one
    (its TTFT there counts no transfer). cost: the fitted step cost model of a prefill
    instance (decode_cost: of a decode instance, when they differ: tensor-parallel sizes);
    transfer_s_per_page: moving one page between instances. A request's bookkeeping
    (`admit` ... `prefill_done` ... `finished`) is the caller's to keep: the router calls
    them as responses come back, the simulator at predicted times.

    Disaggregated, an instance may also pull a prompt's cached prefix from the prefill
    instance that holds the longest one (Mooncake's remote prefix reuse): its TTFT is then
    the longer of its queue and the pull (the holder's cached pages of the prompt x
    transfer_s_per_page; they come while the queue drains), plus the prefill after them. It pulls
    when that is the lower prediction (Decision.source)."""

    def __init__(self, cost: CostModel, prefill: Sequence[str], decode: Sequence[str], page_size: int,
                 transfer_s_per_page: float = 0.0, ttft_slo: float | None = None, tpot_slo: float | None = None,
                 colocated: bool = False, decode_cost: CostModel | None = None):
        if not prefill or not decode:
            raise ValueError("the Conductor needs at least one prefill and one decode instance")
        if colocated and list(prefill) != list(decode):
            raise ValueError("colocated instances are both the prefill and the decode instances")
        if page_size < 1 or transfer_s_per_page < 0:
            raise ValueError(f"page_size must be >= 1 and transfer_s_per_page >= 0, got {page_size}, "
                             f"{transfer_s_per_page}")
        for name, slo in (("ttft_slo", ttft_slo), ("tpot_slo", tpot_slo)):
            if slo is not None and not slo > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {slo}")
        if colocated and decode_cost not in (None, cost):
            raise ValueError("colocated instances have one cost model: leave decode_cost out")
        self.cost, self.page_size, self.transfer_s = cost, page_size, transfer_s_per_page
        self.decode_cost = decode_cost or cost
        self.prefill, self.decode, self.colocated = list(prefill), list(decode), colocated
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.queued = {u: {} for u in self.prefill}  # instance -> ticket -> predicted prefill seconds
        self.busy_until = dict.fromkeys(self.prefill, 0.0)  # when an instance's queued prefills end
        self.running = {u: {} for u in self.decode}  # instance -> ticket -> context tokens
        self.where: dict[object, tuple[str, str]] = {}
        self._turn = 0  # rotates the choice among equal predictions
        self.counts = collections.Counter()

    def _prefill_s(self, prompt_len: int, matched_pages: int) -> float:
        """The prefill of the prompt after the pages an instance caches (one token at least)."""
        cached = min(matched_pages * self.page_size, prompt_len - 1)
        return self.cost.prefill_time([prompt_len - cached], [prompt_len])

    def _ttft(self, url: str, now: float, prompt_len: int, matched_pages: int, pulled: int = 0) -> float:
        """Predicted TTFT on prefill instance url, which caches matched_pages of the prompt
        and first pulls the `pulled` pages another instance caches (all of them move)."""
        queue = max(self.busy_until[url] - now, 0.0)
        t = max(queue, pulled * self.transfer_s) + self._prefill_s(prompt_len, max(matched_pages, pulled))
        if not self.colocated:  # the transfer, then the decode instance's step over the last partial page
            pages = (prompt_len - 1) // self.page_size
            tail = prompt_len - pages * self.page_size
            first = (self.decode_cost.prefill_time([tail], [prompt_len]) if tail > 1
                     else self.decode_cost.decode_time([prompt_len]))
            t += pages * self.transfer_s + first
        return t

    def _tpot(self, url: str, prompt_len: int) -> float:
        return self.decode_cost.decode_time([*self.running[url].values(), prompt_len])

    def _best(self, values: Mapping[str, float], names: list[str]) -> str:
        low = min(values.values())
        order = names[self._turn % len(names):] + names[:self._turn % len(names)]
        return next(u for u in order if values[u] <= low * (1 + 1e-9))

    def admit(self, ticket, now: float, prompt_len: int, matched: Mapping[str, int] | None = None
              ) -> Decision | Rejection:
        """Choose instances for request `ticket` (a prompt of prompt_len tokens) arriving at
        `now`; matched: prompt pages each prefill instance caches (default none). Records the
        choice, or rejects without recording anything."""
        if ticket in self.where:
            raise ValueError(f"ticket {ticket!r} is already admitted")
        matched = matched or {}
        ttft = {u: self._ttft(u, now, prompt_len, matched.get(u, 0)) for u in self.prefill}
        pull: dict[str, tuple[str, int]] = {}  # instance -> (holder, pages) where pulling predicts less
        holder = max(self.prefill, key=lambda u: matched.get(u, 0))
        if not self.colocated and matched.get(holder, 0):
            for u in self.prefill:
                if matched.get(u, 0) < matched[holder] and \
                        (t := self._ttft(u, now, prompt_len, matched.get(u, 0), matched[holder])) < ttft[u]:
                    ttft[u], pull[u] = t, (holder, matched[holder])
        if self.colocated:  # one instance does both: the lowest TTFT, its TPOT
            p = d = self._best(ttft, self.prefill)
        else:
            p = self._best(ttft, self.prefill)
            d = self._best({u: self._tpot(u, prompt_len) for u in self.decode}, self.decode)
        self._turn += 1
        tpot = self._tpot(d, prompt_len)
        if self.ttft_slo is not None and ttft[p] > self.ttft_slo:
            self.counts["rejected_ttft"] += 1
            return Rejection(f"predicted TTFT {ttft[p]:.3f} s exceeds the {self.ttft_slo} s SLO", ttft[p], tpot)
        if self.tpot_slo is not None and tpot > self.tpot_slo:
            self.counts["rejected_tpot"] += 1
            return Rejection(f"predicted TPOT {tpot:.4f} s exceeds the {self.tpot_slo} s SLO", ttft[p], tpot)
        source, source_pages = pull.get(p, (None, 0))
        seconds = self._prefill_s(prompt_len, source_pages or matched.get(p, 0))
        start = max(self.busy_until[p], now)
        if source is not None:
            start = max(start, now + source_pages * self.transfer_s)
            self.counts["pulled"] += 1
        self.queued[p][ticket] = seconds
        self.busy_until[p] = start + seconds
        self.running[d][ticket] = prompt_len
        self.where[ticket] = (p, d)
        self.counts["admitted"] += 1
        return Decision(p, d, ttft[p], tpot, source, source_pages)

    def prefill_done(self, ticket, now: float) -> None:
        """The prefill of `ticket` ended (answered, or failed): its instance's queue is what
        is still queued there, from now."""
        p, _ = self.where[ticket]
        if self.queued[p].pop(ticket, None) is not None:
            self.busy_until[p] = now + sum(self.queued[p].values())

    def finished(self, ticket, now: float) -> None:
        """`ticket` left its decode instance (done, failed or aborted)."""
        if ticket not in self.where:
            return
        self.prefill_done(ticket, now)
        _, d = self.where.pop(ticket)
        self.running[d].pop(ticket, None)


# -- simulated serving ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    prefill: int  # prefill instances; 0: colocated replicas
    decode: int  # decode instances, or colocated replicas
    prefill_tp: int = 1  # devices per prefill instance (tensor parallel); colocated: per replica
    decode_tp: int = 1  # devices per decode instance; colocated: per replica, as prefill_tp

    @property
    def devices(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def label(self) -> str:
        tp = lambda n: f"(tp{n})" if n > 1 else ""
        if not self.prefill:
            return f"{self.decode} colocated" + (f" (tp{self.decode_tp})" if self.decode_tp > 1 else "")
        return f"{self.prefill}P{tp(self.prefill_tp)} + {self.decode}D{tp(self.decode_tp)}"


@dataclasses.dataclass(frozen=True)
class InstanceSetup:
    """What a simulated instance is: one engine (on one device, or tensor parallel over
    several: its cost model says which)."""
    cost: CostModel
    sched_config: sched.SchedulerConfig
    num_pages: int
    max_model_len: int
    transfer_s_per_page: float = 0.0
    enable_prefix_caching: bool = True


@dataclasses.dataclass
class Served:
    """Per request (in the order given): TTFT and TPOT in seconds (nan: rejected, or never
    served), and whether the Conductor rejected it; makespan: the last token's time."""
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    rejected: np.ndarray
    makespan_s: float

    def met(self, ttft_slo: float, tpot_slo: float) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return (self.ttft_s <= ttft_slo) & (self.tpot_s <= tpot_slo)

    def attainment(self, ttft_slo: float, tpot_slo: float) -> float:
        """Share of all requests (rejected ones included) that met both SLOs."""
        return float(self.met(ttft_slo, tpot_slo).mean()) if len(self.ttft_s) else 0.0


class _CachedPages:
    """The pages a simulated prefill instance caches, as the router's index sees them: the
    prompts it was given, least recently used first, at most its pool's pages."""

    def __init__(self, capacity: int):
        self.capacity, self.keys = capacity, collections.OrderedDict()

    def matched(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return n

    def add(self, keys: list[bytes]) -> None:
        for k in keys:
            self.keys[k] = None
            self.keys.move_to_end(k)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


def dispatch(requests: Sequence[SimRequest], conductor: Conductor, setup: InstanceSetup
             ) -> list[Decision | Rejection]:
    """The Conductor's choice for each request (in arrival order), with its bookkeeping
    advanced at predicted times: a prefill ends when its instance's predicted queue does
    (its prompt's pages are cached there from then on, as the router's index learns of
    stored pages), a request leaves its decode instance after output_len predicted steps."""
    ps = setup.sched_config.page_size
    caches = {u: _CachedPages(setup.num_pages) for u in conductor.prefill}
    order = sorted(range(len(requests)), key=lambda k: requests[k].arrival_s)
    events: list[tuple[float, int, int, int]] = []  # (time, kind 0 prefill done / 1 finished, seq, ticket)
    out: list[Decision | Rejection | None] = [None] * len(requests)
    prompt_keys: dict[int, list[bytes]] = {}
    for seq, k in enumerate(order):
        r = requests[k]
        while events and events[0][0] <= r.arrival_s:
            t, kind, _, ticket = heapq.heappop(events)
            if kind == 0:
                caches[out[ticket].prefill].add(prompt_keys.pop(ticket))
            (conductor.prefill_done if kind == 0 else conductor.finished)(ticket, t)
        keys = chain(_ROOT, r.prompt[:len(r.prompt) - 1], ps)
        choice = conductor.admit(k, r.arrival_s, len(r.prompt), {u: c.matched(keys) for u, c in caches.items()})
        out[k] = choice
        if isinstance(choice, Decision):
            prompt_keys[k] = keys
            ready = conductor.busy_until[choice.prefill]
            heapq.heappush(events, (ready, 0, seq, k))
            done = r.arrival_s + choice.ttft_s + max(r.output_len - 1, 0) * choice.tpot_s
            heapq.heappush(events, (max(done, ready), 1, seq, k))
    return out


def _instance(requests: list[SimRequest], setup: InstanceSetup) -> list[list[float]]:
    if not requests:
        return []
    res = simulate(requests, setup.sched_config, setup.num_pages, setup.max_model_len, setup.cost,
                   enable_prefix_caching=setup.enable_prefix_caching)
    return res.token_times


def _prefill_request(r: SimRequest, choice: Decision, setup: InstanceSetup) -> SimRequest:
    """r as its prefill instance runs it: one token; a pulled prefix arrives with it, the
    pull's time later (the real instance overlaps the pull with its queue: the simulator
    is the more pessimistic of the two)."""
    r = dataclasses.replace(r, output_len=1)
    if choice.source is None or not setup.enable_prefix_caching:
        return r
    return dataclasses.replace(r, arrival_s=r.arrival_s + choice.source_pages * setup.transfer_s_per_page,
                               remote_pages=choice.source_pages)


def serve(requests: Sequence[SimRequest], placement: Placement,
          setup: InstanceSetup | Mapping[int, InstanceSetup], ttft_slo: float | None = None,
          tpot_slo: float | None = None) -> Served:
    """Simulate `requests` on `placement`, dispatched by a Conductor (early rejection when
    SLOs are given). A prefill instance runs each of its requests for one token, after
    pulling the prefix the Conductor chose to pull from another (Decision.source); the
    request reaches its decode instance when that prefill ends plus its pages' transfer,
    with the prompt's full pages cached there (SimRequest.remote_pages). setup: every
    instance's, or {tensor-parallel size: setup} for placements with instances of
    several devices (`placements`' tp_sizes)."""
    colocated = placement.prefill == 0
    if placement.decode < 1 or placement.prefill < 0:
        raise ValueError(f"a placement needs >= 1 decode instance (or colocated replica), got {placement}")
    setup_p = setup_for(setup, placement.decode_tp if colocated else placement.prefill_tp)
    setup_d = setup_for(setup, placement.decode_tp)
    transfer_s = setup_p.transfer_s_per_page
    names_p = [f"p{i}" for i in range(placement.prefill)] or [f"r{i}" for i in range(placement.decode)]
    names_d = names_p if colocated else [f"d{i}" for i in range(placement.decode)]
    conductor = Conductor(setup_p.cost, names_p, names_d, setup_d.sched_config.page_size, transfer_s,
                          ttft_slo, tpot_slo, colocated=colocated, decode_cost=setup_d.cost)
    choices = dispatch(requests, conductor, setup_p)
    token_times: list[list[float]] = [[] for _ in requests]
    rejected = np.array([isinstance(c, Rejection) for c in choices], bool)
    first: dict[int, float] = {}  # request -> when its prefill instance's token came (disaggregated)
    if not colocated:
        for u in names_p:
            mine = [k for k, c in enumerate(choices) if isinstance(c, Decision) and c.prefill == u]
            times = _instance([_prefill_request(requests[k], choices[k], setup_p) for k in mine], setup_p)
            first.update((k, t[0]) for k, t in zip(mine, times) if t)
    ps = setup_d.sched_config.page_size
    for u in names_d:
        mine = [k for k, c in enumerate(choices) if isinstance(c, Decision) and c.decode == u
                and (colocated or k in first)]
        if colocated:
            batch = [requests[k] for k in mine]
        else:
            batch = []
            for k in mine:
                r = requests[k]
                pages = (len(r.prompt) - 1) // ps
                batch.append(dataclasses.replace(r, arrival_s=first[k] + pages * transfer_s,
                                                 remote_pages=pages if setup_d.enable_prefix_caching else 0))
        for k, times in zip(mine, _instance(batch, setup_d)):
            token_times[k] = times
    ttft, tpot = latencies(token_times, requests)
    return Served(ttft, tpot, rejected, max((t[-1] for t in token_times if t), default=0.0))


def at_rate(requests: Sequence[SimRequest], rate: float, seed: int = 0) -> list[SimRequest]:
    """The requests, in their order, arriving as a Poisson process of `rate` requests a
    second (DistServe's workload): one seeded draw of unit gaps divided by the rate, so
    changing the rate rescales the same arrival pattern. (The conversation trace's own
    timestamps come in bursts of about ten equal ones every 3 s, which any rescaling keeps.)"""
    if not rate > 0:
        raise ValueError(f"the rate must be > 0 requests/s, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0, len(requests))
    gaps[0] = 0.0
    return [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(requests, np.cumsum(gaps) / rate)]


def max_rate(attainment: Callable[[float], float], guess: float, target: float = ATTAINMENT,
             steps: int = 7, max_doublings: int = 12) -> tuple[float, float]:
    """The highest rate (requests/s) whose attainment is >= target, within a factor
    2 ** (1 / 2 ** steps): doubling or halving from `guess` to bracket it, then
    geometric bisection. Returns (rate, its attainment); (0.0, nan) when even
    guess / 2 ** max_doublings misses the target."""
    if not guess > 0:
        raise ValueError(f"the first rate tried must be > 0, got {guess}")
    lo = hi = None
    rate, seen = guess, {}
    for _ in range(max_doublings + 1):
        seen[rate] = attainment(rate)
        if seen[rate] >= target:
            lo = rate
            if hi is not None:
                break
            rate *= 2
        else:
            hi = rate
            if lo is not None:
                break
            rate /= 2
    if lo is None:
        return 0.0, math.nan
    if hi is None:
        return lo, seen[lo]
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        seen[mid] = attainment(mid)
        lo, hi = (mid, hi) if seen[mid] >= target else (lo, mid)
    return lo, seen[lo]


def placements(devices: int, tp_sizes: Sequence[int] = (1,)) -> list[Placement]:
    """Every split of exactly `devices` into >= 1 prefill and >= 1 decode instance, each
    role's instances of one tensor-parallel size from tp_sizes, then colocated replicas of
    each size that divides `devices`."""
    if devices < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    if not tp_sizes or any(not isinstance(t, int) or t < 1 for t in tp_sizes) or len(set(tp_sizes)) < len(tp_sizes):
        raise ValueError(f"tensor-parallel sizes must be distinct ints >= 1, got {list(tp_sizes)}")
    out = []
    for tp_p in tp_sizes:
        for tp_d in tp_sizes:
            for p in range(1, devices):
                rest = devices - p * tp_p
                if rest >= tp_d and rest % tp_d == 0:
                    out.append(Placement(p, rest // tp_d, tp_p, tp_d))
    return out + [Placement(0, devices // tp, tp, tp) for tp in tp_sizes if devices % tp == 0]


def setup_for(setup: InstanceSetup | Mapping[int, InstanceSetup], tp: int) -> InstanceSetup:
    """The setup of an instance of tp devices: setup itself for tp 1, or setup[tp]."""
    if isinstance(setup, InstanceSetup):
        if tp != 1:
            raise ValueError(f"an instance of {tp} devices needs its own cost model: pass {{tp: InstanceSetup}}")
        return setup
    if tp not in setup:
        raise ValueError(f"no instance setup (cost model) for tensor-parallel size {tp}; have {sorted(setup)}")
    return setup[tp]


def capacity_guess(requests: Sequence[SimRequest], setup: InstanceSetup, devices: int) -> float:
    """Requests/s `devices` engines serve if every prompt ran alone and decodes ran 8 at a
    time: where the bisection starts."""
    work = sum(setup.cost.step_time_for_prefill(len(r.prompt)) + r.output_len * setup.cost.decode_per_token(8)
               for r in requests)
    return devices * len(requests) / work


def latencies(token_times: Sequence[Sequence[float]], requests: Sequence[SimRequest]) -> tuple[np.ndarray, np.ndarray]:
    """Per request: TTFT and TPOT (nan: no token; TPOT 0 for one token) from token times."""
    ttft, tpot = np.full(len(requests), np.nan), np.full(len(requests), np.nan)
    for k, (times, r) in enumerate(zip(token_times, requests)):
        if times:
            ttft[k] = times[0] - r.arrival_s
            tpot[k] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return ttft, tpot


def _warm(llm, requests: Sequence[SimRequest], max_runs: int, tag: str) -> int:
    """Replay `requests` on llm's engine until a replay compiles no new step (a simulator
    has no compile stalls), at most max_runs times; returns the replays that compiled."""
    from serving.simulator import replay

    runner = getattr(llm, "runner", None)
    for n in range(max_runs):
        compiled = runner.num_compilations() if runner is not None else 0
        llm.engine.kv.flush_prefix_cache()
        replay(llm.engine, list(requests), tag=f"{tag}{n}")
        if runner is None or runner.num_compilations() == compiled:
            return n
    return max_runs


def validate(llm, requests: Sequence[SimRequest], setups: Mapping[str, InstanceSetup], repeats: int = 2,
             max_warmups: int = 4) -> dict:
    """The simulator against the real engine: `requests` replayed in real time on `llm`
    (a serving.LLM built with the setups' scheduler and pool), after replays until one
    compiles nothing new (at most max_warmups), `repeats` times with the prefix cache
    flushed before each; against `simulate` on the same requests under each setup (its
    cost model). Returns {"real": [(ttft, tpot) per run], "sim": {name: (ttft, tpot)},
    "warmups": the replays that compiled}."""
    from serving.simulator import replay

    warmups = _warm(llm, requests, max_warmups, "validate-warm")
    runs = []
    for n in range(repeats):
        llm.engine.kv.flush_prefix_cache()
        runs.append(latencies(replay(llm.engine, list(requests), tag=f"validate{n}"), requests))
    sims = {}
    for name, setup in setups.items():
        res = simulate(list(requests), setup.sched_config, setup.num_pages, setup.max_model_len, setup.cost,
                       enable_prefix_caching=setup.enable_prefix_caching)
        sims[name] = latencies(res.token_times, requests)
    return {"real": runs, "sim": sims, "warmups": warmups}


def _print_validation(args) -> None:
    from serving.bench import load_trace
    from serving.llm import LLM
    from serving.simulator import fit_cost_model

    config = sched.SchedulerConfig(page_size=16, max_num_seqs=16, max_num_batched_tokens=512)
    trace, _, _ = load_trace(args.trace, 2 * args.validate, 8, 1024, 1 / 32)
    # fitted on the first half of the requests, validated on the second, other arrivals
    fit_on, requests = at_rate(trace[:args.validate], args.validate_rate, seed=1), trace[args.validate:]
    requests = at_rate(requests, args.validate_rate)
    llm = LLM(args.model, max_model_len=2048, max_num_seqs=config.max_num_seqs,
              max_num_batched_tokens=config.max_num_batched_tokens, num_kv_blocks=512, precompile=True)
    (iso_p, iso_d), record = _samples(llm, fit_on)
    isolated, served = fit_cost_model(iso_p, iso_d), fit_cost_model(*record)
    both = fit_cost_model(iso_p + record[0], iso_d + record[1])
    setups = {"isolated steps": InstanceSetup(isolated, config, 512, 2048),
              "served steps": InstanceSetup(served, config, 512, 2048),
              "both (what --cost fits)": InstanceSetup(both, config, 512, 2048)}
    out = validate(llm, requests, setups, repeats=3)
    print(f"validation: {len(requests)} requests of the trace (prompts at 8 tokens per 512-token block, mean "
          f"{np.mean([len(r.prompt) for r in requests]):.0f} tokens; outputs x1/32, mean "
          f"{np.mean([r.output_len for r in requests]):.1f}), Poisson arrivals at {args.validate_rate} req/s, one "
          f"engine of {args.model} (max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
          f"{config.max_num_batched_tokens}), replayed in real time after {out['warmups']} more replays that "
          f"compiled; simulated with three cost models fitted on this engine: on its isolated steps "
          f"(measure_engine_steps: prefill {_coefficients(isolated.prefill)}, decode "
          f"{_coefficients(isolated.decode)}), on the {len(record[0]) + len(record[1])} steps it served for the "
          f"trace's previous {len(fit_on)} requests (prefill {_coefficients(served.prefill)}, decode "
          f"{_coefficients(served.decode)}), and on both (prefill {_coefficients(both.prefill)}, decode "
          f"{_coefficients(both.decode)})")
    print("| run | TTFT mean (s) | TTFT p90 (s) | TPOT mean (s) | TPOT p90 (s) |")
    print("|---|---:|---:|---:|---:|")
    stats = [lambda t: np.nanmean(t[0]), lambda t: _pct(t[0], 90), lambda t: np.nanmean(t[1][t[1] > 0]),
             lambda t: _pct(t[1][t[1] > 0], 90)]
    for n, run in enumerate(out["real"]):
        print(f"| real engine, run {n + 1} | " + " | ".join(f"{f(run):.3f}" for f in stats) + " |")
    real = [float(np.median([f(run) for run in out["real"]])) for f in stats]
    for name, sim in out["sim"].items():
        print(f"| simulator, {name} | " + " | ".join(f"{f(sim):.3f}" for f in stats) + " |")
        print("| error vs the median run | " + " | ".join(f"{f(sim) / r - 1:+.1%}" for f, r in zip(stats, real))
              + " |")


def _coefficients(values) -> str:
    return "(" + ", ".join(f"{v:.3g}" for v in values) + ")"


def _pct(x: np.ndarray, q: float) -> float:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if len(x) else math.nan


def cost_path(path: str | None, tp: int) -> str | None:
    """Where the cost model of an instance of tp devices is kept: `path` for tp 1, else
    path with .tp<N> before its extension (cost.json -> cost.tp3.json)."""
    if path is None or tp == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.tp{tp}{ext}"


def _cost(args, tp: int = 1) -> CostModel:
    path = cost_path(args.cost, tp)
    if path and os.path.exists(path):
        try:
            return CostModel.load(path)
        except ValueError as e:
            raise SystemExit(f"kvfold placement: {e}")
    from serving.bench import load_trace
    from serving.llm import LLM

    print(f"fitting the cost model of {args.model} on {tp} device(s): its isolated steps, then the steps it "
          f"serves for the trace's first {args.fit_requests} requests at {args.validate_rate} req/s ...",
          file=sys.stderr)
    llm = LLM(args.model, max_model_len=2048, max_num_seqs=SCHEDULER.max_num_seqs,
              max_num_batched_tokens=SCHEDULER.max_num_batched_tokens, num_kv_blocks=512,
              tensor_parallel_size=tp)
    trace, _, _ = load_trace(args.trace, args.fit_requests, 8, 1024, 1 / 32)
    cost = fit_served(llm, at_rate(trace, args.validate_rate, seed=1))
    if path:
        cost.save(path)
    return cost


def _host_devices(count: int) -> None:
    """On a CPU host, let jax see `count` devices for tensor-parallel fits (XLA's host
    device count must be set before jax starts; a GPU or TPU host's devices are real)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 1 and "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _samples(llm, requests: Sequence[SimRequest]) -> tuple[tuple[list, list], tuple[list, list]]:
    """(isolated, served) step samples of llm's engine, fit_cost_model's format: the steps
    of `measure_engine_steps`, and every step the engine ran replaying `requests` in real
    time (after replays until one compiles nothing new)."""
    from serving.simulator import measure_engine_steps, replay

    isolated = measure_engine_steps(llm)
    _warm(llm, requests, 4, "fit-warm")
    served = ([], [])
    llm.engine.kv.flush_prefix_cache()
    replay(llm.engine, list(requests), tag="fit", record=served)
    return isolated, served


def fit_served(llm, requests: Sequence[SimRequest]) -> CostModel:
    """The cost model `--cost` fits: one least-squares fit over llm's isolated steps (every
    step shape up to the engine's largest, so the bisection's heavy loads stay inside
    what was measured) and the steps it served for `requests` (the mixes a trace makes).
    On held-out requests of the conversation trace (`--validate 48`, this 2-core CPU) the
    joint fit predicted the TTFT and TPOT means and p90s within 7% of the real engine, the
    served steps alone within 6%, the isolated steps alone up to 18% short."""
    from serving.simulator import fit_cost_model

    (iso_p, iso_d), (srv_p, srv_d) = _samples(llm, requests)
    return fit_cost_model(iso_p + srv_p, iso_d + srv_d)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="a Mooncake-format JSONL trace")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--tp-sizes", default="1",
                        help="comma-separated tensor-parallel sizes an instance may have (default 1); each size's "
                             "cost model is fitted on --model with that many devices (kept in --cost's file with "
                             ".tp<N> before its extension)")
    parser.add_argument("--ttft-slo", type=float, required=True, help="seconds")
    parser.add_argument("--tpot-slo", type=float, required=True, help="seconds")
    parser.add_argument("--model", default="default", help="the model whose engine steps the cost model fits")
    parser.add_argument("--cost", default=None,
                        help="a cost model JSON file: read when it exists, else fitted on --model and written")
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token trace block")
    parser.add_argument("--output-scale", type=float, default=1 / 16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-pages", type=int, default=2048, help="KV pages of one instance")
    parser.add_argument("--transfer-ms-per-page", type=float, default=5.3,
                        help="moving one page between instances (default: `python -m serving.bench disagg` "
                             "on a 2-core CPU)")
    parser.add_argument("--validate", type=int, default=0,
                        help="first replay this many of the trace's requests on the real engine of --model and "
                             "compare its TTFT / TPOT with the simulator's (0: skip)")
    parser.add_argument("--validate-rate", type=float, default=1.0,
                        help="requests/s of the validation replay and of the replay --cost fits on")
    parser.add_argument("--fit-requests", type=int, default=48,
                        help="the trace's first N requests, served in real time to fit the cost model on")
    parser.add_argument("--overload", type=float, default=1.5,
                        help="the best placement at this multiple of its goodput rate, with and without early "
                             "rejection (0: skip)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.trace):
        parser.error(f"trace {args.trace} does not exist")
    for name in ("devices", "num_requests", "block_tokens", "kv_pages", "fit_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.ttft_slo > 0 and args.tpot_slo > 0 and args.output_scale > 0 and args.transfer_ms_per_page >= 0
            and args.overload >= 0):
        parser.error("SLOs and --output-scale must be > 0, --transfer-ms-per-page and --overload >= 0")
    if args.validate < 0 or not args.validate_rate > 0:
        parser.error("--validate must be >= 0 and --validate-rate > 0")
    try:
        tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
        candidates = placements(args.devices, tp_sizes)
    except ValueError as e:
        parser.error(f"--tp-sizes takes distinct sizes >= 1 separated by commas: {e}")
    _host_devices(max(tp_sizes))
    from serving.bench import load_trace  # imports jax

    if args.validate:
        _print_validation(args)
    setups = {tp: InstanceSetup(_cost(args, tp), SCHEDULER, args.kv_pages, args.max_model_len,
                                args.transfer_ms_per_page / 1e3) for tp in tp_sizes}
    requests, _, _ = load_trace(args.trace, args.num_requests, args.block_tokens, args.max_model_len - 64,
                                args.output_scale)
    slo = (args.ttft_slo, args.tpot_slo)
    print(f"placement: {len(requests)} requests of {args.trace} (mean prompt "
          f"{np.mean([len(r.prompt) for r in requests]):.0f} tokens, mean output "
          f"{np.mean([r.output_len for r in requests]):.0f}), {args.devices} devices, instances of "
          f"{' or '.join(map(str, tp_sizes))} device(s) (tensor parallel), SLOs TTFT <= {args.ttft_slo} s and "
          f"TPOT <= {args.tpot_slo} s for {ATTAINMENT:.0%} of requests; simulated engines with a cost model per "
          f"size (" + "; ".join(f"tp{tp}: prefill {_coefficients(u.cost.prefill)}, decode "
                               f"{_coefficients(u.cost.decode)}" for tp, u in setups.items()) +
          f"), {args.kv_pages} KV pages each, KV transfer {args.transfer_ms_per_page} ms/page")
    print("| placement | goodput req/s | per device | attainment | TTFT p50 / p90 (s) | TPOT p50 / p90 (s) |")
    print("|---|---:|---:|---:|---|---|")
    rows = []
    for placement in candidates:
        rate, got = max_rate(lambda q, p=placement: serve(at_rate(requests, q), p, setups).attainment(*slo),
                             capacity_guess(requests, setups[placement.decode_tp], placement.devices))
        served = serve(at_rate(requests, rate), placement, setups) if rate else None
        rows.append((placement, rate, served))
        lat = "- | -" if served is None else (
            f"{_pct(served.ttft_s, 50):.2f} / {_pct(served.ttft_s, 90):.2f} | "
            f"{_pct(served.tpot_s, 50):.3f} / {_pct(served.tpot_s, 90):.3f}")
        print(f"| {placement.label} | {rate:.3f} | {rate / placement.devices:.3f} | {got:.2f} | {lat} |")
    best = max((r for r in rows if r[0].prefill), key=lambda r: r[1], default=None)
    colocated = max((r for r in rows if not r[0].prefill), key=lambda r: r[1])
    if best is not None:
        ratio = f"{best[1] / colocated[1]:.2f}x" if colocated[1] else "inf"
        print(f"best disaggregated placement: {best[0].label}, {best[1]:.3f} req/s ({best[1] / args.devices:.3f} "
              f"per device), {ratio} the goodput of {colocated[0].label}")
    top = max(rows, key=lambda r: r[1])
    if args.overload and top[1]:
        rate = args.overload * top[1]
        print(f"overload: {top[0].label} at {rate:.3f} req/s ({args.overload}x its goodput rate)")
        print("| early rejection | 429 share | attainment of all | goodput (met SLOs / s) |")
        print("|---|---:|---:|---:|")
        for early in (False, True):
            served = serve(at_rate(requests, rate), top[0], setups, *(slo if early else (None, None)))
            met = served.met(*slo).sum()
            print(f"| {'on' if early else 'off'} | {served.rejected.mean():.1%} | {served.attainment(*slo):.2f} | "
                  f"{met / served.makespan_s if served.makespan_s else 0:.3f} |")


if __name__ == "__main__":
    main()


__all__ = ["Conductor", "Decision", "InstanceSetup", "Placement", "Rejection", "Served", "at_rate", "cost_path",
           "dispatch", "fit_served", "latencies", "max_rate", "placements", "serve", "setup_for", "validate"]
