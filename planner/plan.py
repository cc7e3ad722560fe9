"""The planner's library API: one call from acceptance statistics (and a latency profile) to a Tree.

Methods: medusa (top-n paths), sequoia (exact contiguous-rank DP), ppd (dynamic sparse trees).
With a profile and no size, the size (ppd: input length) maximising predicted speedup
(ALGORITHMS.md section 4) is chosen and the whole curve is recorded in the tree.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from planner.accept import Acceptance
from planner.candidate import (
    best_paths,
    num_paths,
    sequoia_table,
    sequoia_tree,
    sort_nodes,
)
from planner.cost import predicted_speedup, step_latency
from planner.errors import UserError
from planner.profile import LatencyProfile
from planner.tree import Tree, TreeState

METHODS = ("medusa", "sequoia", "ppd")
POSITIONAL_DEFAULT_DEPTH = 8  # a positional vector allows any depth; deeper than 8 rarely pays
SHARED_DIR = Path(__file__).resolve().parents[1] / ".." / "shared"  # ../shared/data/... from the repo


def default_max_depth(accept: Acceptance) -> int:
    return accept.max_depth if accept.max_depth is not None else POSITIONAL_DEFAULT_DEPTH


def _single(method: str, nodes, tau: float, settings: dict) -> Tree:
    nodes = sort_nodes(nodes)
    st = TreeState(state=0, nodes=nodes, expected_tokens=float(tau), input_length=1 + len(nodes))
    return Tree(method=method, states=[st], expected_tokens_per_step=float(tau), settings=settings)


def _check_size(name: str, value: int | None, lo: int = 1) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo):
        raise UserError(f"{name} must be an integer >= {lo}, got {value!r}")


def _profile_cap(profile: LatencyProfile, what: str) -> int:
    if profile.input_lengths[0] > 1:
        raise UserError(
            f"{profile.source.get('file', 'profile')}: needs L(1) for the speedup, profile starts at input length {profile.input_lengths[0]}"
        )
    return profile.max_input_length


def _curve_row(size, input_length, tau, latency_s, speedup, **extra) -> dict:
    row = {"size": int(size), "input_length": float(input_length), "expected_tokens_per_step": float(tau),
           "latency_s": float(latency_s), "predicted_speedup": float(speedup)}
    row.update(extra)
    return row


def plan(method: str, accept: Acceptance, *, size: int | None = None, max_depth: int | None = None,
         input_length: int | None = None, prompt_tokens: int = 3, profile: LatencyProfile | None = None,
         max_size: int = 64, max_input_length: int | None = None, improved: bool = True,
         per_state_budgets: bool = True, draft_latency_s: float = 0.0,
         progress: Callable | None = None) -> Tree:
    """Plan a tree. size/input_length given: that tree. None with a profile: the best by predicted speedup.

    progress: optional wrapper for iterables (e.g. tqdm) used by the size searches.
    """
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}, expected one of {', '.join(METHODS)}")
    _check_size("size", size)
    _check_size("max depth", max_depth)
    _check_size("input length", input_length)
    _check_size("prompt tokens", prompt_tokens)
    _check_size("max size", max_size)
    _check_size("max input length", max_input_length)
    if draft_latency_s < 0:
        raise UserError(f"draft latency must be >= 0, got {draft_latency_s}")
    progress = progress or (lambda it, **_: it)
    if method == "ppd":
        if size is not None:
            raise UserError("ppd takes --input-length (tokens per forward pass), not --size")
        if max_depth is not None:
            raise UserError("ppd trees of state s reach depth s <= P: set --prompt-tokens, not --max-depth")
        tree = _plan_ppd(accept, input_length, prompt_tokens, profile, max_input_length, improved,
                         per_state_budgets, progress)
    else:
        if input_length is not None:
            raise UserError(f"{method} takes --size (candidates; input length = size + 1), not --input-length")
        depth = max_depth or default_max_depth(accept)
        if accept.max_depth is not None and depth > accept.max_depth:
            raise UserError(f"{accept.label}: max depth {depth} asked, the acceptance covers distances 1..{accept.max_depth}")
        rows = accept.rows(depth)
        if method == "medusa":
            tree = _plan_medusa(rows, size, depth, profile, max_size, draft_latency_s)
        else:
            tree = _plan_sequoia(rows, size, depth, profile, max_size, draft_latency_s)
    if profile is not None:
        tree.predicted_speedup = predicted_speedup(tree, profile, draft_latency_s)
        tree.settings["draft_latency_s"] = draft_latency_s
    tree.provenance["acceptance"] = dict(accept.source)
    if profile is not None:
        tree.provenance["profile"] = {k: v for k, v in profile.source.items() if isinstance(v, (str, int, float))}
    return tree


def _plan_medusa(rows, size, depth, profile, max_size, draft_latency_s) -> Tree:
    settings = {"max_depth": depth}
    if size is not None:
        nodes, probs = best_paths(rows, size, depth)
        return _single("medusa", nodes, 1.0 + probs.sum(), settings | {"size": size})
    if profile is None:
        raise UserError("medusa needs --size N, or --profile FILE to choose the size")
    cap = min(max_size, _profile_cap(profile, "medusa") - 1, num_paths(rows.shape[1], depth))
    nodes, probs = best_paths(rows, cap, depth)  # every prefix is the best tree of its size
    tau = 1.0 + np.concatenate([[0.0], np.cumsum(probs)])
    depths = np.maximum.accumulate(np.array([0] + [len(p) for p in nodes]))
    n = np.arange(cap + 1)
    lat = profile.latency(1 + n) + depths * draft_latency_s
    speed = tau * profile.latency(1) / lat
    best = int(np.argmax(speed))
    tree = _single("medusa", nodes[:best], tau[best], settings | {"size": best, "max_size": max_size})
    tree.size_curve = [_curve_row(k, 1 + k, tau[k], lat[k], speed[k]) for k in range(1, cap + 1)]
    return tree


def _plan_sequoia(rows, size, depth, profile, max_size, draft_latency_s) -> Tree:
    settings = {"max_depth": depth}
    if size is not None:
        nodes = sequoia_tree(rows, size, depth)
        tau = sequoia_table(rows, size, depth)[depth, size]
        return _single("sequoia", nodes, tau, settings | {"size": size})
    if profile is None:
        raise UserError("sequoia needs --size N, or --profile FILE to choose the size")
    cap = min(max_size, _profile_cap(profile, "sequoia") - 1, num_paths(rows.shape[1], depth))
    table = sequoia_table(rows, cap, depth)  # [D+1, cap+1], every (depth limit, size)
    n = np.arange(cap + 1)
    lat = profile.latency(1 + n)[None, :] + np.arange(depth + 1)[:, None] * draft_latency_s  # [D+1, cap+1]
    speed = np.where(np.isfinite(table), table * profile.latency(1) / lat, -np.inf)
    best_d = speed.argmax(axis=0)  # per size, the depth limit that pays best
    best_n = int(np.argmax(speed[best_d, n]))
    d = int(best_d[best_n])
    nodes = sequoia_tree(rows, best_n, d)
    tree = _single("sequoia", nodes, table[d, best_n], settings | {"size": best_n, "depth": d, "max_size": max_size})
    tree.size_curve = [
        _curve_row(k, 1 + k, table[best_d[k], k], lat[best_d[k], k], speed[best_d[k], k], depth=int(best_d[k]))
        for k in range(1, cap + 1)
    ]
    return tree


def _plan_ppd(accept, input_length, P, profile, max_input_length, improved, per_state_budgets, progress) -> Tree:
    from planner.ppd import _check, _state_options, ppd_tree

    if input_length is not None:
        if profile is not None and input_length > _profile_cap(profile, "ppd"):
            raise UserError(f"input length {input_length} exceeds the profiled range 1..{profile.max_input_length}")
        return ppd_tree(accept, input_length, P, improved=improved, profile=profile,
                        per_state_budgets=per_state_budgets and profile is not None)
    if profile is None:
        raise UserError("ppd needs --input-length N, or --profile FILE to choose it")
    cap = _profile_cap(profile, "ppd")
    cap = min(cap, max_input_length) if max_input_length else cap
    _check(accept, cap, P)
    options_all = [_state_options(accept, s, cap - 1, P) for s in range(P + 1)]
    curve, best, best_speed = [], None, -np.inf
    for N in progress(range(1, cap + 1), desc="input lengths", unit="N"):
        opts = [_slice_options(o, N - 1) for o in options_all]
        tree = ppd_tree(accept, N, P, improved=improved, options=opts)
        lat = step_latency(tree, profile)
        speed = tree.expected_tokens_per_step * profile.latency(1) / lat
        curve.append(_curve_row(N - 1, N, tree.expected_tokens_per_step, lat, speed))
        if speed > best_speed:
            best, best_speed = tree, speed
    if improved and per_state_budgets:
        # start the throughput iteration from the best shared budget, let states spend up to cap
        from planner.ppd import (
            PPDResult,
            improve,
            stationary_distribution,
            transition_matrix,
        )

        M = transition_matrix(best.states, accept, P)
        start = PPDResult(best.states, M, stationary_distribution(M), best.expected_tokens_per_step)
        res = improve(accept, start, options_all, P, cap, latency=profile.latency)
        tree = Tree("ppd", res.states, res.tau, prompt_tokens_max=P, settings=dict(best.settings))
        if predicted_speedup(tree, profile) > best_speed:
            tree.settings.update(construction="policy-iteration+per-state-budgets", policy_iterations=res.iterations)
            best = tree
    best.settings.update(max_input_length=cap, chosen_input_length=best.max_input_length)
    best.size_curve = curve
    return best


def _slice_options(opts, c_max: int):
    """The first c_max candidates of a state's nested options (the top paths do not depend on C)."""
    from planner.ppd import _StateOptions

    c = min(c_max, len(opts.paths))
    return _StateOptions(opts.paths[:c], opts.tau[: c + 1], opts.last[: c + 1, : c + 1])

