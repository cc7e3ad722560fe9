"""A draft LM's per-step pool under a dynamic plan (decoder/guessers/dynamic.py).

`DraftSource` (greedy) expands the EXPAND most probable nodes of a level with their top children
and stops when a level would not pay. `SampledDraftSource` drafts under lossless sampling, where
children are drawn only where they are kept:

Under sampling a node's children are draws from the drafter's warped q without replacement, and the
sibling procedure (decoder.verify.verify_sampled) stays exact only while how many children a node
has never depends on those children's own draws (docs/sampling.md). So nothing drawn is dropped:
level by level, the session's marginal rule (expected tokens per second against the measured step
cost) decides how many children each fed node gets from what is known before they are drawn (the
node's path probability and the corrected rank-level acceptance c(d, r) the sampled acceptance rows
give), they are drawn, and they all stay. A level pass of the drafter is paid only when its best
next child pays for it.

In a hybrid (lookup+draft) the deterministic source's candidates are chosen first (planner.dynamic
.choose over what it put in the pool); at a node where one of them stays, the draft's children are
drawn from q without its token, and that q is the one verification checks them with, so a point-mass
sibling and sampled siblings share the node losslessly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from decoder.guesser import DecodeContext, StepOutcome
from decoder.guessers.draft_cache import DraftCache
from decoder.guessers.pool import POOL_WIDTH, Decider, Pool, Source
from decoder.noise import aimed_top_k
from decoder.verify import draw_children, probabilities
from planner.dynamic import DynamicSpec, GuesserModel, choose, q_bins

EXPAND = 4  # nodes of a level the greedy source expands (EAGLE-2's expansion)


class DraftSource(Source):
    """The draft LM in a dynamic plan, drafting level by level over its `DraftCache`: each level
    expands the EXPAND most probable nodes with their top POOL_WIDTH children and stops when a level
    would not pay. Under lossless sampling `SampledDraftSource` drafts instead."""

    kind = "draft"

    def __init__(self, gm: GuesserModel, drafter, top_k: int, spec: DynamicSpec, prompt_ids: torch.Tensor,
                 ctx: DecodeContext, sampled: bool):
        super().__init__(gm)
        self.drafter = DraftCache(drafter, prompt_ids, ctx.prompt_hidden)
        self.ctx, self.sampled, self.spec = ctx, sampled, spec
        self.width = min(POOL_WIDTH, top_k)

    def _level_pass(self, pool: Pool, fed: list[int]) -> torch.Tensor:
        """The drafter's pass over pool nodes `fed` (one level) -> logits [len(fed), V]."""
        tokens = torch.tensor([pool.tokens[u] for u in fed], device=self.ctx.device)
        return self.drafter.level_pass(fed, pool.parent, tokens, [pool.depth[u] for u in fed])

    def _children(self, logits: torch.Tensor, k: int, d: int):
        """(tokens [rows, k], q of them [rows, k] on the host): the top-k of each row, children at
        distance d (greedy; under coupled sampling the Gumbel top-k of the warped q with the noise of
        distance d's draw, decoder/noise.py; the sampled subclass draws instead)."""
        probs = torch.softmax(logits.float(), dim=-1)
        noise = self.ctx.noise
        if noise is None:
            top = probs.topk(k, dim=-1)
            idx, values = top.indices, top.values
        else:
            idx = aimed_top_k(logits, self.ctx.sampling, noise, [noise.cursor + d - 1] * logits.shape[0], k)
            values = probs.gather(-1, idx)
        both = torch.stack([values, idx.float()]).cpu().numpy()
        return both[1].astype(np.int64), both[0], None

    def extend(self, pool: Pool, root: torch.Tensor, session: Decider) -> None:
        gm = self.model
        if not self.drafter.ready or not session.worth_level(pool, session.top1(self.kind, 1), gm.draft_s):
            self.drafter.skip(int(root[0]))
            return
        t0 = time.perf_counter()
        logits = self.drafter.first_pass(root)[None]
        frontier = [-1]
        for d in range(1, self.spec.max_depth + 1):
            toks, q, _ = self._children(logits, self.width, d)
            pool.passes_s += time.perf_counter() - t0
            pool.sunk_s += gm.draft_s
            depth = np.full(q.size, d)
            rank = np.tile(np.arange(self.width), len(frontier))
            bins = q_bins(q.reshape(-1))
            cells = gm.cells(depth, rank, bins)
            c = session.c_of(self.kind, cells).tolist()
            new = []
            for j, u in enumerate(frontier):
                for r in range(self.width):
                    k = j * self.width + r
                    new.append(pool.add(int(toks[j, r]), u, c[k], (self.kind, int(cells[k]), int(bins[k])), r))
            if d == self.spec.max_depth:
                break
            P = pool.probabilities()
            frontier = sorted(new, key=lambda i: -P[i])[:EXPAND]
            est = float(P[frontier[0]]) * session.top1(self.kind, d + 1)
            if not session.worth_level(pool, est, gm.draft_s):
                break
            t0 = time.perf_counter()
            logits = self._level_pass(pool, frontier)

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        """Keep the accepted nodes the drafter fed (a prefix of the path); the rest wait as unseen."""
        self.drafter.keep_outcome(accepted, outcome)


@dataclass
class _Kept:
    """The nodes this step keeps, with the step's expected tokens and cost so far."""

    nodes: list[int]
    tau: float
    sunk_s: float
    cost_n: np.ndarray
    pending: int = 0  # slots chosen at this level, not drawn yet

    @property
    def cost(self) -> float:
        return self.sunk_s + float(self.cost_n[len(self.nodes) + self.pending])

    def pays(self, gain: float, more: int = 1, pass_s: float = 0.0) -> bool:
        """Whether `more` candidates adding `gain` expected tokens (and a drafter pass) raise tokens per second."""
        n = len(self.nodes) + self.pending + more
        if gain <= 0 or n >= len(self.cost_n):
            return False
        return (self.tau + gain) / (self.sunk_s + pass_s + float(self.cost_n[n])) > self.tau / self.cost


class SampledDraftSource(DraftSource):
    """DraftSource under lossless sampling (decoder/guessers/draft.py's `dynamic_source` picks it)."""

    def extend(self, pool: Pool, root: torch.Tensor, session: Decider) -> None:
        gm = self.model
        if pool.tokens:  # a hybrid's deterministic candidates: the ones that pay stay, chosen before any draw
            ch = choose(pool.probabilities(), session.cost_n, pool.sunk_s, len(session.cost_n) - 1)
            kept = _Kept(list(ch.chosen), ch.expected_tokens, pool.sunk_s, session.cost_n)
        else:
            kept = _Kept([], 1.0, pool.sunk_s, session.cost_n)
        probs = pool.probabilities() if pool.tokens else np.zeros(0)
        P = {-1: 1.0} | {i: float(probs[i]) for i in kept.nodes}  # path probability of every kept node
        pool.fixed = sorted(kept.nodes)
        if not self.drafter.ready or not kept.pays(self._c(session, 1, 0), 1, gm.draft_s):
            self.drafter.skip(int(root[0]))
            return
        t0 = time.perf_counter()
        logits = {-1: self.drafter.first_pass(root)}  # fed node -> the drafter's logits after it
        kept.sunk_s += gm.draft_s
        for d in range(1, self.spec.max_depth + 1):
            self._level(pool, kept, P, logits, d, session)
            # the next level: the best nodes at depth d whose parent was fed, if their best child pays a pass
            nxt = sorted((u for u in kept.nodes if pool.depth[u] == d and pool.parent[u] in logits),
                         key=lambda u: -P[u])[:EXPAND]
            if d == self.spec.max_depth or not nxt or not kept.pays(P[nxt[0]] * self._c(session, d + 1, 0), 1, gm.draft_s):
                break
            logits.update(zip(nxt, self._level_pass(pool, nxt)))
            kept.sunk_s += gm.draft_s
        pool.fixed = sorted(kept.nodes)
        pool.sunk_s = kept.sunk_s
        pool.passes_s += time.perf_counter() - t0  # drafting (passes and draws), not the decision's own time

    def _level(self, pool: Pool, kept: _Kept, P: dict, logits: dict, d: int, session: Decider) -> None:
        """Children at depth d of the fed nodes at depth d - 1: slots best-first while each pays, then
        drawn per node from q without the node's kept deterministic children."""
        fed = [u for u in logits if (u == -1 and d == 1) or (u >= 0 and pool.depth[u] == d - 1)]
        q, taken, support = {}, {}, {}
        for u in fed:
            qu = probabilities(logits[u], self.ctx.sampling).double().cpu()
            for i in kept.nodes:  # lookup's guesses at u that stay: never drawn, verified as point masses
                if pool.parent[i] == u:
                    qu[pool.tokens[i]] = 0.0
            total = float(qu.sum())
            if total > 0:
                q[u] = qu / total
                taken[u] = 0
                support[u] = int((qu > 0).sum())
        width = min(self.width, len(self.model.prior[0]))
        while True:  # the best next slot over the fed nodes; c is non-increasing in rank, so ranks stay contiguous
            best, value = None, 0.0
            for u in q:
                r = taken[u]
                if r < width and r < support[u]:
                    v = P[u] * self._c(session, d, r)
                    if v > value:
                        best, value = u, v
            if best is None or not kept.pays(value):
                break
            taken[best] += 1
            kept.tau += value
            kept.pending += 1
        kept.pending = 0
        for u, k in taken.items():
            if not k:
                continue
            toks = draw_children(q[u], k, self.ctx.generator)  # the first k draws without replacement, in order
            pool.q[u] = q[u].to(device=self.ctx.device, dtype=torch.float32)
            for r, x in enumerate(toks):
                c = self._c(session, d, r)
                cell = int(self.model.cells(np.array([d]), np.array([r]), np.zeros(1, dtype=np.int64))[0])
                i = pool.add(int(x), u, c, (self.kind, cell, 0), r, merge=False)
                pool.sampled.add(i)
                kept.nodes.append(i)
                P[i] = P[u] * c

    def _c(self, session: Decider, d: int, r: int) -> float:
        """c(d, r) before the draw: the corrected rank-0 acceptance at distance d, and the sampled
        acceptance rows' rank ratio for later siblings (non-increasing in r)."""
        prior = self.model.prior
        row = prior[min(d, prior.shape[0]) - 1]
        top = session.top1(self.kind, d)
        if r == 0:
            return top
        if r >= len(row):
            return 0.0
        return float(min(top, top * row[r] / row[0])) if row[0] > 0 else float(row[r])
