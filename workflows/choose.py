"""Choosing a plan by measurement: paired timings per prompt, a race, and the decision.

Every finalist decodes the same prompts as plain decoding does. For prompt p an arm's speedup is
t_plain(p) / t_arm(p) (same tokens: every output equals plain greedy decoding). Prompts differ far
more than repeats of one prompt (how much an answer repeats its question decides prompt lookup),
so the prompt is the unit of resampling: an arm's speedup is the geometric mean over prompts,
with a bootstrap 95 % interval over prompts; two arms are compared on the prompts both decoded.

The race (`Race`) decodes prompts in stages. After each stage an arm clearly slower than the
leader (the interval of their paired ratio excludes 1) leaves; when the next stage would not fit
the time left, the slower half leaves (successive halving), so the time saved goes to the close
ones. Plain decoding always runs: it is the baseline and a candidate.

The decision (`decide`): among the arms measured faster than plain beyond the noise (their
interval vs plain lies above 1), the fastest, or a cheaper arm within the noise of it (ties go to
the cheaper plan); when none is faster than plain beyond the noise, plain decoding.
numpy only: the statistics are tested on synthetic measurements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PLAIN = "plain"
LEVEL = 0.95
RESAMPLES = 4000
MIN_PROMPTS = 3  # fewer paired prompts give no interval: nothing is decided on them


@dataclass
class Arm:
    """One plan in the race (or plain decoding): its cost and its timings per prompt."""

    key: str
    cost: float  # predicted step time relative to plain's (plain 1.0): ties go to the cheaper arm
    predicted_speedup: float = 1.0
    predicted_s: dict[int, float] = field(default_factory=dict)  # prompt -> predicted seconds (ETA)
    seconds: dict[int, float] = field(default_factory=dict)  # prompt -> measured seconds (median of repeats)
    dropped: str = ""  # why the arm left the race ("" while it runs)

    @property
    def running(self) -> bool:
        return not self.dropped


@dataclass(frozen=True)
class Interval:
    """A ratio (geometric mean over prompts) with its bootstrap interval; n = paired prompts."""

    mean: float
    lo: float
    hi: float
    n: int

    def to_json(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "prompts": self.n, "level": LEVEL}

    def __str__(self) -> str:
        if self.n < MIN_PROMPTS:
            return f"{self.mean:.2f}x (n={self.n}, no interval)"
        return f"{self.mean:.2f}x [{self.lo:.2f}, {self.hi:.2f}]"


def log_ratios(fast: Arm, slow: Arm) -> np.ndarray:
    """Per prompt both decoded: log(t_slow / t_fast); positive where `fast` really was faster."""
    common = sorted(set(fast.seconds) & set(slow.seconds))
    return np.array([math.log(slow.seconds[p] / fast.seconds[p]) for p in common], dtype=np.float64)


def bootstrap(x: np.ndarray, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """Geometric-mean ratio exp(mean(x)) with a percentile bootstrap interval over the prompts.
    Fewer than MIN_PROMPTS prompts: the interval is (0, inf), which decides nothing."""
    n = len(x)
    if n == 0:
        return Interval(1.0, 0.0, math.inf, 0)
    mean = float(np.exp(x.mean()))
    if n < MIN_PROMPTS:
        return Interval(mean, 0.0, math.inf, n)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return Interval(mean, float(np.exp(lo)), float(np.exp(hi)), n)


def speedup(arm: Arm, plain: Arm) -> Interval:
    """The arm's speedup over plain decoding on the prompts both decoded."""
    return bootstrap(log_ratios(arm, plain))


def clearly_faster(a: Arm, b: Arm) -> bool:
    """a beat b beyond the noise: the interval of t_b / t_a lies above 1."""
    return bootstrap(log_ratios(a, b)).lo > 1.0


@dataclass(frozen=True)
class Decision:
    choice: str  # an arm's key, or PLAIN
    speedup: Interval  # the chosen arm's measured speedup over plain (1.0 for plain)
    reason: str


def decide(arms: list[Arm]) -> Decision:
    """The plan to write: see the module docstring. `arms` includes plain decoding (key PLAIN);
    arms that left the race (clearly slower than another, or a wrong output) are not chosen."""
    plain = next(a for a in arms if a.key == PLAIN)
    others = [a for a in arms if a.key != PLAIN and a.seconds and a.running]  # out of the race: beaten, or wrong
    ups = {a.key: speedup(a, plain) for a in others}
    faster = [a for a in others if ups[a.key].lo > 1.0]
    if not faster:
        best = max(others, key=lambda a: ups[a.key].mean, default=None)
        if best is None:
            why = "no plan was measured"
        elif ups[best.key].mean < 1.0:
            why = f"every plan measured slower than plain (the best, {best.key}, at {ups[best.key]})"
        else:
            why = (f"no plan measured faster than plain beyond the noise (the best, {best.key}, at "
                   f"{ups[best.key]}): plain decoding is the cheaper plan")
        return Decision(PLAIN, Interval(1.0, 1.0, 1.0, len(plain.seconds)), why)
    best = max(faster, key=lambda a: ups[a.key].mean)
    tied = [a for a in faster if a is best or not clearly_faster(best, a)]
    choice = min(tied, key=lambda a: (a.cost, -ups[a.key].mean))
    up = ups[choice.key]
    if choice is best:
        rivals = sorted((a for a in others if a is not best), key=lambda a: -ups[a.key].mean)
        second = f"; next {rivals[0].key} at {ups[rivals[0].key]}" if rivals else ""
        why = f"fastest measured: {up} plain over {up.n} prompts{second}"
    else:
        why = (f"within the noise of the fastest ({best.key}, {ups[best.key]}) and cheaper per step "
               f"({choice.cost:.2f} vs {best.cost:.2f} x plain's step): {up} plain over {up.n} prompts")
    return Decision(choice.key, up, why)


@dataclass
class Race:
    """Stages of prompts; after each, arms clearly slower than the leader leave (see module doc)."""

    arms: list[Arm]  # plain first
    log: list[str] = field(default_factory=list)

    @property
    def plain(self) -> Arm:
        return self.arms[0]

    def running(self) -> list[Arm]:
        return [a for a in self.arms if a.running]

    def leader(self) -> Arm:
        runners = self.running()
        return max(runners, key=lambda a: speedup(a, self.plain).mean if a is not self.plain else 1.0)

    def prune(self, stage: int) -> list[Arm]:
        """Drop the arms clearly slower than the leader; returns them."""
        lead = self.leader()
        out = []
        for a in self.running():
            if a is self.plain or a is lead:
                continue
            r = bootstrap(log_ratios(lead, a))
            if r.lo > 1.0:
                a.dropped = f"stage {stage}: slower than {lead.key} beyond the noise ({lead.key} {r} of it)"
                out.append(a)
        if out:
            self.log.append(f"stage {stage}: dropped {', '.join(a.key for a in out)} (slower than {lead.key})")
        return out

    def halve(self, stage: int) -> list[Arm]:
        """Successive halving: keep the faster half of the running plans (plain always stays)."""
        runners = [a for a in self.running() if a is not self.plain]
        runners.sort(key=lambda a: -speedup(a, self.plain).mean)
        keep = max(1, math.ceil(len(runners) / 2))
        out = runners[keep:]
        for a in out:
            a.dropped = f"stage {stage}: slower half when the time left did not fit every plan"
        if out:
            self.log.append(f"stage {stage}: time budget, kept the faster half, dropped {', '.join(a.key for a in out)}")
        return out

    def stage_seconds(self, prompts: list[int]) -> float:
        """Predicted time to decode `prompts` with every running arm (for the budget and the ETA)."""
        return sum(a.predicted_s.get(p, 0.0) for a in self.running() for p in prompts)
