"""Host and disk tiers under the device prefix cache (SGLang's HiCache, Mooncake Store).

A page that leaves the device pool can stay in host memory and on disk, so a prefix the
radix cache evicted is loaded back rather than recomputed. Every tier is a store of
pages keyed by the page's prefix-chained hash (`chain`): the hash of a page covers the
model (`fingerprint`), the namespace and every token up to the page's end, so equal keys
mean equal K/V, across engines and restarts. The same get / put / exists interface
serves each tier.

- `HostTier`: page-first rows in host memory: one row holds a page of every layer, so a
  page moves as one copy. On an accelerator with JAX's `pinned_host` memory kind, a row
  is an array there (the device copies into it and reads from it directly, and the row is
  packed and unpacked on the device); on the CPU backend, a numpy row (`host_rows_memory`).
  Bounded in pages, least recently used out first; entries the scheduler counted on this
  step are pinned until the step ends.
- `DiskTier`: one file per page (a header with the payload's length and checksum, then
  the payload), read memory-mapped; survives the engine, bounded in bytes, least
  recently used out first. A file that fails its checksum or is short is deleted and
  read as a miss: the tokens are recomputed, never read as KV. Files are written by a
  background thread; a page whose write is in flight is read from memory.
- `MooncakeTier`: the same pages in a Mooncake Store instead of on disk (SGLang's
  storage backend "mooncake"): host memory pooled across engine processes by a
  `mooncake_master`, so several engines share one KV pool.
- `Tiers`: host and disk (or store) with a write policy (when a device page is copied
  down): HiCache's `write_through` (as soon as it is cached), `write_through_selective`
  (once its node has been hit `SELECTIVE_HITS` times; the default) or `write_back` (when
  the device evicts it). Pages leave the host for the disk at the same time
  (write-through forms) or when the host evicts them (write-back). Pages come back from
  the disk into host memory by background prefetches (`prefetch` / `land`), which the
  engine defers a request for, by the prefetch policy.

`PageCodec` turns the runner's page data (a pytree of [n, ...] arrays, one leaf per pool
array) into such rows and back. Host-side only: the engine moves bytes on device
(serving/engine.py) when the KV manager says so. A copy down is dispatched by one step
and lands in the host tier at the next (`Tiers.copy_down` / `settle`); a lookup of a
page still in flight waits for it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import os
import socket
import threading
import time
from typing import Callable

import numpy as np

WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK = "write_through", "write_through_selective", "write_back"
WRITE_POLICIES = (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK)
SELECTIVE_HITS = 2  # SGLang's HiRadixCache writes a node through at its second hit
TIERS = ("device", "host", "disk", "store")  # "store": the Mooncake Store
STORAGE_BACKENDS = ("file", "mooncake")
# HiCache's prefetch from the tier under the host: started when a waiting request would be
# served more than PREFETCH_THRESHOLD tokens from there; the request waits for it (a
# delayed hit, deferred while other work runs) never ("best_effort"), until it is done
# ("wait_complete"), or at most base + per_ki_token * tokens / 1024 seconds ("timeout").
PREFETCH_BEST_EFFORT, PREFETCH_WAIT_COMPLETE, PREFETCH_TIMEOUT = "best_effort", "wait_complete", "timeout"
PREFETCH_POLICIES = (PREFETCH_BEST_EFFORT, PREFETCH_WAIT_COMPLETE, PREFETCH_TIMEOUT)
PREFETCH_THRESHOLD = 256
PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_KI_TOKEN_S = 1.0, 0.25
_PREFETCH_THREADS = 4
# The host tier's rows: JAX's pinned_host memory on an accelerator that has it ("auto"),
# always ("pinned_host": a ValueError where it cannot be), or numpy (`host_rows_memory`).
HOST_MEMORY_AUTO, HOST_MEMORY_PINNED, HOST_MEMORY_NUMPY = "auto", "pinned_host", "numpy"
HOST_MEMORIES = (HOST_MEMORY_AUTO, HOST_MEMORY_PINNED, HOST_MEMORY_NUMPY)
MOONCAKE_MIN_SEGMENT = 16 << 20  # the smallest segment a Mooncake client may lend
_MAGIC = b"KVFPAGE1"
_DIGEST = 16


def _digest(data) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def root_hash(fingerprint: bytes, namespace: int) -> bytes:
    """The chain's start for one model and namespace."""
    return _digest(fingerprint + int(namespace).to_bytes(8, "little", signed=True))


def chain(start: bytes, tokens, page_size: int) -> list[bytes]:
    """Keys of the full pages of `tokens`, chained from `start` (the key of the page before
    them, or root_hash): key i covers every token up to the end of page i."""
    ids = np.asarray(tokens, np.int64)
    keys, key = [], start
    for i in range(len(ids) // page_size):
        key = _digest(key + ids[i * page_size:(i + 1) * page_size].tobytes())
        keys.append(key)
    return keys


class PageCodec:
    """A page of the runner's data (leaves [n, ...]) as one contiguous uint8 row."""

    def __init__(self, sample):
        import jax  # the pytree utilities only; no device work

        leaves, self.treedef = jax.tree.flatten(sample)
        self.specs = [(np.asarray(a).shape[1:], np.asarray(a).dtype) for a in leaves]
        self.sizes = [int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in self.specs]
        self.page_nbytes = sum(self.sizes)

    def pack(self, data) -> np.ndarray:
        import jax

        leaves = [np.ascontiguousarray(a) for a in jax.tree.leaves(data)]
        n = leaves[0].shape[0]
        return np.concatenate([a.reshape(n, -1).view(np.uint8) for a in leaves], axis=1)

    def unpack(self, rows: np.ndarray):
        import jax

        leaves, offset = [], 0
        for (shape, dtype), size in zip(self.specs, self.sizes):
            part = np.ascontiguousarray(rows[:, offset:offset + size])
            leaves.append(part.view(dtype).reshape((rows.shape[0],) + shape))
            offset += size
        return jax.tree.unflatten(self.treedef, leaves)


def host_rows_memory(choice: str, pinned_host):
    """Where the host tier keeps its rows for TierConfig.host_memory `choice`, given the
    runner's pinned_host Sharding (None where it has none): that Sharding, or None for
    numpy rows. "auto" takes it on accelerators only: on the CPU backend the device's
    memory already is host memory, and pinned rows (one array a page, packed on the
    device) measured slower there than numpy rows (`bench trace --tiers` prints both)."""
    if choice == HOST_MEMORY_NUMPY:
        return None
    if choice == HOST_MEMORY_PINNED:
        if pinned_host is None:
            raise ValueError("hicache_host_memory='pinned_host' needs a backend with that memory kind and "
                             "a pool on one device (tensor_parallel_size=1)")
        return pinned_host
    on_cpu = pinned_host is not None and all(d.platform == "cpu" for d in pinned_host.device_set)
    return None if on_cpu else pinned_host


class HostTier:
    """Pages in host memory, page-first, at most capacity_bytes // page_nbytes of them.

    memory: a jax Sharding in `pinned_host` memory to keep each row in (one array a page,
    as the runner's `read_rows` writes them), or None for rows of one numpy array."""

    name = "host"

    def __init__(self, capacity_bytes: int, page_nbytes: int, memory=None):
        self.capacity = capacity_bytes // page_nbytes
        if self.capacity < 1:
            raise ValueError(f"host_cache_bytes={capacity_bytes} holds no page of {page_nbytes} bytes")
        self.memory = memory
        self.rows: np.ndarray | list = (np.empty((self.capacity, page_nbytes), np.uint8)  # untouched until written
                                        if memory is None else [None] * self.capacity)
        self.slots: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self.origin: dict[bytes, str] = {}  # where a hit on the page is counted: "host", or "disk" (staged)
        self.pinned: set[bytes] = set()
        self._free = list(range(self.capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.slots)

    def exists(self, key: bytes) -> bool:
        return key in self.slots

    def get(self, key: bytes):
        """The page's row (a copy, or the immutable pinned array), or None."""
        slot = self.slots.get(key)
        if slot is None:
            return None
        self.slots.move_to_end(key)
        return self.rows[slot].copy() if self.memory is None else self.rows[slot]

    def put(self, key: bytes, row, origin: str = "host") -> list[tuple[bytes, object]]:
        """Store a page (best effort: nothing happens when every held page is pinned).
        Returns the pages evicted to make room, least recently used first."""
        if key in self.slots:
            self.slots.move_to_end(key)
            return []
        evicted = []
        if not self._free:
            victim = next((k for k in self.slots if k not in self.pinned), None)
            if victim is None:
                return []
            slot = self.slots.pop(victim)
            evicted.append((victim, self._take(slot)))
            del self.origin[victim]
            self._free.append(slot)
        slot = self._free.pop()
        if self.memory is None:
            self.rows[slot] = row
        else:  # a row read from disk comes in as numpy
            import jax

            self.rows[slot] = row if isinstance(row, jax.Array) else jax.device_put(row, self.memory)
        self.slots[key] = slot
        self.origin[key] = origin
        return evicted

    def _take(self, slot: int):
        """The row in `slot`, handed out as it leaves the tier."""
        if self.memory is None:
            return self.rows[slot].copy()
        row, self.rows[slot] = self.rows[slot], None
        return row

    def clear(self) -> None:
        self._free.extend(self.slots.values())
        if self.memory is not None:
            self.rows = [None] * self.capacity
        self.slots.clear()
        self.origin.clear()
        self.pinned.clear()

    def check(self) -> None:
        used = list(self.slots.values())
        assert len(set(used)) == len(used) and not set(used) & set(self._free), "host slot held twice"
        assert len(used) + len(self._free) == self.capacity, "host slot leaked"
        assert set(self.origin) == set(self.slots)
        if self.memory is not None:
            free = set(self._free)
            assert all((self.rows[slot] is None) == (slot in free) for slot in range(self.capacity)), \
                "a free host slot holds a row"


def _frame(row: np.ndarray) -> bytes:
    """A stored page: magic, payload length (8 bytes), blake2b-128 of the payload, payload."""
    return _MAGIC + row.nbytes.to_bytes(8, "little") + _digest(row) + row.tobytes()


_HEAD = len(_MAGIC) + 8 + _DIGEST


def _unframe(data, page_nbytes: int) -> np.ndarray | None:
    """The payload of a stored page (uint8 buffer), or None if it is short, not a page of
    page_nbytes bytes, or fails its checksum."""
    data = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    ok = (data.shape[0] == _HEAD + page_nbytes and bytes(data[:len(_MAGIC)]) == _MAGIC
          and int.from_bytes(bytes(data[len(_MAGIC):len(_MAGIC) + 8]), "little") == page_nbytes
          and bytes(data[len(_MAGIC) + 8:_HEAD]) == _digest(data[_HEAD:]))
    return np.array(data[_HEAD:]) if ok else None


class _WriteBehind:
    """A store whose `put` hands the write to one background thread: until it lands, the
    page is served from `writing` (so a reader never sees half a page); `flush` waits for
    every write. Subclasses say how a page is written (`_write`: True if stored), whether
    one is stored (`_stored`, under the lock) and what a landed write changes (`_landed`)."""

    def __init__(self, thread_name: str):
        self._lock = threading.Lock()  # `writing` and the subclass's index, shared with the writer
        self.writing: dict[bytes, np.ndarray] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._writes: list[concurrent.futures.Future] = []
        self.num_corrupt = 0  # pages read back short or failing their checksum (dropped, recomputed)

    def _stored(self, key: bytes) -> bool:
        raise NotImplementedError

    def _write(self, key: bytes, row: np.ndarray) -> bool:
        raise NotImplementedError

    def _landed(self, key: bytes) -> None:
        pass

    def put(self, key: bytes, row: np.ndarray) -> None:
        """Write the page in the background (nothing if it is there or on its way)."""
        with self._lock:
            if key in self.writing or self._stored(key):
                return
            self.writing[key] = row
        self._writes = [f for f in self._writes if not f.done()]
        self._writes.append(self._writer.submit(self._land, key, row))

    def _land(self, key: bytes, row: np.ndarray) -> None:
        ok = False
        try:
            ok = self._write(key, np.asarray(row))  # a pinned row is read from host memory here
        finally:
            with self._lock:
                del self.writing[key]
                if ok:
                    self._landed(key)

    def _being_written(self, key: bytes) -> np.ndarray | None:
        """A copy of the page while its write is in flight, else None."""
        with self._lock:
            row = self.writing.get(key)
            return None if row is None else np.array(row)  # a pinned row is read to numpy

    def flush(self) -> None:
        """Wait until every write handed to the background thread has landed."""
        for future in self._writes:
            future.result()
        self._writes = []


class DiskTier(_WriteBehind):
    """Pages as files under `directory`, at most capacity_bytes of them (header included).

    A file is a framed page (`_frame`: magic, length, checksum, payload). The index of
    what is there (with its LRU order: file modification times, refreshed on read) is read
    from the directory at start, so a new engine finds an earlier one's pages. Files are
    written in the background (`_WriteBehind`) and appear by atomic rename."""

    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, page_nbytes: int):
        super().__init__("kvfold-disk")
        self.directory, self.capacity_bytes, self.page_nbytes = directory, capacity_bytes, page_nbytes
        self.file_nbytes = _HEAD + page_nbytes
        if capacity_bytes < self.file_nbytes:
            raise ValueError(f"disk_cache_bytes={capacity_bytes} holds no page of {self.file_nbytes} bytes")
        os.makedirs(directory, exist_ok=True)
        found = []
        for name in os.listdir(directory):
            if name.endswith(".kvpage") and len(name) == 2 * _DIGEST + 7:
                path = os.path.join(directory, name)
                stat = os.stat(path)
                if stat.st_size == self.file_nbytes:  # another model's pages have other sizes
                    found.append((stat.st_mtime_ns, bytes.fromhex(name[:-7])))
        self.index: collections.OrderedDict[bytes, None] = collections.OrderedDict(
            (key, None) for _, key in sorted(found))
        self._evict()

    def _path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + ".kvpage")

    @property
    def nbytes(self) -> int:
        """Bytes of the files written and of the writes in flight."""
        with self._lock:
            return (len(self.index) + len(self.writing)) * self.file_nbytes

    def exists(self, key: bytes) -> bool:
        with self._lock:
            return key in self.index or key in self.writing

    def get(self, key: bytes) -> np.ndarray | None:
        """The page, or None if absent, short or failing its checksum (then deleted)."""
        row = self._being_written(key)
        if row is not None:
            return row
        with self._lock:
            if key not in self.index:
                return None
        path = self._path(key)
        try:
            data = np.memmap(path, np.uint8, mode="r")
            row = _unframe(data, self.page_nbytes)
            del data
        except FileNotFoundError:  # evicted by the writer since the check above
            with self._lock:
                self.index.pop(key, None)
            return None
        except (OSError, ValueError):  # unreadable, or empty
            row = None
        with self._lock:
            if row is None:
                self.num_corrupt += 1
                self._remove(key)
                return None
            if key in self.index:
                self.index.move_to_end(key)
        try:
            os.utime(path)
        except FileNotFoundError:  # evicted meanwhile by the writer: the row read is still whole
            pass
        return row

    def _stored(self, key: bytes) -> bool:
        if key in self.index:
            self.index.move_to_end(key)
            return True
        return False

    def _write(self, key: bytes, row: np.ndarray) -> bool:
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_frame(row))
            os.replace(tmp, path)  # a reader never sees half a page
        except OSError:  # a full or vanished disk loses this copy, not the engine
            return False
        return True

    def _landed(self, key: bytes) -> None:
        self.index[key] = None
        self._evict()

    def _remove(self, key: bytes) -> None:
        self.index.pop(key, None)
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass

    def _evict(self) -> None:  # under the lock
        while self.index and (len(self.index) + len(self.writing)) * self.file_nbytes > self.capacity_bytes:
            self._remove(next(iter(self.index)))

    def check(self) -> None:  # writes in flight may pass the bound until they land and evict
        assert len(self.index) * self.file_nbytes <= self.capacity_bytes, "disk over its bound"

    def close(self) -> None:
        self.flush()


class MooncakeTier(_WriteBehind):
    """Pages in a Mooncake Store: a distributed pool of host memory that every engine
    pointed at the same `mooncake_master` (host:port) shares, so one engine finds the
    prefixes another computed. This engine lends `segment_bytes` of its memory to the
    pool; the master keeps the metadata, places each page in some engine's segment and
    evicts least recently used pages above 90% use (Mooncake's policy). Pages are stored
    framed like the disk tier's files (a page that fails its checksum is removed and read
    as a miss) under "kvfold/" + the key's hex, written in the background. Transport: TCP
    (the non-CUDA wheel; RDMA where the machine has it is Mooncake's own setting)."""

    name = "store"

    def __init__(self, master: str, segment_bytes: int, page_nbytes: int, hostname: str = "127.0.0.1"):
        super().__init__("kvfold-store")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError("hicache_storage_backend='mooncake' needs the mooncake-transfer-engine-non-cuda "
                             f"package and Debian's libibverbs1 ({e})") from None
        self.page_nbytes = page_nbytes
        if segment_bytes < max(MOONCAKE_MIN_SEGMENT, _HEAD + page_nbytes):
            raise ValueError(f"disk_cache_bytes={segment_bytes} (the memory lent to the Mooncake store) must be at "
                             f"least {max(MOONCAKE_MIN_SEGMENT, _HEAD + page_nbytes)} bytes (16 MiB, the store's "
                             "smallest segment, and one page)")
        host, _, port = master.rpartition(":")
        try:  # the client retries an absent master for a minute and a half: ask first
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise ValueError(f"no Mooncake master answers at mooncake_master={master!r} ({e})") from None
        self.store = MooncakeDistributedStore()
        # P2P handshake: no metadata service beyond the master; the local buffer stages
        # one get or put at a time
        rc = self.store.setup(hostname, "P2PHANDSHAKE", segment_bytes, max(16 << 20, 2 * (_HEAD + page_nbytes)),
                              "tcp", "", master)
        if rc != 0:
            raise ValueError(f"could not join the Mooncake store at mooncake_master={master!r} (setup returned {rc})")

    @staticmethod
    def _name(key: bytes) -> str:
        return "kvfold/" + key.hex()

    def exists(self, key: bytes) -> bool:
        with self._lock:
            writing = key in self.writing
        return writing or self.store.is_exist(self._name(key)) == 1

    def get(self, key: bytes) -> np.ndarray | None:
        """The page, or None if absent or failing its checksum (then removed)."""
        row = self._being_written(key)
        if row is not None:
            return row
        data = self.store.get(self._name(key))
        if not data:
            return None
        row = _unframe(data, self.page_nbytes)
        if row is None:
            with self._lock:  # prefetch threads read too
                self.num_corrupt += 1
            self.store.remove(self._name(key), force=True)  # leased by this read: removed anyway
        return row

    def _stored(self, key: bytes) -> bool:
        return False  # asked in `_write`, off the engine thread (an RPC to the master)

    def _write(self, key: bytes, row: np.ndarray) -> bool:
        name = self._name(key)
        if self.store.is_exist(name) == 1:  # another engine put it
            return True
        return self.store.put(name, _frame(row)) == 0  # a full pool of leased pages: not stored

    def check(self) -> None:
        pass  # the master bounds the pool

    def close(self) -> None:
        """Leave the pool (this engine's segment, and the pages placed in it, go with it)."""
        self.flush()
        self.store.close()


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """What LLM(enable_hierarchical_cache=True, ...) asks for. host_cache_bytes None: twice
    the device pool (SGLang's default hicache_ratio). The tier under the host (SGLang's
    storage backend): storage_backend "file" keeps pages under disk_cache_dir (None: no
    such tier), "mooncake" in the Mooncake Store whose master is at mooncake_master
    ("host:port"). disk_cache_bytes bounds the directory, or is the memory this engine
    lends to the store. host_memory: where host rows live (HOST_MEMORIES)."""

    host_cache_bytes: int | None = None
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 16 * 2**30
    write_policy: str = WRITE_THROUGH_SELECTIVE
    storage_backend: str = "file"
    mooncake_master: str | None = None
    prefetch_policy: str = PREFETCH_TIMEOUT
    host_memory: str = HOST_MEMORY_AUTO

    def __post_init__(self):
        if self.host_memory not in HOST_MEMORIES:
            raise ValueError(f"hicache_host_memory must be one of {list(HOST_MEMORIES)}, got {self.host_memory!r}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy must be one of {list(PREFETCH_POLICIES)}, "
                             f"got {self.prefetch_policy!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {list(WRITE_POLICIES)}, "
                             f"got {self.write_policy!r}")
        if self.storage_backend not in STORAGE_BACKENDS:
            raise ValueError(f"hicache_storage_backend must be one of {list(STORAGE_BACKENDS)}, "
                             f"got {self.storage_backend!r}")
        if self.storage_backend == "mooncake":
            host, _, port = str(self.mooncake_master).rpartition(":")
            if not isinstance(self.mooncake_master, str) or not host or not port.isdigit():
                raise ValueError(f"hicache_storage_backend='mooncake' needs mooncake_master='host:port', "
                                 f"got {self.mooncake_master!r}")
            if self.disk_cache_dir is not None:
                raise ValueError("disk_cache_dir is the 'file' backend's: the 'mooncake' backend keeps pages "
                                 "in the store")
        elif self.mooncake_master is not None:
            raise ValueError("mooncake_master needs hicache_storage_backend='mooncake'")
        for name in ("host_cache_bytes", "disk_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.disk_cache_dir is not None and not isinstance(self.disk_cache_dir, (str, os.PathLike)):
            raise ValueError(f"disk_cache_dir must be a path, got {self.disk_cache_dir!r}")


class Tiers:
    """The host tier, the optional disk tier and the write policy, for one engine.

    fingerprint: the model's identity (weights and KV layout), the root of every key.
    host_memory: the pinned_host Sharding the host rows live in, or None (numpy rows)."""

    def __init__(self, config: TierConfig, codec: PageCodec, device_bytes: int, fingerprint: bytes,
                 host_memory=None):
        self.config, self.codec, self.fingerprint = config, codec, fingerprint
        self.policy = config.write_policy
        # on the engine thread: seconds spent copying pages between tiers (a write to the
        # device pool is dispatched, not awaited) and pages copied either way
        self.copy_s, self.pages_moved = 0.0, 0
        self._pending: list[tuple[list[bytes], Callable[[], np.ndarray]]] = []  # copies down in flight
        self._in_flight: set[bytes] = set()
        host_bytes = config.host_cache_bytes if config.host_cache_bytes is not None else 2 * device_bytes
        self.host = HostTier(host_bytes, codec.page_nbytes, host_memory)
        self.disk: DiskTier | MooncakeTier | None = None  # the tier under the host, if any
        if config.storage_backend == "mooncake":
            self.disk = MooncakeTier(config.mooncake_master, config.disk_cache_bytes, codec.page_nbytes)
        elif config.disk_cache_dir is not None:
            self.disk = DiskTier(os.fspath(config.disk_cache_dir), config.disk_cache_bytes, codec.page_nbytes)
        # prefetches from the tier under the host: reads run on their own threads and land
        # in the host tier on the engine thread (`land`)
        self.prefetch_threshold = PREFETCH_THRESHOLD
        self.prefetching: dict[bytes, concurrent.futures.Future] = {}
        self.pages_prefetched = 0  # pages read by prefetches (each page once, however many wait)
        self.pages_staged = 0  # pages read from the tier under the host on the engine thread (`stage`)
        # runs the prefetch reads: threads, made at the first prefetch (the simulator sets its own)
        self.reader: concurrent.futures.Executor | None = None
        self.closed = False

    def reseed(self, fingerprint: bytes) -> None:
        """New weights: no stored page matches them; the host rows are dropped (the disk's
        stay, under the old model's keys, for an engine that still runs it)."""
        self.settle()
        concurrent.futures.wait(list(self.prefetching.values()))
        self.prefetching.clear()
        self.fingerprint = fingerprint
        self.host.clear()

    def prefetch(self, keys: list[bytes]) -> list[concurrent.futures.Future]:
        """Start reading `keys` (a prefix's pages past what the device and host hold, which
        the tier under the host has) into host memory in the background; a key already on
        its way is not read again. Returns the reads the prefix waits on."""
        if self.reader is None:
            self.reader = concurrent.futures.ThreadPoolExecutor(_PREFETCH_THREADS,
                                                                thread_name_prefix="kvfold-prefetch")
        futures = []
        for key in keys:
            if key not in self.prefetching:
                self.prefetching[key] = self.reader.submit(self.disk.get, key)
                self.pages_prefetched += 1
            futures.append(self.prefetching[key])
        return futures

    def land(self) -> None:
        """Move finished prefetches into the host tier (on the engine thread, which owns it)."""
        for key in [k for k, f in self.prefetching.items() if f.done()]:
            row = self.prefetching.pop(key).result()
            if row is not None:
                self.host.put(key, row, origin=self.disk.name)

    def prefetch_timeout(self, num_tokens: int) -> float:
        """Seconds a request waits for a prefetch of num_tokens tokens (HiCache's formula)."""
        return PREFETCH_TIMEOUT_BASE_S + PREFETCH_TIMEOUT_PER_KI_TOKEN_S * num_tokens / 1024

    def copy_down(self, keys: list[bytes], fetch: Callable[[], np.ndarray]) -> None:
        """Device pages on their way down: fetch() waits for their rows (dispatched
        already, so the pool may change meanwhile); they are stored at `settle`."""
        self._pending.append((keys, fetch))
        self._in_flight.update(keys)

    def settle(self) -> None:
        """Store every copy down still in flight."""
        if not self._pending:
            return
        start = time.perf_counter()
        pending, self._pending = self._pending, []
        for keys, fetch in pending:
            self.store(keys, fetch())
        self._in_flight.clear()
        self.copy_s += time.perf_counter() - start

    def flush(self) -> None:
        """Everything copied down so far is in the host tier and on disk."""
        self.settle()
        if self.disk is not None:
            self.disk.flush()

    def stage(self, key: bytes) -> bool:
        """Make the page `key` readable from the host tier for this step (pinned until
        `end_step`), reading it from disk if it is only there. False: no tier has it."""
        if key in self._in_flight:  # never read a page whose copy has not landed
            self.settle()
        future = self.prefetching.get(key)
        if future is not None:  # a prefetch reads it: never a second read, never a wait
            if not future.done():
                return False
            self.land()
        if not self.host.exists(key):
            row = self.disk.get(key) if self.disk is not None else None
            if row is None:
                return False
            self.pages_staged += 1
            self.host.put(key, row, origin=self.disk.name)
            if not self.host.exists(key):  # the host is full of pinned pages
                return False
        self.host.pinned.add(key)
        return True

    def store(self, keys: list[bytes], rows: np.ndarray) -> None:
        """Pages copied down from the device, by the write policy."""
        for key, row in zip(keys, rows):
            for old_key, old_row in self.host.put(key, row):
                if self.disk is not None and self.policy == WRITE_BACK:
                    self.disk.put(old_key, old_row)
            if self.disk is not None and self.policy != WRITE_BACK:
                self.disk.put(key, row)

    def end_step(self) -> None:
        self.host.pinned.clear()

    def check(self) -> None:
        self.host.check()
        if self.disk is not None:
            self.disk.check()

    def close(self) -> None:
        """Land every copy and let go of the tier under the host (the disk's files stay)."""
        self.closed = True
        self.flush()
        if self.reader is not None:
            self.reader.shutdown()
        if self.disk is not None:
            self.disk.close()


__all__ = ["DiskTier", "HOST_MEMORIES", "HostTier", "MooncakeTier", "PREFETCH_POLICIES", "PageCodec",
           "SELECTIVE_HITS", "STORAGE_BACKENDS", "TIERS", "TierConfig", "Tiers", "WRITE_POLICIES", "chain",
           "host_rows_memory", "root_hash"]
