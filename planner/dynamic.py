"""Per-step trees: calibrated confidence against the measured step cost (numpy only).

A `dynamic` plan does not fix a tree. Each step the guesser offers a pool of candidates, each with
a live signal (a drafter's probability q of the token; prompt lookup's matched n-gram length and
how often that n-gram was followed by the token), the plan's calibration maps the signal to
c = P(candidate accepted | parent accepted), a path's probability is the product of its c's, and
the step keeps the n most probable paths (best-first, so always a tree) for the n, 0 included,
that maximises

    (1 + sum of the n path probabilities) / (decide_s + sunk drafting + step_cost[n])

where step_cost[n] is the one cost model's L(n + 1) + overhead(n + 1) (planner/cost.py), drafting
is priced at each pass's recorded draft_s and decide_s is the plan's recorded decision cost: all
constants of the plan, so a step's choice never depends on a clock read while decoding.

Calibration (written by `planner accept --calibrate`, stored in the acceptance file under
"calibration"): per signal kind, a table c[depth bin, signal bin], made monotone (pool adjacent
violators) in the signal within each depth bin, with the counts behind it and a reliability table
measured on prompts the fit did not see. Without calibration, the acceptance's per-distance,
per-rank rows are the prior: c = accuracy[depth - 1][rank].

Online correction (`OnlineMap`): during decoding every candidate whose parent was accepted is an
observation of its cell; the cell's c becomes (s c0 + hits) / (s + trials) with counts that decay
by `forget` each step, so a prompt where guesses fail falls back to plain steps within a few steps
and one where they succeed grows its trees.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from planner.errors import UserError
from planner.guessers import LOOKUP_SIGNAL

SIGNALS = ("q", LOOKUP_SIGNAL)
# q bins: finer at the low end, where most drafted tokens sit
Q_EDGES = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LOOKUP_NGRAMS = 4  # matched n-gram length 1..3, 4+ pooled
LOOKUP_COUNTS = (1, 2, 3, 5)  # follow-count bins: 1, 2, 3-4, 5+
DEPTH_BINS = 4  # distances 1, 2, 3, 4+
MAX_DYNAMIC_SIZE = 64
MAX_POOL_DEPTH = 16
MAX_COST_LENGTH = 8192


# ---------------------------------------------------------------------------------------------- signal -> bin


def q_bins(q: np.ndarray) -> np.ndarray:
    """Bin index of each probability q (0..len(Q_EDGES) - 2)."""
    return np.clip(np.searchsorted(Q_EDGES, q, side="right") - 1, 0, len(Q_EDGES) - 2)


def lookup_bins(ngram: np.ndarray, follows: np.ndarray) -> np.ndarray:
    """(matched n-gram length, times that n-gram was followed by this token) -> one bin index,
    n-gram-major: bin = (min(ngram, 4) - 1) * 4 + count bin."""
    g = np.clip(np.asarray(ngram), 1, LOOKUP_NGRAMS) - 1
    c = np.clip(np.searchsorted(LOOKUP_COUNTS, np.asarray(follows), side="right") - 1, 0, len(LOOKUP_COUNTS) - 1)
    return g * len(LOOKUP_COUNTS) + c


def lookup_bin_list(ngram: int, follows: list[int]) -> list[int]:
    """lookup_bins for one match (its n-gram length and each token's follow count), in plain ints."""
    from bisect import bisect_right

    g = (min(max(ngram, 1), LOOKUP_NGRAMS) - 1) * len(LOOKUP_COUNTS)
    return [g + max(bisect_right(LOOKUP_COUNTS, f) - 1, 0) for f in follows]


def num_bins(signal: str) -> int:
    return len(Q_EDGES) - 1 if signal == "q" else LOOKUP_NGRAMS * len(LOOKUP_COUNTS)


def depth_bins(depth: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(depth), 1, DEPTH_BINS) - 1


def bin_labels(signal: str) -> list[str]:
    if signal == "q":
        return [f"q {Q_EDGES[i]:.2f}-{Q_EDGES[i + 1]:.2f}" for i in range(len(Q_EDGES) - 1)]
    counts = [f"{a}" if b - a == 1 else f"{a}-{b - 1}" for a, b in zip(LOOKUP_COUNTS, LOOKUP_COUNTS[1:])] + [f"{LOOKUP_COUNTS[-1]}+"]
    return [f"{g + 1}{'+' if g + 1 == LOOKUP_NGRAMS else ''}-gram, followed {c}" for g in range(LOOKUP_NGRAMS) for c in counts]


# ---------------------------------------------------------------------------------------------- calibration


def isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [value, weight, length]
    for v, wt in zip(y.tolist(), w.tolist()):
        blocks.append([v, wt, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            wt_ = w1 + w2
            blocks.append([(v1 * w1 + v2 * w2) / wt_ if wt_ > 0 else (v1 + v2) / 2, wt_, n1 + n2])
    return np.array([v for v, _, n in blocks for _ in range(n)])


@dataclass
class Calibration:
    """c[depth bin, signal bin] = P(accepted | parent accepted), monotone in the signal bin."""

    signal: str  # "q" or "lookup"
    p: np.ndarray  # [DEPTH_BINS, B]
    hits: np.ndarray  # [DEPTH_BINS, B] observations the fit used
    totals: np.ndarray
    reliability: list[dict] = field(default_factory=list)  # held-out: per cell, predicted vs realised
    source: dict = field(default_factory=dict)

    def conditional(self, depth: np.ndarray, bins: np.ndarray) -> np.ndarray:
        return self.p[depth_bins(depth), bins]

    def to_json(self) -> dict:
        return {"signal": self.signal, "depth_bins": DEPTH_BINS,
                "bins": bin_labels(self.signal), "p": self.p.round(6).tolist(),
                "hits": self.hits.tolist(), "totals": self.totals.tolist(),
                "reliability": self.reliability, **self.source}


def fit_calibration(signal: str, depth: np.ndarray, bins: np.ndarray, accepted: np.ndarray,
                    smoothing: float = 2.0) -> Calibration:
    """Fit c[depth bin, bin] from observations (each: a candidate whose parent was accepted).

    Empty and thin cells lean on their depth bin's mean (`smoothing` pseudo-observations), then
    pool adjacent violators make each depth row non-decreasing in the signal."""
    if signal not in SIGNALS:
        raise UserError(f"calibration: signal must be one of {', '.join(SIGNALS)}, got {signal!r}")
    B = num_bins(signal)
    hits = np.zeros((DEPTH_BINS, B))
    totals = np.zeros((DEPTH_BINS, B))
    np.add.at(totals, (depth_bins(depth), bins), 1)
    np.add.at(hits, (depth_bins(depth), bins), np.asarray(accepted, dtype=np.float64))
    p = np.zeros((DEPTH_BINS, B))
    for d in range(DEPTH_BINS):
        row_mean = hits[d].sum() / totals[d].sum() if totals[d].sum() > 0 else (p[d - 1].mean() if d else 0.0)
        smooth = (hits[d] + smoothing * row_mean) / (totals[d] + smoothing)
        if signal == "q":
            p[d] = isotonic(smooth, totals[d] + smoothing)
        else:  # monotone in the follow count within each n-gram length
            C = len(LOOKUP_COUNTS)
            for g in range(LOOKUP_NGRAMS):
                sl = slice(g * C, (g + 1) * C)
                p[d, sl] = isotonic(smooth[sl], totals[d, sl] + smoothing)
    return Calibration(signal, np.clip(p, 0.0, 1.0), hits, totals)


def reliability(cal: Calibration, depth: np.ndarray, bins: np.ndarray, accepted: np.ndarray) -> list[dict]:
    """Predicted vs realised acceptance per (depth bin, signal bin) on observations the fit did not see."""
    pred = cal.conditional(depth, bins)
    db = depth_bins(depth)
    labels = bin_labels(cal.signal)
    out = []
    for d in range(DEPTH_BINS):
        for b in range(cal.p.shape[1]):
            m = (db == d) & (bins == b)
            if m.any():
                out.append({"depth_bin": d + 1, "bin": labels[b], "n": int(m.sum()),
                            "predicted": float(pred[m].mean()), "realised": float(np.mean(accepted[m]))})
    return out


def calibration_from_json(obj, label: str) -> Calibration:
    if not isinstance(obj, dict) or obj.get("signal") not in SIGNALS:
        raise UserError(f"{label}: field 'calibration.signal' must be one of {', '.join(SIGNALS)}")
    B = num_bins(obj["signal"])
    arrays = {}
    for key in ("p", "hits", "totals"):
        try:
            a = np.array(obj.get(key), dtype=np.float64)
        except (TypeError, ValueError):
            a = np.zeros(0)
        if a.shape != (DEPTH_BINS, B) or not np.isfinite(a).all():
            raise UserError(f"{label}: field 'calibration.{key}' must be a {DEPTH_BINS} x {B} table of numbers")
        arrays[key] = a
    if (arrays["p"] < 0).any() or (arrays["p"] > 1).any():
        raise UserError(f"{label}: field 'calibration.p' must hold probabilities in [0, 1]")
    rel = obj.get("reliability", [])
    if not isinstance(rel, list):
        raise UserError(f"{label}: field 'calibration.reliability' must be a list")
    extra = {k: v for k, v in obj.items() if k in ("prompts", "observations", "held_out_observations", "guesser", "source")}
    return Calibration(obj["signal"], arrays["p"], arrays["hits"], arrays["totals"], rel, extra)


# ---------------------------------------------------------------------------------------------- the plan's decision model


@dataclass
class GuesserModel:
    """What one guesser's candidates are worth: its calibration, else the acceptance rows (prior)."""

    kind: str  # lookup, draft, parallelspec, chain, ppd
    prior: np.ndarray  # [D, K] accuracy rows (conditional on the rank-0 path)
    calibration: Calibration | None = None
    draft_s: float = 0.0  # one drafter pass
    draft_passes: str = "depth"  # depth: one pass per level; one: one pass per step

    @property
    def signal(self) -> str:
        from planner.guessers import kind

        return kind(self.kind).signal

    @property
    def branches(self) -> bool:
        """Its candidates at a distance can have siblings (lookup proposes one continuation)."""
        from planner.guessers import kind

        return kind(self.kind).branches

    def cells(self, depth: np.ndarray, rank: np.ndarray, bins: np.ndarray) -> np.ndarray:
        """Flat cell index per candidate: its calibration cell, or its (distance, rank) prior cell."""
        if self.calibration is not None:
            return depth_bins(depth) * self.calibration.p.shape[1] + bins
        D, K = self.prior.shape
        return (np.clip(depth, 1, D) - 1) * K + np.clip(rank, 0, K - 1)

    def base(self) -> np.ndarray:
        """c0 per flat cell."""
        if self.calibration is not None:
            return self.calibration.p.reshape(-1).copy()
        return self.prior.reshape(-1).copy()

    def to_json(self) -> dict:
        d = {"kind": self.kind, "prior": self.prior.round(6).tolist(), "draft_s": self.draft_s,
             "draft_passes": self.draft_passes}
        if self.calibration is not None:
            d["calibration"] = self.calibration.to_json()
        return d


MAX_PRIOR_STRENGTH = 1e6  # dynamic.prior_strength's bound: at it the priors outweigh any prompt's observations


@dataclass
class DynamicSpec:
    """A dynamic plan's settings: the size limit, the step cost at every size, the guessers' maps."""

    max_size: int  # candidates per step at most
    step_cost_s: list[float]  # [i]: step cost of a forward over i + 1 input tokens; all equal without a profile
    guessers: dict[str, GuesserModel]
    max_depth: int = 8  # deepest candidate a pool offers
    prior_strength: float = 4.0  # online correction: pseudo-observations of the calibrated c
    forget: float = 0.95  # online correction: evidence decays by this per step
    profiled: bool = True  # False: every size costs the same (no profile)
    # the decision's own cost per step, one constant priced into every step's choice and the
    # predictions: the main job records its replay's median (workflows/mainjob/predict.py); 0 unmeasured
    decide_s: float = 0.0

    def to_json(self) -> dict:
        return {"max_size": self.max_size, "max_depth": self.max_depth, "step_cost_s": list(self.step_cost_s),
                "profiled": self.profiled, "prior_strength": self.prior_strength, "forget": self.forget,
                "decide_s": self.decide_s, "guessers": {k: g.to_json() for k, g in self.guessers.items()}}


def _num(x, label, field_, lo=0.0, hi=math.inf) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not lo <= x <= hi:
        raise UserError(f"{label}: field '{field_}' must be a number in [{lo}, {hi}], got {x!r}")
    return float(x)


def spec_from_json(obj, label: str) -> DynamicSpec:
    if not isinstance(obj, dict):
        raise UserError(f"{label}: field 'dynamic' must be an object (a dynamic plan's settings)")
    n = obj.get("max_size")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DYNAMIC_SIZE:
        raise UserError(f"{label}: field 'dynamic.max_size' must be an integer in 1..{MAX_DYNAMIC_SIZE}, got {n!r}")
    depth = obj.get("max_depth", 8)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_POOL_DEPTH:
        raise UserError(f"{label}: field 'dynamic.max_depth' must be an integer in 1..{MAX_POOL_DEPTH}")
    cost = obj.get("step_cost_s")
    if not isinstance(cost, list) or not n + 1 <= len(cost) <= MAX_COST_LENGTH:
        raise UserError(f"{label}: field 'dynamic.step_cost_s' must list the step cost at input lengths 1..N, "
                        f"{n + 1} <= N <= {MAX_COST_LENGTH}")
    cost = [_num(c, label, f"dynamic.step_cost_s[{i}]", 1e-12) for i, c in enumerate(cost)]
    gs = obj.get("guessers")
    if not isinstance(gs, dict) or not gs:
        raise UserError(f"{label}: field 'dynamic.guessers' must map guesser kinds to their maps")
    models = {}
    for kind, g in gs.items():
        f = f"dynamic.guessers.{kind}"
        if kind not in dynamic_kinds() or not isinstance(g, dict):
            raise UserError(f"{label}: field '{f}': unknown guesser kind (expected one of {', '.join(dynamic_kinds())})")
        try:
            prior = np.array(g.get("prior"), dtype=np.float64)
        except (TypeError, ValueError):
            prior = np.zeros(0)
        if prior.ndim != 2 or prior.size == 0 or not np.isfinite(prior).all() or (prior < 0).any() or (prior > 1).any():
            raise UserError(f"{label}: field '{f}.prior' must be a non-empty table of probabilities (distance x rank)")
        cal = calibration_from_json(g["calibration"], f"{label}: {f}") if g.get("calibration") is not None else None
        passes = g.get("draft_passes", "depth")
        if passes not in ("depth", "one"):
            raise UserError(f"{label}: field '{f}.draft_passes' must be depth or one")
        models[kind] = GuesserModel(kind, prior, cal, _num(g.get("draft_s", 0.0), label, f"{f}.draft_s"), passes)
    return DynamicSpec(n, cost, models, depth, _num(obj.get("prior_strength", 4.0), label, "dynamic.prior_strength", 0.0, MAX_PRIOR_STRENGTH),
                       _num(obj.get("forget", 0.95), label, "dynamic.forget", 0.0, 1.0), bool(obj.get("profiled", True)),
                       _num(obj.get("decide_s", 0.0), label, "dynamic.decide_s"))


def dynamic_kinds() -> list[str]:
    """The registered kinds a dynamic plan can hold a map for (planner/guessers.py)."""
    from planner.guessers import kinds

    return [k.name for k in kinds(hybrids=False) if k.dynamic]


# ---------------------------------------------------------------------------------------------- the step's decision


def path_probabilities(parent: np.ndarray, c: np.ndarray) -> np.ndarray:
    """P(v) = product of c along the path; parents come before children (parent -1: the root)."""
    P = np.empty(len(c))
    for i in range(len(c)):  # pools are tens of nodes: a python loop over floats beats array calls
        j = parent[i]
        P[i] = c[i] if j < 0 else P[j] * c[i]
    return P


@dataclass
class Choice:
    chosen: list[int]  # pool indices, parents before children
    expected_tokens: float
    cost_s: float


def choose(P: np.ndarray, step_cost: np.ndarray, sunk_s: float = 0.0, max_size: int | None = None) -> Choice:
    """The n most probable paths (parents first on ties) for the n maximising (1 + sum P) / (sunk + cost[n])."""
    limit = min(len(P), len(step_cost) - 1, max_size if max_size is not None else len(P))
    if limit <= 0:
        return Choice([], 1.0, sunk_s + float(step_cost[0]))
    order = np.lexsort((np.arange(len(P)), -P))[:limit]  # best first; ties: lower index (the parent) first
    tau = 1.0 + np.concatenate([[0.0], np.cumsum(P[order])])  # [limit + 1]
    cost = sunk_s + step_cost[: limit + 1]
    n = int(np.argmax(tau / cost))
    return Choice(sorted(order[:n].tolist()), float(tau[n]), float(cost[n]))


class OnlineMap:
    """c per flat cell, corrected by decaying Beta counts: (s c0 + hits) / (s + trials)."""

    def __init__(self, base: np.ndarray, strength: float, forget: float):
        self.base, self.s, self.forget = base, strength, forget
        self.hits = np.zeros_like(base)
        self.trials = np.zeros_like(base)
        self.c = base.copy()

    def observe(self, cells: np.ndarray, accepted: np.ndarray) -> None:
        self.hits *= self.forget
        self.trials *= self.forget
        if len(cells):
            np.add.at(self.trials, cells, 1.0)
            np.add.at(self.hits, cells, accepted)
        self.c = (self.s * self.base + self.hits) / (self.s + self.trials)

    def summary(self) -> dict:
        seen = self.trials > 1e-3
        return {"cells_observed": int(seen.sum()),
                "mean_correction": float((self.c[seen] - self.base[seen]).mean()) if seen.any() else 0.0}


# ---------------------------------------------------------------------------------------------- planning


def dynamic_spec(models: dict[str, GuesserModel], max_size: int, step_cost_s: list[float] | None,
                 max_depth: int = 8, decide_s: float = 0.0) -> DynamicSpec:
    """step_cost_s: the cost at input lengths 1..N (N >= max_size + 1); None: every size costs the same.
    decide_s: the decision's cost per step (DynamicSpec.decide_s)."""
    if isinstance(max_size, bool) or not isinstance(max_size, int) or not 1 <= max_size <= MAX_DYNAMIC_SIZE:
        raise UserError(f"--max-size: expected an integer in 1..{MAX_DYNAMIC_SIZE}, got {max_size}")
    profiled = step_cost_s is not None
    cost = list(step_cost_s) if profiled else [1.0] * (max_size + 1)
    return DynamicSpec(max_size, cost, models, max_depth, profiled=profiled,
                       decide_s=_num(decide_s, "dynamic plan", "decide_s"))


def prior_pool(model: GuesserModel, depth: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The prior's Cartesian pool (rank paths up to `depth`, `width` ranks): parents and c, best-first order
    not needed. Used to predict a dynamic plan's tokens per step before any decoding."""
    D, K = model.prior.shape
    width = min(width, K)
    parents, c, frontier = [], [], [(-1, 0)]
    for d in range(1, min(depth, D) + 1):
        nxt = []
        for parent, _ in frontier:
            for r in range(width if model.branches else 1):
                parents.append(parent)
                c.append(model.prior[d - 1, r])
                nxt.append((len(parents) - 1, r))
        # keep the pool small: only the rank-0 line and its siblings grow deeper
        frontier = [x for x in nxt if x[1] == 0] if len(nxt) > 16 else nxt
    return np.array(parents, dtype=np.int64), np.array(c)


def predict_static_prior(model: GuesserModel, spec: DynamicSpec, plain_s: float) -> dict:
    """The decision on the prior alone (every step alike): tokens per step, step cost, speedup.
    A lower bound on what per-step choice gains (it only adds variation the prior averages out)."""
    parents, c = prior_pool(model, spec.max_depth, 4)
    P = path_probabilities(parents, c)
    cost = np.array(spec.step_cost_s[: spec.max_size + 1])
    best = choose(P, cost, 0.0, spec.max_size)
    depth = 0
    if best.chosen:
        depths = np.zeros(len(parents), dtype=np.int64)
        for i, p in enumerate(parents):
            depths[i] = 1 if p < 0 else depths[p] + 1
        depth = int(depths[best.chosen].max())
    passes = 0 if depth == 0 else (depth if model.draft_passes == "depth" else 1)
    step = best.cost_s + passes * model.draft_s + spec.decide_s
    return {"size": len(best.chosen), "tokens_per_step": best.expected_tokens, "step_s": step,
            "speedup": best.expected_tokens * plain_s / step}
