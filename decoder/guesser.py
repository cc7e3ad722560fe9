"""Guessers: what proposes the candidate tokens of a step (the proposer, in vLLM's words).

One decoding step (decoder/loop.py) has four parts, each in one place:
  1. propose  the guesser's session puts a tree before the target: a `Proposal` (a layout from
              decoder/layout.py, the candidate tokens, for sampled drafts the distribution q each
              node's children were drawn from, for PPD the prompt-token input embeddings);
  2. score    the target runs root + tree in one forward pass (decoder/torch_ops/forward.py);
  3. verify   a rule picks the accepted path and the target's own next token (decoder/verify.py);
  4. commit   the target cache keeps the path (decoder/torch_ops/cache.py) and the session commits the
              `StepOutcome` to its own state: PPD reads its next guesses from the prompt tokens'
              logits, a draft model's cache follows the path, a lookup table grows.

A guesser is a configuration (weights, widths) that opens one session per sequence:
  needs_hidden: bool                    the step must also return the target's last hidden state
  check(plan, label)                    UserError when the plan asks more than the guesser gives
  begin(model, plan, prompt_ids, ctx)   -> a session with propose(root) and commit(outcome),
                                        and max_input_length (largest step input it will ask for)

`DistanceGuesser` serves guessers whose guess for distance d beyond the root does not depend on
the path to it (PPD prompt tokens, the oracle): the candidate at rank path (r1, .., rd) is guess
row d-1, rank rd (a Cartesian tree, as Medusa's), and the plan's state machine (PPD: the number
of prompt tokens on the last accepted node) picks the next step's tree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from decoder.layout import PlanLayout, StepLayout, layout_for, plan_layout
from planner.errors import UserError
from planner.tree import PPD, Tree

if TYPE_CHECKING:
    from decoder.verify import Sampling, Verdict


@dataclass
class Proposal:
    """One step's tree as the guesser proposes it."""

    layout: StepLayout
    tokens: torch.Tensor  # [N] long candidate tokens in layout order (root excluded), on the target's device
    draft_probs: torch.Tensor | None = None  # [num_tree, V] q at each tree token (its children's draw); None: deterministic guesses
    # with draft_probs, in a tree mixing both: per tree index, True where the token is a fixed guess
    # (a point-mass proposal, prompt lookup's in a hybrid) rather than a draw from its parent's q
    deterministic: list[bool] | None = None
    extra_embeds: torch.Tensor | None = None  # [n - num_tree, hidden] inputs after the tree tokens (PPD prompt tokens)
    guesses: torch.Tensor | None = None  # [D, K] per-distance guesses, when the guesser has them (acceptance counting)
    # a verification rule of the proposal's own, (logits [num_tree, V], tokens [num_tree], sampling,
    # generator) -> Verdict: MTAD's joint acceptance; None: the run's rule (decoder.verify.verify)
    rule: object = None


@dataclass
class StepOutcome:
    """What the target and the verification rule decided; the session commits it."""

    proposal: Proposal
    verdict: Verdict  # accepted tree indices (device and host), emitted tokens, the next root
    logits: torch.Tensor  # [n, V] the step's logits
    hidden: torch.Tensor | None  # [n, hidden] the target's last hidden state, when the guesser needs it
    context_length: int  # the target cache's length after the commit: the next root's position


@dataclass(frozen=True)
class DecodeContext:
    """What a session may need to know of the decoding run."""

    sampling: Sampling
    generator: torch.Generator  # CPU generator shared with verification (seeded once per call)
    dtype: torch.dtype
    device: torch.device
    label: str = "plan"
    prompt_hidden: torch.Tensor | None = None  # [T-1, F] the target's features over the prefilled prompt (needs_hidden)
    noise: object = None  # decoder.noise.PositionNoise under the coupled rule (its cursor: the next token's index)
    features: object = False  # decoder.engine.Features the step outcomes carry (the guesser's needs_hidden)


class GuessSession(Protocol):
    max_input_length: int

    def propose(self, root: torch.Tensor) -> Proposal: ...

    def commit(self, outcome: StepOutcome) -> None: ...


class Guesser(Protocol):
    needs_hidden: bool

    def check(self, plan: Tree | None, label: str = "plan") -> None: ...

    def begin(self, model, plan: Tree | None, prompt_ids: torch.Tensor, ctx: DecodeContext) -> GuessSession: ...


# ---------------------------------------------------------------------------------------------
# plain decoding: no guesses


class PlainGuesser:
    """Root-only steps: plain decoding through the same loop, so timings compare like with like."""

    needs_hidden = False

    def check(self, plan, label: str = "plan") -> None:
        pass

    def begin(self, model, plan, prompt_ids, ctx: DecodeContext) -> "_PlainSession":
        return _PlainSession(layout_for((), 1, ctx.dtype, ctx.device))


class _PlainSession:
    def __init__(self, layout: StepLayout):
        self.layout = layout
        self.max_input_length = 1

    def propose(self, root: torch.Tensor) -> Proposal:
        return Proposal(self.layout, root.new_empty(0))

    def commit(self, outcome: StepOutcome) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# per-distance guessers: PPD prompt tokens, the oracle


class DistanceGuesser:
    """Mixin for guessers with `num_distances`, `top_k`, `ensemble`, `input_embeddings()` and
    `guess(prompt_logits [k, E, V] | None, next_root_pos, k) -> [k, top_k]` token ids for
    distances 1..k beyond the next root (which sits at absolute position next_root_pos)."""

    needs_hidden = False

    def check(self, plan: Tree | None, label: str = "plan") -> None:
        if plan is None:
            raise UserError(f"{type(self).__name__}: decoding needs a plan (a tree file)")
        ranks = max((r for st in plan.states for p in st.nodes for r in p), default=-1)
        if ranks >= self.top_k:
            raise UserError(f"{label}: the plan uses rank {ranks}, the guesser gives top-{self.top_k} guesses per distance")
        need = plan.prompt_tokens_max if plan.method == PPD else plan.depth
        if need > self.num_distances:
            what = f"prompt_tokens_max = {need}" if plan.method == PPD else f"depth {need}"
            raise UserError(f"{label}: the plan needs {what}, the guesser guesses {self.num_distances} distances")
        if plan.method != PPD and plan.depth == 0:
            raise UserError(f"{label}: the {plan.method} tree has no candidates")

    def layouts(self, plan: Tree, dtype, device) -> PlanLayout:
        """Every state's layout; prompt-token slots only when the guesser has prompt-token inputs."""
        E = self.ensemble if self.input_embeddings() is not None else 0
        return plan_layout(plan, self.top_k, E, dtype, device)

    def begin(self, model, plan: Tree, prompt_ids, ctx: DecodeContext) -> "DistanceSession":
        table = self.input_embeddings()
        if table is not None:
            table = table.detach().to(device=ctx.device, dtype=ctx.dtype)  # [P*E, hidden]
        return DistanceSession(self, self.layouts(plan, ctx.dtype, ctx.device), table, ctx.device, ctx.dtype)


class DistanceSession:
    """Starts with the bootstrap step (root only, all prompt tokens), so the first real step has guesses."""

    def __init__(self, guesser: DistanceGuesser, plan: PlanLayout, table: torch.Tensor | None, device, dtype):
        self.guesser, self.plan, self.table, self.device, self.dtype = guesser, plan, table, device, dtype
        self.layout = plan.bootstrap
        self.guesses: torch.Tensor | None = None  # [k, K] for the current layout's depths
        self.max_input_length = plan.max_input_length

    def switch(self, plan: Tree | None) -> None:
        """Another tree from now on (a batch's schedule changed with its size); None: plain steps.
        Guesses made for the old tree may not reach the new one's depth, so it starts with its
        bootstrap step (root and all prompt tokens), as after the prefill."""
        if plan is None:
            self.plan = None
            self.layout = layout_for((), 1, self.dtype, self.device)
        else:
            self.plan = self.guesser.layouts(plan, self.dtype, self.device)
            self.layout = self.plan.bootstrap
            self.max_input_length = max(self.max_input_length, self.plan.max_input_length)
        self.guesses = None

    def propose(self, root: torch.Tensor) -> Proposal:
        lay = self.layout
        tokens = self.guesses.reshape(-1)[lay.cand_index] if lay.num_tree > 1 else root.new_empty(0)  # [N]
        extra = self.table[lay.slot_embedding] if lay.input_length > lay.num_tree else None  # [slots, hidden]
        return Proposal(lay, tokens, extra_embeds=extra, guesses=self.guesses)

    def commit(self, outcome: StepOutcome) -> None:
        lay = self.layout
        last = outcome.verdict.nodes[-1]
        k = lay.prompt_count_list[last]
        if k > 0:
            slots = lay.slot_index[last, :k]  # [k, E]
            prompt_logits = outcome.logits[slots] if lay.input_length > lay.num_tree else None  # [k, E, V]
            self.guesses = self.guesser.guess(prompt_logits, outcome.context_length, k).to(self.device)
        else:
            self.guesses = None
        if self.plan is not None:
            self.layout = self.plan.next(k)


def load_plain(request) -> PlainGuesser:
    """The registry's loader for plain decoding (planner/guessers.py)."""
    return PlainGuesser()
