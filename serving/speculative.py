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

The host functions (serving/draft_tree.py: `grow_tree`, `verify_greedy`,
`verify_sampling`) state the algorithms plainly; the runner runs their batched,
jittable twins here (`grow_trees`, `verify_trees`, `compact_kv`), which the tests check
against them.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from model.context import TokenTree
from model.kv_cache import slot_mapping, write_pages
from serving.draft_tree import TreeSpec


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

    def level(depth, carry):  # one loop body however deep the tree: it compiles once
        tokens, parents, all_scores, anc, hidden, frontier, cache = carry
        tree = TokenTree(jnp.broadcast_to(root_positions[:, None] + depth, (b, k)).astype(jnp.int32),
                         (root_positions + 1).astype(jnp.int32), anc[rows, frontier][:, :, 1:])
        slots = jnp.where(root_positions[:, None] >= 0, root_positions[:, None] + frontier, -1)
        logits, hidden, cache = draft_step(cache, hidden, tokens[rows, frontier], slots.astype(jnp.int32), tree)
        child_scores, child_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)  # [B, K, K]
        cand = (all_scores[rows, frontier][:, :, None] + child_scores).reshape(b, k * k)
        best, pick = jax.lax.top_k(cand, k)
        parent = frontier[rows, pick // k]
        new = 1 + depth * k + jnp.arange(k)
        tokens = tokens.at[:, new].set(to_target(child_ids.reshape(b, k * k)[rows, pick]))
        parents = parents.at[:, new].set(parent)
        all_scores = all_scores.at[:, new].set(best)
        anc = anc.at[rows, new[None]].set(anc[rows, parent] | (jnp.arange(m) == new[:, None])[None])
        return tokens, parents, all_scores, anc, hidden[rows, pick // k], jnp.broadcast_to(new, (b, k)), cache
    tokens, parents, all_scores, anc, hidden, frontier, cache = jax.lax.fori_loop(
        1, spec.depth, level, (tokens, parents, all_scores, anc, hidden, frontier, cache))
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

            def child(j, carry):  # try the children best first; a rejected one leaves p
                accepted, p = carry
                tok = tokens[children[j]]
                total = p.sum()
                u = jax.random.uniform(jax.random.fold_in(key, 1 + d * spec.top_k + j))
                trying = jnp.isfinite(child_scores[j]) & (accepted < 0)
                take = trying & (total > 0) & (u * total < p[tok])
                return jnp.where(take, children[j], accepted), p.at[tok].set(jnp.where(trying & ~take, 0.0, p[tok]))
            accepted, p = jax.lax.fori_loop(0, children.shape[0], child, (jnp.int32(-1), probs[node]))
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
