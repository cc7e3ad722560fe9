"""Measuring a guesser against reality: per-distance, per-rank accuracy, and a dynamic plan's state transitions.

accuracy[d][r] (planner/accept.py format): the fraction of positions where the rank-r guess for
distance d+1 beyond the root was the token the base model actually produced when decoding
greedily. Counts and totals are kept so confidence intervals can be drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from decoder.loop import as_tree, generate
from planner.errors import UserError
from planner.tree import Tree, TreeState


def chain_plan(num_distances: int) -> Tree:
    """Root-only steps carrying every prompt token: one token per step plus guesses for all distances."""
    P = num_distances
    states = [TreeState(s, [], 1.0, 1 + P, prompt_tokens=[P]) for s in range(P + 1)]
    return Tree("ppd", states, 1.0, prompt_tokens_max=P, settings={"purpose": "acceptance measurement"})


def count_hits(guesses: torch.Tensor, emitted: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """guesses [G, D, K]: row i guesses distances 1..D beyond the token emitted at step i;
    emitted [S] one token per step (G >= S - 1: the last step's guesses are never scored).
    Returns hits [D, K] and totals [D]."""
    G, D, K = guesses.shape
    S = emitted.numel()
    hits = np.zeros((D, K), dtype=np.int64)
    totals = np.zeros(D, dtype=np.int64)
    for d in range(1, min(D, S - 1) + 1):
        eq = guesses[: S - d, d - 1, :] == emitted[d:, None]  # [S-d, K]
        hits[d - 1] += eq.sum(0).numpy()
        totals[d - 1] += S - d
    return hits, totals


def measure_accuracy(model, guesser, prompts: list[torch.Tensor], max_new_tokens: int = 64, progress: bool = False,
                     eos_token_id=None, allow_empty: bool = False) -> dict:
    """Decode each prompt greedily with root-only steps; returns the acceptance JSON (planner/accept.py).

    allow_empty: return zero rows (accuracy 0) instead of an error when a distance has no data
    (callers that merge counts over several calls).
    """
    from tqdm import tqdm

    if guesser.input_embeddings() is None:
        raise UserError("measure_accuracy: the guesser has no prompt tokens to measure")
    D, K = guesser.num_distances, guesser.top_k
    plan = chain_plan(D)
    hits = np.zeros((D, K), dtype=np.int64)
    totals = np.zeros(D, dtype=np.int64)
    positions = 0
    for ids in tqdm(prompts, desc="accept", unit="prompt", disable=not progress):
        out = generate(model, ids, plan=plan, guesser=guesser, max_new_tokens=max_new_tokens,
                       record_guesses=True, eos_token_id=eos_token_id)
        # step i's proposal holds the guesses made at step i - 1, for distances beyond the token
        # step i - 1 emitted; the bootstrap step has none
        made = out.stats.guesses[1:]
        if not made:
            continue
        h, t = count_hits(torch.stack(made), out.tokens[: len(made) + 1])
        hits += h
        totals += t
        positions += int(out.tokens.numel())
    if totals.min() == 0 and not allow_empty:
        raise UserError(f"measure_accuracy: {positions} positions decoded, too few to measure distance {int(np.argmin(totals)) + 1}")
    cfg = model.config
    return {
        "accuracy": np.divide(hits, totals[:, None], out=np.zeros(hits.shape), where=totals[:, None] > 0).tolist(),
        "counts": hits.tolist(),
        "totals": totals.tolist(),
        "positions": positions,
        "prompts": len(prompts),
        "model": getattr(cfg, "name_or_path", "") or getattr(cfg, "model_type", ""),
        "prompt_tokens": {"num_prompt_tokens": D, "ensemble": guesser.ensemble, "top_k": K,
                          **{k: v for k, v in getattr(guesser, "meta", {}).items() if isinstance(v, (str, int, float))}},
        "source": "profiler.acceptance.measure_accuracy (greedy decoding)",
    }


@dataclass
class Transitions:
    """Empirical state chain of a dynamic plan, next to the planner's Markov model."""

    states: list[int]
    counts: np.ndarray  # [S, S] transitions observed from state i to state j
    visits: np.ndarray  # [S] steps spent in each state (bootstrap step excluded)
    tokens: np.ndarray  # [S] tokens emitted in steps of each state (accepted + 1, before truncation)
    model_transitions: np.ndarray | None  # [S, S] plan's M, when the plan has it
    model_stationary: np.ndarray | None  # [S]
    expected_tokens: np.ndarray  # [S] plan's tau_s

    @property
    def empirical_transitions(self) -> np.ndarray:
        rows = self.counts.sum(1, keepdims=True)
        return np.divide(self.counts, rows, out=np.zeros(self.counts.shape), where=rows > 0)

    @property
    def empirical_frequency(self) -> np.ndarray:
        return self.visits / max(self.visits.sum(), 1)

    @property
    def tokens_per_step(self) -> np.ndarray:
        return np.divide(self.tokens, self.visits, out=np.zeros(len(self.states)), where=self.visits > 0)

    def to_json(self) -> dict:
        def lst(a):
            return None if a is None else a.tolist()

        return {
            "states": self.states,
            "counts": self.counts.tolist(),
            "visits": self.visits.tolist(),
            "empirical_transitions": self.empirical_transitions.tolist(),
            "empirical_frequency": self.empirical_frequency.tolist(),
            "model_transitions": lst(self.model_transitions),
            "model_stationary": lst(self.model_stationary),
            "tokens_per_step_by_state": self.tokens_per_step.tolist(),
            "expected_tokens_by_state": self.expected_tokens.tolist(),
        }


def measure_transitions(model, prompts: list[torch.Tensor], plan: Tree, guesser, max_new_tokens: int = 64,
                        progress: bool = False, **generate_kwargs) -> Transitions:
    """Decode every prompt with `plan` and count state-to-state moves (the bootstrap step is not a state)."""
    from tqdm import tqdm

    tree, _ = as_tree(plan)
    states = sorted(st.state for st in tree.states)
    where = {s: i for i, s in enumerate(states)}
    S = len(states)
    counts = np.zeros((S, S), dtype=np.int64)
    visits = np.zeros(S, dtype=np.int64)
    tokens = np.zeros(S, dtype=np.int64)
    for ids in tqdm(prompts, desc="transitions", unit="prompt", disable=not progress):
        out = generate(model, ids, plan=tree, guesser=guesser, max_new_tokens=max_new_tokens,
                       **generate_kwargs)
        seq = [where[s] for s in out.stats.states if s >= 0]
        acc = [a for s, a in zip(out.stats.states, out.stats.accepted) if s >= 0]
        for i, j in zip(seq[:-1], seq[1:]):
            counts[i, j] += 1
        for i, a in zip(seq, acc):
            visits[i] += 1
            tokens[i] += a + 1
    by_state = {st.state: st for st in tree.states}
    model_m = None
    if all(by_state[s].transitions is not None and len(by_state[s].transitions) == S for s in states):
        model_m = np.array([by_state[s].transitions for s in states], dtype=np.float64)
    model_pi = None
    if all(by_state[s].stationary_probability is not None for s in states):
        model_pi = np.array([by_state[s].stationary_probability for s in states], dtype=np.float64)
    expected = np.array([by_state[s].expected_tokens for s in states], dtype=np.float64)
    return Transitions(states, counts, visits, tokens, model_m, model_pi, expected)
