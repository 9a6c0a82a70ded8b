"""KV transfer between engine processes: the prefill side of a disaggregated pair (DistServe,
Mooncake) hands a prompt's computed pages to the decode side, which caches them and
decodes from there.

Bytes move with `jax.experimental.transfer` (what tpu-inference and sglang-jax use): each
engine process runs a transfer server; the prefill side offers a device copy of the
prompt's cached pages under a uuid, and the decode side pulls it into device arrays of
the same layout and adopts them into its prefix cache, so the request that follows is a
prefix hit there. A control channel (the caller's: two servers' HTTP, or any pipe) carries
three messages: the offer (`KVHandle`, JSON-able), the receiver's "serve it now" (the
sender then calls `await_pull`; the library has no way to cancel an `await_pull`, so a
copy is only put up for a pull that is about to happen) and the acknowledgement.

Every transfer follows one state machine (`Transfer`): bootstrapping (the sender takes
its copy / the receiver checks the offer and connects), waiting (offered, until the
receiver asks / connected, until the sender serves), transferring (the pull is in
flight), then done or failed. Any other move is an `IllegalTransition`. The sender drops
its copy on the acknowledgement or when a time-to-live passes; the receiver gives up a
pull after its timeout (closing the connection, which fails the pull). A failed transfer
loses nothing: the request is computed from its prompt on the decode side, as if no KV
had come.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
import threading
import time
from typing import Callable, Sequence

import jax

from serving.engine import RemoteKV

BOOTSTRAPPING, WAITING, TRANSFERRING, DONE, FAILED = "bootstrapping", "waiting", "transferring", "done", "failed"
STATES = (BOOTSTRAPPING, WAITING, TRANSFERRING, DONE, FAILED)
TRANSITIONS = {BOOTSTRAPPING: (WAITING, FAILED), WAITING: (TRANSFERRING, FAILED), TRANSFERRING: (DONE, FAILED),
               DONE: (), FAILED: ()}
DEFAULT_TTL_S = 30.0  # a sender keeps an offered copy this long without a pull
DEFAULT_PULL_TIMEOUT_S = 30.0  # a receiver waits this long for the bytes


class IllegalTransition(RuntimeError):
    pass


class TransferFailed(RuntimeError):
    pass


@dataclasses.dataclass
class Transfer:
    """One transfer's state (`STATES`) and why it failed, if it did."""

    uuid: int
    state: str = BOOTSTRAPPING
    error: str | None = None
    deadline: float = float("inf")  # the sender's time-to-live, on its clock
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def advance(self, state: str, error: str | None = None) -> None:
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"transfer {self.uuid}: {self.state} -> {state} is not allowed "
                                    f"(from {self.state}: {', '.join(TRANSITIONS[self.state]) or 'none'})")
        self.state, self.error = state, error


@dataclasses.dataclass(frozen=True)
class KVHandle:
    """An offer, as the control channel carries it (`to_json` / `from_json`): where to pull
    (the sender's transfer server), under which uuid, the prompt tokens its pages cover
    (num_pages full pages) and the model's KV fingerprint (hex), which must equal the
    receiver's."""

    address: str
    uuid: int
    num_pages: int
    fingerprint: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "KVHandle":
        try:
            handle = cls(str(data["address"]), int(data["uuid"]), int(data["num_pages"]), str(data["fingerprint"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a KV handle: {data!r} ({e})") from None
        if handle.num_pages < 1 or handle.uuid < 0:
            raise ValueError(f"not a KV handle: {data!r}")
        return handle


def _server(address: str, transports: int):
    from jax.experimental import transfer

    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a KV transfer address is host:port, got {address!r}")

    # Transport addresses must be given: an empty list aborts the process at connect.
    return transfer.start_transfer_server(jax.devices()[0].client, address, [f"{host}:0"] * transports)


def _engine(llm):
    engine = llm.engine
    if not hasattr(engine, "export_prefix"):
        raise ValueError("KV transfer serves one engine per process: use data_parallel_size=1")
    if engine.kv.radix is None:
        raise ValueError("KV transfer goes through the prefix cache: it needs enable_prefix_caching=True")
    return engine


class KVSender:
    """The prefill side: offers prompts' cached pages to receivers in other processes.

    llm: the serving.LLM whose engine computed them. ttl_s: how long an offered copy
    waits for its pull (then dropped, the transfer failed). clock: seconds, for the TTL."""

    def __init__(self, llm, address: str = "127.0.0.1:0", ttl_s: float = DEFAULT_TTL_S, transports: int = 2,
                 clock: Callable[[], float] = time.monotonic):
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        self.llm, self.engine, self.ttl_s, self.clock = llm, _engine(llm), ttl_s, clock
        self.server = _server(address, transports)
        self.address = self.server.address()
        self.transfers: dict[int, Transfer] = {}  # offered, until `expire` after they end
        self.counts: collections.Counter = collections.Counter()  # "offered", then each end state
        self._copies: dict[int, object] = {}  # uuid -> the device copy offered, until done, failed or expired
        self._lock = threading.Lock()

    def offer(self, tokens: Sequence[int]) -> KVHandle | None:
        """Put up a copy of the pages the engine has cached for `tokens` (run the prompt
        first, e.g. generate with max_tokens=1); None when none is cached."""
        self.expire()
        num_pages, data = self.engine.export_prefix(tokens)
        if not num_pages:
            return None
        with self._lock:
            uuid = secrets.randbits(62)
            transfer = self.transfers[uuid] = Transfer(uuid, deadline=self.clock() + self.ttl_s)
            self._copies[uuid] = data
            transfer.advance(WAITING)
            self.counts["offered"] += 1
        return KVHandle(self.address, uuid, num_pages, self.llm.kv_fingerprint.hex())

    def serve(self, uuid: int) -> None:
        """The receiver is about to pull `uuid`: hand the copy to the transfer server.
        ValueError for a uuid that is unknown, expired or served already."""
        self.expire()
        with self._lock:
            transfer = self.transfers.get(uuid)
            if transfer is None or transfer.state != WAITING:
                raise ValueError(f"no offer {uuid} waits for a pull "
                                 f"({'unknown' if transfer is None else transfer.state})")
            self.server.await_pull(uuid, self._copies[uuid])
            transfer.advance(TRANSFERRING)

    def ack(self, uuid: int, ok: bool = True, error: str | None = None) -> None:
        """The receiver has the pages (ok) or gave up: drop the copy. Unknown or finished
        uuids are ignored (an acknowledgement may arrive after the time-to-live)."""
        with self._lock:
            transfer = self.transfers.get(uuid)
            if transfer is None or transfer.state in (DONE, FAILED):
                return
            if ok and transfer.state != TRANSFERRING:
                raise ValueError(f"transfer {uuid} was never served: it cannot be done")
            transfer.advance(DONE if ok else FAILED, None if ok else (error or "the receiver gave up"))
            self.counts[transfer.state] += 1
            self._copies.pop(uuid, None)

    def expire(self) -> list[int]:
        """Fail the transfers whose time-to-live has passed and drop their copies (returns
        their uuids); forget the transfers that ended before (`counts` keeps them)."""
        now, gone = self.clock(), []
        with self._lock:
            for uuid, transfer in list(self.transfers.items()):
                if transfer.state in (DONE, FAILED):
                    del self.transfers[uuid]
                elif now > transfer.deadline:
                    transfer.advance(FAILED, f"no acknowledgement within {self.ttl_s} s")
                    self.counts[FAILED] += 1
                    self._copies.pop(uuid, None)
                    gone.append(uuid)
        return gone

    @property
    def held(self) -> int:
        """Copies still held."""
        return len(self._copies)


class KVReceiver:
    """The decode side: pulls offered pages into its engine's prefix cache."""

    def __init__(self, llm, address: str = "127.0.0.1:0", timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
                 transports: int = 2):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.llm, self.engine, self.timeout_s = llm, _engine(llm), timeout_s
        self.server = _server(address, transports)
        self._connections: dict[str, object] = {}  # by sender address, shared by the pulls' threads
        self._lock = threading.Lock()
        self.transfers: dict[int, Transfer] = {}  # under way (an ended one is only counted)
        self.counts: collections.Counter = collections.Counter()  # by end state
        self.pages, self.seconds = 0, 0.0  # of the done transfers, from `begin` to the pages in the pool

    def receive(self, handle: KVHandle, tokens: Sequence[int], serve: Callable[[int], None]) -> Transfer:
        """Pull `handle`'s pages and cache them for `tokens` (the prompt they were computed
        from). serve(uuid) asks the sender to serve it (the control channel). Returns the
        transfer: done, or failed with its error, in which case nothing was cached and
        the prompt is computed here. Call it between engine steps (it writes the pool);
        a server runs the steps apart (`begin`, the sender's serve, `pull` on a worker
        thread, `adopt` on the engine thread)."""
        transfer = self.begin(handle, tokens)
        try:
            if transfer.state == WAITING:
                serve(handle.uuid)
                self.adopt(handle, tokens, self.pull(handle))
        except Exception as e:  # noqa: BLE001 (any failure falls back to computing the prompt)
            self.fail(handle, e)
        return transfer

    def begin(self, handle: KVHandle, tokens: Sequence[int]) -> Transfer:
        """Check the offer against this engine and connect to its sender: the transfer
        waits for the sender to serve it, or has failed (nothing to pull)."""
        transfer = self.transfers[handle.uuid] = Transfer(handle.uuid)
        try:
            if handle.fingerprint != self.llm.kv_fingerprint.hex():
                raise TransferFailed("the sender's model or KV layout differs from this engine's")
            if handle.num_pages * self.engine.kv.page_size > len(tokens):
                raise TransferFailed(f"{handle.num_pages} pages offered for a prompt of {len(tokens)} tokens")
            with self._lock:
                if handle.address not in self._connections:
                    self._connections[handle.address] = self.server.connect(handle.address)
            transfer.advance(WAITING)
        except Exception as e:  # noqa: BLE001
            self.fail(handle, e)
        return transfer

    def pull(self, handle: KVHandle):
        """The served pages as device arrays (blocks; any thread); TransferFailed after
        timeout_s without them."""
        self.transfers[handle.uuid].advance(TRANSFERRING)
        with self._lock:
            connection = self._connections[handle.address]
        specs = self.engine.runner.page_specs(handle.num_pages)
        result: dict = {}

        def pull():
            try:
                result["data"] = jax.block_until_ready(connection.pull(handle.uuid, specs))
            except Exception as e:  # noqa: BLE001 (reported to the caller)
                result["error"] = e
        worker = threading.Thread(target=pull, name="kvfold-kv-pull", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            # The library's pull has no working timeout: closing the connection fails it.
            with self._lock:
                if self._connections.get(handle.address) is connection:
                    del self._connections[handle.address]
            connection._poison_connection()
            worker.join(5.0)
            raise TransferFailed(f"no bytes within {self.timeout_s} s")
        if "error" in result:
            raise TransferFailed(str(result["error"]))
        return result["data"]

    def adopt(self, handle: KVHandle, tokens: Sequence[int], data, reservation=None) -> None:
        """Cache the pulled pages for `tokens` (on the engine's thread, between steps),
        into the pages the engine reserved under `reservation` (EngineCore.import_prefix)."""
        self.engine.import_prefix(tokens, handle.num_pages, data, reservation)
        transfer = self.transfers.pop(handle.uuid)
        transfer.advance(DONE)
        self.counts[DONE] += 1
        self.pages += handle.num_pages
        self.seconds += time.perf_counter() - transfer.started

    def fail(self, handle: KVHandle, error: BaseException | str) -> None:
        """The transfer failed (the prompt is computed here instead)."""
        transfer = self.transfers.pop(handle.uuid, None)
        if transfer is not None and transfer.state not in (DONE, FAILED):
            transfer.advance(FAILED, error if isinstance(error, str) else f"{type(error).__name__}: {error}")
            self.counts[FAILED] += 1

    def pull_later(self, handle: KVHandle, tokens: Sequence[int], executor) -> RemoteKV:
        """Start the pull on `executor` (after the sender was asked to serve), for
        `EngineCore.add_request(remote_kv=...)`, which reserves the handle's pages: a
        RemoteKV whose future's result is the callable that adopts the pages into them,
        for the engine to run between steps; the future raises if the pull failed (then
        the transfer has failed and the prompt is computed)."""
        def pull():
            try:
                data = self.pull(handle)
            except Exception as e:
                self.fail(handle, e)
                raise

            def adopt(reservation=None):
                try:
                    self.adopt(handle, tokens, data, reservation)
                except Exception as e:
                    self.fail(handle, e)
                    raise
            return adopt
        return RemoteKV(executor.submit(pull), handle.num_pages)


__all__ = ["STATES", "TRANSITIONS", "IllegalTransition", "KVHandle", "KVReceiver", "KVSender", "Transfer",
           "TransferFailed"]
