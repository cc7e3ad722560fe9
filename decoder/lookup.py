"""Prompt lookup (n-gram drafting): propose what followed the last n-gram the last time it occurred.

vLLM's `ngram` method and transformers' `prompt_lookup_num_tokens`: no model, near-zero cost. The
text so far (prompt + output, root included) is searched for the most recent earlier occurrence
of its last n tokens, n from `max_ngram` down to `min_ngram`; the up to `num_tokens` tokens that
followed it are proposed as a chain. A miss proposes nothing (a plain step). Guesses are
deterministic, so verification is greedy or the point-mass lossless rule.
"""
from __future__ import annotations

import torch

from decoder.guesser import DecodeContext, Proposal, StepOutcome
from decoder.layout import layout_for
from planner.errors import UserError
from planner.tree import Tree


def find_continuation(history: list[int], max_ngram: int, min_ngram: int, num_tokens: int) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the longest matching suffix n-gram."""
    T = len(history)
    for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
        suffix = history[T - n:]
        for start in range(T - n - 1, -1, -1):  # most recent first, never the suffix itself
            if history[start: start + n] == suffix:
                follow = history[start + n: start + n + num_tokens]
                if follow:
                    return follow
    return []


class PromptLookupGuesser:
    """num_tokens: longest chain proposed; max_ngram / min_ngram: the n-gram sizes tried, longest first.

    A plan, when given, must be a chain (depth = num_tokens); lookup proposes one continuation."""

    needs_hidden = False

    def __init__(self, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        if num_tokens < 1 or min_ngram < 1 or max_ngram < min_ngram:
            raise UserError(f"prompt lookup: need num_tokens >= 1 and 1 <= min_ngram <= max_ngram, got "
                            f"{num_tokens}, {min_ngram}, {max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    top_k = 1  # one continuation: a single guess per distance

    @property
    def num_distances(self) -> int:
        return self.num_tokens

    def check(self, plan: Tree | None, label: str = "plan") -> None:
        if plan is None:
            return
        nodes = plan.states[0].nodes if len(plan.states) == 1 else None
        if plan.method == "ppd" or nodes is None or any(r != 0 for p in nodes for r in p):
            raise UserError(f"{label}: prompt lookup proposes one chain; give no plan or a chain (rank 0 only)")

    def begin(self, model, plan: Tree | None, prompt_ids: torch.Tensor, ctx: DecodeContext) -> "LookupSession":
        k = plan.depth if plan is not None else self.num_tokens
        return LookupSession(self, k, prompt_ids.reshape(-1).tolist(), ctx)


class LookupSession:
    def __init__(self, g: PromptLookupGuesser, k: int, prompt: list[int], ctx: DecodeContext):
        self.g, self.k, self.ctx = g, k, ctx
        self.history = prompt[:-1]  # everything before the root; the root joins at propose
        self.max_input_length = 1 + k
        self.proposed = 0

    def propose(self, root: torch.Tensor) -> Proposal:
        self.history.append(int(root[0]))
        follow = find_continuation(self.history, self.g.max_ngram, self.g.min_ngram, self.k)
        self.proposed = len(follow)
        chain = tuple((0,) * d for d in range(1, len(follow) + 1))
        layout = layout_for(chain, 1, self.ctx.dtype, self.ctx.device)
        tokens = torch.tensor(follow, dtype=torch.long, device=root.device)
        return Proposal(layout, tokens, guesses=None)

    def commit(self, outcome: StepOutcome) -> None:
        # the accepted candidates join the history; the new root joins at the next propose
        self.history.extend(outcome.verdict.emitted[:-1])


def load(request) -> PromptLookupGuesser:
    """The registry's loader (planner/guessers.py): chains of request.depth tokens (default 4)."""
    return PromptLookupGuesser(num_tokens=request.depth if request.depth is not None else 4,
                               max_ngram=request.options.get("max_ngram", 3), min_ngram=request.options.get("min_ngram", 1))
