"""An `LLM` for asyncio callers: one engine thread owns every engine change.

The engine thread is the only caller of `engine.step()` and the only one that adds or
aborts requests; asyncio code hands it work (adds, aborts) through a queue and reads
results from one `asyncio.Queue` per `Stream`, fed with `loop.call_soon_threadsafe`.
So an HTTP handler never waits on the engine's lock, and a step never waits on a client.

    async_llm = AsyncLLM(llm, max_waiting_requests=64, max_waiting_tokens=32768)
    with async_llm:                        # starts and stops the engine thread
        stream = await async_llm.add(["Hello"], SamplingParams(max_tokens=8))
        async for deltas in stream:        # [(prompt index, RequestOutput of new tokens)]
            ...
        # or async_llm.abort(stream): its requests stop and their pages free before the next step

Admission (the server's 429): a batch of prompts is refused with `Overloaded` when the
requests waiting to be scheduled, or their prompt tokens, would pass the caps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from typing import Protocol

from serving.params import RequestOutput, SamplingParams


class Overloaded(Exception):
    """The waiting queue is full; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDead(RuntimeError):
    """The engine thread stopped (an error in a step, or shutdown)."""


class Observer(Protocol):
    """What the engine thread reports per request (serving.metrics.ServerMetrics)."""

    def first_token(self, ttft_s: float) -> None: ...
    def tokens(self, gap_s: float, num_tokens: int) -> None: ...
    def finished(self, output: RequestOutput, num_generated: int, e2e_s: float) -> None:
        """output: the last delta (its prompt, cached-token count and finish reasons)."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread takes after each step (read by /metrics)."""

    num_running: int = 0  # requests with a sequence in the running batch
    num_waiting: int = 0  # requests with a sequence in the waiting queue
    kv_used_pages: int = 0  # pages neither free nor evictable (the prefix cache's idle pages are free)
    kv_total_pages: int = 1
    num_preemptions: int = 0
    cache_hits_by_tier: tuple[tuple[str, int], ...] = ()  # (tier, prompt tokens served), since start


@dataclasses.dataclass
class _Timing:
    arrival: float
    first: float | None = None
    last: float | None = None
    generated: int = 0


class Stream:
    """One call's requests (one per prompt). Iterate for lists of (prompt index, RequestOutput
    holding only what is new); iteration ends when every request has finished."""

    def __init__(self, stream_id: int, added: list[tuple[str, str | None]], num_seqs: list[int],
                 loop: asyncio.AbstractEventLoop, arrival: float):
        self.id, self.added, self.loop = stream_id, added, loop
        self.marks = [[(0, 0)] * n for n in num_seqs]
        self.timing = [_Timing(arrival) for _ in added]
        self.done: set[int] = set()
        self.queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[tuple[int, RequestOutput]]:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLM:
    """`llm` driven by one engine thread (see the module docstring)."""

    def __init__(self, llm, max_waiting_requests: int | None = None, max_waiting_tokens: int | None = None,
                 observer: Observer | None = None):
        for name, cap in (("max_waiting_requests", max_waiting_requests),
                          ("max_waiting_tokens", max_waiting_tokens)):
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
                raise ValueError(f"{name} must be a positive int or None, got {cap!r}")
        self.llm, self.observer = llm, observer
        self.max_waiting_requests, self.max_waiting_tokens = max_waiting_requests, max_waiting_tokens
        self._wake = threading.Condition()  # guards _adds, _aborts, _stopping
        self._adds: list[tuple[list, list[SamplingParams], list, list | None, asyncio.Future, float]] = []
        self._taken: list = []  # the adds the engine thread is working through
        self._aborts: list[int] = []
        self._calls: list[tuple] = []  # (fn, args, future): run on the engine thread between steps
        self._stopping = False
        self._closed = False  # the engine thread has ended: adds are refused, not queued
        self._streams: dict[int, Stream] = {}  # only the engine thread touches it
        self._ids = itertools.count()
        self._reserved = [0, 0]  # requests and prompt tokens admitted, not yet in the engine
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.stats = self._take_stats()

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> "AsyncLLM":
        if self._thread is not None:
            raise RuntimeError("the engine thread was already started")
        self._thread = threading.Thread(target=self._run, name="kvfold-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the engine thread; unfinished requests are aborted and their streams fail."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "AsyncLLM":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- asyncio side ---------------------------------------------------------------

    async def add(self, prompts: list, params: SamplingParams | list[SamplingParams],
                  lora_request=None, remote_kv: list | None = None) -> Stream:
        """Validate and queue `prompts` (all or none), under `lora_request` (a LoRARequest
        for all, None for the base model); remote_kv: per prompt, its K/V on its way from
        another engine, or None (EngineCore.add_request). ValueError: a bad prompt,
        parameter or adapter; Overloaded: over the waiting caps; EngineDead: the engine
        thread is gone."""
        arrival = time.monotonic()
        if not self.alive:
            raise EngineDead("the engine is not running")
        # Tokenizing and checking off the event loop; the engine checks lengths again when adding.
        requests = await asyncio.to_thread(self.llm._requests, prompts, params, lora_request)
        num_tokens = sum(len(ids) for _, ids, _, _ in requests)
        self._admit(len(requests), num_tokens)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        try:
            with self._wake:
                if self._closed:
                    raise EngineDead(f"the engine stopped: {self.error!r}" if self.error else "the server is stopping")
                self._adds.append(([{"prompt": text, "prompt_token_ids": ids} for text, ids, _, _ in requests],
                                   [p for _, _, p, _ in requests], [r for *_, r in requests], remote_kv,
                                   future, arrival))
                self._wake.notify()
            return await future
        finally:
            self._reserved[0] -= len(requests)
            self._reserved[1] -= num_tokens

    async def call(self, fn, *args):
        """fn(*args) on the engine thread between steps (what touches the engine's state,
        like adopting transferred KV pages); its result, or its exception.
        EngineDead: the engine thread is gone."""
        future = asyncio.get_running_loop().create_future()
        with self._wake:
            if self._closed or not self.alive:
                raise EngineDead("the engine is not running")
            self._calls.append((fn, args, future))
            self._wake.notify()
        return await future

    def abort(self, stream: Stream) -> None:
        """Stop the stream's requests; their pages free before the next engine step."""
        with self._wake:
            self._aborts.append(stream.id)
            self._wake.notify()

    def _admit(self, num_requests: int, num_tokens: int) -> None:
        """Refuse (Overloaded) when the waiting queue would pass a cap. Runs on the event loop
        with no await between the check and the reservation, so concurrent calls see each other."""
        waiting = self.llm.engine.state.waiting  # an immutable tuple, replaced whole by each step
        requests = {s.seq_id.rsplit("#", 1)[0] for s in waiting}
        num_waiting = len(requests) + self._reserved[0]
        waiting_tokens = sum(s.num_tokens for s in waiting) + self._reserved[1]
        if self.max_waiting_tokens is not None and num_tokens > self.max_waiting_tokens:
            raise ValueError(f"the prompts hold {num_tokens} tokens, more than the server's "
                             f"max_waiting_tokens={self.max_waiting_tokens} lets wait at once")
        if self.max_waiting_requests is not None and num_waiting + num_requests > self.max_waiting_requests:
            raise Overloaded(f"{num_waiting} requests are waiting (max_waiting_requests="
                             f"{self.max_waiting_requests}); retry later")
        if self.max_waiting_tokens is not None and waiting_tokens + num_tokens > self.max_waiting_tokens:
            raise Overloaded(f"{waiting_tokens} prompt tokens are waiting (max_waiting_tokens="
                             f"{self.max_waiting_tokens}); retry later")
        self._reserved[0] += num_requests
        self._reserved[1] += num_tokens

    # -- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.llm.engine
        try:
            while True:
                with self._wake:
                    while not (self._stopping or self._adds or self._aborts or self._calls
                               or engine.has_unfinished()):
                        self._wake.wait()
                    if self._stopping:
                        break
                    self._taken, self._adds = self._adds, []  # settled by _shut if a step fails
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                with self.llm._lock:
                    for fn, args, future in calls:
                        try:
                            error, result = None, fn(*args)
                        except Exception as e:  # noqa: BLE001 (the caller's to handle)
                            error, result = e, None
                        self._call(future.get_loop(), _settle, future, error, result)
                    for stream_id in aborts:
                        stream = self._streams.pop(stream_id, None)
                        if stream is not None:
                            self.llm._forget(stream.added)
                    for add in self._taken:
                        self._add_now(*add)
                    progressed = engine.step() if engine.has_unfinished() else set()
                    self._publish(progressed)
                    self.stats = self._take_stats()
        except BaseException as e:  # noqa: BLE001 - reported to every stream and to /health
            self.error = e
        finally:
            self._shut(EngineDead(f"the engine stopped: {self.error!r}" if self.error else "the server is stopping"))

    def _add_now(self, prompts: list, params: list[SamplingParams], loras: list, remote_kv: list | None,
                 future: asyncio.Future, arrival: float) -> None:
        try:
            added = self.llm._add(prompts, params, loras, remote_kv)
        except ValueError as e:
            future.get_loop().call_soon_threadsafe(_settle, future, e, None)
            return
        num_seqs = [len(self.llm.engine.requests[rid].seq_ids) for rid, _ in added]
        stream = Stream(next(self._ids), added, num_seqs, future.get_loop(), arrival)
        self._streams[stream.id] = stream
        future.get_loop().call_soon_threadsafe(_settle, future, None, stream, lambda: self.abort(stream))

    def _publish(self, progressed: set[str]) -> None:
        """Hand each stream what its requests produced in the step (`progressed`: the request
        ids that took tokens; a request only finishes in a step that gives it tokens)."""
        now = time.monotonic()
        for stream in list(self._streams.values()):
            deltas = []
            for i, (rid, text) in enumerate(stream.added):
                if i in stream.done or rid not in progressed:
                    continue
                out = self.llm._output(rid, text, stream.marks[i])
                new = sum(len(o.token_ids) for o in out.outputs)
                if new:
                    self._observe(stream.timing[i], now, new)
                if out.finished:
                    stream.done.add(i)
                    if self.observer is not None:
                        t = stream.timing[i]
                        self.observer.finished(out, t.generated, now - t.arrival)
                if new or out.finished:
                    deltas.append((i, out))
            finished = len(stream.done) == len(stream.added)
            if finished:
                del self._streams[stream.id]
                self.llm._forget(stream.added)
            if deltas and not self._send(stream, deltas):
                self._streams.pop(stream.id, None)
                self.llm._forget(stream.added)
            elif finished:
                self._send(stream, None)

    def _observe(self, timing: _Timing, now: float, num_tokens: int) -> None:
        if self.observer is not None:
            if timing.first is None:
                self.observer.first_token(now - timing.arrival)
                if num_tokens > 1:
                    self.observer.tokens(0.0, num_tokens - 1)
            else:
                self.observer.tokens(now - timing.last, num_tokens)
        timing.first = now if timing.first is None else timing.first
        timing.last = now
        timing.generated += num_tokens

    @staticmethod
    def _send(stream: Stream, item) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            return True
        except RuntimeError:  # the caller's event loop is closed: nobody will read
            return False

    def _take_stats(self) -> EngineStats:
        engine = self.llm.engine
        state = engine.state

        def requests(seqs) -> int:
            return len({s.seq_id.rsplit("#", 1)[0] for s in seqs})
        total = engine.kv.pool.num_pages
        return EngineStats(requests(state.running), requests(state.waiting), total - engine.kv.num_available,
                           total, engine.num_preemptions, tuple(sorted(engine.kv.hits.items())))

    def _shut(self, error: EngineDead) -> None:
        """Fail every stream and pending add, and free their requests."""
        with self._wake:
            self._closed = True
            adds, self._adds = self._taken + self._adds, []
            calls, self._calls = self._calls, []
        for future in [f for *_, f, _ in adds] + [f for *_, f in calls]:  # those already settled stay so
            self._call(future.get_loop(), _settle, future, error, None)
        with self.llm._lock:
            for stream in self._streams.values():
                self.llm._forget(stream.added)
                self._call(stream.loop, stream.queue.put_nowait, error)
            self._streams.clear()

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed


def _settle(future: asyncio.Future, error: BaseException | None, result, on_cancelled=None) -> None:
    """Resolve `future` on its loop; a caller that stopped waiting gets its requests aborted."""
    if future.cancelled():
        if on_cancelled is not None:
            on_cancelled()
        return
    if future.done():  # settled before the engine thread failed
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
