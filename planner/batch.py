"""Batched speculative decoding (EMS-SD): the accepted-length law, padding, and plans per batch size.

Notation (docs/seed-systems.md, section 'EMS-SD'): tau is the number of tokens one sequence
gains in a step, the root counted (1..depth+1). Under the independence model a tree gives

    P(tau >= j) = sum of P(v) over its depth-(j-1) candidates

(at most one node per depth is accepted, so those events are disjoint); a chain of k guesses,
each right with probability p, gives P(tau >= j) = p^(j-1). A PPD plan's per-step law is the
mixture over its states weighted by the stationary distribution. Sequences of a batch are
independent of each other, so with F the CDF of tau, for b sequences:

    E[tau]     = sum_j P(tau >= j)
    E[tau_max] = sum_{j>=1} [1 - F(j-1)^b]                        (exact)
    E[delta]   = E[tau_max] - E[tau]                              padding per step
    E[r]       = 1 - E[tau_1 / max(tau_1, M')]                    padding ratio, exact double sum,
                 M' the maximum of the other b - 1 (PMF from differences of F^(b-1))

Per-sequence speedup over batched plain decoding at the same b, by layout:

- packed (EMS-SD: no padding of the KV cache or the inputs): each sequence advances by its own
  tau and the step costs what planner.cost says on the profile measured at batch size b:
  E[tau] * step_b(plain) / sum_s pi_s step_b(n_s). [D] For PPD the b sequences sit in different
  states; their packed forward is priced as the mean of L_b over the per-sequence input lengths,
  not measured as a packed forward of sum n_i tokens.
- padded (vanilla): inputs are padded to the longest tree in the batch (exact under the model:
  cost.padded_step_latency) and every row's KV advances by tau_max, so a sequence's context
  grows by rho = E[tau_max] / E[tau] positions per generated token. [D] A profile is measured
  at one context length, so the extra context is priced linearly, b * kv_s * (rho - 1) * G / 2
  seconds per step (kv_s: seconds per KV position per row, `ContextCost`; G / 2: the mean over
  a generation of G tokens). With kv_s = 0, the default, only the input padding is priced; the
  KV padding is still reported (E[delta], E[r], rho). rho is a ratio of means, used for cost;
  the paper's E[r] is a mean of per-step ratios.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import numpy as np

from planner.accept import Acceptance
from planner.cost import Guessing, default_guessing, padded_step_latency, plain_step, state_weights, step_latency
from planner.errors import PlainIsFastest, UserError
from planner.plan import default_max_depth, plan
from planner.profile import LatencyProfile
from planner.tree import LAYOUTS, PPD, ScheduleEntry, Tree, TreeState

MAX_PADDED_CANDIDATES = 12  # sizes of the packed sweep re-scored under the padded model
PLAIN_FASTEST = "plain decoding is predicted fastest"


# ---------------------------------------------------------------- the law of tau


@dataclass(frozen=True)
class AcceptedLength:
    """The law of tau (root counted): survival[j-1] = P(tau >= j) for j = 1..K+1, survival[0] = 1."""

    survival: np.ndarray

    @property
    def mean(self) -> float:
        """E[tau] = sum_j P(tau >= j)."""
        return float(self.survival.sum())

    def pmf(self) -> np.ndarray:
        """P(tau = t) for t = 1..K+1."""
        return self.survival - np.append(self.survival[1:], 0.0)

    def cdf(self) -> np.ndarray:
        """F(m) = P(tau <= m) for m = 0..K+1 (F(0) = 0, F(K+1) = 1)."""
        return np.concatenate([[0.0], 1.0 - self.survival[1:], [1.0]])


def _law(survival) -> AcceptedLength:
    s = np.clip(np.asarray(survival, dtype=np.float64), 0.0, 1.0)
    s[0] = 1.0
    return AcceptedLength(np.minimum.accumulate(s))  # rounding must not make a survival function rise


def chain_law(p: float, k: int) -> AcceptedLength:
    """k guesses in a row, each right with probability p: P(tau >= j) = p^(j-1), j = 1..k+1."""
    if not 0.0 <= p <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= p <= 1 and k >= 0, got p={p}, k={k}")
    return _law(p ** np.arange(k + 1))


def state_law(st: TreeState, accept: Acceptance) -> AcceptedLength:
    """One tree: P(tau >= j) = sum of the path probabilities of its depth-(j-1) candidates."""
    surv = np.zeros(st.depth + 1)
    surv[0] = 1.0
    if not st.nodes:
        return _law(surv)
    rows = accept.rows(st.depth)
    prob = {(): 1.0}
    for path in st.nodes:  # parents first (validated tree files)
        rank, d = path[-1], len(path) - 1
        p_rank = rows[d, rank] if rank < rows.shape[1] else 0.0  # ranks a file does not list never hit
        prob[path] = prob[path[:-1]] * p_rank
        surv[d + 1] += prob[path]
    return _law(surv)


def tree_law(tree: Tree, accept: Acceptance) -> AcceptedLength:
    """The per-step law of a plan: one tree's, or the stationary mixture of a PPD plan's states."""
    laws = [state_law(st, accept).survival for st in tree.states]
    weights = np.asarray(state_weights(tree), dtype=np.float64)
    weights = weights / weights.sum()
    out = np.zeros(max(len(s) for s in laws))
    for w, s in zip(weights, laws):
        out[: len(s)] += w * s
    return _law(out)


def expected_max(law: AcceptedLength, batch_size: int) -> float:
    """E[tau_max] over b independent sequences = sum_{j>=1} [1 - F(j-1)^b] (exact)."""
    F = law.cdf()[:-1]  # F(j-1) for j = 1..K+1
    return float(np.sum(1.0 - F**batch_size))


def expected_padding(law: AcceptedLength, batch_size: int) -> float:
    """E[delta] = E[tau_max] - E[tau]: KV slots a padded row wastes per step."""
    return expected_max(law, batch_size) - law.mean


def padding_ratio(law: AcceptedLength, batch_size: int) -> float:
    """E[r] = 1 - E[tau_1 / max(tau_1, M')], M' = max of the other b - 1 sequences.

    P(M' = m) = F(m)^(b-1) - F(m-1)^(b-1), m = 0..K+1 (M' = 0 only when b = 1: no other
    sequence, no padding); an O(K^2) double sum over (tau_1, M').
    """
    if batch_size == 1:
        return 0.0
    G = law.cdf() ** (batch_size - 1)  # P(M' <= m), m = 0..K+1
    p_other = np.diff(np.concatenate([[0.0], G]))
    t = np.arange(1, len(law.survival) + 1, dtype=np.float64)[:, None]
    m = np.arange(0, len(G), dtype=np.float64)[None, :]
    kept = (law.pmf()[:, None] * p_other[None, :] * t / np.maximum(t, m)).sum()
    return float(1.0 - kept)


# ---------------------------------------------------------------- per-sequence speedup at batch b


@dataclass(frozen=True)
class ContextCost:
    """[D] The price of context a padded KV cache adds, which a one-context profile does not measure."""

    kv_s_per_token: float = 0.0  # seconds per step per KV position per row (0: unpriced)
    new_tokens: int = 128  # G, tokens generated per sequence

    def __post_init__(self):
        if not (isinstance(self.kv_s_per_token, (int, float)) and math.isfinite(self.kv_s_per_token)
                and self.kv_s_per_token >= 0):
            raise UserError(f"KV latency must be a finite number >= 0 seconds, got {self.kv_s_per_token!r}")
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 1:
            raise UserError(f"new tokens must be an integer >= 1, got {self.new_tokens!r}")

    def extra_step_s(self, batch_size: int, growth: float) -> float:
        """b * kv_s * (rho - 1) * G / 2: the mean extra context per row over a generation of G."""
        return batch_size * self.kv_s_per_token * (growth - 1.0) * self.new_tokens / 2.0


@dataclass(frozen=True)
class BatchPrediction:
    """The model's numbers for one plan at one batch size (see the module docstring)."""

    batch_size: int
    layout: str
    speedup: float  # per sequence, over batched plain decoding at this batch size
    tokens_per_step: float  # E[tau]
    expected_max_tokens: float  # E[tau_max]
    padding_per_step: float  # E[delta]
    padding_ratio: float  # E[r]
    context_growth: float  # rho = E[tau_max] / E[tau], KV positions per generated token when padded
    step_latency_s: float
    plain_step_s: float

    def to_json(self) -> dict:
        return asdict(self)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise UserError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")


def predict_batch(tree: Tree | None, accept: Acceptance, profile: LatencyProfile, batch_size: int,
                  guessing: Guessing = Guessing(), layout: str = "packed",
                  context: ContextCost = ContextCost()) -> BatchPrediction:
    """Per-sequence speedup of `tree` (None: plain decoding) for b sequences on the profile measured at b."""
    _check_layout(layout)
    plain = plain_step(profile)
    if tree is None:
        return BatchPrediction(batch_size, layout, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, plain, plain)
    law = tree_law(tree, accept)
    tau, tau_max = law.mean, expected_max(law, batch_size)
    growth = tau_max / tau
    if layout == "packed":
        step = step_latency(tree, profile, guessing)
    else:
        step = padded_step_latency(tree, profile, batch_size, guessing) + context.extra_step_s(batch_size, growth)
    return BatchPrediction(batch_size, layout, tau * plain / step, tau, tau_max, tau_max - tau,
                           padding_ratio(law, batch_size), growth, step, plain)


# ---------------------------------------------------------------- plans per batch size


@dataclass
class _Choice:
    batch_size: int
    tree: Tree | None
    prediction: BatchPrediction


def check_batch_sizes(batch_sizes, profiles_by_batch: Mapping[int, LatencyProfile], label: str = "profile") -> list[int]:
    """Sorted distinct batch sizes, each measured in the profile file."""
    sizes = sorted(set(batch_sizes))
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise UserError(f"batch sizes must be integers >= 1, got {list(batch_sizes)!r}")
    missing = [b for b in sizes if b not in profiles_by_batch]
    if missing:
        have = ", ".join(str(b) for b in sorted(profiles_by_batch))
        raise UserError(f"{label}: no latency series for batch size {missing[0]} (measured: {have})")
    return sizes


def plan_schedule(method: str, accept: Acceptance, profiles_by_batch: Mapping[int, LatencyProfile], batch_sizes,
                  guessing: Guessing | None = None, layout: str = "packed", context: ContextCost = ContextCost(),
                  **plan_kwargs) -> list[ScheduleEntry]:
    """The best tree per batch size, neighbours with the same tree merged into ranges.

    Each batch size is planned by planner.plan.plan on the profile measured at that batch size
    (packed: plan's own choice is the best; padded: the packed sweep's trees at up to
    MAX_PADDED_CANDIDATES sizes re-scored under the padded model [D: not re-optimised for
    padding]); None ("no speculation") wherever plain decoding is predicted at least as fast.
    Range i covers [b_i, b_{i+1} - 1], the first one from 1, the last one [b_n, b_n] (above it
    the last entry applies).
    """
    _check_layout(layout)
    label = next(iter(profiles_by_batch.values())).source.get("file", "profile") if profiles_by_batch else "profile"
    sizes = check_batch_sizes(batch_sizes, profiles_by_batch, label)
    if guessing is None:
        guessing = default_guessing(method, accept, draft_s=plan_kwargs.pop("draft_latency_s", None))
    choices = [_best_at(method, accept, profiles_by_batch[b], b, guessing, layout, context, plan_kwargs) for b in sizes]
    return _merge(choices, layout)


def _best_at(method, accept, profile, batch_size, guessing, layout, context, plan_kwargs) -> _Choice:
    tree = _plan_or_plain(method, accept, profile, guessing, plan_kwargs)
    candidates = [None] + ([tree] if tree is not None else [])
    if layout == "padded" and tree is not None:
        candidates += _resized(method, accept, profile, guessing, plan_kwargs, tree)
    scored = [(predict_batch(t, accept, profile, batch_size, guessing, layout, context), t) for t in candidates]
    best_pred, best = scored[0]  # plain decoding unless a tree is strictly faster
    for pred, t in scored[1:]:
        if pred.speedup > best_pred.speedup + 1e-12:
            best_pred, best = pred, t
    return _Choice(batch_size, best, best_pred)


def _plan_or_plain(method, accept, profile, guessing, plan_kwargs) -> Tree | None:
    try:
        return plan(method, accept, profile=profile, guessing=guessing, **plan_kwargs)
    except PlainIsFastest:  # plan refuses an empty static tree; here that means "no speculation"
        return None


def _resized(method, accept, profile, guessing, plan_kwargs, best: Tree) -> list[Tree]:
    """The packed sweep's trees at other sizes (spread over its size curve), for re-scoring."""
    rows = [r for r in (best.size_curve or []) if r.get("size", 0) >= 1]
    if not rows:
        return []
    picks = np.unique(np.round(np.geomspace(1, len(rows), min(MAX_PADDED_CANDIDATES, len(rows)))).astype(int)) - 1
    keep = {k: v for k, v in plan_kwargs.items() if k in ("prompt_tokens", "improved", "per_state_budgets")}
    out = []
    for r in (rows[i] for i in picks):
        if method == PPD:
            sized = {"input_length": int(r["planned_input_length"])}
        else:
            sized = {"size": int(r["size"]), "max_depth": int(r.get("depth") or best.settings["max_depth"])}
        out.append(plan(method, accept, profile=profile, guessing=guessing, **sized, **keep))
    return out


def _merge(choices: list[_Choice], layout: str) -> list[ScheduleEntry]:
    entries: list[ScheduleEntry] = []
    for i, c in enumerate(choices):
        lo = 1 if i == 0 else c.batch_size
        hi = choices[i + 1].batch_size - 1 if i + 1 < len(choices) else c.batch_size
        point = c.prediction.to_json()
        last = entries[-1] if entries else None
        if last is not None and _same(last.tree, c.tree):
            last.batch_sizes = (last.batch_sizes[0], hi)
            last.points.append(point)
            continue
        entries.append(ScheduleEntry((lo, hi), c.tree, c.prediction.speedup, c.prediction.tokens_per_step,
                                     layout, [point]))
    return entries


def _same(a: Tree | None, b: Tree | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape() == b.shape()


def tree_with_schedule(entries: list[ScheduleEntry]) -> Tree:
    """The tree file for a schedule: the batch-size-1 entry's tree on top (what schedule-unaware
    readers decode), or, where plain decoding is best at batch size 1, the first planned tree."""
    first = next((e.tree for e in entries if e.tree is not None), None)
    if first is None:
        raise UserError(f"{PLAIN_FASTEST} at every planned batch size: there is no tree to write")
    top = copy.deepcopy(first)
    top.schedule = entries
    return top


# ---------------------------------------------------------------- chains (engines without trees)


def chain_acceptance(accept: Acceptance) -> Acceptance:
    """The rank-0 guess at every distance only: a medusa plan on it is the best chain."""
    return Acceptance(accept.accuracy[:, :1].copy(), accept.positional, dict(accept.source, ranks="top-1 only"))


def plan_chain_schedule(accept: Acceptance, profiles_by_batch: Mapping[int, LatencyProfile], batch_sizes,
                        guessing: Guessing, layout: str = "packed", context: ContextCost = ContextCost(),
                        max_depth: int | None = None) -> list[ScheduleEntry]:
    """The best draft length per batch size for an engine that verifies chains only, planned as
    a chain (depth-only tree) under the same cost model. The engine's drafter feeds the chain's
    own tokens (no prompt tokens); drafting costs what `guessing` says."""
    depth = max_depth or default_max_depth(accept)
    chain_guess = replace(guessing, prompt_tokens=False, ensemble=1)
    return plan_schedule("medusa", chain_acceptance(accept), profiles_by_batch, batch_sizes, chain_guess, layout,
                         context, max_depth=depth, max_size=depth)
