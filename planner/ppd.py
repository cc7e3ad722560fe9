"""PPD dynamic sparse trees (docs/algorithms.md, section 'PPD dynamic sparse trees').

State s = number of prompt tokens on the last accepted node; the tree of state s has candidate
depth <= s. Every node u (root included) carries k_u <= P prompt tokens; if the step ends at u,
the next state is k_u. With P(u last) = P(u) - sum of its children's P, the transition row of
state s is M[s][k] = sum of P(u last) over the nodes with k_u = k.

Both constructions search, per state, over the candidate count c (candidates = the c most likely
paths, nested in c) and the prompt-token count p, and allocate the p prompt tokens over the c + 1
nodes to maximise sum_u P(u last) * V(k_u):

- paper (`improved=False`): V(k) = tau of the best depth-<=k candidate-only tree using the whole
  budget (the paper's f(T_k) of its step 1 trees); pick per state the split maximising the two-step value
  tau_s + sum_k M[s][k] V(k) (Proposition 4.2); prompt tokens by greedy removal (4.3).
- improved: V = relative values h of the average-reward chain, by policy iteration (evaluate
  the trees: pi, g, h; re-plan each state against h; repeat until no state changes). With a
  latency profile and per-state budgets, the same iteration on the semi-Markov chain whose step
  cost is L(n_s) maximises throughput sum pi tau / sum pi L(n_s), each state free to pick its own
  input length up to the maximum.

Greedy removal with per-node cost P(u last) * (V(k) - V(k-1)) equals keeping the p largest
values P(u last) * (V(j) - V(j-1)), which is the exact optimum when those increments do not grow
with j (concave V); otherwise an exact knapsack over the nodes is used instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.accept import Acceptance
from planner.candidate import best_paths, num_paths, sort_nodes
from planner.cost import step_cost
from planner.errors import UserError
from planner.tree import PPD, Tree, TreeState

NEG = -np.inf
MAX_ITERATIONS = 50


# ---------------------------------------------------------------- Markov chain


def stationary_distribution(M: np.ndarray) -> np.ndarray:
    """pi with pi M = pi, sum pi = 1 (least squares on the stacked system, checked)."""
    M = np.asarray(M, dtype=np.float64)
    S = M.shape[0]
    A = np.vstack([M.T - np.eye(S), np.ones((1, S))])
    b = np.zeros(S + 1)
    b[-1] = 1.0
    pi = np.linalg.lstsq(A, b, rcond=None)[0]
    pi = np.clip(pi, 0.0, None)
    pi /= pi.sum()
    if np.abs(pi @ M - pi).max() > 1e-8:
        raise ValueError("no stationary distribution found (transition rows must sum to 1)")
    return pi


def evaluate(M: np.ndarray, reward: np.ndarray, cost: np.ndarray) -> tuple[float, np.ndarray]:
    """Gain g and relative values h (h[0] = 0) of h(s) + g cost_s = reward_s + sum_k M[s,k] h(k).

    cost = 1 everywhere: g is tokens per step; cost = L(n_s): g is tokens per second.
    """
    S = M.shape[0]
    A = np.zeros((S, S))
    A[:, 0] = cost  # unknown 0 is g, unknowns 1.. are h(1..S-1)
    A[:, 1:] = np.eye(S)[:, 1:] - M[:, 1:]
    x = np.linalg.lstsq(A, reward, rcond=None)[0]
    return float(x[0]), np.concatenate([[0.0], x[1:]])


def transition_matrix(states: list[TreeState], accept: Acceptance, prompt_tokens: int) -> np.ndarray:
    """M[s, k] from the trees: probability that a step in state s ends on a node carrying k prompt tokens."""
    S = prompt_tokens + 1
    M = np.zeros((S, S))
    for st in states:
        rows = accept.rows(max(st.depth, 1))
        prob = {(): 1.0}
        for p in st.nodes:
            prob[p] = prob[p[:-1]] * rows[len(p) - 1, p[-1]]
        last = dict(prob)
        for p in st.nodes:
            last[p[:-1]] -= prob[p]
        for u, k in zip([()] + list(st.nodes), st.prompt_tokens):
            M[st.state, k] += last[u]
    return M


# ---------------------------------------------------------------- one state's options


@dataclass
class _StateOptions:
    """The nested candidate trees of one state: the top-c paths for c = 0..C."""

    paths: list[tuple[int, ...]]  # [C] pop order, parents first
    tau: np.ndarray  # [C+1] tau of the top-c tree
    last: np.ndarray  # [C+1, C+1] last[c, u] = P(u last accepted) in the top-c tree, u = 0 root, i+1 path i


def _state_options(accept: Acceptance, state: int, c_max: int, P: int) -> _StateOptions:
    K = accept.num_ranks
    c_max = min(c_max, num_paths(K, state)) if state > 0 else 0
    rows = accept.rows(max(state, P, 1))
    paths, probs = best_paths(rows[:state], c_max, state) if c_max else ([], np.zeros(0))
    index = {(): 0}
    last = np.zeros((c_max + 1, c_max + 1))
    last[0, 0] = 1.0
    for i, (path, pr) in enumerate(zip(paths, probs)):
        index[path] = i + 1
        last[i + 1] = last[i]
        last[i + 1, i + 1] = pr
        last[i + 1, index[path[:-1]]] -= pr
    tau = 1.0 + np.concatenate([[0.0], np.cumsum(probs)])
    return _StateOptions(paths, tau, last)


def paper_values(accept: Acceptance, input_length: int, P: int) -> np.ndarray:
    """The paper's V(k), k = 0..P: tau of the best candidate-only tree of depth <= k using the
    whole budget (N - 1 candidates), i.e. the step-(1) optimal candidate trees."""
    V = np.ones(P + 1)
    for k in range(1, P + 1):
        n_k = min(input_length - 1, num_paths(accept.num_ranks, k))
        V[k] = 1.0 + best_paths(accept.rows(k), n_k, k)[1].sum()
    return V


@dataclass
class _Allocation:
    value: np.ndarray  # [C+1, B+1] best sum_u last[c,u] * V(k_u) - V(0) with at most p prompt tokens
    order: np.ndarray | None  # [C+1, (C+1)*P] fast path: (j-major) flat indices, best first
    V: np.ndarray  # [C+1, P+1] the values used (per c)
    use: np.ndarray  # [C+1, P+1] tokens actually placed for a nominal k (fewer when V(k) is no record)


def _allocation(opts: _StateOptions, V: np.ndarray, P: int) -> _Allocation:
    """Best prompt-token allocation for every (c, p). V is [P+1] or [C+1, P+1].

    A count k whose V(k) does not beat every smaller count is dominated (fewer tokens, same or
    more value), so V is replaced by its running maximum and k by the count that attains it;
    budgets are then "at most p", which is what the callers optimise over anyway.
    """
    C = len(opts.tau) - 1
    V = np.broadcast_to(np.asarray(V, dtype=np.float64), (C + 1, P + 1))
    use = np.zeros((C + 1, P + 1), dtype=np.int64)
    for k in range(1, P + 1):
        use[:, k] = np.where(V[:, k] > V[np.arange(C + 1), use[:, k - 1]], k, use[:, k - 1])
    V_run = np.take_along_axis(V, use, axis=1)
    delta = np.diff(V_run, axis=1)  # [C+1, P] >= 0
    B = P * (C + 1)
    if np.all(np.diff(delta, axis=1) <= 1e-12):
        # values[c, j, u] = last[c, u] * delta[c, j]; nodes beyond c do not exist
        values = opts.last[:, None, :] * delta[:, :, None]  # [C+1, P, C+1]
        exists = np.arange(C + 1)[None, None, :] <= np.arange(C + 1)[:, None, None]
        values = np.where(exists, values, NEG).reshape(C + 1, -1)
        order = np.argsort(-values, axis=1, kind="stable")  # ties: lower j first keeps k prefix-closed
        value = np.zeros((C + 1, B + 1))
        value[:, 1:] = np.cumsum(np.take_along_axis(values, order, axis=1), axis=1)
        return _Allocation(value, order, V_run, use)
    value = np.full((C + 1, B + 1), NEG)
    for c in range(C + 1):
        best, _ = _knapsack(opts.last[c, : c + 1], V[c], P)
        value[c, : len(best)] = best - V[c, 0]
    return _Allocation(value, None, np.array(V), np.tile(np.arange(P + 1), (C + 1, 1)))


def _knapsack(w: np.ndarray, V: np.ndarray, P: int):
    """Exact max of sum_u w_u V(k_u) with sum k_u = b, for every b; plus choices to rebuild."""
    n = len(w)
    best = np.full(P * n + 1, NEG)
    best[0] = 0.0
    choice = np.zeros((n, P * n + 1), dtype=np.int64)
    for u in range(n):
        cand = np.full((P + 1, P * n + 1), NEG)
        for k in range(P + 1):
            cand[k, k:] = best[: P * n + 1 - k] + w[u] * V[k]
        choice[u] = cand.argmax(axis=0)
        best = cand.max(axis=0)
    return best, choice


def _prompt_counts(opts: _StateOptions, alloc: _Allocation, c: int, p: int, P: int) -> list[int]:
    """k_u for the root and the c candidates, for the allocation behind alloc.value[c, p]."""
    C = len(opts.tau) - 1
    if alloc.order is not None:
        u = alloc.order[c, :p] % (C + 1)
        return alloc.use[c, np.bincount(u, minlength=C + 1)[: c + 1]].tolist()
    _, choice = _knapsack(opts.last[c, : c + 1], alloc.V[c], P)
    ks, b = [], p
    for u in range(c, -1, -1):
        k = int(choice[u, b])
        ks.append(k)
        b -= k
    return ks[::-1]


def _choose(opts: _StateOptions, alloc: _Allocation, max_n: int, g: float = 0.0, cost=None, current=None,
            ensemble: int = 1):
    """Best (c, p) whose forward of n = 1 + c + E p tokens fits max_n, for tau[c] + alloc.value[c, p] - g * cost(n).

    cost: seconds of a step of n real tokens (None: every step costs the same, the average-reward
    chain). Ties keep `current` (policy iteration must not cycle on ties), else prefer smaller inputs.
    """
    C, B = alloc.value.shape[0] - 1, alloc.value.shape[1] - 1
    c = np.arange(C + 1)[:, None]
    p = np.arange(B + 1)[None, :]
    n = 1 + c + ensemble * p
    J = opts.tau[:, None] + alloc.value
    if cost is not None:
        J = J - g * cost(np.minimum(n, max_n).astype(np.float64))
    J = np.where(n <= max_n, J, NEG)
    flat = int(np.argmax(J))  # smallest c, then smallest p, among ties
    best = (flat // (B + 1), flat % (B + 1))
    if current is not None and J[current] >= J[best] - 1e-12:
        best = current
    return best


def _build_state(s: int, opts: _StateOptions, alloc: _Allocation, c: int, p: int, P: int) -> TreeState:
    ks = _prompt_counts(opts, alloc, c, p, P)
    paths = opts.paths[:c]
    by_path = dict(zip(paths, ks[1:]))
    nodes = sort_nodes(paths)
    return TreeState(
        state=s,
        nodes=nodes,
        expected_tokens=float(opts.tau[c]),
        input_length=1 + c + int(sum(ks)),
        prompt_tokens=[ks[0]] + [by_path[q] for q in nodes],
    )


# ---------------------------------------------------------------- constructions


@dataclass
class PPDResult:
    states: list[TreeState]
    M: np.ndarray  # [P+1, P+1]
    pi: np.ndarray  # [P+1]
    tau: float  # amortised tokens per step
    iterations: int = 0


def _finish(states: list[TreeState], accept: Acceptance, P: int, iterations: int = 0) -> PPDResult:
    M = transition_matrix(states, accept, P)
    pi = stationary_distribution(M)
    for st in states:
        st.stationary_probability = float(pi[st.state])
        st.transitions = M[st.state].tolist()
    tau = float(sum(pi[st.state] * st.expected_tokens for st in states))
    return PPDResult(states, M, pi, tau, iterations)


def _check(accept: Acceptance, input_length: int, P: int) -> None:
    if P < 1:
        raise UserError(f"prompt tokens must be >= 1, got {P}")
    if input_length < 1:
        raise UserError(f"input length must be >= 1, got {input_length}")
    if accept.max_depth is not None and accept.max_depth < P:
        raise UserError(
            f"{accept.label}: ppd with {P} prompt tokens needs acceptance rows for distances 1..{P}, "
            f"the file has {accept.max_depth}"
        )


def paper_trees(accept: Acceptance, input_length: int, prompt_tokens: int = 3, options=None) -> PPDResult:
    """The paper's construction at one shared input budget N (see module docstring)."""
    P = prompt_tokens
    _check(accept, input_length, P)
    options = options or [_state_options(accept, s, input_length - 1, P) for s in range(P + 1)]
    V = paper_values(accept, input_length, P)
    states = []
    for s, opts in enumerate(options):
        alloc = _allocation(opts, V, P)
        c, p = _choose(opts, alloc, input_length)
        states.append(_build_state(s, opts, alloc, c, p, P))
    return _finish(states, accept, P)


def improve(accept: Acceptance, start: PPDResult, options, prompt_tokens: int, max_n: int,
            cost=None, ensemble: int = 1) -> PPDResult:
    """Policy iteration from `start`: average reward (cost None) or throughput, with cost(n) the
    seconds of a step of n real tokens (prompt tokens counted E times) and max_n a cap on n."""
    P = prompt_tokens
    best = current = start
    choice = [(len(st.nodes), st.input_length - 1 - len(st.nodes)) for st in start.states]
    key = _policy_key(start.states)
    it = 0
    for it in range(1, MAX_ITERATIONS + 1):
        reward = np.array([st.expected_tokens for st in current.states])
        g, h = evaluate(current.M, reward, _state_costs(current.states, cost, ensemble))
        states, choice_new = [], []
        for s, opts in enumerate(options):
            alloc = _allocation(opts, h, P)
            cp = _choose(opts, alloc, max_n, g=g, cost=cost, current=choice[s], ensemble=ensemble)
            choice_new.append(cp)
            states.append(_build_state(s, opts, alloc, *cp, P))
        key_new = _policy_key(states)
        if key_new == key:
            break
        choice, key = choice_new, key_new
        current = _finish(states, accept, P, it)
        if _objective(current, cost, ensemble) > _objective(best, cost, ensemble) + 1e-12:
            best = current
    best.iterations = it
    return best


def _policy_key(states: list[TreeState]):
    return tuple((tuple(st.nodes), tuple(st.prompt_tokens)) for st in states)


def _state_costs(states: list[TreeState], cost, ensemble: int) -> np.ndarray:
    """Seconds per step of each state (1 each without a cost model)."""
    if cost is None:
        return np.ones(len(states))
    n = np.array([1 + len(st.nodes) + ensemble * sum(st.prompt_tokens) for st in states], dtype=np.float64)
    return np.asarray(cost(n), dtype=np.float64)


def _objective(r: PPDResult, cost, ensemble: int) -> float:
    if cost is None:
        return r.tau
    return r.tau / float(r.pi @ _state_costs(r.states, cost, ensemble))


def ppd_tree(accept: Acceptance, input_length: int, prompt_tokens: int = 3, improved: bool = True,
             profile=None, per_state_budgets: bool = False, options=None) -> Tree:
    """PPD trees for input budget N = input_length tokens per forward pass (root + candidates + prompt tokens).

    improved=False: the paper's heuristic. improved=True: policy iteration on top of it.
    With a profile and per_state_budgets, each state may use any input length up to
    input_length, chosen to maximise throughput under the profile's L(n).
    """
    P = prompt_tokens
    _check(accept, input_length, P)
    options = options or [_state_options(accept, s, input_length - 1, P) for s in range(P + 1)]
    paper = paper_trees(accept, input_length, P, options)
    result, how = paper, "paper"
    if improved:
        result = improve(accept, paper, options, P, input_length)
        how = "policy-iteration"
        if profile is not None and per_state_budgets:
            result = improve(accept, result, options, P, input_length, cost=lambda n: step_cost(profile, n))
            how = "policy-iteration+per-state-budgets"
    return Tree(
        method=PPD,
        states=result.states,
        expected_tokens_per_step=result.tau,
        prompt_tokens_max=P,
        settings={
            "input_length": input_length,
            "prompt_tokens": P,
            "construction": how,
            "policy_iterations": result.iterations,
            "paper_expected_tokens_per_step": paper.tau,
        },
    )
