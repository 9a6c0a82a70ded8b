"""Host and disk tiers under the device prefix cache (SGLang's HiCache, Mooncake Store).

A page that leaves the device pool can stay in host memory and on disk, so a prefix the
radix cache evicted is loaded back rather than recomputed. Every tier is a store of
pages keyed by the page's prefix-chained hash (`chain`): the hash of a page covers the
model (`fingerprint`), the namespace and every token up to the page's end, so equal keys
mean equal K/V, across engines and restarts. The same get / put / exists interface
serves each tier.

- `HostTier`: page-first rows in host memory (numpy): one row holds a page of every
  layer, so a page moves as one copy. Bounded in pages, least recently used out first;
  entries the scheduler counted on this step are pinned until the step ends.
- `DiskTier`: one file per page (a header with the payload's length and checksum, then
  the payload), read memory-mapped; survives the engine, bounded in bytes, least
  recently used out first. A file that fails its checksum or is short is deleted and
  read as a miss: the tokens are recomputed, never read as KV. Files are written by a
  background thread; a page whose write is in flight is read from memory.
- `Tiers`: the two with a write policy (when a device page is copied down): HiCache's
  `write_through` (as soon as it is cached), `write_through_selective` (once its node
  has been hit `SELECTIVE_HITS` times; the default) or `write_back` (when the device
  evicts it). Pages leave the host for the disk at the same time (write-through forms)
  or when the host evicts them (write-back).

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
import threading
import time
from typing import Callable

import numpy as np

WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK = "write_through", "write_through_selective", "write_back"
WRITE_POLICIES = (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK)
SELECTIVE_HITS = 2  # SGLang's HiRadixCache writes a node through at its second hit
TIERS = ("device", "host", "disk")
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


class HostTier:
    """Pages in host memory, page-first, at most capacity_bytes // page_nbytes of them."""

    name = "host"

    def __init__(self, capacity_bytes: int, page_nbytes: int):
        self.capacity = capacity_bytes // page_nbytes
        if self.capacity < 1:
            raise ValueError(f"host_cache_bytes={capacity_bytes} holds no page of {page_nbytes} bytes")
        self.rows = np.empty((self.capacity, page_nbytes), np.uint8)  # untouched memory until written
        self.slots: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self.origin: dict[bytes, str] = {}  # where a hit on the page is counted: "host", or "disk" (staged)
        self.pinned: set[bytes] = set()
        self._free = list(range(self.capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.slots)

    def exists(self, key: bytes) -> bool:
        return key in self.slots

    def get(self, key: bytes) -> np.ndarray | None:
        slot = self.slots.get(key)
        if slot is None:
            return None
        self.slots.move_to_end(key)
        return self.rows[slot].copy()

    def put(self, key: bytes, row: np.ndarray, origin: str = "host") -> list[tuple[bytes, np.ndarray]]:
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
            evicted.append((victim, self.rows[slot].copy()))
            del self.origin[victim]
            self._free.append(slot)
        slot = self._free.pop()
        self.rows[slot] = row
        self.slots[key] = slot
        self.origin[key] = origin
        return evicted

    def clear(self) -> None:
        self._free.extend(self.slots.values())
        self.slots.clear()
        self.origin.clear()
        self.pinned.clear()

    def check(self) -> None:
        used = list(self.slots.values())
        assert len(set(used)) == len(used) and not set(used) & set(self._free), "host slot held twice"
        assert len(used) + len(self._free) == self.capacity, "host slot leaked"
        assert set(self.origin) == set(self.slots)


class DiskTier:
    """Pages as files under `directory`, at most capacity_bytes of them (header included).

    File: magic, payload length (8 bytes), blake2b-128 of the payload, payload. The index
    of what is there (with its LRU order: file modification times, refreshed on read) is
    read from the directory at start, so a new engine finds an earlier one's pages.
    `put` hands the write to a background thread: until it lands, the page is served
    from `writing` (never from a half-written file: files appear by atomic rename);
    `flush` waits for every write."""

    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, page_nbytes: int):
        self._lock = threading.Lock()  # the index and `writing`, shared with the writer thread
        self.writing: dict[bytes, np.ndarray] = {}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvfold-disk")
        self._writes: list[concurrent.futures.Future] = []
        self.directory, self.capacity_bytes, self.page_nbytes = directory, capacity_bytes, page_nbytes
        self.file_nbytes = len(_MAGIC) + 8 + _DIGEST + page_nbytes
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
        self.num_corrupt = 0
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
        with self._lock:
            if key in self.writing:
                return self.writing[key].copy()
            if key not in self.index:
                return None
        path = self._path(key)
        try:
            data = np.memmap(path, np.uint8, mode="r")
            head = len(_MAGIC) + 8 + _DIGEST
            ok = (data.shape[0] == self.file_nbytes and bytes(data[:len(_MAGIC)]) == _MAGIC
                  and int.from_bytes(bytes(data[len(_MAGIC):len(_MAGIC) + 8]), "little") == self.page_nbytes
                  and bytes(data[len(_MAGIC) + 8:head]) == _digest(data[head:]))
            row = np.array(data[head:]) if ok else None
            del data
        except FileNotFoundError:  # evicted by the writer since the check above
            with self._lock:
                self.index.pop(key, None)
            return None
        except (OSError, ValueError):  # unreadable, or empty
            ok, row = False, None
        with self._lock:
            if not ok:
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

    def put(self, key: bytes, row: np.ndarray) -> None:
        """Write the page in the background (nothing if it is there or on its way)."""
        with self._lock:
            if key in self.index:
                self.index.move_to_end(key)
                return
            if key in self.writing:
                return
            self.writing[key] = row
        self._writes = [f for f in self._writes if not f.done()]
        self._writes.append(self._writer.submit(self._write, key, row))

    def _write(self, key: bytes, row: np.ndarray) -> None:
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_MAGIC + self.page_nbytes.to_bytes(8, "little") + _digest(row) + row.tobytes())
            os.replace(tmp, path)  # a reader never sees half a page
        except OSError:  # a full or vanished disk loses this copy, not the engine
            with self._lock:
                del self.writing[key]
            return
        with self._lock:
            del self.writing[key]
            self.index[key] = None
            self._evict()

    def flush(self) -> None:
        """Wait until every write handed to the background thread has landed."""
        for future in self._writes:
            future.result()
        self._writes = []

    def _remove(self, key: bytes) -> None:
        self.index.pop(key, None)
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass

    def _evict(self) -> None:  # under the lock
        while self.index and (len(self.index) + len(self.writing)) * self.file_nbytes > self.capacity_bytes:
            self._remove(next(iter(self.index)))


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """What LLM(enable_hierarchical_cache=True, ...) asks for. host_cache_bytes None: twice
    the device pool (SGLang's default hicache_ratio); disk_cache_dir None: no disk tier."""

    host_cache_bytes: int | None = None
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 16 * 2**30
    write_policy: str = WRITE_THROUGH_SELECTIVE

    def __post_init__(self):
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {list(WRITE_POLICIES)}, "
                             f"got {self.write_policy!r}")
        for name in ("host_cache_bytes", "disk_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.disk_cache_dir is not None and not isinstance(self.disk_cache_dir, (str, os.PathLike)):
            raise ValueError(f"disk_cache_dir must be a path, got {self.disk_cache_dir!r}")


class Tiers:
    """The host tier, the optional disk tier and the write policy, for one engine.

    fingerprint: the model's identity (weights and KV layout), the root of every key."""

    def __init__(self, config: TierConfig, codec: PageCodec, device_bytes: int, fingerprint: bytes):
        self.config, self.codec, self.fingerprint = config, codec, fingerprint
        self.policy = config.write_policy
        # on the engine thread: seconds spent copying pages between tiers (a write to the
        # device pool is dispatched, not awaited) and pages copied either way
        self.copy_s, self.pages_moved = 0.0, 0
        self._pending: list[tuple[list[bytes], Callable[[], np.ndarray]]] = []  # copies down in flight
        self._in_flight: set[bytes] = set()
        host_bytes = config.host_cache_bytes if config.host_cache_bytes is not None else 2 * device_bytes
        self.host = HostTier(host_bytes, codec.page_nbytes)
        self.disk = None
        if config.disk_cache_dir is not None:
            self.disk = DiskTier(os.fspath(config.disk_cache_dir), config.disk_cache_bytes, codec.page_nbytes)

    def reseed(self, fingerprint: bytes) -> None:
        """New weights: no stored page matches them; the host rows are dropped (the disk's
        stay, under the old model's keys, for an engine that still runs it)."""
        self.settle()
        self.fingerprint = fingerprint
        self.host.clear()

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
        if not self.host.exists(key):
            row = self.disk.get(key) if self.disk is not None else None
            if row is None:
                return False
            self.host.put(key, row, origin="disk")
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
        if self.disk is not None:  # writes in flight may pass the bound until they land and evict
            assert len(self.disk.index) * self.disk.file_nbytes <= self.disk.capacity_bytes, "disk over its bound"


__all__ = ["SELECTIVE_HITS", "TIERS", "WRITE_POLICIES", "DiskTier", "HostTier", "PageCodec", "TierConfig",
           "Tiers", "chain", "root_hash"]
