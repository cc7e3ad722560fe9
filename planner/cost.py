"""The cost model: one function for what a decoding step costs, used by plan, tune, autotune and export.

A step of a tree in state s costs

    step_s = L(n_s) + overhead(n_s) + draft cost

- n_s: the tokens the decoder really feeds (`input_lengths`): the root, the candidates and, for
  prompt-token guessers, every prompt-token input (E ensemble copies each). PPD trees list their
  prompt tokens per node; static trees (medusa, sequoia) decoded with prompt tokens carry D of
  them on every node so the next step can guess depth D: (1 + N)(1 + D E) tokens.
- L(n): the measured forward latency (planner/profile.py).
- overhead(n): the decoder's own work outside the forward pass (verification, KV compaction,
  guessing), measured by the profiler as a line in n; 0 when the profile has none.
- draft cost: a drafter's passes before the step (draft LM or chain: one per tree level;
  ParallelSpec: one for the whole tree), each `draft_s`.

Plain decoding is the same step with n = 1 and no drafter, so

    speedup = sum_s pi_s tau_s * step_s(plain) / sum_s pi_s step_s

(docs/algorithms.md, sections 'PPD dynamic sparse trees' and 'Cost model').
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.errors import UserError
from planner.profile import LatencyProfile
from planner.tree import PPD, Tree

DRAFT_PASSES = ("depth", "one")


@dataclass(frozen=True)
class Guessing:
    """How a guesser turns a tree into the decoder's step: extra input tokens and drafting work."""

    prompt_tokens: bool = False  # PPD-style: static trees carry `depth` prompt tokens on every node
    ensemble: int = 1  # input tokens per prompt token (E)
    draft_s: float = 0.0  # one drafter pass
    draft_passes: str = "depth"  # "depth": one pass per tree level; "one": a single pass (ParallelSpec)

    def __post_init__(self):
        if not isinstance(self.ensemble, int) or self.ensemble < 1:
            raise UserError(f"ensemble size must be an integer >= 1, got {self.ensemble!r}")
        if not (isinstance(self.draft_s, (int, float)) and math.isfinite(self.draft_s) and self.draft_s >= 0):
            raise UserError(f"draft latency must be a finite number >= 0 seconds, got {self.draft_s!r}")
        if self.draft_passes not in DRAFT_PASSES:
            raise UserError(f"draft passes: expected one of {', '.join(DRAFT_PASSES)}, got {self.draft_passes!r}")

    def draft_cost(self, depth):
        """Seconds of drafting before a step whose tree is `depth` deep (scalar or array)."""
        depth = np.asarray(depth, dtype=np.float64)
        passes = depth if self.draft_passes == "depth" else np.minimum(depth, 1.0)
        out = passes * self.draft_s
        return float(out) if out.ndim == 0 else out

    def input_length(self, tree_tokens, depth):
        """Forward length of a static tree of `tree_tokens` (root + candidates) and `depth` (arrays welcome)."""
        if not self.prompt_tokens:
            return tree_tokens
        return np.asarray(tree_tokens) * (1 + np.asarray(depth) * self.ensemble)


PPD_GUESSING = Guessing(prompt_tokens=True)


@dataclass(frozen=True)
class Prediction:
    """The planner's model for one tree on one profile."""

    speedup: float  # tokens_per_step * plain step / step_s
    tokens_per_step: float  # amortised over PPD states
    step_latency_s: float  # amortised step cost (forward + overhead + drafting)
    max_input_length: int  # tokens in the largest forward pass


def state_weights(tree: Tree) -> list[float]:
    """pi_s per state; a single-state tree has weight 1."""
    return [1.0] if len(tree.states) == 1 else [st.stationary_probability or 0.0 for st in tree.states]


def input_lengths(tree: Tree, guessing: Guessing = Guessing()) -> list[int]:
    """Tokens in the forward pass of each state (see the module docstring)."""
    if tree.method == PPD:
        return [1 + len(st.nodes) + guessing.ensemble * sum(st.prompt_tokens or []) for st in tree.states]
    st = tree.states[0]
    return [int(guessing.input_length(1 + len(st.nodes), st.depth))]


def mean_input_length(tree: Tree, guessing: Guessing = Guessing()) -> float:
    """Tokens per forward pass, amortised over states."""
    return float(sum(w * n for w, n in zip(state_weights(tree), input_lengths(tree, guessing))))


def step_cost(profile: LatencyProfile, n, depth=0, guessing: Guessing = Guessing()):
    """Seconds of one step feeding n tokens after a `depth`-deep draft (scalars or arrays)."""
    return profile.latency(n) + profile.overhead(n) + guessing.draft_cost(depth)


def padding(profile: LatencyProfile) -> dict:
    """The settings a plan records so the decoder realises the profile's prices: {"pad_to": {n: m}}
    where a forward of n tokens runs padded to m (planner.profile._padded); {} when none pays."""
    return {"pad_to": {str(n): m for n, m in sorted(profile.pad_to.items())}} if profile.pad_to else {}


def plain_step(profile: LatencyProfile) -> float:
    """One step of plain decoding: one token, no drafter."""
    return float(step_cost(profile, 1))


def prefill_cost(profile: LatencyProfile, prompt_tokens: int) -> float:
    """The prefill of a prompt, priced as the forward of its tokens but the last (the first step
    feeds that one), capped at the profile's longest input."""
    return float(profile.latency(min(max(prompt_tokens - 1, 1), profile.max_input_length)))


def step_latency(tree: Tree, profile: LatencyProfile, guessing: Guessing = Guessing()) -> float:
    """sum_s pi_s step_s."""
    lengths = input_lengths(tree, guessing)
    return float(sum(w * step_cost(profile, n, st.depth, guessing)
                     for w, n, st in zip(state_weights(tree), lengths, tree.states)))


def padded_step_latency(tree: Tree, profile: LatencyProfile, batch_size: int,
                        guessing: Guessing = Guessing()) -> float:
    """E[step_s] for `batch_size` sequences whose inputs are padded to the longest in the batch.

    Each sequence is in state s with probability pi_s, independently of the others (stationarity,
    an approximation for PPD: neighbouring steps of one sequence are correlated, different
    sequences are not). With states sorted by input length and W_i = sum of pi over the first i,
    the longest input is state i's with probability W_i^b - W_{i-1}^b, and the step then costs
    step_cost(profile_b, n_i, depth_i). A single-state tree (medusa, sequoia) pads nothing: its
    value is `step_latency`. The profile must be the one measured at this batch size.
    """
    lengths = input_lengths(tree, guessing)
    order = sorted(range(len(tree.states)), key=lambda i: (lengths[i], tree.states[i].depth))
    weights = np.array(state_weights(tree))[order]
    cum = np.cumsum(weights / weights.sum())
    p_longest = np.diff(np.concatenate([[0.0], cum ** batch_size]))
    costs = [step_cost(profile, lengths[i], tree.states[i].depth, guessing) for i in order]
    return float(np.dot(p_longest, costs))


def predict(tree: Tree, profile: LatencyProfile, guessing: Guessing = Guessing()) -> Prediction:
    tau = float(sum(w * st.expected_tokens for w, st in zip(state_weights(tree), tree.states)))
    cost = step_latency(tree, profile, guessing)
    return Prediction(tau * plain_step(profile) / cost, tau, cost, max(input_lengths(tree, guessing)))


def predicted_speedup(tree: Tree, profile: LatencyProfile, guessing: Guessing = Guessing()) -> float:
    return predict(tree, profile, guessing).speedup


def default_guessing(method: str, accept=None, **overrides) -> Guessing:
    """The guessing an acceptance file describes (its 'guesser' record, written by `planner accept`),
    else PPD prompt tokens for ppd plans and for files measured on prompt tokens, else heads
    (Medusa heads: the tree's own tokens only). `overrides` replace single fields."""
    fields = {}
    record = (accept.source.get("guesser") if accept is not None else None) or {}
    if isinstance(record, dict):
        fields = {k: record[k] for k in ("prompt_tokens", "ensemble", "draft_s", "draft_passes") if k in record}
    if "prompt_tokens" not in fields:
        names = " ".join(str(accept.source.get(k, "")) for k in ("kind", "label", "name")).lower() if accept else ""
        fields["prompt_tokens"] = method == PPD or PPD in names
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return Guessing(**fields)
