"""The cost model: what a step of a planned tree costs on a measured latency profile, and the
predicted speedup over plain decoding (ALGORITHMS.md sections 3 and 4).

    speedup = sum_s pi_s tau_s * L(1) / (sum_s pi_s L(n_s) + draft cost)

n_s is the number of tokens the decoder really feeds in state s: the root, the candidates, and
every prompt-token input (E ensemble copies each). PPD trees list their prompt tokens per node;
static trees (medusa, sequoia) decoded with prompt tokens carry D of them on every node, so that
the next step can guess depth D: (1 + N)(1 + D E) tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.profile import LatencyProfile
from planner.tree import Tree


@dataclass(frozen=True)
class Prediction:
    """The planner's model for one tree on one profile."""

    speedup: float  # tokens_per_step * L(1) / step_latency_s
    tokens_per_step: float  # amortised over PPD states
    step_latency_s: float  # amortised forward latency (+ draft cost)
    max_input_length: int  # tokens in the largest forward pass


def state_weights(tree: Tree) -> list[float]:
    """pi_s per state; a single-state tree has weight 1."""
    return [1.0] if len(tree.states) == 1 else [st.stationary_probability or 0.0 for st in tree.states]


def step_input_lengths(tree: Tree, ensemble: int = 1, static_prompt_tokens: bool = False) -> list[int]:
    """Tokens in the forward pass of each state.

    ppd: 1 + N + E * (prompt tokens). Static trees: 1 + N, or (1 + N)(1 + D E) when they run with
    prompt-token guessers (`static_prompt_tokens`), which put D prompt tokens on every node.
    """
    if tree.method == "ppd":
        return [1 + len(st.nodes) + ensemble * sum(st.prompt_tokens or []) for st in tree.states]
    st = tree.states[0]
    if static_prompt_tokens:
        return [(1 + len(st.nodes)) * (1 + st.depth * ensemble)]
    return [1 + len(st.nodes)]


def mean_input_length(tree: Tree, ensemble: int = 1, static_prompt_tokens: bool = False) -> float:
    """Tokens per forward pass, amortised over states."""
    lengths = step_input_lengths(tree, ensemble, static_prompt_tokens)
    return float(sum(w * n for w, n in zip(state_weights(tree), lengths)))


def step_latency(tree: Tree, profile: LatencyProfile, ensemble: int = 1, static_prompt_tokens: bool = False) -> float:
    """sum_s pi_s L(n_s)."""
    lengths = step_input_lengths(tree, ensemble, static_prompt_tokens)
    return float(sum(w * profile.latency(n) for w, n in zip(state_weights(tree), lengths)))


def predict(tree: Tree, profile: LatencyProfile, ensemble: int = 1, static_prompt_tokens: bool = False,
            draft_latency_s: float = 0.0) -> Prediction:
    """The predicted speedup; a draft model's latency is paid once per tree level (depth passes)."""
    tau = float(sum(w * st.expected_tokens for w, st in zip(state_weights(tree), tree.states)))
    cost = step_latency(tree, profile, ensemble, static_prompt_tokens) + tree.depth * draft_latency_s
    lengths = step_input_lengths(tree, ensemble, static_prompt_tokens)
    return Prediction(tau * profile.latency(1) / cost, tau, cost, max(lengths))


def predicted_speedup(tree: Tree, profile: LatencyProfile, draft_latency_s: float = 0.0) -> float:
    """`predict` on the plan's own input lengths (each prompt token once)."""
    return predict(tree, profile, draft_latency_s=draft_latency_s).speedup
