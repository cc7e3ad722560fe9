"""Measuring a guesser against reality: per-distance, per-rank accuracy, and a dynamic plan's state transitions.

accuracy[d][r] (planner/accept.py format): the fraction of positions where the rank-r guess for
distance d+1 beyond the root was the token the base model actually produced when decoding
greedily. Counts and totals are kept so confidence intervals can be drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from decoder.engines.registry import as_engine
from decoder.loop import as_tree, generate
from planner.errors import UserError
from planner.guessers import kinds
from planner.tree import PPD, Tree, TreeState


def chain_plan(num_distances: int) -> Tree:
    """Root-only steps carrying every prompt token: one token per step plus guesses for all distances."""
    P = num_distances
    states = [TreeState(s, [], 1.0, 1 + P, prompt_tokens=[P]) for s in range(P + 1)]
    return Tree(PPD, states, 1.0, prompt_tokens_max=P, settings={"purpose": "acceptance measurement"})


def count_hits(guesses: torch.Tensor, emitted: torch.Tensor, conditional: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """guesses [G, D, K]: row i guesses distances 1..D beyond the token emitted at step i;
    emitted [S] one token per step (G >= S - 1: the last step's guesses are never scored).
    Returns hits [D, K] and totals [D].

    conditional: a row counts at distance d only when its rank-0 guesses at distances 1..d-1 were
    right, so accuracy[d][r] is P(rank r right at d | the rank-0 path to d right), the factor a
    path's probability takes under the planner's product model. Guesses at consecutive distances
    are not independent (a wrong guess is followed by wrong ones more often), so unconditional
    counts make deep trees look worse than they decode along their main path.
    """
    G, D, K = guesses.shape
    S = emitted.numel()
    hits = np.zeros((D, K), dtype=np.int64)
    totals = np.zeros(D, dtype=np.int64)
    alive = torch.ones(max(S - 1, 0), dtype=torch.bool)  # rows whose rank-0 chain is right so far
    for d in range(1, min(D, S - 1) + 1):
        rows = S - d
        eq = guesses[:rows, d - 1, :] == emitted[d:, None]  # [rows, K]
        keep = alive[:rows] if conditional else torch.ones(rows, dtype=torch.bool)
        hits[d - 1] += eq[keep].sum(0).numpy()
        totals[d - 1] += int(keep.sum())
        alive = alive[:rows] & eq[:, 0]
    return hits, totals


def comb_nodes(depth: int, width: int) -> list[tuple[int, ...]]:
    """The rank-0 chain of `depth` with `width` ranked guesses at every level: the tree whose
    guesses are the rows a[d][r] of a drafter's acceptance."""
    return [(0,) * d + (r,) for d in range(depth) for r in range(width)]


class Measuring:
    """Root-only target steps while the wrapped guesser proposes its comb tree each step: its
    guesses are recorded (Proposal.guesses [D, K]) and its proposal's wall time is the drafting cost."""

    def __init__(self, inner, depth: int, width: int):
        self.inner, self.depth, self.width = inner, depth, width
        self.needs_hidden = inner.needs_hidden
        self.times: list[float] = []

    def check(self, plan, label: str = "plan") -> None:
        pass

    def begin(self, target, plan, prompt_ids, ctx):
        from decoder.layout import layout_for

        nodes = comb_nodes(self.depth, self.width)
        tree = Tree("medusa", [TreeState(0, nodes, 1.0, 1 + len(nodes))], 1.0)
        return _MeasuringSession(self, self.inner.begin(target, tree, prompt_ids, ctx),
                                 layout_for((), 1, ctx.dtype, ctx.device), ctx.device)


class _MeasuringSession:
    def __init__(self, owner: Measuring, inner, root_only, device):
        self.owner, self.inner, self.root_only, self.device = owner, inner, root_only, device
        self.max_input_length = 1
        self.last = None

    def propose(self, root):
        import time

        from decoder.guesser import Proposal

        t0 = time.perf_counter()
        p = self.inner.propose(root)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.owner.times.append(time.perf_counter() - t0)
        self.last = p
        return Proposal(self.root_only, root.new_empty(0), guesses=self._guesses(p))

    def _guesses(self, p) -> torch.Tensor:
        """[D, K] from the comb's tokens (or the guesser's own per-distance rows); -1 where none."""
        D, K = self.owner.depth, self.owner.width
        if p.guesses is not None:
            g = p.guesses[:D, :K]
        else:
            g = torch.full((D * K,), -1, dtype=torch.long, device=p.tokens.device)
            g[: p.tokens.numel()] = p.tokens[: D * K]
            g = g.view(D, K)
        out = torch.full((D, K), -1, dtype=torch.long, device=g.device)
        out[: g.shape[0], : g.shape[1]] = g
        return out

    def commit(self, outcome):
        from decoder.guesser import StepOutcome

        self.inner.commit(StepOutcome(self.last, outcome.verdict, outcome.logits, outcome.hidden, outcome.context_length))


def measure_accuracy(model, guesser, prompts: list[torch.Tensor], max_new_tokens: int = 64, progress: bool = False,
                     eos_token_id=None, allow_empty: bool = False, conditional: bool = True, depth: int | None = None,
                     width: int | None = None) -> dict:
    """Decode each prompt greedily with root-only target steps, recording the guesser's guesses for
    distances 1..D beyond each root; returns the acceptance JSON (planner/accept.py), with how the
    guesser feeds trees ("guesser": planner.cost.Guessing's fields, the drafter's measured pass time).

    PPD prompt tokens ride along every root (their logits are the guesses); any other guesser
    proposes its comb tree (`comb_nodes`) each step through `Measuring`, which is not verified.
    allow_empty: zero rows instead of an error when a distance has no data (callers that merge).
    """
    from tqdm import tqdm

    ppd = getattr(guesser, "input_embeddings", lambda: None)() is not None
    D = depth or guesser.num_distances
    K = width or getattr(guesser, "top_k", 1)
    runner = guesser if ppd else Measuring(guesser, D, K)
    plan = chain_plan(D) if ppd else None
    hits = np.zeros((D, K), dtype=np.int64)
    totals = np.zeros(D, dtype=np.int64)
    positions = 0
    for ids in tqdm(prompts, desc="accept", unit="prompt", disable=not progress):
        out = generate(model, ids, plan=plan, guesser=runner, max_new_tokens=max_new_tokens,
                       record_guesses=True, eos_token_id=eos_token_id)
        # step i's proposal holds the guesses for distances beyond step i's root, which is the
        # token step i - 1 emitted; PPD's bootstrap step has none (its guesses come a step late)
        made = [g for g in out.stats.guesses if g is not None]
        if not made:
            continue
        emitted = torch.cat([ids[-1:].cpu(), out.tokens]) if not ppd else out.tokens
        h, t = count_hits(torch.stack(made), emitted[: len(made) + 1], conditional)
        hits += h
        totals += t
        positions += int(out.tokens.numel())
    return accuracy_json(hits, totals, positions, len(prompts), model, guessing_record(guesser, runner, D),
                         "profiler.acceptance.measure_accuracy (greedy decoding)", conditional, allow_empty)


def accuracy_json(hits: np.ndarray, totals: np.ndarray, positions: int, prompts: int, model, guesser: dict,
                  source: str, conditional: bool = True, allow_empty: bool = False) -> dict:
    """The acceptance record (planner/accept.py format) from hit counts [D, K] and totals [D]."""
    # A deeper distance with no row whose rank-0 path was right has an undefined conditional; it is
    # recorded as 0, which changes no prediction (every path to it has probability 0 already).
    if (totals[0] == 0 or (not conditional and totals.min() == 0)) and not allow_empty:
        raise UserError(f"measure_accuracy: {positions} positions decoded, too few to measure distance {int(np.argmin(totals)) + 1}")
    return {
        "accuracy": np.divide(hits, totals[:, None], out=np.zeros(hits.shape), where=totals[:, None] > 0).tolist(),
        "counts": hits.tolist(),
        "totals": totals.tolist(),
        "conditional": conditional,
        "positions": positions,
        "prompts": prompts,
        "model": model_name(model),
        "guesser": guesser,
        "source": source,
    }


def model_name(target) -> str:
    """What an acceptance record calls the target: its engine's model name (a bare model's config name)."""
    return str(as_engine(target).model_name)


def guessing_record(guesser, runner, depth: int) -> dict:
    """How the guesser feeds trees (planner.cost.Guessing fields) and what it is."""
    import statistics

    if getattr(guesser, "input_embeddings", lambda: None)() is not None:  # prompt tokens (or an oracle riding on them)
        pt_kind = next(k.name for k in kinds(hybrids=False) if k.needs_embeddings)
        return {"kind": pt_kind, "prompt_tokens": True, "ensemble": guesser.ensemble, "top_k": guesser.top_k,
                "num_prompt_tokens": guesser.num_distances,
                **{k: v for k, v in getattr(guesser, "meta", {}).items() if isinstance(v, (str, int, float))}}
    kind = type(guesser).__name__
    one_pass = getattr(guesser, "mode", None) == "parallel" or kind == "PromptLookupGuesser"
    propose_s = statistics.median(runner.times) if runner.times else 0.0
    return {"kind": kind, "prompt_tokens": False, "ensemble": 1, "top_k": getattr(guesser, "top_k", 1),
            "draft_passes": "one" if one_pass else "depth",
            # a comb of `depth` levels took `depth` passes (one for a parallel drafter or lookup)
            "draft_s": propose_s if one_pass else propose_s / depth, "propose_s_median": propose_s}


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
