"""Discrete-event simulation of the engine: the real scheduler and KV manager, a cost model
instead of the model.

The pure scheduler and the host-side KV bookkeeping are exactly the engine's
(EngineCore); only the runner changes: SimRunner returns tokens from a seeded hash and
charges each step the time the cost model predicts (DistServe's form, REFERENCES §6):

    prefill: a + b * sum(len) + c * sum(len^2)      decode: a + b * sum(context) + c * batch

fitted by least squares from the real engine's measured steps (`fit_cost_model`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from serving import scheduler as sched
from serving.engine import EngineCore
from serving.params import SamplingParams
from serving.runner import Row, RowResult


@dataclasses.dataclass(frozen=True)
class CostModel:
    prefill: tuple[float, float, float]  # a, b, c (seconds)
    decode: tuple[float, float, float]

    def step_time(self, rows: list[Row]) -> float:
        pre = [len(r.tokens) + r.start for r in rows if len(r.tokens) > 1]
        new = [len(r.tokens) for r in rows if len(r.tokens) > 1]
        dec = [r.start + 1 for r in rows if len(r.tokens) == 1]
        t = 0.0
        if new:
            a, b, c = self.prefill
            # attention cost grows with the context the chunk reads (len * (start + len))
            t += a + b * sum(new) + c * sum(n * p for n, p in zip(new, pre))
        if dec:
            a, b, c = self.decode
            t += a + b * sum(dec) + c * len(dec)
        return t


    def step_time_for_prefill(self, n: int) -> float:
        a, b, c = self.prefill
        return a + b * n + c * n * n

    def decode_per_token(self, batch: int, context: int = 512) -> float:
        a, b, c = self.decode
        return (a + b * context * batch + c * batch) / batch


def fit_cost_model(prefill_samples: list[tuple[list[int], list[int], float]],
                   decode_samples: list[tuple[list[int], float]]) -> CostModel:
    """Least-squares fit. prefill_samples: (chunk lengths, context ends, seconds) per
    step; decode_samples: (contexts, seconds) per step. Coefficients are clipped at 0."""
    x = np.array([[1.0, sum(n), sum(a * b for a, b in zip(n, p))] for n, p, _ in prefill_samples])
    y = np.array([t for *_, t in prefill_samples])
    pre = np.clip(np.linalg.lstsq(x, y, rcond=None)[0], 0, None)
    x = np.array([[1.0, sum(c), len(c)] for c, _ in decode_samples])
    y = np.array([t for _, t in decode_samples])
    dec = np.clip(np.linalg.lstsq(x, y, rcond=None)[0], 0, None)
    return CostModel(tuple(map(float, pre)), tuple(map(float, dec)))


class SimRunner:
    """The runner contract without a model: deterministic tokens, predicted time."""

    def __init__(self, cost: CostModel, vocab_size: int = 32000, avoid_token: int | None = None):
        self.cost, self.vocab, self.avoid = cost, vocab_size, avoid_token
        self.last_step_time = 0.0

    def execute(self, rows: list[Row]) -> list[RowResult | None]:
        self.last_step_time = self.cost.step_time(rows)
        out: list[RowResult | None] = []
        for r in rows:
            if not r.sample:
                out.append(None)
                continue
            tok = (r.seed * 1_000_003 + r.counter * 7919 + r.start) % self.vocab
            if tok == self.avoid:
                tok = (tok + 1) % self.vocab
            out.append(RowResult(int(tok)))
        return out

    def copy_pages(self, pairs) -> None:
        pass

    def read_pages(self, pages):
        return list(pages)

    def write_pages(self, pages, data) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt: tuple[int, ...]
    output_len: int


@dataclasses.dataclass
class SimResult:
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    itl_s: np.ndarray
    e2e_s: np.ndarray
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    makespan_s: float
    num_preemptions: int
    steps: int


def simulate(requests: list[SimRequest], sched_config: sched.SchedulerConfig, num_pages: int,
             max_model_len: int, cost: CostModel, enable_prefix_caching: bool = True,
             max_steps: int = 10_000_000) -> SimResult:
    """Replay `requests` (sorted by arrival) through the engine core on simulated time."""
    now = [0.0]
    runner = SimRunner(cost)
    engine = EngineCore(runner, sched_config, num_pages, max_model_len, eos_token_id=None,
                        enable_prefix_caching=enable_prefix_caching, clock=lambda: now[0])
    pending = sorted(requests, key=lambda r: r.arrival_s)
    token_times: dict[str, list[float]] = {}
    arrivals: dict[str, float] = {}
    cached = 0
    i = steps = 0
    while (i < len(pending) or engine.has_unfinished()) and steps < max_steps:
        if not engine.has_unfinished() and i < len(pending):
            now[0] = max(now[0], pending[i].arrival_s)
        while i < len(pending) and pending[i].arrival_s <= now[0]:
            r = pending[i]
            rid = str(i)
            engine.add_request(rid, list(r.prompt),
                               SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True),
                               arrival=r.arrival_s)
            arrivals[rid] = r.arrival_s
            token_times[rid] = []
            i += 1
        progressed = engine.step()
        steps += 1
        now[0] += runner.last_step_time
        for rid in progressed:
            token_times[rid].append(now[0])
        for rid in list(engine.requests):
            if engine.request_finished(rid):
                cached += engine.requests[rid].num_cached_tokens
                engine.release(rid)
    ttft, tpot, e2e, itl = [], [], [], []
    for rid, times in token_times.items():
        if not times:
            continue
        ttft.append(times[0] - arrivals[rid])
        e2e.append(times[-1] - arrivals[rid])
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl.extend(np.diff(times))
    return SimResult(np.array(ttft), np.array(tpot), np.array(itl), np.array(e2e),
                     sum(len(t) for t in token_times.values()), sum(len(r.prompt) for r in requests),
                     cached, now[0], engine.num_preemptions, steps)


def measure_engine_steps(llm, prompt_lens=(16, 64, 128, 256), decode_batches=(1, 4, 8, 16),
                         seed: int = 0) -> tuple[list, list]:
    """Time real engine steps on `llm` (a serving.LLM) for fit_cost_model: each
    configuration runs twice and the second (compiled) timing is kept."""
    rng = np.random.default_rng(seed)
    runner = llm.runner
    table = list(range(runner.max_pages_per_seq))
    prefill, decode = [], []
    for n in prompt_lens:
        row = Row(rng.integers(0, llm.config.vocab_size, n).tolist(), 0, table, sample=True)
        for _ in range(2):
            start = time.perf_counter()
            runner.execute([row])
            elapsed = time.perf_counter() - start
        prefill.append(([n], [n], elapsed))
    for b in decode_batches:
        ctx = 128
        rows = [Row([1], ctx - 1, table, sample=True) for _ in range(b)]
        for _ in range(2):
            start = time.perf_counter()
            runner.execute(rows)
            elapsed = time.perf_counter() - start
        decode.append(([ctx] * b, elapsed))
    return prefill, decode
