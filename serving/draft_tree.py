"""Draft trees on the host: the tree, its shape, and the EAGLE-2/3 algorithms stated plainly.

A draft tree's node 0 is the root: the last token the target accepted. Every other
node is a drafted token whose parent precedes it (parents before children), so a
tree is three arrays. `grow_tree`, `verify_greedy` and `verify_sampling` are the
reference algorithms; serving/speculative.py holds their batched, jittable twins that
the runner uses, and the tests check one against the other. Host-only (numpy): the
engine and the simulator import this module, never jax.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class DraftTree:
    tokens: np.ndarray  # int [N]; tokens[0] is the root (already accepted)
    parents: np.ndarray  # int [N]; parents[0] = -1, parents[i] < i
    scores: np.ndarray  # float [N]; cumulative draft log-prob (root 0)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> np.ndarray:
        d = np.zeros(self.size, np.int32)
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return d

    def children(self, node: int) -> list[int]:
        """Children of `node`, best draft score first."""
        kids = [i for i in range(node + 1, self.size) if self.parents[i] == node]
        return sorted(kids, key=lambda i: -self.scores[i])

    def ancestor_mask(self) -> np.ndarray:
        """bool [N, N]: mask[i, j] iff node j is node i or one of its ancestors (as
        pallas_kernels.tree_mask.ancestor_mask builds it; this module stays free of jax, which
        that one imports, so the host-side engine can load without it)."""
        mask = np.eye(self.size, dtype=bool)
        for i in range(1, self.size):
            mask[i] |= mask[self.parents[i]]
        return mask


def grow_tree(root_token: int, expand: Callable[[list[int], DraftTree], np.ndarray], depth: int,
              top_k: int, total_tokens: int) -> DraftTree:
    """EAGLE-2/3's dynamic tree.

    expand(frontier, tree) returns draft log-probs [len(frontier), V] for the children
    of the frontier nodes. Each level expands the top-k frontier (by cumulative
    log-prob) into top-k children each; finally the best `total_tokens - 1` drafted
    nodes are kept (a child never outscores its parent, so parents stay).
    """
    if depth < 1 or top_k < 1 or total_tokens < 2:
        raise ValueError(f"need depth >= 1, top_k >= 1, total_tokens >= 2; got {depth}, {top_k}, "
                         f"{total_tokens}")
    tokens, parents, scores = [root_token], [-1], [0.0]
    frontier = [0]
    for _ in range(depth):
        tree = DraftTree(np.array(tokens), np.array(parents), np.array(scores))
        logp = np.asarray(expand(frontier, tree), np.float64)
        cand = []
        for row, node in enumerate(frontier):
            best = np.argsort(-logp[row], kind="stable")[:top_k]
            cand += [(scores[node] + logp[row, t], node, int(t)) for t in best]
        cand.sort(key=lambda c: -c[0])
        frontier = []
        for score, parent, tok in cand[:top_k]:
            tokens.append(tok)
            parents.append(parent)
            scores.append(score)
            frontier.append(len(tokens) - 1)
    # Keep the root and the best total_tokens - 1 drafted nodes, renumbered in order.
    order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[:total_tokens - 1]
    keep = [0] + sorted(order)
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree(np.array([tokens[i] for i in keep]),
                     np.array([-1] + [new_index[parents[i]] for i in keep[1:]]),
                     np.array([scores[i] for i in keep]))


def verify_greedy(tree: DraftTree, target_argmax: np.ndarray) -> tuple[list[int], int]:
    """Accepted node path (excluding the root) and the bonus token.

    target_argmax: int [N], the target's argmax after each node.
    """
    path, node = [], 0
    while True:
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == target_argmax[node]), None)
        if nxt is None:
            return path, int(target_argmax[node])
        path.append(nxt)
        node = nxt


def verify_sampling(tree: DraftTree, target_probs: np.ndarray,
                    rng: np.random.Generator) -> tuple[list[int], int]:
    """Accepted node path and bonus token, sampling exactly from the target.

    target_probs: float [N, V], the target's processed next-token distribution after
    each node (temperature / top-k / top-p already applied).
    """
    path, node = [], 0
    while True:
        p = np.array(target_probs[node], np.float64)
        accepted = None
        for child in tree.children(node):
            total = p.sum()
            tok = tree.tokens[child]
            if total > 0 and rng.random() * total < p[tok]:
                accepted = child
                break
            p[tok] = 0.0
        if accepted is None:
            p /= p.sum()
            return path, int(rng.choice(len(p), p=p))
        path.append(accepted)
        node = accepted


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """Shape of the dynamic draft tree (the EAGLE-3 paper: depth 7, top-k 10, 60 tokens)."""

    depth: int = 7
    top_k: int = 10
    num_tokens: int = 60  # nodes scored by the target per step, the root included

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.num_tokens < 2:
            raise ValueError(f"need depth >= 1, top_k >= 1, num_tokens >= 2; got {self.depth}, "
                             f"{self.top_k}, {self.num_tokens}")
        if self.num_tokens > self.num_grown:
            raise ValueError(f"a tree of depth {self.depth} and top-k {self.top_k} grows "
                             f"{self.num_grown - 1} draft tokens, fewer than the "
                             f"{self.num_tokens - 1} asked for")

    @property
    def num_grown(self) -> int:
        """Nodes before pruning: the root and top_k per level."""
        return 1 + self.depth * self.top_k

    @property
    def lookahead(self) -> int:
        """KV slots a sequence may touch past the position it computes next: the target's
        tree (num_tokens), then the draft's tree rows after up to `depth` accepted tokens."""
        return max(self.num_tokens, self.depth + (self.depth - 1) * self.top_k + 1) - 1
