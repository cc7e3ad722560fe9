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
from decoder.layout import layout_for
from decoder.pool import Decider, Pool, Source
from planner.dynamic import DynamicSpec, GuesserModel, lookup_bins
from planner.errors import UserError
from planner.tree import Tree


@dataclass
class Match:
    tokens: list[int]  # what followed the most recent earlier occurrence of the suffix n-gram (at most k)
    ngram: int  # the matched n-gram length (0: no match)
    starts: np.ndarray  # [m] every earlier occurrence of the suffix n-gram, oldest first


class History:
    """The text so far in a growing buffer (amortised appends), searched with array compares."""

    def __init__(self, ids: list[int]):
        self.buf = np.zeros(len(ids) + 4096, dtype=np.int64)
        self.T = len(ids)
        self.buf[: self.T] = ids

    def push(self, toks: list[int]) -> None:
        need = self.T + len(toks)
        if need > len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros(max(need, 2 * len(self.buf)) - len(self.buf), dtype=np.int64)])
        self.buf[self.T: need] = toks
        self.T = need

    def continuation(self, max_ngram: int, min_ngram: int, k: int) -> Match:
        """The longest suffix n-gram (max_ngram down to min_ngram) with an earlier occurrence; the
        at most k tokens that followed its most recent one (never the suffix itself)."""
        h, T = self.buf, self.T
        for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
            m = np.ones(T - n, dtype=bool)  # candidate starts 0..T-n-1
            for j in range(n):
                m &= h[j: T - n + j] == h[T - n + j]
            starts = np.flatnonzero(m)
            if len(starts):  # a start s <= T-n-1 is always followed by h[s + n]
                s = int(starts[-1])
                return Match(h[s + n: min(s + n + k, T)].tolist(), n, starts)
        return Match([], 0, np.zeros(0, dtype=np.int64))

    def follow_counts(self, match: Match) -> list[int]:
        """Per proposed token: the occurrences of the n-gram whose text continued with the match so far."""
        h, T, n = self.buf, self.T, match.ngram
        counts, alive = [], match.starts
        for j, tok in enumerate(match.tokens):
            alive = alive[alive + n + j < T]
            alive = alive[h[alive + n + j] == tok]
            counts.append(max(1, len(alive)))
        return counts


def find_continuation(history: list[int], max_ngram: int, min_ngram: int, num_tokens: int) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the longest matching suffix n-gram."""
    return History(history).continuation(max_ngram, min_ngram, num_tokens).tokens


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

    def dynamic_source(self, gm: GuesserModel, spec: DynamicSpec, target, prompt_ids: torch.Tensor,
                       ctx: DecodeContext, sampled: bool) -> "LookupSource":
        return LookupSource(gm, self, spec, prompt_ids)


class LookupSession:
    def __init__(self, g: PromptLookupGuesser, k: int, prompt: list[int], ctx: DecodeContext):
        self.g, self.k, self.ctx = g, k, ctx
        self.history = History(prompt[:-1])  # everything before the root; the root joins at propose
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
        self.history = History(prompt_ids.reshape(-1).tolist()[:-1])  # the root joins at extend

    def extend(self, pool: Pool, root: torch.Tensor, session: Decider) -> None:
        self.history.push([int(root[0])])
        match = self.history.continuation(self.g.max_ngram, self.g.min_ngram, self.k)
        if not match.tokens:
            return
        follow = match.tokens
        depth = np.arange(1, len(follow) + 1)
        bins = lookup_bins(np.full(len(follow), match.ngram), np.array(self.history.follow_counts(match)))
        cells = self.model.cells(depth, np.zeros(len(follow), dtype=np.int64), bins)
        c = session.c_of(self.kind, cells)
        parent = -1
        for tok, ci, cell, b in zip(follow, c.tolist(), cells.tolist(), bins.tolist()):
            parent = pool.add(tok, parent, ci, (self.kind, cell, b))

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        self.history.push(outcome.verdict.emitted[:-1])


def load(request) -> PromptLookupGuesser:
    """The registry's loader (planner/guessers.py): chains of request.depth tokens (default 4)."""
    return PromptLookupGuesser(num_tokens=request.depth if request.depth is not None else 4,
                               max_ngram=request.options.get("max_ngram", 3), min_ngram=request.options.get("min_ngram", 1))
