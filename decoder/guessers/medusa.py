"""Medusa heads as a guesser: guesses per distance from the target's last hidden state (a Cartesian tree).

    guesser = load_guesser("medusa-heads", LoadRequest(engine, path="path/to/medusa"))   # decoder/guessers/heads.py reads it
    out = generate(engine, ids, plan="trees/medusa.json", guesser=guesser)          # plan=None: a chain

Head h, read at the last accepted token's hidden state, guesses the token h + 1 places beyond the next
root, whatever the path to it, so a step's candidates are a medusa tree over the heads' ranks (as
ParallelSpec's one-pass drafter and PPD's prompt tokens). The first step reads the hidden state of the
prompt's last prefilled token. Guesses are deterministic top-k: greedy verification, or the point-mass
lossless rule under sampling.
"""
from __future__ import annotations

import torch

from decoder.guesser import DecodeContext, DistanceGuesser, Proposal, StepOutcome
from decoder.layout import layout_for
from planner.errors import UserError
from planner.tree import PPD, Tree


class MedusaGuesser(DistanceGuesser):
    needs_hidden = True
    ensemble = 1

    def __init__(self, heads, top_k: int = 8, label: str = "medusa"):
        if top_k < 1:
            raise UserError(f"{label}: top_k must be at least 1")
        self.heads, self.top_k, self.label = heads.eval(), top_k, label

    @property
    def num_distances(self) -> int:
        return len(self.heads.heads)

    def input_embeddings(self):
        return None

    def check(self, plan: Tree | None, label: str = "plan") -> None:
        if plan is None:
            return  # a chain over every head
        if plan.method == PPD:
            raise UserError(f"{label}: a ppd plan needs PPD prompt tokens; Medusa heads run medusa trees")
        super().check(plan, label)

    @torch.inference_mode()
    def guess(self, hidden: torch.Tensor) -> torch.Tensor:
        """[H] the target's hidden state at the last accepted token -> [heads, top_k] guesses, distance 1 first."""
        return self.heads(hidden.to(self.heads.heads[0].weight.dtype)).float().topk(self.top_k, dim=-1).indices

    def begin(self, target, plan: Tree | None, prompt_ids: torch.Tensor, ctx: DecodeContext) -> "MedusaSession":
        if ctx.prompt_hidden is None and prompt_ids.numel() > 1:
            raise UserError(f"{self.label}: the decoder did not return the target's hidden states")
        nodes = tuple(plan.states[0].nodes) if plan is not None else tuple((0,) * d for d in range(1, self.num_distances + 1))
        return MedusaSession(self, layout_for(nodes, self.top_k, ctx.dtype, ctx.device), ctx)


class MedusaSession:
    def __init__(self, guesser: MedusaGuesser, layout, ctx: DecodeContext):
        self.g, self.layout, self.ctx = guesser, layout, ctx
        self.max_input_length = layout.input_length
        hidden = ctx.prompt_hidden
        self.guesses = guesser.guess(hidden[-1]) if hidden is not None and hidden.shape[0] else None

    def propose(self, root: torch.Tensor) -> Proposal:
        if self.guesses is None:  # a one-token prompt: no hidden state to read yet
            return Proposal(layout_for((), 1, self.ctx.dtype, self.ctx.device), root.new_empty(0))
        return Proposal(self.layout, self.guesses.reshape(-1)[self.layout.cand_index], guesses=self.guesses)

    def commit(self, outcome: StepOutcome) -> None:
        self.guesses = self.g.guess(outcome.hidden[outcome.verdict.nodes[-1]])
