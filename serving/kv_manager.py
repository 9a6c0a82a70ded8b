"""Per-sequence block tables over the page pool, with the prefix cache and copy-on-write.

Host-side bookkeeping only (numpy and Python lists, on purpose); the engine moves
the bytes on device when this says so (page copies for copy-on-write, swaps).
"""

from __future__ import annotations

from serving.radix_cache import NoFreePages, PagePool, RadixCache


class KVManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.radix = RadixCache(self.pool, page_size) if enable_prefix_caching else None
        self.tables: dict[str, list[int]] = {}
        self._locks: dict[str, object] = {}  # seq_id -> radix node it keeps locked

    # -- capacity ------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Pages that can be handed out now: free plus evictable cached ones."""
        return self.pool.num_free + (self.radix.evictable_pages if self.radix else 0)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _allocate(self, n: int) -> list[int]:
        if n > self.pool.num_free and self.radix is not None:
            self.radix.evict(n - self.pool.num_free)
        return self.pool.allocate(n)

    # -- prefix cache ----------------------------------------------------------

    def cached_prefix_len(self, tokens) -> int:
        """Tokens of `tokens` the cache could serve (page-aligned, leaving one to compute)."""
        if self.radix is None or len(tokens) < 2:
            return 0
        pages, _ = self.radix.match_prefix(tokens[:len(tokens) - 1], touch=False)
        return len(pages) * self.page_size

    def admit(self, seq_id: str, tokens, use_cache: bool = True) -> int:
        """Start a block table for seq_id, reusing cached prefix pages; returns cached tokens."""
        assert seq_id not in self.tables
        pages, node = [], None
        if use_cache and self.radix is not None and len(tokens) >= 2:
            pages, node = self.radix.match_prefix(tokens[:len(tokens) - 1])
            self.radix.lock(node)
            self.pool.incref(pages)
        self.tables[seq_id] = list(pages)
        self._locks[seq_id] = node
        return len(pages) * self.page_size

    def cache_computed(self, seq_id: str, tokens, num_computed: int) -> None:
        """Offer the sequence's full computed pages to the prefix cache."""
        if self.radix is None:
            return
        full = num_computed // self.page_size
        if full == 0:
            return
        node = self.radix.insert(tokens[:full * self.page_size], self.tables[seq_id][:full])
        self.radix.lock(node)
        old = self._locks[seq_id]
        if old is not None:
            self.radix.unlock(old)
        self._locks[seq_id] = node

    # -- growth, sharing, release ----------------------------------------------

    def ensure(self, seq_id: str, num_tokens: int) -> None:
        """Grow seq_id's table to hold `num_tokens` positions (raises NoFreePages)."""
        table = self.tables[seq_id]
        need = self.pages_for(num_tokens) - len(table)
        if need > 0:
            table.extend(self._allocate(need))

    def fork(self, parent: str, child: str, num_tokens: int) -> None:
        """child shares parent's pages holding its first `num_tokens` positions (parallel
        sampling); writes copy on demand. Pages past them (speculative lookahead) stay the
        parent's: the child allocates its own, which the scheduler counts."""
        pages = self.tables[parent][:self.pages_for(num_tokens)]
        self.pool.incref(pages)
        self.tables[child] = list(pages)
        node = self._locks[parent]
        if node is not None:
            self.radix.lock(node)
        self._locks[child] = node

    def copy_on_write(self, seq_id: str, position: int) -> tuple[int, int] | None:
        """Before writing `position`: if its page is shared, give seq_id a private copy.

        Returns (src_page, dst_page) for the engine to copy on device, or None.
        """
        table = self.tables[seq_id]
        i = position // self.page_size
        page = table[i]
        if self.pool.ref_counts[page] == 1:
            return None
        (new,) = self._allocate(1)
        self.pool.decref([page])
        table[i] = new
        return page, new

    def free(self, seq_id: str) -> None:
        """Release the sequence's pages now (finish, abort, preemption)."""
        table = self.tables.pop(seq_id)
        node = self._locks.pop(seq_id)
        if node is not None:
            self.radix.unlock(node)
        self.pool.decref(table)

    def check(self) -> None:
        """Every refcount equals its number of holders; no page leaked (for tests)."""
        holders = [0] * self.pool.num_pages
        for table in self.tables.values():
            for p in table:
                holders[p] += 1
        if self.radix is not None:
            for p in self.radix.cached_pages():
                holders[p] += 1
            self.radix.check()
        assert holders == self.pool.ref_counts.tolist(), "refcount != holders"
        free = set(self.pool._free)
        assert len(free) == len(self.pool._free), "page on the free list twice"
        assert free == {p for p, h in enumerate(holders) if h == 0}, "leaked or double-freed page"


__all__ = ["KVManager", "NoFreePages"]
