"""`planner plan dynamic`: a dynamic plan (planner/dynamic.py) from acceptance files and a profile.

Kept apart from planner/dynamic.py, which planner/tree.py reads to load plans: this module builds
them with the cost model (planner/cost.py), which itself reads trees.
"""
from __future__ import annotations

import numpy as np

from planner.dynamic import (
    MAX_POOL_DEPTH,
    DynamicSpec,
    GuesserModel,
    dynamic_kinds,
    dynamic_spec,
    path_probabilities,
    predict_static_prior,
    prior_pool,
)
from planner.errors import UserError
from planner.guessers import LOOKUP_SIGNAL, hybrid_of, kind_of_record
from planner.guessers import kind as guesser_kind


def kind_of(accept) -> str | None:
    """The guesser kind an acceptance file was measured for (its 'guesser' record), or None."""
    spec = kind_of_record(accept.source.get("guesser"))
    return spec.name if spec is not None else None


def guesser_model(kind: str, accept) -> GuesserModel:
    rec = accept.source.get("guesser") or {}
    spec = guesser_kind(kind)
    draft_s = float(rec.get("draft_s", 0.0) or 0.0) if spec.signal != LOOKUP_SIGNAL else 0.0
    passes = "one" if spec.passes == "one" or spec.signal == LOOKUP_SIGNAL else "depth"
    prior = accept.rows(accept.max_depth or MAX_POOL_DEPTH)
    return GuesserModel(kind, np.array(prior, dtype=np.float64), accept.source.get("calibration"), draft_s, passes)


def plan_dynamic(accepts: list[tuple[str | None, object]], profile=None, max_size: int = 16, max_depth: int = 8,
                 ensemble: int = 1, decide_s: float = 0.0):
    """A dynamic plan (planner.tree.Tree, method 'dynamic') from (kind or None, Acceptance) pairs:
    one map per guesser (hybrids: lookup and a drafter), the cost of a step at every input length
    by the one cost model (planner.cost.step_cost: L(n) + decoder overhead; drafter passes are added
    per step by the session as it drafts), and the prior-only prediction. decide_s: the decision's
    cost per step the plan records; 0 by default, since planning decodes nothing to time it (the
    main job records what its replay measures, workflows/mainjob/predict.py)."""
    from planner.cost import step_cost
    from planner.tree import DYNAMIC, Tree, TreeState

    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or not 1 <= max_depth <= MAX_POOL_DEPTH:
        raise UserError(f"--max-depth: expected an integer in 1..{MAX_POOL_DEPTH}, got {max_depth}")
    models: dict[str, GuesserModel] = {}
    for kind, acc in accepts:
        k = kind or kind_of(acc)
        if k is None:
            raise UserError(f"{acc.label}: no guesser record says which guesser this acceptance is for; "
                            f"name it: --accept KIND=FILE with KIND one of {', '.join(dynamic_kinds())}")
        if k not in dynamic_kinds():
            raise UserError(f"--accept {k}=...: KIND must be one of {', '.join(dynamic_kinds())}")
        if k in models:
            raise UserError(f"--accept: two acceptance files for {k}")
        models[k] = guesser_model(k, acc)
    name = _plan_guesser(list(models))
    per_node = 1
    pt = next((k for k in models if guesser_kind(k).needs_embeddings), None)  # prompt tokens ride on every node
    if pt is not None:
        rec = dict(next(a for k, a in accepts if (k or kind_of(a)) == pt).source.get("guesser") or {})
        P = int(rec.get("num_prompt_tokens", models[pt].prior.shape[0]))
        per_node = 1 + P * int(rec.get("ensemble", ensemble))
    need = per_node * (max_size + 1)
    cost = None
    if profile is not None:
        top = min(need, profile.max_input_length)
        if top < per_node * 2:
            raise UserError(f"profile covers input lengths up to {profile.max_input_length}; the plan needs {per_node * 2}")
        cost = [float(step_cost(profile, n)) for n in range(1, top + 1)]
        max_size = min(max_size, top // per_node - 1)
    spec = dynamic_spec(models, max_size, cost, max_depth, decide_s)
    if cost is None and per_node > 1:
        spec.step_cost_s = [1.0] * need
    plain = spec.step_cost_s[0] if per_node == 1 else float(step_cost(profile, 1)) if profile is not None else 1.0
    preds = {k: predict_static_prior(m, _per_node_view(spec, per_node), plain) for k, m in models.items()}
    best_kind = max(preds, key=lambda k: preds[k]["speedup"])
    best = preds[best_kind]
    nodes = _prior_nodes(models[best_kind], spec, best["size"])
    tau = float(best["tokens_per_step"])
    tree = Tree(DYNAMIC, [TreeState(0, nodes, min(tau, 1.0 + len(nodes)), 1 + len(nodes))], tau,
                predicted_speedup=float(best["speedup"]) if profile is not None else None,
                settings={"guesser": name, "max_size": max_size,
                          "max_depth": max_depth, "prior_prediction": preds},
                dynamic=spec, engine=profile.source.get("engine") if profile is not None else None)
    return tree


def _plan_guesser(names: list[str]) -> str:
    """The guesser a dynamic plan decodes with: the one measured, or the registered hybrid of two."""
    if len(names) == 1:
        return names[0]
    for a, b in ((names + names)[:2], (names + names)[1:3]):
        h = hybrid_of(a, b)
        if h is not None and len(names) == 2:
            return h.name
    raise UserError("--accept: one guesser, or lookup and one drafter (a hybrid)")


def _per_node_view(spec: DynamicSpec, per_node: int) -> DynamicSpec:
    """The step cost indexed by candidates (PPD: every node brings its prompt tokens)."""
    if per_node == 1:
        return spec
    cost = [spec.step_cost_s[per_node * (n + 1) - 1] for n in range(spec.max_size + 1)]
    return DynamicSpec(spec.max_size, cost, spec.guessers, spec.max_depth, spec.prior_strength, spec.forget,
                       spec.profiled, spec.decide_s)


def _prior_nodes(model: GuesserModel, spec: DynamicSpec, size: int) -> list[tuple[int, ...]]:
    """The rank paths the prior alone would choose (states[0] of the file: what a reader without
    dynamic plans could decode)."""
    parents, c = prior_pool(model, spec.max_depth, 4)
    if size == 0 or not len(c):
        return []
    P = path_probabilities(parents, c)
    chosen = sorted(np.lexsort((np.arange(len(P)), -P))[:size].tolist())
    path = {-1: ()}
    kids: dict[int, int] = {}
    out = []
    for i in chosen:
        p = int(parents[i])
        r = kids.get(p, 0)
        kids[p] = r + 1
        path[i] = path[p] + (r,)
        out.append(path[i])
    return out
