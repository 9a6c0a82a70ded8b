"""Discrete-event simulation of the engine: the real scheduler and KV manager, a cost model
instead of the model.

The pure scheduler and the host-side KV bookkeeping are exactly the engine's
(EngineCore); only the runner changes: SimRunner returns tokens from a seeded hash and
charges each step the time the cost model predicts (the form of DistServe, Zhong et al.,
OSDI 2024, on the step as the runner pads it):

    prefill: a + b * N + c * sum(len * end) + d * N [several chunks]
    decode:  a + b * sum(context) + c * rows

where a prefill chunk of `len` tokens ends at position `end` (its attention reads that
much context), N is the step's tokens padded to the runner's bucket (`bucket`, at least
MIN_CHUNK_TOKENS), the last prefill term is paid by steps of several chunks (the runner's
variant whose attention tiles every row slot), and rows is the decode batch padded to
its bucket. A step with chunks and decode rows is one padded step: the decode rows add
their tokens to N and their context reads (decode's b). The coefficients are fitted by
least squares (`fit_cost_model`) from the real engine's measured steps
(`measure_engine_steps`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import math
import time

import numpy as np

from serving import scheduler as sched
from serving.engine import MIN_CHUNK_TOKENS, EngineCore, Row, RowResult, bucket
from serving.kv_manager import pages_for
from serving.kv_tiers import TierConfig
from serving.radix_cache import NoFreePages
from serving.params import SamplingParams


def prefill_features(lens: list[int], ends: list[int], decode_rows: int = 0) -> list[float]:
    """The prefill cost model's regressors for one step's chunks (and decode_rows rows of
    one token beside them): [1, N, sum(len * end), N if several chunks else 0], N the
    step's tokens padded as the runner pads them."""
    n = float(bucket(sum(lens) + decode_rows, MIN_CHUNK_TOKENS))
    return [1.0, n, float(sum(k * e for k, e in zip(lens, ends))), n if len(lens) > 1 else 0.0]


def decode_features(contexts: list[int]) -> list[float]:
    """The decode cost model's regressors for one step's rows: [1, sum(context), rows
    padded to the runner's bucket]."""
    return [1.0, float(sum(contexts)), float(bucket(len(contexts)))]


@dataclasses.dataclass(frozen=True)
class CostModel:
    prefill: tuple[float, ...]  # a, b, c, d (seconds) of prefill_features; given a, b, c: d = 0
    decode: tuple[float, float, float]  # a, b, c (seconds) of decode_features

    def __post_init__(self):
        if len(self.prefill) == 3:
            object.__setattr__(self, "prefill", (*self.prefill, 0.0))
        if len(self.prefill) != 4 or len(self.decode) != 3:
            raise ValueError(f"a cost model has 4 (or 3) prefill and 3 decode coefficients, got {self.prefill}, "
                             f"{self.decode}")

    def prefill_time(self, lens: list[int], ends: list[int], decode_rows: int = 0) -> float:
        return float(np.dot(self.prefill, prefill_features(lens, ends, decode_rows)))

    def decode_time(self, contexts: list[int]) -> float:
        return float(np.dot(self.decode, decode_features(contexts)))

    def step_time(self, rows: list[Row]) -> float:
        chunks = [r for r in rows if len(r.tokens) > 1]
        decodes = [r for r in rows if len(r.tokens) == 1]
        if not chunks:
            return self.decode_time([r.start + 1 for r in decodes])
        return (self.prefill_time([len(r.tokens) for r in chunks], [r.start + len(r.tokens) for r in chunks],
                                  len(decodes)) + self.decode[1] * sum(r.start + 1 for r in decodes))

    def step_time_for_prefill(self, n: int) -> float:
        return self.prefill_time([n], [n])

    def decode_per_token(self, batch: int, context: int = 512) -> float:
        return self.decode_time([context] * batch) / batch

    def save(self, path: str) -> None:
        """Write the coefficients as JSON: {"prefill": [a, b, c, d], "decode": [a, b, c]}."""
        with open(path, "w") as f:
            json.dump({"prefill": list(self.prefill), "decode": list(self.decode)}, f)

    @classmethod
    def load(cls, path: str) -> CostModel:
        """A cost model `save` wrote; ValueError naming the file when it is not one."""
        try:
            with open(path) as f:
                data = json.load(f)
            model = cls(tuple(float(x) for x in data["prefill"]), tuple(float(x) for x in data["decode"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a cost model file ({{'prefill': [a, b, c, d], 'decode': [a, b, c]}}): "
                             f"{e}") from None
        if min(model.prefill + model.decode) < 0:
            raise ValueError(f"{path}: a cost model's coefficients are non-negative, got {data}")
        return model


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x w - y|| over w >= 0, exactly: the best unconstrained fit on every subset of
    columns that comes out non-negative (three columns: eight small solves)."""
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y * y))
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            w = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            if np.all(w >= 0):
                err = float(np.sum((x[:, cols] @ w - y) ** 2))
                if err < best_err:
                    best_err, best = err, np.zeros(x.shape[1])
                    best[list(cols)] = w
    return best


def _fit(features: list[list[float]], seconds: list[float]) -> tuple[float, ...]:
    # Weighted by 1 / t: step times span orders of magnitude, and what the simulation
    # needs is a small relative error on every step, not on the slowest ones only.
    x, y = np.array(features), np.array(seconds)
    w = 1.0 / np.maximum(y, 1e-12)
    return tuple(map(float, _nonnegative_lstsq(x * w[:, None], y * w)))


def fit_cost_model(prefill_samples: list[tuple], decode_samples: list[tuple[list[int], float]]) -> CostModel:
    """Least-squares fit of non-negative coefficients, minimising relative error.

    prefill_samples: (chunk lengths, chunk ends, seconds) per step, or (chunk lengths,
    chunk ends, decode contexts, seconds) for a step that also ran decode rows (a served
    step, `replay`'s record); decode_samples: (contexts, seconds) per step. One joint fit:
    decode rows beside chunks share decode's per-context-token cost. The prefill design
    needs rank 4 (steps of several chunks among them), the decode design rank 3: decode
    samples must vary the context at a fixed batch, or sum(context) is a multiple of the
    batch column and the per-token and per-row costs cannot be told apart (see
    `decode_layout`)."""
    features, seconds = [], []
    for *shape, t in prefill_samples:
        lens, ends, contexts = (*shape, [])[:3]
        features.append(prefill_features(lens, ends, len(contexts)) + [0.0, float(sum(contexts)), 0.0])
        seconds.append(t)
    for contexts, t in decode_samples:
        features.append([0.0] * 4 + decode_features(contexts))
        seconds.append(t)
    w = _fit(features, seconds)
    return CostModel(w[:4], w[4:])


class SimRunner:
    """The runner contract without a model: deterministic tokens, predicted time.

    With page_size, it also keeps a stand-in KV pool where a position's "K/V" is its
    token id (-1: never written), moved by copies, swaps and tier loads like real pages,
    so tests can check that every page a sequence reads holds its own tokens."""

    def __init__(self, cost: CostModel, vocab_size: int = 32000, avoid_token: int | None = None,
                 page_size: int | None = None):
        self.cost, self.vocab, self.avoid = cost, vocab_size, avoid_token
        self.page_size = page_size
        self.pages: dict[int, np.ndarray] = {}  # the stand-in pool, page id -> token ids
        # The engine calls execute only when it scheduled rows: num_steps tells the
        # caller whether last_step_time belongs to the step it just ran.
        self.num_steps = 0
        self.last_step_time = 0.0

    def execute(self, rows: list[Row]) -> list[RowResult | None]:
        self.num_steps += 1
        self.last_step_time = self.cost.step_time(rows)
        out: list[RowResult | None] = []
        for r in rows:
            if self.page_size is not None and r.tree is None:
                for i, tok in enumerate(r.tokens):
                    page, slot = divmod(r.start + i, self.page_size)
                    self._page(r.block_table[page])[slot] = tok
            if not r.sample:
                out.append(None)
                continue
            tok = (r.seed * 1_000_003 + r.counter * 7919 + r.start) % self.vocab
            if tok == self.avoid:
                tok = (tok + 1) % self.vocab
            out.append(RowResult((int(tok),)))
        return out

    def _page(self, page: int) -> np.ndarray:
        if page not in self.pages:
            self.pages[page] = np.full(self.page_size or 1, -1, np.int64)
        return self.pages[page]

    def copy_pages(self, pairs) -> None:
        for src, dst in pairs:
            self.pages[dst] = self._page(src).copy()

    def read_pages(self, pages, wait: bool = True):
        """Host copy of pages: int64 [n, page_size] (the page ids themselves without a page size)."""
        if self.page_size is None:
            data = np.asarray(list(pages), np.int64)[:, None]
        else:
            data = np.stack([self._page(p).copy() for p in pages])
        return data if wait else lambda: data

    host_memory = None  # the tiers keep numpy rows: pages here are ids, or token rows

    def upload_pages(self, data):
        return data

    def write_pages(self, pages, data) -> None:
        if self.page_size is not None:
            for page, row in zip(pages, data):
                self.pages[page] = np.array(row)

    def put_pages(self, pages, data, first: int = 0) -> None:
        """Pages from another engine (EngineCore.import_prefix): read_pages' form, or None
        (a disaggregated simulation moves no stand-in K/V)."""
        if data is not None:
            self.write_pages(pages, data[first:first + len(pages)])

    def kv_tokens(self, block_table, num_tokens: int) -> list[int]:
        """The stand-in K/V of positions [0, num_tokens) through a block table."""
        return [int(self._page(block_table[i // self.page_size])[i % self.page_size]) for i in range(num_tokens)]


@dataclasses.dataclass(frozen=True)
class TierCost:
    """Seconds per page moved between the tiers, on the engine thread (measure_tier_cost):
    host -> device, disk -> host, and device -> host (a copy down)."""

    load_host_s: float
    load_disk_s: float
    copy_down_s: float


class _SimReads(concurrent.futures.Executor):
    """The tiers' prefetch reads in simulated time: a read runs at once (the page is in
    the simulator's disk tier) but its future completes when the disk lane has read it
    (`load_disk_s` a page, one after another)."""

    def __init__(self, now: list[float], load_disk_s: float):
        self.now, self.load_disk_s = now, load_disk_s  # now: the simulator's clock cell
        self.lane = 0.0
        self.pending: collections.deque = collections.deque()  # (done at, future, result), in order

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self.lane = max(self.lane, self.now[0]) + self.load_disk_s
        self.pending.append((self.lane, future, fn(*args, **kwargs)))
        return future

    def complete(self) -> None:
        """Finish the reads the lane is done with by now."""
        while self.pending and self.pending[0][0] <= self.now[0]:
            _, future, row = self.pending.popleft()
            future.set_result(row)

    def next_done(self) -> float | None:
        return self.pending[0][0] if self.pending else None

    def wait(self, futures, timeout=None, return_when=None) -> None:
        """The engine has nothing else to run: time passes to the next read's end, or the
        timeout (EngineCore.wait_for_reads)."""
        target = self.pending[0][0] if self.pending else math.inf
        if timeout is not None:
            target = min(target, self.now[0] + timeout)
        if math.isinf(target):
            raise RuntimeError("the engine waits for prefetch reads that never end")
        self.now[0] = max(self.now[0], target)
        self.complete()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt: tuple[int, ...]
    output_len: int
    # full pages of the prompt whose K/V comes with the request from a prefill instance
    # (disaggregated serving): cached on arrival, as a decode instance imports them
    remote_pages: int = 0


@dataclasses.dataclass
class SimResult:
    ttft_s: np.ndarray
    tpot_s: np.ndarray  # requests with more than one output token
    itl_s: np.ndarray
    e2e_s: np.ndarray
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    makespan_s: float
    num_preemptions: int
    steps: int  # steps that ran rows (empty steps cost nothing and are not counted)
    # per request, aligned with ttft_s: its TPOT, 0 for a single output token (no gap)
    request_tpot_s: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    # with tiers: prompt tokens served by tier, and the seconds spent moving pages
    hits: dict = dataclasses.field(default_factory=dict)
    io_s: float = 0.0
    # per request, in the order given to simulate: the simulated times of its tokens
    token_times: list = dataclasses.field(default_factory=list)


def simulate(requests: list[SimRequest], sched_config: sched.SchedulerConfig, num_pages: int,
             max_model_len: int, cost: CostModel, enable_prefix_caching: bool = True,
             max_steps: int = 10_000_000, tiers: TierConfig | None = None,
             tier_cost: TierCost | None = None) -> SimResult:
    """Replay `requests` through the engine core on simulated time.

    With tiers (host_cache_bytes at 8 bytes a page: the simulator's pages are their ids),
    the pages an admission loads into the device pool go over one copy lane (a GPU's
    host-to-device copy engine) while steps compute: they take tier_cost.load_host_s each,
    one load after another, and their request (a delayed hit, admitted without tokens)
    computes from the first step that starts after its load. The engine's prefetches
    from disk read on a disk lane (load_disk_s a page) in simulated time, their requests
    deferred meanwhile by the prefetch policy, whose timeouts count simulated seconds.
    Smaller disk hits, which the engine reads on its own thread, and copies down add
    their time to the step.

    A request with remote_pages (a decode instance's, in disaggregated serving:
    serving/placement.py) has that many full pages of its prompt cached on arrival, as the
    engine imports another engine's pages (EngineCore.import_prefix); they take room in the
    pool as they do there, and when they do not fit the prompt is computed instead.

    Time advances by each step's predicted cost. A step that schedules nothing (an idle
    engine, or every request blocked) costs nothing; when it changed nothing either, the
    engine cannot move until the next arrival or the next load's end, so time jumps
    there. max_steps bounds the engine steps taken, empty ones included. Raises
    RuntimeError if the engine is stuck with nothing left to change that."""
    if (tiers is None) != (tier_cost is None):
        raise ValueError("simulating tiers needs both tiers and tier_cost")
    now = [0.0]
    runner = SimRunner(cost)
    engine = EngineCore(runner, sched_config, num_pages, max_model_len, eos_token_id=None,
                        enable_prefix_caching=enable_prefix_caching, clock=lambda: now[0], tiers=tiers,
                        fingerprint=b"simulator")
    reads = None
    if engine.tiers is not None and engine.tiers.disk is not None:
        reads = _SimReads(now, tier_cost.load_disk_s)
        engine.tiers.reader, engine.wait_for_reads = reads, reads.wait
    io_s = 0.0
    lane = 0.0  # when the copy lane finishes the loads it has been given
    order = sorted(range(len(requests)), key=lambda k: requests[k].arrival_s)
    pending = [requests[k] for k in order]
    token_times: dict[str, list[float]] = {}
    arrivals: dict[str, float] = {}
    cached = 0
    i = taken = 0
    while (i < len(pending) or engine.has_unfinished()) and taken < max_steps:
        while i < len(pending) and pending[i].arrival_s <= now[0]:
            r = pending[i]
            rid = str(order[i])
            if r.remote_pages:
                try:
                    engine.import_prefix(r.prompt, r.remote_pages, None)
                except NoFreePages:  # as a decode instance does: the prompt is computed here
                    pass
            engine.add_request(rid, list(r.prompt),
                               SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True),
                               arrival=r.arrival_s)
            arrivals[rid] = r.arrival_s
            token_times[rid] = []
            i += 1
        executed, preempted = runner.num_steps, engine.num_preemptions
        if reads is not None:
            reads.complete()
        before = ((engine.tiers.pages_staged, engine.tiers.pages_prefetched, engine.tiers.pages_moved)
                  if tiers else None)
        progressed = engine.step()
        taken += 1
        if tiers is not None:
            loaded = sum(engine.step_loads.values())
            staged, prefetched = (engine.tiers.pages_staged - before[0], engine.tiers.pages_prefetched - before[1])
            down = engine.tiers.pages_moved - before[2] - loaded
            for sid, n in engine.step_loads.items():
                lane = max(lane, now[0]) + n * tier_cost.load_host_s
                engine.load_ready[sid] = lane
            step_io = staged * tier_cost.load_disk_s + down * tier_cost.copy_down_s
            now[0] += step_io
            io_s += step_io + loaded * tier_cost.load_host_s + prefetched * tier_cost.load_disk_s
        if runner.num_steps == executed:
            if engine.num_preemptions == preempted and not engine.step_loads:  # nothing changed: wait
                later = [t for t in engine.load_ready.values() if t > now[0]]
                if reads is not None and reads.pending:
                    later.append(reads.next_done())
                if i < len(pending):
                    later.append(pending[i].arrival_s)
                if not later:
                    raise RuntimeError(f"the engine cannot schedule any of its {len(engine.requests)} "
                                       f"unfinished requests and none is left to arrive")
                now[0] = min(later)
            continue
        now[0] += runner.last_step_time
        for rid in progressed:
            token_times[rid].append(now[0])
        for rid in list(engine.requests):
            if engine.request_finished(rid):
                cached += engine.requests[rid].num_cached_tokens
                engine.release(rid)
    ttft, tpot, e2e, itl, request_tpot = [], [], [], [], []
    for rid, times in token_times.items():
        if not times:
            continue
        ttft.append(times[0] - arrivals[rid])
        e2e.append(times[-1] - arrivals[rid])
        gap = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        request_tpot.append(gap)
        if len(times) > 1:
            tpot.append(gap)
            itl.extend(np.diff(times))
    if engine.tiers is not None:
        engine.tiers.flush()
    return SimResult(np.array(ttft), np.array(tpot), np.array(itl), np.array(e2e),
                     sum(len(t) for t in token_times.values()), sum(len(r.prompt) for r in requests),
                     cached, now[0], engine.num_preemptions, runner.num_steps, np.array(request_tpot),
                     dict(engine.kv.hits), io_s, [token_times.get(str(k), []) for k in range(len(requests))])


def measure_tier_cost(llm, directory: str, num_pages: int = 64, repeats: int = 3,
                      host_memory: str = "auto") -> TierCost:
    """Seconds per page of the tier copies on `llm`'s runner (a serving.LLM): device ->
    host, host -> device, and a disk tier's write and read of pages of its size under
    `directory`, best of `repeats`. host_memory (serving.kv_tiers.HOST_MEMORIES): the host
    rows measured, chosen as the engine chooses them (`host_rows_memory`): packed on the
    device into pinned_host memory, or packed and unpacked in numpy."""
    import jax

    from serving.kv_tiers import DiskTier, PageCodec, host_rows_memory

    runner = llm.runner
    pinned = host_rows_memory(host_memory, getattr(runner, "host_memory", None)) is not None
    pages = list(range(min(num_pages, runner.num_pages)))
    codec = PageCodec(runner.read_pages(pages[:1]))
    disk = DiskTier(directory, 4 * len(pages) * (codec.page_nbytes + 64), codec.page_nbytes)
    best = [float("inf")] * 3
    for r in range(repeats + 1):  # the first round compiles
        t = time.perf_counter()
        rows = jax.block_until_ready(runner.read_rows(pages)) if pinned else codec.pack(runner.read_pages(pages))
        down = time.perf_counter() - t
        t = time.perf_counter()
        runner.write_pages(pages, runner.upload_rows(rows) if pinned else codec.unpack(rows))
        jax.block_until_ready(runner.pool)
        up = time.perf_counter() - t
        keys = [f"{r}-{p}".encode().ljust(16, b".")[:16] for p in pages]
        for key, row in zip(keys, rows):
            disk.put(key, row)
        disk.flush()
        t = time.perf_counter()
        for key in keys:
            assert disk.get(key) is not None
        read = time.perf_counter() - t
        if r:
            best = [min(b, x / len(pages)) for b, x in zip(best, (up, read, down))]
    return TierCost(best[0], best[0] + best[1], best[2])


# -- measuring the real engine ---------------------------------------------------------


def prefill_layout(max_model_len: int) -> list[tuple[int, int, int]]:
    """(chunk length, start, chunks) of the prefill steps measured for the fit: three
    prompt lengths from position 0 (so len and len * end are told apart), a chunk behind
    a long cached context (its attention reads far past its own tokens), and a step of
    two chunks (the runner's several-chunks variant)."""
    if max_model_len < 64:
        raise ValueError(f"measuring needs max_model_len >= 64, got {max_model_len}")
    top = min(256, max_model_len // 2)
    return [(top // 16, 0, 1), (top // 4, 0, 1), (top, 0, 1), (top // 4, max_model_len // 2, 1), (top // 4, 0, 2)]


def decode_layout(max_model_len: int) -> list[tuple[int, int]]:
    """(batch, context) of the decode steps measured for the fit: short and long contexts
    at a small and a large batch, and a point between. Every batch is measured at more
    than one context, so sum(context) and batch are not collinear."""
    if max_model_len < 64:
        raise ValueError(f"measuring needs max_model_len >= 64, got {max_model_len}")
    hi = min(2048, max_model_len - 1)
    lo = max(1, hi // 32)
    return [(1, lo), (1, hi), (16, lo), (16, hi), (4, hi // 4)]


def measure_engine_steps(llm, prefill_steps: list[tuple[int, ...]] | None = None,
                         decode_steps: list[tuple[int, int]] | None = None, repeats: int = 3,
                         seed: int = 0) -> tuple[list, list]:
    """Time real engine steps on `llm` (a serving.LLM) in fit_cost_model's sample format.

    prefill_steps: (chunk length, start[, chunks]) per step (chunks of that length, one
    sequence each, default one), default `prefill_layout`; decode_steps:
    (batch, context) per step, default `decode_layout`, contexts at most max_model_len - 1.
    Each step runs once to compile, then once in each of `repeats` rounds over all the
    steps; its fastest run is kept (other work on the machine only ever adds time). Each
    row gets the pages its context needs, different pages per row where the pool has enough."""
    rng = np.random.default_rng(seed)
    runner = llm.runner
    ps, pool = runner.page_size, runner.num_pages
    if prefill_steps is None:
        prefill_steps = prefill_layout(llm.max_model_len)
    if decode_steps is None:
        decode_steps = decode_layout(llm.max_model_len)
    prefill_steps = [(n, s, *k) if k else (n, s, 1) for n, s, *k in prefill_steps]
    if any(n < 2 or s + n > llm.max_model_len or k < 1 for n, s, k in prefill_steps):
        raise ValueError(f"prefill steps need 2 <= length and start + length <= {llm.max_model_len}, "
                         f"got {prefill_steps}")
    if any(b < 1 or not 1 <= c < llm.max_model_len for b, c in decode_steps):
        raise ValueError(f"decode steps need batch >= 1 and 1 <= context < {llm.max_model_len}, "
                         f"got {decode_steps}")
    first_page = 0

    def table(end: int) -> tuple[int, ...]:
        nonlocal first_page
        need = pages_for(end, ps)
        pages = tuple((first_page + j) % pool for j in range(need))
        first_page = (first_page + need) % pool
        return pages

    steps = [[Row(tuple(rng.integers(0, llm.config.vocab_size, n).tolist()), s, table(s + n), sample=True)
              for _ in range(k)] for n, s, k in prefill_steps]
    steps += [[Row((int(rng.integers(0, llm.config.vocab_size)),), c - 1, table(c), sample=True)
               for _ in range(b)] for b, c in decode_steps]
    for rows in steps:  # compile
        runner.execute(rows)
    # Rounds over every step rather than repeats of one: a burst of other work on the
    # machine then spoils one run of many steps, not every run of one.
    best = [float("inf")] * len(steps)
    for _ in range(repeats):
        for k, rows in enumerate(steps):
            start = time.perf_counter()
            runner.execute(rows)
            best[k] = min(best[k], time.perf_counter() - start)
    prefill = [([n] * k, [s + n] * k, t) for (n, s, k), t in zip(prefill_steps, best)]
    decode = [([c] * b, t) for (b, c), t in zip(decode_steps, best[len(prefill_steps):])]
    return prefill, decode


def replay(engine, requests: list[SimRequest], tag: str = "replay",
           record: tuple[list, list] | None = None) -> list[list[float]]:
    """Run `requests` on a real engine (an EngineCore, e.g. LLM(...).engine) in real time:
    each is added once the wall clock passes its arrival (seconds from the start), and
    steps run back to back while any is unfinished. Returns per request, in the order
    given, the seconds from the start at which each of its tokens was sampled: what
    `simulate`'s token_times predicts for the same requests (the simulator's validation).

    record: (prefill samples, decode samples) lists to append every step the runner ran
    to, timed, in fit_cost_model's format (the runner's execute is wrapped meanwhile):
    a cost model fitted on served steps rather than on isolated ones."""
    if record is not None:
        execute = engine.runner.execute

        def timed(rows):
            start = time.perf_counter()
            out = execute(rows)
            t = time.perf_counter() - start
            chunks = [r for r in rows if len(r.tokens) > 1]
            contexts = [r.start + 1 for r in rows if len(r.tokens) == 1]
            if chunks:
                record[0].append(([len(r.tokens) for r in chunks], [r.start + len(r.tokens) for r in chunks],
                                  contexts, t))
            else:
                record[1].append((contexts, t))
            return out
        patched = "execute" in vars(engine.runner)
        engine.runner.execute = timed
        try:
            return replay(engine, requests, tag)
        finally:
            if patched:
                engine.runner.execute = execute
            else:
                del engine.runner.execute
    order = sorted(range(len(requests)), key=lambda k: requests[k].arrival_s)
    times: list[list[float]] = [[] for _ in requests]
    live: dict[str, int] = {}
    i, start = 0, time.perf_counter()
    while i < len(order) or live:
        now = time.perf_counter() - start
        while i < len(order) and requests[order[i]].arrival_s <= now:
            k = order[i]
            r = requests[k]
            live[f"{tag}-{k}"] = k
            engine.add_request(f"{tag}-{k}", list(r.prompt),
                               SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True))
            i += 1
        if not live:
            time.sleep(max(requests[order[i]].arrival_s - now, 0.0))
            continue
        progressed = engine.step()
        now = time.perf_counter() - start
        for rid in progressed & live.keys():
            k = live[rid]
            made = len(engine.seqs[engine.requests[rid].seq_ids[0]].output.tokens)
            times[k] += [now] * (made - len(times[k]))
        for rid in [rid for rid in live if engine.request_finished(rid)]:
            engine.release(rid)
            del live[rid]
    return times
