"""Speculative decoding core: dynamic draft trees and lossless verification.

A draft tree's node 0 is the root: the last token the target accepted. Every other
node is a drafted token whose parent precedes it (parents before children), so a
tree is three arrays. The target scores every node in one forward (tree attention:
a node sees the sequence's KV and its own ancestors, `ancestor_mask`); verification
walks down from the root (EAGLE-3, Li et al. 2025):

- greedy: follow the child equal to the target's argmax; the target's argmax at the
  last accepted node is the bonus token. Output equals plain greedy decoding.
- sampling: at each node try its children in draft order, accepting token x with
  probability p(x) under the target's (processed) distribution; on rejection set
  p(x) = 0 and renormalise; when every child fails, sample the bonus from what is
  left. Drafts are deterministic (top-k of the draft), so this emits exactly p's
  distribution: lossless.

The host functions (`grow_tree`, `verify_greedy`, `verify_sampling`) state the
algorithms plainly; the engine runs their batched, jittable twins (`grow_trees`,
`verify_trees`, `compact_kv`), which the tests check against them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from model.context import TokenTree
from model.kv_cache import slot_mapping, write_pages


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
        """bool [N, N]: mask[i, j] iff node j is node i or one of its ancestors."""
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


# --- the engine's batched, jittable versions -----------------------------------------------

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


def tree_masks(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(depth int32 [B, N], ancestor-or-self mask bool [B, N, N]) of parent arrays [B, N]."""
    b, n = parents.shape
    rows = jnp.arange(b)

    def body(i, carry):
        depth, anc = carry
        parent = jnp.maximum(parents[:, i], 0)
        depth = depth.at[:, i].set(depth[rows, parent] + 1)
        anc = anc.at[:, i].set(anc[rows, parent] | (jnp.arange(n) == i))
        return depth, anc
    init = (jnp.zeros((b, n), jnp.int32), jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n)))
    return jax.lax.fori_loop(1, n, body, init)


def grow_trees(draft_step: Callable, cache, root_logits: jax.Array, root_hidden: jax.Array,
               root_tokens: jax.Array, root_positions: jax.Array, d2t: jax.Array, spec: TreeSpec):
    """`grow_tree` for a batch, on device: the draft expands the top-k frontier level by level.

    draft_step(cache, hidden [B, K, H], tokens [B, K], slots [B, K], tree) ->
    (logits [B, K, Vd], hidden [B, K, H], cache) runs the draft on frontier nodes.
    root_logits [B, Vd] / root_hidden [B, H]: the draft's output at the root row (the
    last accepted position, root_positions [B], -1 for a padding row). Grown node i (>= 1)
    keeps its draft K/V in slot root_position + i. d2t maps draft ids to target ids.
    Returns ((tokens, parents, scores) [B, num_tokens], cache); node 0 is the root.
    """
    k, m = spec.top_k, spec.num_grown
    b = root_logits.shape[0]
    rows = jnp.arange(b)[:, None]
    to_target = lambda ids: ids + d2t[ids]
    scores, ids = jax.lax.top_k(jax.nn.log_softmax(root_logits, axis=-1), k)  # level 1
    tokens = jnp.zeros((b, m), jnp.int32).at[:, 0].set(root_tokens).at[:, 1:k + 1].set(to_target(ids))
    parents = jnp.full((b, m), -1, jnp.int32).at[:, 1:k + 1].set(0)
    all_scores = jnp.zeros((b, m), jnp.float32).at[:, 1:k + 1].set(scores)
    frontier = jnp.broadcast_to(jnp.arange(1, k + 1), (b, k))
    anc = jnp.broadcast_to(jnp.eye(m, dtype=bool), (b, m, m)).at[:, 1:k + 1, 0].set(True)
    hidden = jnp.broadcast_to(root_hidden[:, None], (b, k, root_hidden.shape[-1]))
    for level in range(1, spec.depth):
        tree = TokenTree(jnp.broadcast_to(root_positions[:, None] + level, (b, k)).astype(jnp.int32),
                         (root_positions + 1).astype(jnp.int32), anc[rows, frontier][:, :, 1:])
        slots = jnp.where(root_positions[:, None] >= 0, root_positions[:, None] + frontier, -1)
        logits, hidden, cache = draft_step(cache, hidden, tokens[rows, frontier],
                                           slots.astype(jnp.int32), tree)
        child_scores, child_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)  # [B, K, K]
        cand = (all_scores[rows, frontier][:, :, None] + child_scores).reshape(b, k * k)
        best, pick = jax.lax.top_k(cand, k)
        parent = frontier[rows, pick // k]
        new = 1 + level * k + jnp.arange(k)
        tokens = tokens.at[:, new].set(to_target(child_ids.reshape(b, k * k)[rows, pick]))
        parents = parents.at[:, new].set(parent)
        all_scores = all_scores.at[:, new].set(best)
        anc = anc.at[rows, new[None]].set(anc[rows, parent] | (jnp.arange(m) == new[:, None])[None])
        hidden = hidden[rows, pick // k]
        frontier = jnp.broadcast_to(new, (b, k))
    # Keep the root and the best num_tokens - 1 nodes, renumbered in their grown order
    # (a child never outscores its parent, and top_k prefers the lower index on ties).
    _, best = jax.lax.top_k(all_scores[:, 1:], spec.num_tokens - 1)
    keep = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.sort(best + 1, axis=-1)], axis=1)
    renumber = jnp.full((b, m), -1, jnp.int32).at[rows, keep].set(jnp.arange(spec.num_tokens))
    kept_parents = parents[rows, keep]
    new_parents = jnp.where(kept_parents < 0, -1, renumber[rows, jnp.maximum(kept_parents, 0)])
    return (tokens[rows, keep], new_parents, all_scores[rows, keep]), cache


def verify_trees(probs: jax.Array, tokens: jax.Array, parents: jax.Array, scores: jax.Array,
                 keys: jax.Array, spec: TreeSpec) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`verify_sampling` for a batch, on device (with one-hot probs it is `verify_greedy`).

    probs: [B, N, V] the target's processed distribution after each node; tokens,
    parents, scores: [B, N] trees; keys: [B] PRNG keys.
    Returns (path int32 [B, depth]: accepted nodes by depth, 0 past the end;
    num_accepted int32 [B]; bonus int32 [B]).
    """
    def one(probs, tokens, parents, scores, key):
        def level(d, carry):
            node, done, path, count, residual = carry
            child_scores, children = jax.lax.top_k(jnp.where(parents == node, scores, -jnp.inf),
                                                   min(spec.top_k, tokens.shape[0]))
            p = probs[node]
            accepted = jnp.int32(-1)
            for j in range(children.shape[0]):
                tok = tokens[children[j]]
                total = p.sum()
                u = jax.random.uniform(jax.random.fold_in(key, 1 + d * spec.top_k + j))
                trying = jnp.isfinite(child_scores[j]) & (accepted < 0)
                take = trying & (total > 0) & (u * total < p[tok])
                accepted = jnp.where(take, children[j], accepted)
                p = p.at[tok].set(jnp.where(trying & ~take, 0.0, p[tok]))
            moves = ~done & (accepted >= 0)
            residual = jnp.where(done, residual, p)  # at the first failure: what is left
            return (jnp.where(moves, accepted, node), done | ~moves,
                    path.at[d].set(jnp.where(moves, accepted, 0)), count + moves, residual)
        init = (jnp.int32(0), jnp.bool_(False), jnp.zeros(spec.depth, jnp.int32), jnp.int32(0),
                jnp.zeros_like(probs[0]))
        node, done, path, count, residual = jax.lax.fori_loop(0, spec.depth, level, init)
        last = jnp.where(done, residual, probs[node])  # every level accepted: the leaf's p
        bonus = jax.random.categorical(jax.random.fold_in(key, 0), jnp.log(last))
        return path, count, bonus.astype(jnp.int32)
    return jax.vmap(one)(probs, tokens, parents, scores, keys)


def compact_kv(layers: list, block_tables: jax.Array, page_size: int, start: jax.Array,
               path: jax.Array, num_accepted: jax.Array) -> list:
    """Move the accepted nodes' K/V into place: node path[i] (slot start + path[i]) goes to
    position start + 1 + i. Rejected branches are left past the sequence's end, unseen.
    Rows with start < 0 are padding and write nothing.

    layers: page pools whose leaves are [num_pages, page_size, ...] (every row format).
    """
    depth = path.shape[1]
    # A padding row (start -1) may "accept" nodes too: it must not move anything.
    valid = (start[:, None] >= 0) & (jnp.arange(depth)[None] < num_accepted[:, None])
    src_pos = jnp.where(valid, start[:, None] + path, -1)
    dst_pos = jnp.where(valid, start[:, None] + 1 + jnp.arange(depth)[None], -1)

    def move(pages):
        num_pages = pages.shape[0]
        src = slot_mapping(src_pos, block_tables, page_size, num_pages)
        dst = slot_mapping(dst_pos, block_tables, page_size, num_pages)
        flat = pages.reshape(num_pages * page_size, *pages.shape[2:])
        rows = flat[jnp.minimum(src, num_pages * page_size - 1)]  # read every source first
        return write_pages(pages, rows, dst)
    return jax.tree.map(move, layers)
