"""The planner's library API: one call from acceptance statistics (and a latency profile) to a Tree.

Methods: medusa (top-n paths), sequoia (exact contiguous-rank DP), ppd (dynamic sparse trees).
With a profile and no size, the size (ppd: input length) maximising predicted speedup
(docs/algorithms.md, section 'Cost model') is chosen and the whole curve is recorded in the tree.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
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
from planner.cost import (
    Guessing,
    default_guessing,
    input_lengths,
    mean_input_length,
    padding,
    plain_step,
    predicted_speedup,
    step_cost,
    step_latency,
)
from planner.errors import PlainIsFastest, UserError
from planner.order import coarse_to_fine
from planner.profile import LatencyProfile
from planner.tree import MAX_DEPTH, MAX_INPUT_LENGTH, MAX_PROMPT_TOKENS, MAX_SIZE, MEDUSA, PPD, SEQUOIA, Tree, TreeState

METHODS = (MEDUSA, SEQUOIA, PPD)
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


def _profile_cap(profile: LatencyProfile) -> int:
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


@dataclass(frozen=True)
class PlanOptions:
    """How `plan` sizes a tree: a given size, or the best by predicted speedup within the bounds."""

    size: int | None = None  # medusa / sequoia: candidates (None with a profile: chosen)
    max_depth: int | None = None
    input_length: int | None = None  # ppd: tokens per forward (None with a profile: chosen)
    prompt_tokens: int = 3  # ppd: P
    max_size: int = 64
    max_input_length: int | None = None
    improved: bool = True  # ppd: the improved construction, not the paper's
    per_state_budgets: bool = True  # ppd: every state spends what the latency curve says pays
    guessing: Guessing | None = None  # how the guesser feeds the tree (default from the acceptance file)
    draft_latency_s: float | None = None  # the drafter's pass, when guessing is the default
    time_budget_s: float | None = None  # ppd's size sweep stops there (coarse to fine: a cut sweep spans the range)
    progress: Callable | None = None  # optional wrapper for iterables (e.g. tqdm) used by the size searches


def plan(method: str, accept: Acceptance, profile: LatencyProfile | None = None, options: PlanOptions | None = None,
         **fields) -> Tree:
    """Plan a tree. A size (or ppd's input length) given: that tree; none with a profile: the best by
    predicted speedup. options: a PlanOptions, or its fields as keywords."""
    o = replace(options or PlanOptions(), **fields)
    size, max_depth, input_length, prompt_tokens = o.size, o.max_depth, o.input_length, o.prompt_tokens
    max_size, max_input_length, guessing, draft_latency_s = o.max_size, o.max_input_length, o.guessing, o.draft_latency_s
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}, expected one of {', '.join(METHODS)}")
    for name, value in (("size", size), ("max depth", max_depth), ("input length", input_length),
                        ("prompt tokens", prompt_tokens), ("max size", max_size), ("max input length", max_input_length)):
        _check_size(name, value)
    _check_bound("size", size, MAX_SIZE)
    _check_bound("max size", max_size, MAX_SIZE)
    _check_bound("prompt tokens", prompt_tokens, MAX_PROMPT_TOKENS)
    _check_bound("max depth", max_depth, MAX_DEPTH)
    _check_bound("input length", input_length, MAX_INPUT_LENGTH)
    if guessing is None:
        guessing = default_guessing(method, accept, draft_s=draft_latency_s)
    elif draft_latency_s is not None:
        raise UserError("give the draft latency inside `guessing` or as draft_latency_s, not both")
    o = replace(o, guessing=guessing, progress=o.progress or (lambda it, **_: it))
    if method == PPD:
        tree = _plan_ppd(accept, profile, o)
    else:
        tree = _plan_static(method, accept, size, max_depth, input_length, profile, max_size, guessing)
    if not any(st.nodes for st in tree.states) and method != PPD:
        raise PlainIsFastest(f"{accept.label}: the best {method} tree has no candidates (plain decoding is predicted "
                        "fastest); give --size N to plan a tree anyway")
    if profile is not None:
        tree.predicted_speedup = predicted_speedup(tree, profile, guessing)
        tree.settings["guessing"] = asdict(guessing)
        tree.settings.update(padding(profile))
    tree.provenance["acceptance"] = accept.provenance()
    if profile is not None:
        tree.provenance["profile"] = {k: v for k, v in profile.source.items() if isinstance(v, (str, int, float))}
        if isinstance(profile.source.get("simulated"), dict):
            tree.provenance["profile"]["simulated"] = profile.source["simulated"]
        tree.engine = profile.source.get("engine")  # a plan runs in the engine its profile timed
    return tree


def _check_bound(name: str, value: int | None, bound: int) -> None:
    if value is not None and value > bound:
        raise UserError(f"{name} {value} is above the largest this planner handles ({bound})")


def _plan_static(method, accept, size, max_depth, input_length, profile, max_size, guessing) -> Tree:
    if input_length is not None:
        raise UserError(f"{method} takes --size (candidates; input length = size + 1), not --input-length")
    depth = max_depth or default_max_depth(accept)
    note = None
    if accept.max_depth is not None and depth > accept.max_depth:  # --max-depth is a maximum
        note = (f"max depth {depth} asked; {accept.label} covers distances 1..{accept.max_depth}, "
                f"so the tree is planned within depth {accept.max_depth}")
        depth = accept.max_depth
    rows = accept.rows(depth)
    if method == "medusa":
        tree = _plan_medusa(rows, size, depth, profile, max_size, guessing)
    else:
        tree = _plan_sequoia(rows, size, depth, profile, max_size, guessing)
    if note:
        tree.settings = dict(tree.settings, notes=[note])
    return tree


def _fitting_sizes(profile: LatencyProfile, guessing: Guessing, sizes: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """Which (size, depth) trees run a forward pass inside the profiled range."""
    return guessing.input_length(1 + sizes, depths) <= _profile_cap(profile)


def _plan_medusa(rows, size, depth, profile, max_size, guessing) -> Tree:
    settings = {"max_depth": depth}
    if size is not None:
        nodes, probs = best_paths(rows, size, depth)
        return _single("medusa", nodes, 1.0 + probs.sum(), settings | {"size": size})
    if profile is None:
        raise UserError("medusa needs --size N, or --profile FILE to choose the size")
    cap = min(max_size, _profile_cap(profile) - 1, num_paths(rows.shape[1], depth))
    nodes, probs = best_paths(rows, cap, depth)  # every prefix is the best tree of its size
    tau = 1.0 + np.concatenate([[0.0], np.cumsum(probs)])
    depths = np.maximum.accumulate(np.array([0] + [len(p) for p in nodes]))
    n = np.arange(cap + 1)
    fits = _fitting_sizes(profile, guessing, n, depths)
    cap = int(np.nonzero(fits)[0].max())  # sizes only grow the forward pass: the fitting ones are a prefix
    n, tau, depths = n[: cap + 1], tau[: cap + 1], depths[: cap + 1]
    real = guessing.input_length(1 + n, depths)
    lat = step_cost(profile, real, depths, guessing)
    speed = tau * plain_step(profile) / lat
    best = int(np.argmax(speed))
    tree = _single("medusa", nodes[:best], tau[best], settings | {"size": best, "max_size": max_size})
    tree.size_curve = [_curve_row(k, real[k], tau[k], lat[k], speed[k]) for k in range(1, cap + 1)]
    return tree


def _plan_sequoia(rows, size, depth, profile, max_size, guessing) -> Tree:
    settings = {"max_depth": depth}
    if size is not None:
        nodes = sequoia_tree(rows, size, depth)
        tau = sequoia_table(rows, size, depth)[depth, size]
        return _single("sequoia", nodes, tau, settings | {"size": size})
    if profile is None:
        raise UserError("sequoia needs --size N, or --profile FILE to choose the size")
    cap = min(max_size, _profile_cap(profile) - 1, num_paths(rows.shape[1], depth))
    table = sequoia_table(rows, cap, depth)  # [D+1, cap+1], every (depth limit, size)
    n = np.arange(cap + 1)[None, :]
    d = np.arange(depth + 1)[:, None]
    real = np.broadcast_to(guessing.input_length(1 + n, d), table.shape)  # [D+1, cap+1]
    fits = real <= _profile_cap(profile)
    lat = step_cost(profile, np.where(fits, real, 1), np.broadcast_to(d, table.shape), guessing)
    speed = np.where(np.isfinite(table) & fits, table * plain_step(profile) / lat, -np.inf)
    best_d = speed.argmax(axis=0)  # per size, the depth limit that pays best
    sizes = [k for k in range(cap + 1) if np.isfinite(speed[best_d[k], k])]
    best_n = max(sizes, key=lambda k: speed[best_d[k], k])
    d_best = int(best_d[best_n])
    nodes = sequoia_tree(rows, best_n, d_best)
    tree = _single("sequoia", nodes, table[d_best, best_n],
                   settings | {"size": best_n, "depth": d_best, "max_size": max_size})
    tree.size_curve = [
        _curve_row(k, real[best_d[k], k], table[best_d[k], k], lat[best_d[k], k], speed[best_d[k], k], depth=int(best_d[k]))
        for k in sizes if k > 0
    ]
    return tree


def _plan_ppd(accept, profile, o: PlanOptions) -> Tree:
    from planner.ppd import _check, ppd_tree

    input_length, P, improved, guessing = o.input_length, o.prompt_tokens, o.improved, o.guessing
    if o.size is not None:
        raise UserError("ppd takes --input-length (tokens per forward pass), not --size")
    if o.max_depth is not None:
        raise UserError("ppd trees of state s reach depth s <= P: set --prompt-tokens, not --max-depth")
    if input_length is not None:
        if profile is not None and input_length > _profile_cap(profile):
            raise UserError(f"input length {input_length} exceeds the profiled range 1..{profile.max_input_length}")
        return ppd_tree(accept, input_length, P, improved=improved, profile=profile,
                        per_state_budgets=o.per_state_budgets and profile is not None)
    if profile is None:
        raise UserError("ppd needs --input-length N, or --profile FILE to choose it")
    cap = min(_profile_cap(profile), o.max_input_length or MAX_INPUT_LENGTH)
    _check(accept, cap, P)
    best, curve, swept = _ppd_sweep(accept, P, profile, cap, improved, guessing, o.time_budget_s, o.progress)
    if improved and o.per_state_budgets:
        best = _ppd_per_state(accept, P, profile, cap, guessing, best)
    best.settings.update(max_input_length=cap, chosen_input_length=best.max_input_length,
                         swept_input_lengths=swept, guessing=asdict(guessing))
    best.size_curve = curve
    return best


def _ppd_sweep(accept, P, profile, cap, improved, guessing, time_budget_s, progress):
    """The shared budget N at every input length (coarse to fine, so that a sweep the time budget
    cuts short still spans 1..cap); keeps trees whose real forward pass fits the profile."""
    import time

    from planner.ppd import _state_options, ppd_tree

    options_all = [_state_options(accept, s, cap - 1, P) for s in range(P + 1)]
    curve, best, best_speed, swept = [], None, -np.inf, 0
    deadline = time.monotonic() + (time_budget_s if time_budget_s is not None else math.inf)
    for N in progress(coarse_to_fine(range(1, cap + 1)), desc="input lengths", unit="N"):
        if swept >= 2 and best is not None and time.monotonic() > deadline:
            break
        swept += 1
        tree = ppd_tree(accept, N, P, improved=improved, options=[_slice_options(o, N - 1) for o in options_all])
        if max(input_lengths(tree, guessing)) > cap:
            continue
        lat = step_latency(tree, profile, guessing)
        speed = tree.expected_tokens_per_step * plain_step(profile) / lat
        curve.append(_curve_row(N - 1, mean_input_length(tree, guessing), tree.expected_tokens_per_step, lat, speed,
                                planned_input_length=N))
        if speed > best_speed:
            best, best_speed = tree, speed
    if best is None:
        raise UserError(f"ppd: no tree fits the profiled range 1..{cap} with E = {guessing.ensemble} "
                        "inputs per prompt token")
    curve.sort(key=lambda r: r["planned_input_length"])
    return best, curve, swept


def _ppd_per_state(accept, P, profile, cap, guessing, best: Tree) -> Tree:
    """Start the throughput iteration from the best shared budget; let every state spend up to cap."""
    from planner.ppd import PPDResult, _state_options, improve, stationary_distribution, transition_matrix

    options_all = [_state_options(accept, s, cap - 1, P) for s in range(P + 1)]
    M = transition_matrix(best.states, accept, P)
    start = PPDResult(best.states, M, stationary_distribution(M), best.expected_tokens_per_step)
    res = improve(accept, start, options_all, P, cap, cost=lambda n: step_cost(profile, n), ensemble=guessing.ensemble)
    tree = Tree(PPD, res.states, res.tau, prompt_tokens_max=P, settings=dict(best.settings))
    if predicted_speedup(tree, profile, guessing) > predicted_speedup(best, profile, guessing):
        tree.settings.update(construction="policy-iteration+per-state-budgets", policy_iterations=res.iterations)
        return tree
    return best


def _slice_options(opts, c_max: int):
    """The first c_max candidates of a state's nested options (the top paths do not depend on C)."""
    from planner.ppd import _StateOptions

    c = min(c_max, len(opts.paths))
    return _StateOptions(opts.paths[:c], opts.tau[: c + 1], opts.last[: c + 1, : c + 1])

