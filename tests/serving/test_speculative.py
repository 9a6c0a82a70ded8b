"""Draft trees and verification against hand-worked cases and the target distribution."""

import itertools

import jax
import jax.numpy as jnp

import numpy as np
import pytest

from serving.draft_tree import DraftTree, grow_tree, verify_greedy, verify_sampling


def hand_tree():
    #        0(root=5)
    #       /        \
    #    1(tok 7)   2(tok 3)
    #     /    \        \
    #  3(tok 1) 4(tok 2) 5(tok 9)
    return DraftTree(np.array([5, 7, 3, 1, 2, 9]), np.array([-1, 0, 0, 1, 1, 2]),
                     np.array([0, -0.1, -0.5, -0.3, -0.9, -1.0]))


def test_ancestor_mask_by_hand():
    want = np.array([[1, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0],
                     [1, 0, 1, 0, 0, 0],
                     [1, 1, 0, 1, 0, 0],
                     [1, 1, 0, 0, 1, 0],
                     [1, 0, 1, 0, 0, 1]], bool)
    np.testing.assert_array_equal(hand_tree().ancestor_mask(), want)
    np.testing.assert_array_equal(hand_tree().depths, [0, 1, 1, 2, 2, 2])


def test_greedy_follows_target_argmax():
    tree = hand_tree()
    # target after root -> 7 (node 1), after node 1 -> 2 (node 4), after node 4 -> 8 (bonus)
    argmax = np.array([7, 2, 0, 0, 8, 0])
    assert verify_greedy(tree, argmax) == ([1, 4], 8)
    assert verify_greedy(tree, np.array([4, 0, 0, 0, 0, 0])) == ([], 4)  # first guess wrong


def test_grow_tree_keeps_parents_and_best_scores():
    vocab = 6
    table = np.log(np.random.default_rng(0).dirichlet(np.ones(vocab), size=64))

    def expand(frontier, tree):
        # a fixed "draft": distribution depends on the node's token and depth
        d = tree.depths
        return np.stack([table[(tree.tokens[n] * 7 + d[n]) % 64] for n in frontier])

    tree = grow_tree(1, expand, depth=3, top_k=2, total_tokens=6)
    assert tree.size == 6 and tree.parents[0] == -1
    assert all(tree.parents[i] < i for i in range(1, 6))
    assert all(tree.scores[i] <= tree.scores[tree.parents[i]] + 1e-12 for i in range(1, 6))
    # the first level holds the draft's two best tokens after the root
    first = sorted(tree.tokens[i] for i in range(1, 6) if tree.parents[i] == 0)
    assert set(np.argsort(-table[(1 * 7) % 64])[:1]) <= set(first)
    with pytest.raises(ValueError):
        grow_tree(1, expand, depth=0, top_k=2, total_tokens=6)


def test_sampling_verification_emits_the_target_distribution():
    """Joint distribution of the first two emitted tokens equals the target's."""
    vocab = 4
    rng = np.random.default_rng(1)
    target = {}

    def p(prefix):  # an arbitrary target: next-token distribution of each prefix
        if prefix not in target:
            target[prefix] = rng.dirichlet(np.ones(vocab) * 0.7)
        return target[prefix]

    tree = DraftTree(np.array([0, 1, 2, 3, 0]), np.array([-1, 0, 0, 1, 1]),
                     np.array([0, -0.2, -0.4, -0.5, -0.9]))
    paths = {0: ()}
    for i in range(1, tree.size):
        paths[i] = paths[tree.parents[i]] + (int(tree.tokens[i]),)
    probs = np.stack([p(paths[i]) for i in range(tree.size)])
    counts = {}
    n = 40000
    for _ in range(n):
        path, bonus = verify_sampling(tree, probs, rng)
        emitted = [int(tree.tokens[i]) for i in path] + [bonus]
        if len(emitted) < 2:  # continue with plain sampling from the target, as the engine would
            emitted.append(int(rng.choice(vocab, p=p(tuple(emitted)))))
        key = tuple(emitted[:2])
        counts[key] = counts.get(key, 0) + 1
    for a, b in itertools.product(range(vocab), repeat=2):
        want = p(())[a] * p((a,))[b]
        got = counts.get((a, b), 0) / n
        assert abs(got - want) < 4 * np.sqrt(want * (1 - want) / n) + 1e-3, (a, b, got, want)


# --- the engine's batched device versions against the host statements above ---------------

from serving.draft_tree import TreeSpec  # noqa: E402
from serving.speculative import compact_kv, grow_trees, tree_masks, verify_trees  # noqa: E402


def test_tree_masks_equal_host_tree():
    tree = hand_tree()
    depth, anc = tree_masks(jnp.asarray(np.stack([tree.parents, tree.parents])))
    np.testing.assert_array_equal(np.asarray(anc[1]), tree.ancestor_mask())
    np.testing.assert_array_equal(np.asarray(depth[0]), tree.depths)


def test_device_tree_growth_equals_grow_tree():
    vocab, spec = 12, TreeSpec(depth=3, top_k=3, num_tokens=7)
    table = np.log(np.random.default_rng(2).dirichlet(np.ones(vocab), size=64)).astype(np.float32)

    def expand(frontier, tree):
        d = tree.depths
        return np.stack([table[(tree.tokens[n] * 7 + d[n]) % 64] for n in frontier])

    roots = np.array([1, 5])
    root_pos = jnp.array([10, 3])

    def draft_step(cache, hidden, tokens, slots, tree):
        level = tree.rope_positions - root_pos[:, None]
        return jnp.asarray(table)[(tokens * 7 + level) % 64], hidden, cache + 1

    grow = jax.jit(lambda *a: grow_trees(draft_step, *a, spec))  # one compile, not op by op
    (tokens, parents, scores), calls = grow(
        0, jnp.asarray(table[(roots * 7) % 64]), jnp.zeros((2, 4)), jnp.asarray(roots), root_pos,
        jnp.zeros(vocab, jnp.int32))
    assert int(calls) == spec.depth - 1
    for b, root in enumerate(roots):
        want = grow_tree(int(root), expand, spec.depth, spec.top_k, spec.num_tokens)
        np.testing.assert_array_equal(np.asarray(tokens[b]), want.tokens)
        np.testing.assert_array_equal(np.asarray(parents[b]), want.parents)
        np.testing.assert_allclose(np.asarray(scores[b]), want.scores, rtol=1e-5)


def test_device_greedy_verification_equals_verify_greedy():
    rng = np.random.default_rng(3)
    tree = hand_tree()
    spec = TreeSpec(depth=2, top_k=3, num_tokens=6)
    argmax = rng.choice([0, 1, 2, 3, 7, 9], size=(40, 6))  # 40 targets, one batch
    b = lambda a: jnp.broadcast_to(jnp.asarray(a), (40,) + np.shape(a))
    verify = jax.jit(verify_trees, static_argnames="spec")
    path, count, bonus = verify(jnp.asarray(np.eye(10, dtype=np.float32)[argmax]), b(tree.tokens),
                                b(tree.parents), b(tree.scores.astype(np.float32)),
                                jax.random.split(jax.random.key(0), 40), spec=spec)
    for row in range(40):
        want_path, want_bonus = verify_greedy(tree, argmax[row])
        assert list(np.asarray(path[row, :int(count[row])])) == want_path
        assert int(bonus[row]) == want_bonus
    assert int(np.max(count)) == 2  # some row accepted a whole root-to-leaf path


def test_device_sampling_verification_emits_the_target_distribution():
    """First two emitted tokens of the device verifier follow the target's joint distribution."""
    vocab, n = 4, 40000
    rng = np.random.default_rng(4)
    p = {(): rng.dirichlet(np.ones(vocab) * 0.7)}
    for a in range(vocab):
        p[(a,)] = rng.dirichlet(np.ones(vocab) * 0.7)
    tree = DraftTree(np.array([0, 1, 2, 3, 0]), np.array([-1, 0, 0, 1, 1]),
                     np.array([0, -0.2, -0.4, -0.5, -0.9]))
    probs = np.stack([p[()], p[(1,)], p[(2,)], p[(1,)], p[(1,)]]).astype(np.float32)
    # nodes 3 and 4 are leaves at depth 2: emitted third tokens are not checked
    spec = TreeSpec(depth=2, top_k=2, num_tokens=5)
    b = lambda a: jnp.broadcast_to(jnp.asarray(a), (n,) + np.shape(a))
    path, count, bonus = jax.jit(verify_trees, static_argnames="spec")(
        b(probs), b(tree.tokens), b(tree.parents), b(tree.scores.astype(np.float32)),
        jax.random.split(jax.random.key(1), n), spec=spec)
    path, count, bonus = map(np.asarray, (path, count, bonus))
    first = np.where(count > 0, tree.tokens[path[:, 0]], bonus)
    second = np.where(count > 1, tree.tokens[path[:, 1]], np.where(count == 1, bonus, -1))
    has_second = second >= 0
    for a in range(vocab):
        want = p[()][a]
        got = np.mean(first == a)
        assert abs(got - want) < 4 * np.sqrt(want * (1 - want) / n) + 1e-3, (a, got, want)
        rows = (first == a) & has_second
        if rows.sum() > 500:
            for c in range(vocab):
                want2, got2 = p[(a,)][c], np.mean(second[rows] == c)
                assert abs(got2 - want2) < 4 * np.sqrt(want2 * (1 - want2) / rows.sum()) + 1e-3


def test_compact_kv_moves_accepted_nodes_into_place():
    page_size, pages = 4, np.arange(6 * 4, dtype=np.float32).reshape(6, 4, 1)
    tables = jnp.asarray([[2, 0, 5], [1, 3, 4], [0, 0, 0]], jnp.int32)
    start = jnp.asarray([2, 5, -1])  # row 2 is padding: whatever it "accepts" moves nothing
    path = jnp.asarray([[2, 4, 0], [3, 0, 0], [1, 2, 3]])  # row 0 accepts nodes 2, 4; row 1 node 3
    out = np.asarray(compact_kv([jnp.asarray(pages)], tables, page_size, start, path,
                                jnp.asarray([2, 1, 3]))[0]).reshape(-1)
    flat = pages.reshape(-1)
    slot = lambda row, pos: int(tables[row, pos // page_size]) * page_size + pos % page_size
    want = flat.copy()
    want[slot(0, 3)], want[slot(0, 4)] = flat[slot(0, 4)], flat[slot(0, 6)]
    want[slot(1, 6)] = flat[slot(1, 8)]
    np.testing.assert_array_equal(out, want)
