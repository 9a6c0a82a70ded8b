"""Draft trees and verification against hand-worked cases and the target distribution."""

import itertools

import numpy as np
import pytest

from serving.speculative import DraftTree, grow_tree, verify_greedy, verify_sampling


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
