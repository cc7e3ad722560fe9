"""medusa and sequoia planners against brute force over every legal tree of small cases."""
import itertools

import numpy as np
import pytest

from planner.candidate import (
    _sequoia_dp,
    best_paths,
    num_paths,
    path_prob,
    sequoia_table,
    sequoia_tree,
    tree_tau,
)
from planner.errors import UserError


def random_rows(rng, depth, ranks, monotone=False):
    rows = np.stack([rng.dirichlet(np.ones(ranks + 1))[:ranks] for _ in range(depth)])
    return -np.sort(-rows, axis=1) if monotone else rows


def all_trees(ranks, depth, max_size, contiguous):
    """Every legal tree (set of rank paths) with up to max_size nodes, grown node by node."""
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
    by_size = {0: {frozenset()}}
    for m in range(1, max_size + 1):
        grown = set()
        for t in by_size[m - 1]:
            for p in paths:
                if p in t or (len(p) > 1 and p[:-1] not in t):
                    continue
                if contiguous and p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in t:
                    continue
                grown.add(t | {p})
        by_size[m] = grown
    return by_size


def brute_best(rows, trees_of_size):
    return max(tree_tau(rows, t) for t in trees_of_size)


@pytest.mark.parametrize("seed", range(4))
def test_medusa_and_sequoia_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    ranks, depth, max_size = 3, 3, 6
    rows = random_rows(rng, depth, ranks)
    free = all_trees(ranks, depth, max_size, contiguous=False)
    contiguous = all_trees(ranks, depth, max_size, contiguous=True)
    table = sequoia_table(rows, max_size, depth)
    for D in range(1, depth + 1):
        free_D = {m: [t for t in ts if all(len(p) <= D for p in t)] for m, ts in free.items()}
        cont_D = {m: [t for t in ts if all(len(p) <= D for p in t)] for m, ts in contiguous.items()}
        for n in range(1, max_size + 1):
            if n > num_paths(ranks, D):
                assert table[D, n] == -np.inf and not free_D[n]
                continue
            paths, probs = best_paths(rows, n, D)
            assert 1 + probs.sum() == pytest.approx(brute_best(rows, free_D[n]), abs=1e-12)
            assert table[D, n] == pytest.approx(brute_best(rows, cont_D[n]), abs=1e-12)
            nodes = sequoia_tree(rows, n, D)
            assert len(nodes) == n and max(len(p) for p in nodes) <= D
            assert tree_tau(rows, nodes) == pytest.approx(table[D, n], abs=1e-12)


def test_sequoia_equals_medusa_on_monotone_rows():
    rng = np.random.default_rng(7)
    for depth, ranks in [(4, 6), (6, 3)]:
        rows = random_rows(rng, depth, ranks, monotone=True)
        table = sequoia_table(rows, 40, depth)
        for D in range(1, depth + 1):
            _, probs = best_paths(rows, min(40, num_paths(ranks, D)), D)
            tau = 1 + np.concatenate([[0], np.cumsum(probs)])
            k = len(tau)
            np.testing.assert_allclose(table[D, :k], tau, atol=1e-12)


def test_sequoia_loses_to_medusa_when_a_row_is_not_monotone():
    rows = np.array([[0.1, 0.6], [0.1, 0.6]])  # the rank-1 guess is the good one
    _, probs = best_paths(rows, 1, 2)
    assert 1 + probs.sum() == pytest.approx(1.6)  # medusa may use rank 1 alone
    assert sequoia_table(rows, 1, 2)[2, 1] == pytest.approx(1.1)  # sequoia must take rank 0 first
    assert sequoia_table(rows, 2, 2)[2, 2] == pytest.approx(1.7)


def test_best_paths_order_and_parents():
    rng = np.random.default_rng(1)
    rows = random_rows(rng, 5, 8)
    paths, probs = best_paths(rows, 200, 5)
    assert np.all(np.diff(probs) <= 1e-15)
    seen = {()}
    for p, pr in zip(paths, probs):
        assert p[:-1] in seen and p not in seen
        assert path_prob(rows, p) == pytest.approx(pr, rel=1e-12)
        seen.add(p)
    # nothing left out beats the last one kept
    all_p = sorted((path_prob(rows, p) for d in range(1, 4) for p in itertools.product(range(8), repeat=d)), reverse=True)
    kept3 = sorted((pr for p, pr in zip(paths, probs) if len(p) <= 3), reverse=True)
    assert kept3 == pytest.approx(all_p[: len(kept3)])


def test_zero_rows_and_too_many_candidates():
    rows = np.array([[0.5, 0.0], [0.0, 0.0]])
    paths, probs = best_paths(rows, 6, 2)
    assert len(paths) == 6 and probs[0] == 0.5 and probs[1:].max() == 0
    with pytest.raises(UserError, match="only 6 paths"):
        best_paths(rows, 7, 2)
    with pytest.raises(UserError, match="only 6 paths"):
        sequoia_tree(rows, 7, 2)
    assert sequoia_table(rows, 7, 2)[2, 7] == -np.inf
    nodes = sequoia_tree(rows, 6, 2)
    assert tree_tau(rows, nodes) == pytest.approx(1.5)


def test_positional_shortcut_matches_per_limit_dp():
    rng = np.random.default_rng(3)
    rows = np.tile(random_rows(rng, 1, 5), (6, 1))
    fast = sequoia_table(rows, 30, 6)
    for limit in range(1, 7):
        F, _, _ = _sequoia_dp(rows[:limit], 30, limit, keep_choices=False)
        np.testing.assert_allclose(fast[limit], F[0, 1:])


def test_sequoia_tree_is_contiguous_and_parents_first():
    rng = np.random.default_rng(5)
    rows = random_rows(rng, 10, 32)
    nodes = sequoia_tree(rows, 128, 10)
    present = {()}
    for p in nodes:
        assert p[:-1] in present
        assert p[-1] == 0 or p[:-1] + (p[-1] - 1,) in present
        present.add(p)
    assert tree_tau(rows, nodes) == pytest.approx(sequoia_table(rows, 128, 10)[10, 128], abs=1e-12)
