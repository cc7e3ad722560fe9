"""MTAD planning: pick (W, gamma, tau_acc) from measured joint-ratio walks, the one cost model and
a perplexity cap (docs/seed-systems.md, section 'MTAD'). numpy only.

Acceptance is a random walk, not a first failure. A beam draft x_1..x_gamma has per-token
log-ratios D_j = log p~(x_j) - log q~(x_j) (target vs drafter, both warped alike; -inf where the
target's warped support misses x_j), and MTAD accepts the longest passing prefix

    i* = max{ i in 0..gamma : S_i >= log tau_acc },   S_i = sum_{j<=i} D_j,   S_0 = 0 (always passes).

- E[i*](W, gamma, tau_acc): replay the walks measured on beam drafts of that (W, gamma) (exact for
  that data; the walks are correlated and depend on W, so no independence is assumed), or, as a
  model, a DP over an i.i.d. walk whose increments are discretised on a lattice.
- tokens/step = E[i*] + 1;  step_s = gamma t_d(W) + step_cost(L, n)  (planner.cost: the target's
  forward over root + draft, n = gamma + 1 for one beam or the measured mean size of the W beams'
  tree, plus the decoder's overhead; t_d(W): one drafter forward at
  batch W, paid gamma times: the first pass runs at batch 1, so this errs slightly high);
  speedup = (E[i*] + 1) plain_step / step_s.
- Quality: produced-text perplexity per (W, gamma, tau_acc) comes from measurement (a grid on
  held-out prompts); `choose` maximises predicted speedup subject to ppl <= R ppl_plain and
  reports the (speedup, perplexity) Pareto front.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from planner.cost import plain_step, step_cost
from planner.errors import UserError
from planner.profile import LatencyProfile

MAX_WIDTH = 64  # beams: the drafter runs at batch W, and the paper saturates by 8
MAX_GAMMA = 32  # draft tokens per step


# ---------------------------------------------------------------------------------------------- settings


def _positive_int(x, name: str, hi: int, label: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not 1 <= x <= hi:
        raise UserError(f"{label}: {name} must be an integer in 1..{hi}, got {x!r}")
    return int(x)


@dataclass(frozen=True)
class MTADSettings:
    """One MTAD configuration: W beams, gamma draft tokens, acceptance threshold tau_acc in [0, 1]."""

    width: int
    gamma: int
    tau_acc: float

    def __post_init__(self):
        _positive_int(self.width, "W", MAX_WIDTH, "mtad")
        _positive_int(self.gamma, "GAMMA", MAX_GAMMA, "mtad")
        t = self.tau_acc
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0.0 <= t <= 1.0):
            raise UserError(f"mtad: TAU must be a number in [0, 1], got {t!r}")

    @classmethod
    def parse(cls, spec: str, label: str = "--mtad") -> "MTADSettings":
        """'W,GAMMA,TAU' (e.g. '4,3,0.1') -> settings; a one-line UserError otherwise."""
        parts = str(spec).split(",")
        if len(parts) != 3:
            raise UserError(f"{label} {spec}: expected W,GAMMA,TAU (e.g. 4,3,0.1)")
        try:
            w, g, t = int(parts[0]), int(parts[1]), float(parts[2])
        except ValueError:
            raise UserError(f"{label} {spec}: expected W,GAMMA,TAU with integers W, GAMMA and a number TAU") from None
        try:
            return cls(w, g, t)
        except UserError as e:
            raise UserError(f"{label} {spec}: {str(e).partition(': ')[2]}") from None

    @property
    def name(self) -> str:
        return f"W{self.width}-g{self.gamma}-t{self.tau_acc:g}"


def grid(widths: Sequence[int], gammas: Sequence[int], taus: Sequence[float]) -> list[MTADSettings]:
    return [MTADSettings(w, g, t) for w in widths for g in gammas for t in taus]


# ---------------------------------------------------------------------------------------------- the rule


def log_threshold(tau_acc: float) -> float:
    """log tau_acc, with tau 0 -> -inf (every prefix passes) and tau inf -> inf (only i = 0 passes:
    plain target sampling; the decoder accepts it for tests, the settings do not)."""
    if isinstance(tau_acc, bool) or not isinstance(tau_acc, (int, float)) or math.isnan(tau_acc) or tau_acc < 0:
        raise UserError(f"tau_acc: expected a number >= 0, got {tau_acc!r}")
    return -math.inf if tau_acc == 0 else math.log(tau_acc)


def accepted_length(log_ratios: Sequence[float], tau_acc: float) -> int:
    """i* = max{i : S_i >= log tau_acc} for one walk (D_1..D_gamma; -inf allowed, never NaN).
    The decoder's verification calls this, so the planner's replay and decoding share one rule."""
    c = log_threshold(tau_acc)
    best, s = 0, 0.0
    for i, d in enumerate(log_ratios, start=1):
        s = -math.inf if (d == -math.inf or s == -math.inf) else s + d
        if s >= c:
            best = i
    return best


def accepted_lengths(walks: np.ndarray, tau_acc: float) -> np.ndarray:
    """i* for each row of walks [N, gamma] (vectorised `accepted_length`)."""
    walks = np.asarray(walks, dtype=np.float64)
    if walks.ndim != 2:
        raise UserError(f"walks: expected a [N, gamma] array, got shape {walks.shape}")
    if walks.shape[1] == 0:
        return np.zeros(walks.shape[0], dtype=np.int64)
    if np.isnan(walks).any() or (walks == np.inf).any():
        raise UserError("walks: log-ratios must be finite or -inf")
    S = np.cumsum(walks, axis=1)  # -inf stays -inf: increments are never +inf
    passes = S >= log_threshold(tau_acc)
    g = walks.shape[1]
    return np.where(passes.any(axis=1), g - np.argmax(passes[:, ::-1], axis=1), 0).astype(np.int64)


def expected_accepted(walks: np.ndarray, gamma: int, tau_acc: float) -> float:
    """E[i*] by replaying measured walks [N, >= gamma] (their first gamma steps)."""
    walks = np.asarray(walks, dtype=np.float64)
    if walks.ndim != 2 or walks.shape[0] == 0 or walks.shape[1] < gamma:
        raise UserError(f"walks: need [N >= 1, >= {gamma}] log-ratios, got shape {walks.shape}")
    return float(accepted_lengths(walks[:, :gamma], tau_acc).mean())


# ---------------------------------------------------------------------------------------------- an i.i.d. model


@dataclass(frozen=True)
class IncrementLattice:
    """An i.i.d. increment D on a lattice: D = k * step with probability probs[i] for k = ks[i],
    D = -inf with probability `dead` (a token outside the target's warped support)."""

    step: float
    ks: np.ndarray  # [K] int
    probs: np.ndarray  # [K], sum = 1 - dead
    dead: float = 0.0


def discretise(values, step: float) -> IncrementLattice:
    """The empirical distribution of measured increments, rounded to multiples of `step`."""
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0 or not step > 0:
        raise UserError("discretise: need at least one value and step > 0")
    finite = v[np.isfinite(v)]
    ks, counts = np.unique(np.rint(finite / step).astype(np.int64), return_counts=True)
    return IncrementLattice(float(step), ks, counts / v.size, float((v.size - finite.size) / v.size))


def expected_accepted_iid(lat: IncrementLattice, gamma: int, tau_acc: float) -> float:
    """E[i*] for an i.i.d. walk on the lattice, exactly, by dynamic programming.

    P(i* = i) = sum_s f_i(s) [s >= c] g_i(s), with f_i the law of S_i (f_0 = delta at 0; i = 0
    passes by definition), and g_i(s) = P(S_j < c for all j in i+1..gamma | S_i = s) by the
    backward recursion g_gamma = 1, g_i(s) = dead + sum_k p_k [s + k h < c] g_{i+1}(s + k h)
    (a dead walk, S = -inf, never passes again). E[i*] = sum_i i P(i* = i).
    """
    c = log_threshold(tau_acc)
    if c == -math.inf:
        return float(gamma)  # every prefix passes, dead ones included
    lo = gamma * min(int(lat.ks.min(initial=0)), 0)
    hi = gamma * max(int(lat.ks.max(initial=0)), 0)
    values = np.arange(lo, hi + 1) * lat.step  # S on the lattice
    below = values < c
    g = [np.ones(values.size)]  # g_gamma, built backwards
    for _ in range(gamma):
        nxt = g[-1]
        cur = np.full(values.size, lat.dead)
        for k, p in zip(lat.ks, lat.probs):
            cur += p * _shifted(below * nxt, int(k))
        g.append(cur)
    g = g[::-1]  # g[i] for i = 0..gamma
    f = np.zeros(values.size)
    f[-lo] = 1.0
    expect = 0.0
    for i in range(1, gamma + 1):
        f = sum(p * _shifted(f, -int(k)) for k, p in zip(lat.ks, lat.probs))
        expect += i * float(np.sum(f * (values >= c) * g[i]))
    return expect


def _shifted(a: np.ndarray, k: int) -> np.ndarray:
    """out[s] = a[s + k] (zero outside): a value k lattice steps away."""
    out = np.zeros_like(a)
    if k >= 0:
        out[: a.size - k] = a[k:]
    else:
        out[-k:] = a[: a.size + k]
    return out


# ---------------------------------------------------------------------------------------------- speed and choice


@dataclass
class MTADPoint:
    """One configuration as the planner sees it: predicted speed and measured perplexity."""

    settings: MTADSettings
    expected_accepted: float
    tokens_per_step: float
    step_s: float
    speedup: float
    perplexity: float | None = None
    perplexity_ratio: float | None = None
    within_cap: bool = True

    def to_json(self) -> dict:
        out = asdict(self)
        out["settings"] = asdict(self.settings)
        out["name"] = self.settings.name
        return out


@dataclass
class MTADChoice:
    chosen: MTADPoint | None  # None: no configuration meets the cap (decode plainly)
    points: list[MTADPoint]
    front: list[MTADPoint]  # Pareto front of (speedup up, perplexity down)
    plain_perplexity: float
    max_perplexity_ratio: float | None

    def to_json(self) -> dict:
        return {"chosen": None if self.chosen is None else self.chosen.to_json(),
                "points": [p.to_json() for p in self.points], "front": [p.settings.name for p in self.front],
                "plain_perplexity": self.plain_perplexity, "max_perplexity_ratio": self.max_perplexity_ratio}


def step_seconds(settings: MTADSettings, profile: LatencyProfile, draft_s: Mapping[int, float],
                 forward_tokens: float | None = None) -> float:
    """gamma t_d(W) + L(n) + overhead(n), n = forward_tokens: the mean tokens of the target's forward
    (root + the beams' tree, measured), or gamma + 1 (one beam as a chain) when not given."""
    if settings.width not in draft_s:
        raise UserError(f"draft latency: no drafter time measured at batch {settings.width}")
    n = settings.gamma + 1 if forward_tokens is None else forward_tokens
    return settings.gamma * float(draft_s[settings.width]) + float(step_cost(profile, n))


def predict(walks: Mapping[tuple[int, int], np.ndarray], settings: MTADSettings, profile: LatencyProfile,
            draft_s: Mapping[int, float], forward_tokens: Mapping[tuple[int, int], float] | None = None) -> MTADPoint:
    """Predicted speed of one configuration from the walks (and forward sizes) measured at its (W, gamma)."""
    key = (settings.width, settings.gamma)
    if key not in walks:
        raise UserError(f"walks: none measured for W = {settings.width}, gamma = {settings.gamma}")
    e = expected_accepted(walks[key], settings.gamma, settings.tau_acc)
    step = step_seconds(settings, profile, draft_s, (forward_tokens or {}).get(key))
    return MTADPoint(settings, e, e + 1.0, step, (e + 1.0) * plain_step(profile) / step)


def pareto_front(points: Sequence[MTADPoint]) -> list[MTADPoint]:
    """Points no other point beats on both speedup (higher) and perplexity (lower), fastest first."""
    ranked = sorted((p for p in points if p.perplexity is not None), key=lambda p: (-p.speedup, p.perplexity))
    front, best = [], math.inf
    for p in ranked:
        if p.perplexity < best:
            front.append(p)
            best = p.perplexity
    return front


def choose(walks: Mapping[tuple[int, int], np.ndarray], perplexity: Mapping[MTADSettings, float],
           plain_perplexity: float, profile: LatencyProfile, draft_s: Mapping[int, float],
           max_perplexity_ratio: float | None = None,
           forward_tokens: Mapping[tuple[int, int], float] | None = None) -> MTADChoice:
    """The measured configurations (keys of `perplexity`), each with its predicted speedup; the
    chosen one maximises speedup subject to perplexity <= R * plain_perplexity (R None: no cap),
    ties to the lower perplexity."""
    if not perplexity:
        raise UserError("mtad planning: no configuration with a measured perplexity")
    bad = [s.name for s, v in perplexity.items() if v is None or not v > 0]
    if bad:
        raise UserError(f"mtad planning: no positive perplexity measured for {', '.join(bad)}")
    if plain_perplexity is None or not (plain_perplexity > 0 and math.isfinite(plain_perplexity)):
        raise UserError(f"mtad planning: plain perplexity must be a positive number, got {plain_perplexity!r}")
    if max_perplexity_ratio is not None and not max_perplexity_ratio > 0:
        raise UserError(f"--max-perplexity-ratio: expected a number > 0, got {max_perplexity_ratio!r}")
    points = []
    for settings, ppl in perplexity.items():
        p = predict(walks, settings, profile, draft_s, forward_tokens)
        p.perplexity, p.perplexity_ratio = float(ppl), float(ppl) / plain_perplexity
        p.within_cap = max_perplexity_ratio is None or p.perplexity_ratio <= max_perplexity_ratio
        points.append(p)
    ok = [p for p in points if p.within_cap]
    chosen = max(ok, key=lambda p: (p.speedup, -p.perplexity)) if ok else None
    return MTADChoice(chosen, points, pareto_front(points), float(plain_perplexity), max_perplexity_ratio)


# ---------------------------------------------------------------------------------------------- storage


def walks_to_json(walks: Mapping[tuple[int, int], np.ndarray]) -> list[dict]:
    """JSON has no -inf: it is written as null."""
    return [{"width": w, "gamma": g, "log_ratios": [[None if x == -math.inf else round(float(x), 5) for x in row]
                                                    for row in np.asarray(a)]}
            for (w, g), a in sorted(walks.items())]


def walks_from_json(data) -> dict[tuple[int, int], np.ndarray]:
    try:
        return {(int(d["width"]), int(d["gamma"])): np.array([[-math.inf if x is None else float(x) for x in row]
                                                              for row in d["log_ratios"]], dtype=np.float64)
                for d in data}
    except (KeyError, TypeError, ValueError):
        raise UserError("walks: expected a list of {width, gamma, log_ratios} objects") from None
