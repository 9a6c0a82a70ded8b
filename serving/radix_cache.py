"""Page-granular radix tree over token ids (SGLang's RadixAttention), plus the page pool.

A page's reference count is its number of holders: each sequence whose block table
lists it, plus one if the tree holds it. A page is free when nobody holds it. Tree
nodes are locked by the sequences using them (lock_ref walks to the root); only
unlocked leaves are evicted, least recently used first, when pages run out.

Each node also keeps the prefix-chained key of its last page (serving/kv_tiers.py), so
the pages below the device tree can be looked up in the host and disk tiers, and its
hit count and whether its pages were copied down (`backed`) for the write policy.
"""

from __future__ import annotations

import collections
import heapq
import itertools

import numpy as np

from serving.kv_tiers import chain, root_hash

EVENTS_KEPT = 65536  # stored / removed events a cache keeps for readers that poll them


class NoFreePages(RuntimeError):
    pass


class PagePool:
    """Free list and reference counts of `num_pages` KV pages."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = np.zeros(num_pages, np.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreePages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.ref_counts[pages] = 1
        return pages

    def incref(self, pages) -> None:
        for p in pages:
            assert self.ref_counts[p] > 0, f"incref of free page {p}"
            self.ref_counts[p] += 1

    def decref(self, pages) -> None:
        for p in pages:
            assert self.ref_counts[p] > 0, f"page {p} freed twice"
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                self._free.append(p)


class Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "hash", "hits", "backed")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: "Node | None", page_size: int = 1,
                 start: bytes = b""):
        self.key, self.pages, self.parent = key, pages, parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        # the chained key of the node's last page (its parent's for an empty key: a root's
        # is the namespace's root_hash)
        self.hash = chain(parent.hash, key, page_size)[-1] if key else start
        self.hits = 0  # admissions that matched through this node
        self.backed = False  # its pages were copied to the host tier

    def page_keys(self, page_size: int) -> list[bytes]:
        """The chained keys of the node's pages."""
        return chain(self.parent.hash, self.key, page_size)


class RadixCache:
    """Prefix cache over full pages. Keys are token tuples, page-aligned."""

    def __init__(self, pool: PagePool, page_size: int, fingerprint: bytes = b""):
        self.pool, self.page_size, self.fingerprint = pool, page_size, fingerprint
        self.on_evict = None  # called with each evicted leaf before its pages are released
        self.roots: dict[int, Node] = {}  # one tree per namespace (a LoRA adapter's KV differs)
        self.holds = np.zeros(pool.num_pages, bool)  # pages a node holds (one reference each)
        self.root = self._root(0)
        self.evictable_pages = 0  # pages in unlocked nodes
        self.protected_pages = 0  # pages in locked nodes
        self._clock = itertools.count(1)
        # Block stored / removed events of the base namespace (a router's prefix index,
        # Mooncake's Conductor): (number, "stored" | "removed", chained page keys), the
        # last EVENTS_KEPT of them, once `record_events` turns them on.
        self.events: collections.deque | None = None
        self.num_events = 0

    def record_events(self) -> None:
        if self.events is None:
            self.events = collections.deque(maxlen=EVENTS_KEPT)

    def _event(self, kind: str, node: Node) -> None:
        if self.events is not None and self.namespace_of(node) == 0:
            self.num_events += 1
            self.events.append((self.num_events, kind, node.page_keys(self.page_size)))

    def _root(self, namespace: int) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Node((), [], None, start=root_hash(self.fingerprint, namespace))
            root.lock_ref = 1  # a root is never evicted
        return root

    def _child_key(self, tokens, start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    def match_prefix(self, tokens, touch: bool = True, namespace: int = 0) -> tuple[list[int], Node]:
        """Pages of the longest cached page-aligned prefix of `tokens` in `namespace`, and
        its last node.

        Splits a node when the match ends inside its key, so the returned node covers
        exactly the matched prefix. Namespaces never share pages (0: the base model; a
        LoRA adapter's id: KV computed under that adapter).
        """
        node, pages, i = self._root(namespace), [], 0
        tokens = tuple(tokens)
        now = next(self._clock)
        while len(tokens) - i >= self.page_size:
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                break
            matched = self._matched_pages(child.key, tokens, i)
            if matched < len(child.pages):
                child = self._split(child, matched)
            if touch:
                child.last_access = now
            pages.extend(child.pages)
            i += len(child.key)
            node = child
        return pages, node

    def _matched_pages(self, key, tokens, start: int) -> int:
        n = 0
        ps = self.page_size
        while n * ps < len(key) and start + (n + 1) * ps <= len(tokens) \
                and key[n * ps:(n + 1) * ps] == tokens[start + n * ps:start + (n + 1) * ps]:
            n += 1
        return n

    def _split(self, child: Node, pages_kept: int) -> Node:
        """Cut `child` after `pages_kept` pages; returns the new upper node."""
        cut = pages_kept * self.page_size
        upper = Node(child.key[:cut], child.pages[:pages_kept], child.parent, self.page_size)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.hits, upper.backed = child.hits, child.backed
        child.parent.children[self._child_key(child.key, 0)] = upper
        child.key, child.pages, child.parent = child.key[cut:], child.pages[pages_kept:], upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def insert(self, tokens, pages: list[int], namespace: int = 0) -> Node:
        """Cache full pages of `tokens` (len(tokens) == len(pages) * page_size) in `namespace`.

        Pages whose tokens are already cached stay with the caller (they are not
        taken); the tree takes a reference on the pages it adds. Returns the node
        ending at the last page.
        """
        tokens = tuple(tokens)
        assert len(tokens) == len(pages) * self.page_size
        _, node = self.match_prefix(tokens, namespace=namespace)
        depth = self._depth(node)
        if depth < len(tokens):
            new_pages = list(pages[depth // self.page_size:])
            leaf = Node(tokens[depth:], new_pages, node, self.page_size)
            leaf.last_access = next(self._clock)
            node.children[self._child_key(leaf.key, 0)] = leaf
            self.pool.incref(new_pages)
            self.holds[new_pages] = True
            self.evictable_pages += len(new_pages)  # a fresh leaf is unlocked
            self._event("stored", leaf)
            node = leaf
        return node

    def path_pages(self, node: Node) -> list[int]:
        """The pages from the root down to `node`, in position order."""
        parts = []
        while node is not None:
            parts.append(node.pages)
            node = node.parent
        return [p for pages in reversed(parts) for p in pages]

    def _depth(self, node: Node) -> int:
        n = 0
        while node is not None:
            n += len(node.key)
            node = node.parent
        return n

    def lock(self, node: Node) -> None:
        while node is not None and node.parent is not None:  # up to, not including, its root
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None and node.parent is not None:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            node = node.parent

    def namespace_of(self, node: Node) -> int:
        while node.parent is not None:
            node = node.parent
        return next(ns for ns, root in self.roots.items() if root is node)

    def reseed(self, fingerprint: bytes) -> None:
        """Key pages under another model's fingerprint (the tree must be empty: new weights)."""
        assert not any(root.children for root in self.roots.values()), "reseeding a tree that holds pages"
        self.fingerprint = fingerprint
        for namespace, root in self.roots.items():
            root.hash = root_hash(fingerprint, namespace)

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves (LRU first); returns freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if self.on_evict is not None:
                self.on_evict(leaf)
            self._event("removed", leaf)
            del parent.children[self._child_key(leaf.key, 0)]
            self.pool.decref(leaf.pages)
            self.holds[leaf.pages] = False
            self.evictable_pages -= len(leaf.pages)
            freed += len(leaf.pages)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def drop_namespace(self, namespace: int) -> int:
        """Free every page cached in `namespace` (none may be locked: no sequence of it
        runs); returns the pages freed."""
        root = self.roots.pop(namespace, None)
        if root is None:
            return 0
        if namespace == 0:
            self.root = self._root(0)
        freed, stack = 0, list(root.children.values())
        while stack:
            node = stack.pop()
            assert node.lock_ref == 0, "dropping a namespace a sequence still holds"
            if namespace == 0 and self.events is not None:
                self.num_events += 1
                self.events.append((self.num_events, "removed", node.page_keys(self.page_size)))
            self.pool.decref(node.pages)
            self.holds[node.pages] = False
            self.evictable_pages -= len(node.pages)
            freed += len(node.pages)
            stack.extend(node.children.values())
        return freed

    def nodes(self, namespace: int):
        """Every node holding pages in `namespace`."""
        stack = list(self.roots[namespace].children.values()) if namespace in self.roots else []
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _nodes(self):
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def cached_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def check(self) -> None:
        """Assert the counters agree with the nodes (for tests)."""
        ev = sum(len(n.pages) for n in self._nodes() if n.lock_ref == 0)
        pr = sum(len(n.pages) for n in self._nodes() if n.lock_ref > 0)
        assert (ev, pr) == (self.evictable_pages, self.protected_pages), \
            (ev, pr, self.evictable_pages, self.protected_pages)
        held = self.holds.copy()
        held[self.cached_pages()] = False
        assert not held.any() and self.holds.sum() == len(self.cached_pages()), "holds != the nodes' pages"
        for n in self._nodes():
            assert len(n.key) == len(n.pages) * self.page_size
            assert n.hash == n.page_keys(self.page_size)[-1], "a node's key is not its prefix's chain"
            if n.lock_ref == 0:
                assert all(c.lock_ref == 0 for c in n.children.values()), "locked child of unlocked node"
