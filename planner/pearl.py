"""PEARL's planning model [D] (docs/seed-systems.md, section 'PEARL'): a two-state chain over rounds.

Per-token acceptance alpha, i.i.d. (the Leviathan model). A round in mode A (pre-verify) emits 1
token and goes to B with probability alpha; a round in mode B (post-verify) checks gamma tokens,
emits gamma with probability alpha^gamma (and stays) or i + 1 with probability alpha^i (1 - alpha),
i < gamma (and goes to A), so E[tokens | B] = (1 - alpha^gamma) / (1 - alpha) = sum_{i<gamma} alpha^i.

  pi_A = (1 - alpha^gamma) / (1 + alpha - alpha^gamma),  pi_B = alpha / (1 + alpha - alpha^gamma)
  tau_PEARL = pi_A + pi_B E[tokens | B] = (1 - alpha^gamma) / ((1 - alpha)(1 + alpha - alpha^gamma))  (gamma at alpha 1)
  T_A = overlap(gamma t_d, L(1)),  T_B = overlap(gamma t_d, L(gamma)),  overlap(a, b) = max(a, b) + (1 - eta) min(a, b)
  speedup = tau_PEARL * t_plain / (pi_A T_A + pi_B T_B + t_coord)

eta: 1 when the two jobs run on separate devices, 0 when they run one after the other; measured
on a shared CPU. Vanilla speculative decoding, for comparison:
  tau_SD = (1 - alpha^(gamma+1)) / (1 - alpha),  T_SD = gamma t_d + L(gamma + 1)

L(n) is planner.cost.step_cost on a LatencyProfile (the one cost model), measured at the thread
count the target really gets beside the drafter; t_d is one drafter forward at its own thread
count; t_plain is plain decoding's step with all cores (default: L(1) of the same profile).
The paper's rule is gamma = round(c), c = L(1) / t_d; `choose_gamma` maximises the predicted
speedup instead and reports both. Numpy only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.accept import Acceptance
from planner.cost import step_cost
from planner.errors import UserError
from planner.profile import LatencyProfile

ALPHA_RULES = ("mean", "first", "geometric")


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise UserError(f"alpha: expected a number in [0, 1], got {alpha!r}")
    return float(alpha)


def _check_gamma(gamma: int) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
        raise UserError(f"gamma: expected an integer >= 1, got {gamma!r}")
    return int(gamma)


def run_sum(alpha: float, k: int) -> float:
    """sum_{i<k} alpha^i = (1 - alpha^k) / (1 - alpha), finite at alpha = 1 (where it is k)."""
    return float(k) if alpha == 1.0 else (1.0 - alpha ** k) / (1.0 - alpha)


def stationary(alpha: float, gamma: int) -> tuple[float, float]:
    """(pi_A, pi_B) of the mode chain [D]."""
    a, g = _check_alpha(alpha), _check_gamma(gamma)
    z = 1.0 + a - a ** g
    return (1.0 - a ** g) / z, a / z


def tokens_b(alpha: float, gamma: int) -> float:
    """E[tokens | B] = (1 - alpha^gamma) / (1 - alpha) [D]."""
    return run_sum(_check_alpha(alpha), _check_gamma(gamma))


def tau_pearl(alpha: float, gamma: int) -> float:
    """Tokens per round, (1 - alpha^gamma) / ((1 - alpha)(1 + alpha - alpha^gamma)) [D]."""
    pi_a, pi_b = stationary(alpha, gamma)
    return pi_a + pi_b * tokens_b(alpha, gamma)


def tau_sd(alpha: float, gamma: int) -> float:
    """Vanilla speculative decoding's tokens per step, (1 - alpha^(gamma+1)) / (1 - alpha)."""
    return run_sum(_check_alpha(alpha), _check_gamma(gamma) + 1)


def overlap(a: float, b: float, eta: float) -> float:
    """Time of two jobs of a and b seconds sharing a machine: max(a, b) + (1 - eta) min(a, b) [D]."""
    if not 0.0 <= eta <= 1.0:
        raise UserError(f"eta: expected a number in [0, 1], got {eta!r}")
    return max(a, b) + (1.0 - eta) * min(a, b)


def eta_from_times(a: float, b: float, together: float) -> float:
    """The overlap factor that a measured time of both jobs at once implies, clipped to [0, 1] [D]."""
    lo = min(a, b)
    if lo <= 0:
        return 1.0
    return float(min(1.0, max(0.0, 1.0 - (together - max(a, b)) / lo)))


@dataclass(frozen=True)
class PearlPrediction:
    gamma: int
    alpha: float
    pi_a: float
    pi_b: float
    tokens_per_round: float
    round_a_s: float  # T_A
    round_b_s: float  # T_B
    round_s: float  # pi_A T_A + pi_B T_B + t_coord
    speedup: float  # tokens_per_round * t_plain / round_s
    mean_accepted_run: float  # alpha / (1 - alpha): the paper's MAT under this model [D]


@dataclass(frozen=True)
class SDPrediction:
    gamma: int
    alpha: float
    tokens_per_step: float
    step_s: float
    speedup: float


def _latency(profile: LatencyProfile, n: int) -> float:
    return float(step_cost(profile, n))


def predict_pearl(alpha: float, gamma: int, t_draft: float, profile: LatencyProfile, eta: float = 1.0,
                  plain_s: float | None = None, coord_s: float = 0.0) -> PearlPrediction:
    """The model above for one gamma. profile: the target's L(n) at its own thread count."""
    a, g = _check_alpha(alpha), _check_gamma(gamma)
    pi_a, pi_b = stationary(a, g)
    t_a = overlap(g * t_draft, _latency(profile, 1), eta)
    t_b = overlap(g * t_draft, _latency(profile, g), eta)
    round_s = pi_a * t_a + pi_b * t_b + coord_s
    tau = tau_pearl(a, g)
    plain = _latency(profile, 1) if plain_s is None else plain_s
    mat = math.inf if a == 1.0 else a / (1.0 - a)
    return PearlPrediction(g, a, pi_a, pi_b, tau, t_a, t_b, round_s, tau * plain / round_s, mat)


def predict_sd(alpha: float, gamma: int, t_draft: float, profile: LatencyProfile,
               plain_s: float | None = None) -> SDPrediction:
    """Vanilla SD with a chain of gamma drafts: T_SD = gamma t_d + L(gamma + 1)."""
    a, g = _check_alpha(alpha), _check_gamma(gamma)
    step = g * t_draft + _latency(profile, g + 1)
    tau = tau_sd(a, g)
    plain = _latency(profile, 1) if plain_s is None else plain_s
    return SDPrediction(g, a, tau, step, tau * plain / step)


@dataclass(frozen=True)
class GammaChoice:
    gamma: int  # maximises the predicted speedup
    paper_gamma: int  # round(c), at least 1
    c: float  # L(1) / t_d
    predictions: tuple[PearlPrediction, ...]  # one per candidate gamma


def choose_gamma(alpha: float, t_draft: float, profile: LatencyProfile, eta: float = 1.0, gammas=range(1, 9),
                 plain_s: float | None = None, coord_s: float = 0.0) -> GammaChoice:
    """The gamma of highest predicted speedup among `gammas`, and the paper's round(L(1) / t_d)."""
    if not t_draft > 0:
        raise UserError(f"t_draft: expected a positive number of seconds, got {t_draft!r}")
    gammas = [_check_gamma(g) for g in gammas]
    if not gammas:
        raise UserError("gammas: expected at least one candidate")
    preds = tuple(predict_pearl(alpha, g, t_draft, profile, eta, plain_s, coord_s) for g in gammas)
    best = max(preds, key=lambda p: p.speedup)
    c = _latency(profile, 1) / t_draft
    return GammaChoice(best.gamma, max(1, int(round(c))), c, preds)


def alpha_from_acceptance(acc: Acceptance, rule: str = "mean") -> float:
    """alpha from a drafter's acceptance file: the conditional rank-0 acceptance per distance
    (accuracy[d][0], the chance the d-th draft is right given the first d-1 were; what `planner
    accept` measures). rule: "mean" over distances (default), "first" (distance 1 only), or
    "geometric" (the alpha whose power D is the chance that all D are right). A distance recorded
    as exactly 0 after a non-zero one is an undefined conditional (profiler.acceptance writes 0
    where no row reached it) and is left out."""
    if rule not in ALPHA_RULES:
        raise UserError(f"alpha rule: expected one of {', '.join(ALPHA_RULES)}, got {rule!r}")
    col = np.asarray(acc.accuracy[:, 0], dtype=np.float64)
    if rule == "first" or col[0] == 0.0:
        return float(col[0])
    col = col[col > 0]
    if rule == "mean":
        return float(col.mean())
    return float(np.exp(np.log(col).mean()))


def alpha_from_mat(mat: float) -> float:
    """The paper's mean accepted tokens (a run length between rejections) as alpha = MAT / (1 + MAT) [D]."""
    if not mat >= 0:
        raise UserError(f"MAT: expected a number >= 0, got {mat!r}")
    return float(mat / (1.0 + mat))


def alpha_from_counts(accepted: int, rejected: int) -> float:
    """Maximum-likelihood alpha from a run: the likelihood is alpha^accepted (1 - alpha)^rejected
    (a round's checks stop at its first rejection), so alpha = accepted / (accepted + rejected) [D]."""
    n = accepted + rejected
    return accepted / n if n else 0.0
