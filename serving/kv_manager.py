"""Per-sequence block tables over the page pool, with the prefix cache and copy-on-write.

The KV manager makes every page decision: how many pages tokens take (`pages_for`, the
one place that rounds), which pages a step may write without a copy (what the
scheduler is shown), the copies a step needs (`prepare`), sharing on fork and release.
Host-side bookkeeping only (numpy and Python lists, on purpose); the engine moves
the bytes on device when this says so (page copies for copy-on-write, swaps, and with
host / disk tiers the pages it queues in `offloads` and `loads`).
"""

from __future__ import annotations

import collections

import numpy as np

from serving.kv_tiers import SELECTIVE_HITS, WRITE_BACK, WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, Tiers, chain
from serving.radix_cache import NoFreePages, PagePool, RadixCache


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages holding positions [0, num_tokens)."""
    return -(-num_tokens // page_size)


class KVManager:
    """tiers: host (and disk) tiers under the prefix cache, or None. They hold the base
    model's pages (namespace 0) only: a LoRA adapter's id names different weights in
    another process, so its K/V must not outlive the device tree."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 tiers: Tiers | None = None):
        if tiers is not None and not enable_prefix_caching:
            raise ValueError("the hierarchical cache extends the prefix cache: enable_prefix_caching must be on")
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.radix = None
        if enable_prefix_caching:
            self.radix = RadixCache(self.pool, page_size, tiers.fingerprint if tiers is not None else b"")
        self.tiers = tiers
        # Queued for the engine, which runs them before anything writes the pool:
        # (key, device page) to copy down to the tiers, then (device page, host row) to load.
        self.offloads: list[tuple[bytes, int]] = []
        self.loads: list[tuple[int, np.ndarray]] = []
        self.hits: collections.Counter = collections.Counter()  # prompt tokens served, by tier
        if tiers is not None:
            self.radix.on_evict = self._evicted
        self.tables: dict[str, list[int]] = {}
        self._locks: dict[str, object] = {}  # seq_id -> radix node it keeps locked
        self._namespaces: dict[str, int] = {}  # seq_id -> its prefix-cache namespace (LoRA id)
        self.reserved: dict[object, list[int]] = {}  # key -> pages held for K/V on its way (`reserve`)

    # -- capacity ------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Pages that can be handed out now: free plus evictable cached ones."""
        return self.pool.num_free + (self.radix.evictable_pages if self.radix else 0)

    def writable_pages(self, seq_id: str, position: int) -> int:
        """Pages of seq_id's table it can write from `position` on without allocating: all
        but the shared ones at or after that position's page (each of those is copied on
        write, one new page; the last sharer to write needs none, so this may count one
        page too many, never too few)."""
        table = self.tables[seq_id]
        first = position // self.page_size
        return len(table) - sum(int(self.pool.ref_counts[p] > 1) for p in table[first:])

    def freeable_pages(self, seq_id: str) -> int:
        """Pages that freeing seq_id now makes available: those no other sequence holds (a
        page the prefix cache also holds becomes evictable, so it counts)."""
        table = self.tables[seq_id]
        if not table:
            return 0
        refs = self.pool.ref_counts[table]
        if self.radix is not None:
            refs = refs - self.radix.holds[table]
        return int(np.sum(refs == 1))

    def flush_prefix_cache(self, namespace: int | None = None) -> int:
        """Drop every cached prefix no sequence holds (their K/V is stale once the weights
        change), or every prefix of one namespace (a LoRA adapter being removed: none of
        its sequences may run); returns the pages freed."""
        if self.radix is None:
            return 0
        if namespace is not None:
            return self.radix.drop_namespace(namespace)
        hook, self.radix.on_evict = self.radix.on_evict, None  # stale pages are not copied down
        try:
            return self.radix.evict(self.radix.evictable_pages)
        finally:
            self.radix.on_evict = hook

    def reseed(self, fingerprint: bytes) -> None:
        """New weights: flush the prefix cache and key pages under the new model from now on."""
        self.flush_prefix_cache()
        if self.tiers is not None:
            self.offloads.clear()
            self.radix.reseed(fingerprint)
            self.tiers.reseed(fingerprint)

    def _allocate(self, n: int) -> list[int]:
        if n > self.pool.num_free and self.radix is not None:
            self.radix.evict(n - self.pool.num_free)
        return self.pool.allocate(n)

    # -- prefix cache ----------------------------------------------------------

    def cached_prefix_len(self, tokens, namespace: int = 0) -> int:
        """Tokens of `tokens` the cache could serve (page-aligned, leaving one to compute):
        from the device tree, then from the host and disk tiers (whose pages this stages
        in host memory for the step: see `Tiers.stage`).
        namespace: whose KV (0: the base model; a LoRA adapter's id: computed under it)."""
        return sum(self.cached_prefix(tokens, namespace))

    def cached_prefix(self, tokens, namespace: int = 0) -> tuple[int, int]:
        """`cached_prefix_len`'s tokens as (from the device tree, from the tiers): the
        second part is loaded into new device pages when the sequence is admitted."""
        if self.radix is None or len(tokens) < 2:
            return 0, 0
        pages, node = self.radix.match_prefix(tokens[:len(tokens) - 1], touch=False, namespace=namespace)
        staged = self._staged(node, tokens[:len(tokens) - 1], len(pages), namespace)
        return len(pages) * self.page_size, len(staged) * self.page_size

    def _staged(self, node, tokens, first: int, namespace: int) -> list[bytes]:
        """Keys of the pages of `tokens` from page `first` on (the device match ends at
        `node`) that the tiers hold, as far as they run without a gap."""
        keys = []
        if self.tiers is None or namespace != 0:
            return keys
        for key in self._keys_past(node, tokens, first):
            if not self.tiers.stage(key):
                break
            keys.append(key)
        return keys

    def _keys_past(self, node, tokens, first: int):
        """The tier keys of `tokens`' full pages from page `first` on, chained from the
        device match's last node; lazily, so a walk that stops at a gap hashes no further."""
        key = node.hash
        for i in range(first, len(tokens) // self.page_size):
            (key,) = chain(key, tokens[i * self.page_size:(i + 1) * self.page_size], self.page_size)
            yield key

    def prefetch(self, tokens, namespace: int = 0) -> list:
        """HiCache's prefetch: the pages of `tokens` past the device match that only the
        tier under the host holds (as far as the chain runs without a gap) start loading
        into host memory in the background when they are more than the threshold's tokens.
        Returns the reads the request should wait for: those it started, or, below the
        threshold, those another request's prefetch has in flight (a delayed hit waits for
        that load rather than starting its own)."""
        tiers = self.tiers
        if tiers is None or tiers.disk is None or self.radix is None or namespace != 0 or len(tokens) < 2:
            return []
        tokens = tokens[:len(tokens) - 1]
        pages, node = self.radix.match_prefix(tokens, touch=False, namespace=namespace)
        keys = []
        for key in self._keys_past(node, tokens, len(pages)):
            if tiers.host.exists(key):
                continue
            if key not in tiers.prefetching and not tiers.disk.exists(key):
                break
            keys.append(key)
        if len(keys) * self.page_size > tiers.prefetch_threshold:
            return tiers.prefetch(keys)
        return [tiers.prefetching[k] for k in keys if k in tiers.prefetching]

    def cached_pages(self, tokens) -> list[int]:
        """The device pages of `tokens`' cached prefix in the base namespace, as far as an
        admission would reuse them (page-aligned, leaving one token to compute)."""
        if self.radix is None or len(tokens) < 2:
            return []
        return self.radix.match_prefix(tokens[:len(tokens) - 1], touch=False)[0]

    def reserve(self, key, num_pages: int) -> int:
        """Hold num_pages pages for K/V on its way from elsewhere (a disaggregated
        request's prompt), evicting cached ones if needed, so that its arrival does not
        depend on room then: adopt_prefix(..., reservation=key) writes into them. All or
        none: returns the pages held (0 when they do not fit now)."""
        if key in self.reserved:
            raise ValueError(f"{key!r} already holds a reservation")
        try:
            self.reserved[key] = self._allocate(num_pages) if num_pages > 0 else []
        except NoFreePages:
            return 0
        return num_pages

    def unreserve(self, key) -> None:
        """Give back what is left of key's reservation (none left: nothing happens)."""
        pages = self.reserved.pop(key, [])
        if pages:
            self.pool.decref(pages)

    def adopt_prefix(self, tokens, num_pages: int, reservation=None) -> tuple[list[int], int, object]:
        """Cache the first num_pages full pages of `tokens` in the base namespace with K/V
        that comes from elsewhere (another engine): returns (new pages, first, node): the
        pages from page `first` on that the tree did not hold yet, now cached (the tree
        their only holder) and evictable, which the caller fills before any step reads
        them, then hands `node` to `filled` (the write policy's copies down read them).
        reservation: a `reserve` key whose pages are used first (what they do not cover
        is allocated; what is not needed goes back). Raises NoFreePages when they do not
        fit."""
        if self.radix is None:
            raise ValueError("adopting a prefix needs enable_prefix_caching=True")
        if not 0 < num_pages * self.page_size <= len(tokens):
            raise ValueError(f"{num_pages} pages of {self.page_size} tokens do not fit a prompt of "
                             f"{len(tokens)} tokens")
        tokens = tuple(tokens[:num_pages * self.page_size])
        pages, node = self.radix.match_prefix(tokens, touch=False)
        first = len(pages)
        held = self.reserved.pop(reservation, [])
        need = num_pages - first
        if len(held) > need:
            self.pool.decref(held[need:])
            held = held[:need]
        if first == num_pages:
            return [], first, node
        self.radix.lock(node)  # what is cached already stays while the new pages are allocated
        try:
            new = held + self._allocate(need - len(held))
        except NoFreePages:
            if held:
                self.pool.decref(held)
            raise
        finally:
            self.radix.unlock(node)
        leaf = self.radix.insert(tokens, pages + new)
        self.pool.decref(new)  # the tree's reference is the one left
        return new, first, leaf

    def filled(self, node) -> None:
        """adopt_prefix's pages now hold their K/V (write-through copies them down)."""
        self._cached(node)

    def hold(self, tokens, namespace: int = 0, limit: int | None = None):
        """Lock the device pages of `tokens`' cached prefix (at most `limit` tokens) until
        `release`: the sequences a step admits hold what the scheduler counted for them
        before any of them allocates, so one admission's eviction cannot take a page
        another admission counted on (the scheduler counts those pages as available, and
        as pages the sequence needs: there is room without them)."""
        if self.radix is None or len(tokens) < 2:
            return None
        end = len(tokens) - 1 if limit is None else min(len(tokens) - 1, limit)
        _, node = self.radix.match_prefix(tokens[:end], touch=False, namespace=namespace)
        self.radix.lock(node)
        return node

    def release(self, node) -> None:
        if node is not None:
            self.radix.unlock(node)

    def admit(self, seq_id: str, tokens, use_cache: bool = True, namespace: int = 0,
              limit: int | None = None) -> int:
        """Start a block table for seq_id, reusing cached prefix pages of its namespace, at
        most `limit` tokens of them (what the scheduler counted on); returns cached tokens.
        Pages from the tiers get new device pages, queued in `loads`."""
        assert seq_id not in self.tables
        pages, node = [], None
        if use_cache and self.radix is not None and len(tokens) >= 2:
            end = len(tokens) - 1 if limit is None else min(len(tokens) - 1, limit)
            pages, node = self.radix.match_prefix(tokens[:end], namespace=namespace)
            self.radix.lock(node)
            self.pool.incref(pages)
            self.hits["device"] += len(pages) * self.page_size
            self._count_hit(node)
            staged = self._staged(node, tokens[:end], len(pages), namespace)
            if staged:
                new = self._allocate(len(staged))  # the match is locked: eviction spares it
                for key, page in zip(staged, new):
                    self.hits[self.tiers.host.origin[key]] += self.page_size
                    self.tiers.host.origin[key] = "host"  # staged from disk once; in host memory now
                    self.loads.append((page, self.tiers.host.get(key)))
                pages = pages + new
                leaf = self.radix.insert(tokens[:len(pages) * self.page_size], pages, namespace)
                leaf.backed = True  # its pages are in the host tier
                self.radix.lock(leaf)
                self.radix.unlock(node)
                node = leaf
        self.tables[seq_id] = list(pages)
        self._locks[seq_id] = node
        self._namespaces[seq_id] = namespace
        return len(pages) * self.page_size

    # -- write policy: which device pages are copied down, and when ------------------

    def _copy_down(self, node) -> None:
        node.backed = True
        self.offloads.extend(zip(node.page_keys(self.page_size), node.pages))

    def _count_hit(self, node) -> None:
        """An admission matched through `node` and its ancestors (write-through-selective
        copies a node down at its SELECTIVE_HITS-th hit)."""
        if self.tiers is None or node.parent is None or self.radix.namespace_of(node) != 0:
            return
        while node.parent is not None:
            node.hits += 1
            if self.tiers.policy == WRITE_THROUGH_SELECTIVE and node.hits >= SELECTIVE_HITS and not node.backed:
                self._copy_down(node)
            node = node.parent

    def _cached(self, node) -> None:
        """`node` and its ancestors were just cached (write-through copies them down)."""
        if self.tiers is None or self.tiers.policy != WRITE_THROUGH or self.radix.namespace_of(node) != 0:
            return
        while node.parent is not None and not node.backed:
            self._copy_down(node)
            node = node.parent

    def _evicted(self, leaf) -> None:
        """The device tree evicts `leaf` (write-back copies it down now; otherwise what
        was not copied down is dropped)."""
        if self.tiers.policy == WRITE_BACK and not leaf.backed and self.radix.namespace_of(leaf) == 0:
            self._copy_down(leaf)

    def take_offloads(self) -> list[tuple[bytes, int]]:
        out, self.offloads = self.offloads, []
        return out

    def take_loads(self) -> list[tuple[int, np.ndarray]]:
        out, self.loads = self.loads, []
        return out

    def cache_computed(self, seq_id: str, tokens, num_computed: int) -> None:
        """Offer the sequence's full computed pages to the prefix cache."""
        if self.radix is None:
            return
        full = num_computed // self.page_size
        if full == 0:
            return
        table = self.tables[seq_id]
        node = self.radix.insert(tokens[:full * self.page_size], table[:full], self._namespaces[seq_id])
        self._cached(node)
        # Where these tokens were cached first, under other pages (the same K/V), the sequence
        # takes the cached pages and gives back its own copies, as SGLang does: a duplicate
        # would stay allocated, and the cached copy pinned under the sequence's newer pages.
        for i, page in enumerate(self.radix.path_pages(node)):
            if table[i] != page:
                self.pool.incref([page])
                self.pool.decref([table[i]])
                table[i] = page
        self._lock_held(seq_id, node)

    def _lock_held(self, seq_id: str, node) -> None:
        """Move seq_id's lock to the deepest node on `node`'s path holding one of the
        sequence's pages (a lock covers its ancestors too). A lock marks cached pages that
        evicting would not free while the sequence runs; a cached page the sequence has
        since copied on write (a fork's) stays evictable."""
        table, held = set(self.tables[seq_id]), None
        while node is not None and node.parent is not None:  # the root holds no pages
            if table.intersection(node.pages):
                held = node
                break
            node = node.parent
        if held is not None:
            self.radix.lock(held)
        old = self._locks[seq_id]
        if old is not None:
            self.radix.unlock(old)
        self._locks[seq_id] = held

    # -- growth, sharing, release ----------------------------------------------

    def ensure(self, seq_id: str, num_tokens: int) -> None:
        """Grow seq_id's table to hold `num_tokens` positions (raises NoFreePages)."""
        table = self.tables[seq_id]
        need = pages_for(num_tokens, self.page_size) - len(table)
        if need > 0:
            table.extend(self._allocate(need))

    def fork(self, parent: str, child: str, num_tokens: int) -> None:
        """child shares parent's pages holding its first `num_tokens` positions (parallel
        sampling); writes copy on demand. Pages past them (speculative lookahead) stay the
        parent's: the child allocates its own, which the scheduler counts."""
        pages = self.tables[parent][:pages_for(num_tokens, self.page_size)]
        self.pool.incref(pages)
        self.tables[child] = list(pages)
        node = self._locks[parent]
        if node is not None:
            self.radix.lock(node)
        self._locks[child] = node
        self._namespaces[child] = self._namespaces[parent]

    def prepare(self, seq_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """Before a step writes positions [start, end): grow the table to hold them and give
        seq_id a private copy of every shared page among them (copy-on-write). Returns the
        (src_page, dst_page) pairs the runner copies on device. Raises NoFreePages."""
        self.ensure(seq_id, end)
        table, copies = self.tables[seq_id], []
        for i in range(start // self.page_size, pages_for(end, self.page_size)):
            page = table[i]
            if self.pool.ref_counts[page] > 1:
                (new,) = self._allocate(1)
                self.pool.decref([page])
                table[i] = new
                copies.append((page, new))
        if copies and self._locks[seq_id] is not None:  # a copied page may no longer be the cache's
            self._lock_held(seq_id, self._locks[seq_id])
        return copies

    def free(self, seq_id: str) -> None:
        """Release the sequence's pages now (finish, abort, preemption)."""
        table = self.tables.pop(seq_id)
        node = self._locks.pop(seq_id)
        del self._namespaces[seq_id]
        if node is not None:
            self.radix.unlock(node)
        self.pool.decref(table)

    def check(self) -> None:
        """Every refcount equals its number of holders; no page leaked (for tests)."""
        holders = [0] * self.pool.num_pages
        for table in self.tables.values():
            for p in table:
                holders[p] += 1
        for pages in self.reserved.values():
            for p in pages:
                holders[p] += 1
        if self.radix is not None:
            for p in self.radix.cached_pages():
                holders[p] += 1
            self.radix.check()
        if self.tiers is not None:
            self.tiers.check()
        assert holders == self.pool.ref_counts.tolist(), "refcount != holders"
        free = set(self.pool._free)
        assert len(free) == len(self.pool._free), "page on the free list twice"
        assert free == {p for p, h in enumerate(holders) if h == 0}, "leaked or double-freed page"


__all__ = ["KVManager", "NoFreePages", "pages_for"]
