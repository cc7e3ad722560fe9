"""Candidate trees under the independence model (docs/algorithms.md, sections 'The independence
model', 'Medusa trees' and 'Sequoia trees').

rows[d, r] is the probability that the rank-r guess at distance d+1 is right; a candidate with
rank path (r1, ..., rd) is accepted with probability rows[0, r1] * ... * rows[d-1, rd].

- medusa (deterministic guesses, any rank subset legal): the best tree of n candidates is the n
  paths of largest probability; `best_paths` finds them best-first without enumerating K^D paths.
- sequoia (sampled drafts, sibling ranks contiguous): the exact dynamic programme F/G, with the
  inner (max, +) convolution done as numpy array work; `sequoia_table` gives tau for every (n, D).
"""
from __future__ import annotations

import heapq

import numpy as np

from planner.errors import UserError

Path_ = tuple[int, ...]
NEG = -np.inf


def _check_rows(rows) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] == 0:
        raise ValueError(f"rows must be [D, K] with K >= 1, got shape {rows.shape}")
    return rows


def num_paths(num_ranks: int, max_depth: int) -> int:
    """Paths of depth 1..max_depth with num_ranks choices per level."""
    return sum(num_ranks**d for d in range(1, max_depth + 1))


def best_paths(rows, size: int, max_depth: int) -> tuple[list[Path_], np.ndarray]:
    """The `size` rank paths of largest acceptance probability, depth <= max_depth.

    Returned in pop order: probabilities non-increasing and every parent before its children,
    so each prefix of the list is itself the best tree of that size (one call gives every n).

    Best-first over paths written in *sorted* rank order (rank index i at a level means the i-th
    most likely rank there). A popped path pushes two successors: its next sibling in sorted
    order and its first child. Each path's predecessor (previous sibling, or parent for a first
    child) has at least its probability, so the heap pops paths in non-increasing order and
    holds at most size + 1 entries.
    """
    rows = _check_rows(rows)
    depth, num_ranks = rows.shape
    if max_depth > depth:
        raise ValueError(f"max_depth {max_depth} exceeds the {depth} rows given")
    if size < 0:
        raise ValueError("size must be >= 0")
    if size > num_paths(num_ranks, max_depth):
        raise UserError(
            f"{size} candidates asked but only {num_paths(num_ranks, max_depth)} paths exist "
            f"with {num_ranks} ranks and depth <= {max_depth}"
        )
    if size == 0 or max_depth == 0:
        return [], np.zeros(0)
    order = np.argsort(-rows, axis=1, kind="stable")  # [D, K] rank of the i-th best guess per level
    sorted_rows = np.take_along_axis(rows, order, axis=1)  # [D, K] non-increasing per row
    # heap entries: (-prob, sorted-index path); paths compare lexicographically for determinism
    heap = [(-sorted_rows[0, 0], (0,))]
    paths: list[Path_] = []
    probs = np.empty(size)
    while len(paths) < size:
        neg_p, spath = heapq.heappop(heap)
        d = len(spath)
        probs[len(paths)] = -neg_p
        paths.append(tuple(int(order[i, s]) for i, s in enumerate(spath)))
        if spath[-1] + 1 < num_ranks:
            sib = spath[:-1] + (spath[-1] + 1,)
            heapq.heappush(heap, (-_path_prob(sorted_rows, sib), sib))
        if d < max_depth:
            heapq.heappush(heap, (neg_p * sorted_rows[d, 0], spath + (0,)))
    return paths, probs


def _path_prob(rows: np.ndarray, path: Path_) -> float:
    p = 1.0
    for d, r in enumerate(path):
        p *= rows[d, r]
    return p


def path_prob(rows, path: Path_) -> float:
    """Acceptance probability of one rank path under the independence model."""
    return _path_prob(_check_rows(rows), path)


def tree_tau(rows, nodes) -> float:
    """tau = 1 + sum of path probabilities (the root always counts)."""
    rows = _check_rows(rows)
    return 1.0 + sum(_path_prob(rows, p) for p in nodes)


def sort_nodes(nodes) -> list[Path_]:
    """Parents first: by depth, then by ranks."""
    return sorted((tuple(p) for p in nodes), key=lambda p: (len(p), p))


# ---------------------------------------------------------------- sequoia: exact DP


def _maxplus(g_old: np.ndarray, f: np.ndarray, src: np.ndarray, valid: np.ndarray):
    """new[j] = max_{t=1..j} g_old[j - t] + f[t]; returns (new [M+1], best t [M+1], 0 where none)."""
    cand = g_old[src] + f[None, 1:]  # [M+1, M]  row j, column t-1
    cand = np.where(valid, cand, NEG)
    t = cand.argmax(axis=1)
    best = cand[np.arange(len(g_old)), t]
    return best, np.where(np.isfinite(best), t + 1, 0)


def _sequoia_dp(rows: np.ndarray, max_size: int, max_depth: int, keep_choices: bool):
    """F[d][m] for top-node depth d = 0..max_depth and subtree size m = 0..M (M = max_size + 1).

    Node values are measured from the top node (1 for itself). Children of a node at depth d use
    row d (distance d+1). Returns F [D+1, M+1] and, if asked, the choices to rebuild a tree:
    best_k [D+1, M+1] and t_choice [D, K+1, M+1] (nodes given to the k-th child at budget j).
    """
    num_ranks = rows.shape[1]
    m_max = max_size + 1
    j = np.arange(m_max + 1)[:, None]
    t = np.arange(1, m_max + 1)[None, :]
    valid = t <= j  # [M+1, M]
    src = np.clip(j - t, 0, None)
    F = np.full((max_depth + 1, m_max + 1), NEG)
    F[max_depth, 1] = 1.0
    best_k = np.zeros((max_depth + 1, m_max + 1), dtype=np.int64)
    t_choice = np.zeros((max_depth, num_ranks + 1, m_max + 1), dtype=np.int64) if keep_choices else None
    for d in range(max_depth - 1, -1, -1):
        G = np.full(m_max + 1, NEG)
        G[0] = 0.0  # k = 0 children, 0 nodes spent
        best = G.copy()  # best over k of G[k][j]
        kbest = np.zeros(m_max + 1, dtype=np.int64)
        f_next = F[d + 1]
        for k in range(1, num_ranks + 1):
            w = rows[d, k - 1]
            f = np.where(np.isfinite(f_next), w * np.where(np.isfinite(f_next), f_next, 0.0), NEG)
            G, tk = _maxplus(G, f, src, valid)
            if keep_choices:
                t_choice[d, k] = tk
            better = G > best
            best = np.where(better, G, best)
            kbest = np.where(better, k, kbest)
        F[d, 1:] = 1.0 + best[:-1]  # top node + m-1 nodes below it
        best_k[d, 1:] = kbest[:-1]
    return F, best_k, t_choice


def sequoia_table(rows, max_size: int, max_depth: int) -> np.ndarray:
    """tau[D, n]: best expected tokens with exactly n candidates, contiguous ranks, depth <= D.

    Shape [max_depth + 1, max_size + 1]; -inf where no such tree exists (n > paths available).
    Since accuracies are >= 0, exactly n is also the best with at most n wherever feasible.
    With depth-dependent rows the depth limit changes every level's table, so this runs one DP
    per limit (sum over D of D levels); with a positional vector the levels are shift-invariant
    and one DP at the largest limit gives all of them.
    """
    rows = _check_rows(rows)
    if max_depth > rows.shape[0]:
        raise ValueError(f"max_depth {max_depth} exceeds the {rows.shape[0]} rows given")
    tau = np.full((max_depth + 1, max_size + 1), NEG)
    tau[:, 0] = 1.0
    positional = bool(np.all(rows[:max_depth] == rows[:1]))
    if positional and max_depth > 0:
        F, _, _ = _sequoia_dp(rows, max_size, max_depth, keep_choices=False)
        for limit in range(1, max_depth + 1):
            tau[limit, :] = F[max_depth - limit, 1:]  # top node at depth D - limit sees `limit` levels
        return tau
    for limit in range(1, max_depth + 1):
        F, _, _ = _sequoia_dp(rows[:limit], max_size, limit, keep_choices=False)
        tau[limit, :] = F[0, 1:]
    return tau


def sequoia_tree(rows, size: int, max_depth: int) -> list[Path_]:
    """The best contiguous-rank tree of exactly `size` candidates, depth <= max_depth, sorted parents first."""
    rows = _check_rows(rows)
    if max_depth > rows.shape[0]:
        raise ValueError(f"max_depth {max_depth} exceeds the {rows.shape[0]} rows given")
    if size < 0:
        raise ValueError("size must be >= 0")
    if size == 0:
        return []
    if size > num_paths(rows.shape[1], max_depth):
        raise UserError(
            f"{size} candidates asked but only {num_paths(rows.shape[1], max_depth)} paths exist "
            f"with {rows.shape[1]} ranks and depth <= {max_depth}"
        )
    F, best_k, t_choice = _sequoia_dp(rows, size, max_depth, keep_choices=True)
    nodes: list[Path_] = []
    stack = [((), 0, size + 1)]  # (path of the top node, its depth, nodes in its subtree)
    while stack:
        path, d, m = stack.pop()
        if path:
            nodes.append(path)
        j, k = m - 1, int(best_k[d, m])
        while k > 0:  # peel children from the highest rank down, as G was built
            t = int(t_choice[d, k, j])
            stack.append((path + (k - 1,), d + 1, t))
            j -= t
            k -= 1
        assert j == 0, "sequoia DP reconstruction lost nodes"
    return sort_nodes(nodes)
