"""PPD dynamic sparse trees: Markov chain, legality, and brute force over every policy of tiny cases."""
import itertools

import numpy as np
import pytest

from planner.accept import Acceptance, load_acceptance
from planner.candidate import tree_tau
from planner.errors import UserError
from planner.plan import SHARED_DIR
from planner.ppd import (
    _allocation,
    _knapsack,
    _state_options,
    evaluate,
    paper_trees,
    ppd_tree,
    stationary_distribution,
    transition_matrix,
)
from planner.profile import LatencyProfile
from planner.tree import TreeState, validate_tree

PUBLISHED = SHARED_DIR / "data" / "published_acceptance.json"


def random_accept(rng, depth, ranks):
    return Acceptance(np.stack([rng.dirichlet(np.ones(ranks + 1))[:ranks] for _ in range(depth)]))


def synthetic_profile(knee=16, slope=0.05, top=256):
    n = np.array([1, knee, top])
    return LatencyProfile(n, np.array([1.0, 1.0, 1.0 + slope * (top - knee)]), {"file": "synthetic"})


def test_stationary_distribution_random_chains():
    rng = np.random.default_rng(0)
    for S in (1, 2, 4, 7):
        M = rng.dirichlet(np.ones(S), size=S)
        pi = stationary_distribution(M)
        assert pi.sum() == pytest.approx(1) and pi.min() >= 0
        np.testing.assert_allclose(pi @ M, pi, atol=1e-12)
        # independent check: the left eigenvector of eigenvalue 1
        w, v = np.linalg.eig(M.T)
        e = np.real(v[:, np.argmin(np.abs(w - 1))])
        np.testing.assert_allclose(pi, e / e.sum(), atol=1e-9)
        r, cost = rng.random(S), 0.5 + rng.random(S)
        g, h = evaluate(M, r, cost)
        assert g == pytest.approx(pi @ r / (pi @ cost))
        np.testing.assert_allclose(h + g * cost, r + M @ h, atol=1e-10)


@pytest.mark.parametrize("N", [1, 2, 5, 17, 60, 120])
@pytest.mark.parametrize("improved", [False, True])
def test_trees_are_legal_and_consistent(N, improved):
    acc = load_acceptance(f"{PUBLISHED}:ppd-vicuna-7b")
    tree = ppd_tree(acc, N, 3, improved=improved)
    validate_tree(tree)
    M = transition_matrix(tree.states, acc, 3)
    np.testing.assert_allclose(M.sum(axis=1), 1, atol=1e-12)
    pi = np.array([st.stationary_probability for st in tree.states])
    np.testing.assert_allclose(pi @ M, pi, atol=1e-10)
    assert tree.expected_tokens_per_step == pytest.approx(sum(p * st.expected_tokens for p, st in zip(pi, tree.states)))
    for st in tree.states:
        assert st.depth <= st.state and st.input_length <= N
        assert max(st.prompt_tokens) <= 3
        assert st.expected_tokens == pytest.approx(tree_tau(acc.rows(3), st.nodes))
        if st.state >= 2:  # room for any budget up to 120: the whole budget is used
            assert st.input_length == N
    assert tree.states[0].input_length <= min(N, 4)  # ties between V(k) keep the smaller input


@pytest.mark.parametrize("seed", range(3))
def test_improved_never_worse_than_paper(seed):
    rng = np.random.default_rng(seed)
    acc = random_accept(rng, 4, 6)
    for N in (8, 20, 50):
        for P in (1, 2, 4):
            paper = paper_trees(acc, N, P).tau
            tree = ppd_tree(acc, N, P)
            assert tree.expected_tokens_per_step >= paper - 1e-12
            assert tree.settings["paper_expected_tokens_per_step"] == pytest.approx(paper)


def _all_actions(opts, s, P, max_n):
    """Every (c, k vector) of state s over the nested candidate trees, within max_n tokens."""
    for c in range(len(opts.tau)):
        for ks in itertools.product(range(P + 1), repeat=c + 1):
            if 1 + c + sum(ks) <= max_n:
                nodes = opts.paths[:c]
                yield TreeState(s, nodes, float(opts.tau[c]), 1 + c + sum(ks), list(ks))


def _brute_force(acc, P, max_n, latency=None):
    options = [_state_options(acc, s, max_n - 1, P) for s in range(P + 1)]
    per_state = [list(_all_actions(o, s, P, max_n)) for s, o in enumerate(options)]
    best = -np.inf
    for states in itertools.product(*per_state):
        M = transition_matrix(list(states), acc, P)
        pi = stationary_distribution(M)
        tau = pi @ np.array([st.expected_tokens for st in states])
        if latency is not None:
            tau /= pi @ latency(np.array([st.input_length for st in states], float))
        best = max(best, tau)
    return best


@pytest.mark.parametrize("seed", range(3))
def test_policy_iteration_reaches_brute_force_optimum(seed):
    rng = np.random.default_rng(10 + seed)
    acc = random_accept(rng, 2, 2)
    P, N = 2, 5
    tree = ppd_tree(acc, N, P)
    assert tree.expected_tokens_per_step == pytest.approx(_brute_force(acc, P, N), abs=1e-9)


@pytest.mark.parametrize("seed", range(2))
def test_per_state_budgets_reach_brute_force_throughput(seed):
    rng = np.random.default_rng(20 + seed)
    acc = random_accept(rng, 2, 2)
    P, N = 2, 5
    prof = LatencyProfile(np.array([1, 2, 5]), np.array([1.0, 1.0, 1.9]), {"file": "synthetic"})
    tree = ppd_tree(acc, N, P, profile=prof, per_state_budgets=True)
    pi = np.array([st.stationary_probability for st in tree.states])
    throughput = tree.expected_tokens_per_step / (pi @ prof.latency(np.array([st.input_length for st in tree.states], float)))
    assert throughput == pytest.approx(_brute_force(acc, P, N, prof.latency), abs=1e-9)


def test_fast_allocation_equals_knapsack():
    rng = np.random.default_rng(4)
    acc = random_accept(rng, 3, 5)
    opts = _state_options(acc, 3, 20, 3)
    V = np.array([0.0, 1.0, 1.6, 1.9])  # concave: the sorted fast path
    fast = _allocation(opts, V, 3)
    assert fast.order is not None
    for c in (0, 1, 7, 20):
        exact, _ = _knapsack(opts.last[c, : c + 1], V, 3)
        np.testing.assert_allclose(fast.value[c, : len(exact)], exact, atol=1e-12)
    convex = _allocation(opts, np.array([0.0, 0.1, 1.0, 3.0]), 3)
    assert convex.order is None  # not concave: exact knapsack path
    assert np.isfinite(convex.value[5, :19]).all() and not np.isfinite(convex.value[5, 19:]).any()


def test_ppd_input_errors():
    acc = load_acceptance(f"{PUBLISHED}:ppd-vicuna-7b")
    with pytest.raises(UserError, match="needs acceptance rows for distances 1..4"):
        ppd_tree(acc, 30, 4)
    with pytest.raises(UserError, match="prompt tokens must be >= 1"):
        ppd_tree(acc, 30, 0)
    pos = Acceptance(np.array([[0.5, 0.2]]), positional=True)
    tree = ppd_tree(pos, 40, 6)  # positional rows cover any P
    validate_tree(tree)
    assert tree.prompt_tokens_max == 6 and len(tree.states) == 7
