"""Prompt lookup (n-gram drafting): propose what followed the last n-gram the last time it occurred.

vLLM's `ngram` method and transformers' `prompt_lookup_num_tokens`: no model, near-zero cost. The
text so far (prompt + output, root included) is searched for the most recent earlier occurrence
of its last n tokens, n from `max_ngram` down to `min_ngram`; the up to `num_tokens` tokens that
followed it are proposed as a chain. A miss proposes nothing (a plain step). Guesses are
deterministic, so verification is greedy or the point-mass lossless rule.

One finder (`History.continuation`) serves the static chain (`LookupSession`) and the per-step
source of dynamic plans (`LookupSource`), which also reads its signals: the matched n-gram length
and how often the text followed the n-gram (and the continuation so far) with each proposed token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from decoder.guesser import DecodeContext, Proposal, StepOutcome
from decoder.guessers.pool import Decider, Pool, Source
from decoder.layout import layout_for
from planner.dynamic import DEPTH_BINS, DynamicSpec, GuesserModel, lookup_bin_list
from planner.errors import UserError
from planner.tree import PPD, Tree


@dataclass
class Match:
    tokens: list[int]  # what followed the most recent earlier occurrence of the suffix n-gram (at most k)
    ngram: int  # the matched n-gram length (0: no match)
    starts: list[int]  # every earlier occurrence of the suffix n-gram, oldest first


class History:
    """The text so far, with every n-gram's start positions (n in `ngrams`) indexed as tokens arrive:
    a step's search is a few dict reads instead of a scan of the whole text, which matters against
    llama.cpp's ~9 ms step (a scan per step cost about as much as the rest of the decision)."""

    def __init__(self, ids: list[int], ngrams: range):
        self.h: list[int] = []
        self.starts: dict[int, dict[tuple, list[int]]] = {n: {} for n in ngrams}
        self.push(ids)

    @property
    def T(self) -> int:
        return len(self.h)

    def push(self, toks: list[int]) -> None:
        h = self.h
        for t in toks:
            h.append(int(t))
            end = len(h)
            for n, index in self.starts.items():
                if end >= n:
                    index.setdefault(tuple(h[end - n:]), []).append(end - n)

    def continuation(self, max_ngram: int, min_ngram: int, k: int) -> Match:
        """The longest suffix n-gram (max_ngram down to min_ngram) with an earlier occurrence; the
        at most k tokens that followed its most recent one (never the suffix itself)."""
        h, T = self.h, len(self.h)
        for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
            starts = self.starts[n].get(tuple(h[T - n:]), [])[:-1]  # the last start is the suffix itself
            if starts:  # a start s <= T-n-1 is always followed by h[s + n]
                s = starts[-1]
                return Match(h[s + n: min(s + n + k, T)], n, starts)
        return Match([], 0, [])

    def follow_counts(self, match: Match) -> list[int]:
        """Per proposed token: the occurrences of the n-gram whose text continued with the match so far."""
        h, T, n = self.h, len(self.h), match.ngram
        counts, alive = [], match.starts
        for j, tok in enumerate(match.tokens):
            alive = [a for a in alive if a + n + j < T and h[a + n + j] == tok]
            counts.append(max(1, len(alive)))
        return counts


def find_continuation(history: list[int], max_ngram: int, min_ngram: int, num_tokens: int) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the longest matching suffix n-gram."""
    return History(history, range(min_ngram, max_ngram + 1)).continuation(max_ngram, min_ngram, num_tokens).tokens


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
        if plan.method == PPD or nodes is None or any(r != 0 for p in nodes for r in p):
            raise UserError(f"{label}: prompt lookup proposes one chain; give no plan or a chain (rank 0 only)")

    def begin(self, model, plan: Tree | None, prompt_ids: torch.Tensor, ctx: DecodeContext) -> "LookupSession":
        k = plan.depth if plan is not None else self.num_tokens
        return LookupSession(self, k, prompt_ids.reshape(-1).tolist(), ctx)

    def dynamic_source(self, gm: GuesserModel, spec: DynamicSpec, target, prompt_ids: torch.Tensor,
                       ctx: DecodeContext, sampled: bool) -> "LookupSource":
        return LookupSource(gm, self, spec, prompt_ids)


class LookupSession:
    def __init__(self, g: PromptLookupGuesser, k: int, prompt: list[int], ctx: DecodeContext):
        self.g, self.k, self.ctx = g, k, ctx
        self.history = History(prompt[:-1], range(g.min_ngram, g.max_ngram + 1))  # the root joins at propose
        self.max_input_length = 1 + k
        self.proposed = 0

    def propose(self, root: torch.Tensor) -> Proposal:
        self.history.push([int(root[0])])
        follow = self.history.continuation(self.g.max_ngram, self.g.min_ngram, self.k).tokens
        self.proposed = len(follow)
        chain = tuple((0,) * d for d in range(1, len(follow) + 1))
        layout = layout_for(chain, 1, self.ctx.dtype, self.ctx.device)
        tokens = torch.tensor(follow, dtype=torch.long, device=root.device)
        return Proposal(layout, tokens, guesses=None)

    def commit(self, outcome: StepOutcome) -> None:
        # the accepted candidates join the history; the new root joins at the next propose
        self.history.push(outcome.verdict.emitted[:-1])


class LookupSource(Source):
    """Prompt lookup in a dynamic plan: its continuation (up to the plan's depth) as a chain, each
    token with its cell (depth, matched n-gram length x follow count)."""

    kind = "lookup"

    def __init__(self, gm: GuesserModel, g: PromptLookupGuesser, spec: DynamicSpec, prompt_ids: torch.Tensor):
        super().__init__(gm)
        self.g, self.k = g, min(spec.max_depth, 16)
        self.history = History(prompt_ids.reshape(-1).tolist()[:-1], range(g.min_ngram, g.max_ngram + 1))

    def extend(self, pool: Pool, root: torch.Tensor, session: Decider) -> None:
        self.history.push([int(root[0])])
        match = self.history.continuation(self.g.max_ngram, self.g.min_ngram, self.k)
        if not match.tokens:
            return
        follow = match.tokens
        bins = lookup_bin_list(match.ngram, self.history.follow_counts(match))  # plain ints: numpy's per-call
        if self.model.calibration is not None:                                   # cost was most of the decision
            width = self.model.calibration.p.shape[1]
            cells = [(min(d, DEPTH_BINS) - 1) * width + b for d, b in enumerate(bins, start=1)]
        else:
            cells = self.model.cells(np.arange(1, len(follow) + 1), np.zeros(len(follow), dtype=np.int64),
                                     np.asarray(bins)).tolist()
        c = session.c_of(self.kind, np.asarray(cells, dtype=np.int64))
        parent = -1
        for tok, ci, cell, b in zip(follow, c.tolist(), cells, bins):
            parent = pool.add(tok, parent, ci, (self.kind, cell, b))

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        self.history.push(outcome.verdict.emitted[:-1])


def load(request) -> PromptLookupGuesser:
    """The registry's loader (planner/guessers.py): chains of request.depth tokens (default 4)."""
    return PromptLookupGuesser(num_tokens=request.depth if request.depth is not None else 4,
                               max_ngram=request.options.get("max_ngram", 3), min_ngram=request.options.get("min_ngram", 1))


def available_lengths(prompt: list[int], answer: list[int], num_tokens: int, max_ngram: int = 3,
                      min_ngram: int = 1) -> tuple[list[int], list[int]]:
    """Per answer position i (answer[:i] emitted, the root is the last token so far): how many tokens
    lookup offers there, and how many of them plain decoding would accept (the matching prefix of its
    continuation and answer[i:]). The oracle ceiling's input (planner/ceiling.py)."""
    offered, available = [], []
    for i in range(len(answer)):
        follow = find_continuation(prompt + answer[:i], max_ngram, min_ngram, num_tokens)
        a = 0
        while a < len(follow) and i + a < len(answer) and follow[a] == answer[i + a]:
            a += 1
        offered.append(len(follow))
        available.append(a)
    return offered, available
