"""The oracle ceiling of a chain guesser on one answer: what a planner that knows in advance how many
guesses each step would accept could reach, priced with a measured L(n) (numpy only).

Input per answer position i (tokens 0..i-1 already emitted): `available[i]`, how many of the guesser's
proposed tokens there plain greedy decoding would accept (prompt lookup: the matching prefix of its
continuation and the real answer; decoder.guessers.lookup.available_lengths). A step at i with g <= available[i]
guesses emits g + 1 tokens and costs step_cost[g] = L(1 + g) plus the per-step overhead. The ceiling is
the cheapest way through the answer (a shortest path over positions; the text, and so every
available[i], is the same whatever steps came before). It ignores the decision's own time.

`simulate_fixed` prices a rule that guesses what it is offered (a stock lookup of k tokens), so the
simulation can be checked against a measured run.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.errors import UserError


@dataclass(frozen=True)
class Ceiling:
    plain_s: float  # every token a one-token step
    oracle_s: float  # the cheapest step sequence
    steps: int
    guesses: list[int]  # per oracle step, guesses made (all accepted)

    @property
    def speedup(self) -> float:
        return self.plain_s / self.oracle_s if self.oracle_s > 0 else 1.0


def _costs(step_cost_s) -> np.ndarray:
    c = np.asarray(step_cost_s, dtype=np.float64)
    if c.ndim != 1 or len(c) < 1 or not np.all(np.isfinite(c)) or np.any(c <= 0):
        raise UserError("oracle ceiling: step costs must be a non-empty list of positive seconds (index = guesses)")
    return c


def oracle_ceiling(available: list[int], step_cost_s) -> Ceiling:
    """available [N] (tokens the oracle may guess at each position); step_cost_s [G + 1] seconds of a step
    with 0..G guesses. Shortest path from position 0 to N, backwards."""
    c = _costs(step_cost_s)
    N, G = len(available), len(c) - 1
    best = np.zeros(N + 1)
    pick = np.zeros(N + 1, dtype=np.int64)
    for i in range(N - 1, -1, -1):
        top = min(int(available[i]), G, N - 1 - i)
        options = [c[g] + best[i + g + 1] for g in range(top + 1)]
        pick[i] = int(np.argmin(options))
        best[i] = options[pick[i]]
    guesses, i = [], 0
    while i < N:
        guesses.append(int(pick[i]))
        i += int(pick[i]) + 1
    plain = N * float(c[0])
    # guessing nothing anywhere is one of the paths: the sum of N plain steps can round one ulp above N c[0]
    return Ceiling(plain, min(float(best[0]), plain), len(guesses), guesses)


def simulate_fixed(offered: list[int], available: list[int], step_cost_s) -> float:
    """Seconds for a rule that guesses every offered token (offered[i] at position i, capped at G)
    and keeps the accepted ones (available[i] of them)."""
    c = _costs(step_cost_s)
    N, G, i, total = len(available), len(c) - 1, 0, 0.0
    while i < N:
        g = min(int(offered[i]), G)
        total += float(c[g])
        i += min(int(available[i]), g, N - 1 - i) + 1
    return total
