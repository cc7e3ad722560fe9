"""The race's decision statistic: the sign-flip (randomization) test of paired log-ratios and the
interval that inverts it (workflows.mainjob.choose decides with it; docs/main-job.md, "The race", says why).

With no real difference each unit's sign is a fair coin given its size, so the p-value, the share of
the 2^n sign patterns whose sum reaches the observed one, is exact at any n, noise and drift.
numpy only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

ALPHA = 0.05  # the false-winner rate the decision guarantees
LEVEL = 1 - 2 * ALPHA  # intervals: two-sided, their lower end is the test's one-sided bound
MIN_PROMPTS = 5  # fewer paired units give no interval at LEVEL (2^-n > ALPHA)
EXACT_MAX = 16  # sign patterns enumerated up to 2^16, sampled beyond


@lru_cache(maxsize=None)
def _signs(n: int) -> np.ndarray:
    """[2^n, n] every +-1 pattern (n <= EXACT_MAX), or 20000 sampled ones with the identity first."""
    if n <= EXACT_MAX:
        return 1.0 - 2.0 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)
    rng = np.random.default_rng(n)
    s = rng.choice([-1.0, 1.0], size=(20000, n))
    s[0] = 1.0
    return s


def sign_flip_p(x) -> float:
    """One-sided p-value of 'mean(x) > 0' when x's signs are fair coins given |x|: the share of
    sign patterns whose sum reaches sum(x). No units: 1.0."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return 1.0
    sums = _signs(x.size) @ np.abs(x)
    return float(np.mean(sums >= x.sum() - 1e-12 * (1 + np.abs(x).sum())))


@dataclass(frozen=True)
class Interval:
    """A speedup (geometric mean over n prompts) with its interval at LEVEL."""

    mean: float
    lo: float
    hi: float
    n: int

    def to_json(self) -> dict:
        known = math.isfinite(self.hi) and self.lo > 0  # JSON has no infinity: no interval is null
        return {"mean": self.mean, "lo": self.lo if known else None, "hi": self.hi if known else None,
                "prompts": self.n, "level": LEVEL}

    def __str__(self) -> str:
        if not math.isfinite(self.hi) or self.lo <= 0:
            return f"{self.mean:.2f}x (n={self.n}, no interval)"
        return f"{self.mean:.2f}x [{self.lo:.2f}, {self.hi:.2f}]"


def _bounds(x: np.ndarray) -> tuple[float, float]:
    """The one-sided (1 - ALPHA) lower and upper bounds on the mean that invert the sign-flip
    test: the k-th smallest and largest of the subset means, k = floor(ALPHA 2^n) (Hartigan 1969:
    the 2^n - 1 subset means cut the line into 2^n equally likely pieces around the centre)."""
    signs = _signs(x.size)
    k = int(math.floor(ALPHA * signs.shape[0]))
    if k < 1:  # too few units: every shift is accepted
        return -math.inf, math.inf
    masks = 0.5 * (1.0 + signs)
    sizes = masks.sum(axis=1)
    means = np.sort((masks[sizes > 0] @ x) / sizes[sizes > 0])
    return float(means[k - 1]), float(means[-k])


def interval(x) -> Interval:
    """exp(mean(x)) with the LEVEL interval inverting the sign-flip test."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return Interval(1.0, 0.0, math.inf, 0)
    lo, hi = _bounds(x)
    return Interval(float(np.exp(x.mean())), float(np.exp(lo)), float(np.exp(hi)), int(x.size))
