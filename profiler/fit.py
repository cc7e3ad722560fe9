"""The latency model the planner interpolates: a monotone piecewise-linear fit of the medians.

Why monotone (isotonic regression, not the raw medians): a forward pass over more tokens does
not take less time in any regime the planner cares about, and where a measured median dips
(a faster kernel tile, or noise) the decoder could pad the shorter tree to the longer length
anyway. Raw medians with dips would let the planner chase noise (pick n = 63 over 62 because one
sample was lucky). Isotonic regression is the least-squares non-decreasing fit, so it moves the
medians only where they disagree with monotonicity and keeps every measured knee. Knots stay at
the measured lengths, so the planner's piecewise-linear interpolation reproduces the fitted
value exactly at every measured length.
"""
from __future__ import annotations

import numpy as np


def isotonic(y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of y [M] (pool adjacent violators)."""
    y = np.asarray(y, dtype=np.float64)
    w = np.ones_like(y) if w is None else np.asarray(w, dtype=np.float64)
    # Blocks as (mean, weight, count); merge backwards while the last two violate the order.
    means: list[float] = []
    weights: list[float] = []
    counts: list[int] = []
    for yi, wi in zip(y, w):
        means.append(float(yi))
        weights.append(float(wi))
        counts.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            m2, w2, c2 = means.pop(), weights.pop(), counts.pop()
            m1, w1, c1 = means.pop(), weights.pop(), counts.pop()
            means.append((m1 * w1 + m2 * w2) / (w1 + w2))
            weights.append(w1 + w2)
            counts.append(c1 + c2)
    return np.repeat(means, counts)


def fit_latency(input_lengths, latency_s, repeats=None) -> dict:
    """{"kind": "piecewise_linear", "input_lengths", "latency_s", "method"} from medians.

    Points are weighted by their repeat count: a median from more samples is trusted more.
    """
    n = np.asarray(input_lengths, dtype=np.int64)
    y = np.asarray(latency_s, dtype=np.float64)
    if n.ndim != 1 or len(n) != len(y) or len(n) == 0:
        raise ValueError("fit_latency: input_lengths and latency_s must be equal-length non-empty lists")
    if np.any(np.diff(n) <= 0):
        raise ValueError("fit_latency: input_lengths must be strictly increasing")
    w = None if repeats is None else np.maximum(np.asarray(repeats, dtype=np.float64), 1.0)
    fitted = isotonic(y, w)
    return {
        "kind": "piecewise_linear",
        "method": "isotonic regression of the medians, weighted by repeats",
        "input_lengths": [int(x) for x in n],
        "latency_s": [float(x) for x in fitted],
    }


def interpolate(fit: dict, n) -> np.ndarray | float:
    """Evaluate the fit at n (clamped to the fitted range; the planner refuses outside it)."""
    out = np.interp(np.asarray(n, dtype=np.float64), fit["input_lengths"], fit["latency_s"])
    return float(out) if np.ndim(out) == 0 else out
