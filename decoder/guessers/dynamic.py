"""Per-step trees: the session side of a `dynamic` plan (planner/dynamic.py decides).

    out = generate(model, ids, plan="trees/dynamic-lookup.json", guesser=PromptLookupGuesser())
    out = generate(model, ids, plan=dyn, guesser=HybridGuesser(PromptLookupGuesser(), drafter))

Each step one `DynamicSession` asks its sources (one guesser, or lookup and a drafter for a hybrid)
for a pool of candidates with their live signals (decoder/guessers/pool.py), maps every signal to
c = P(accepted | parent accepted) through the plan's calibration as corrected online so far, and
keeps the n most probable paths for the n (0: a plain step) that maximises expected tokens per
second of this step (planner.dynamic.choose). The kept nodes become an ordinary `Proposal` of the
one loop (decoder/loop.py): target, verification rules and caches are the static trees' own.

A source lives beside its guesser's own drafting code and is opened by the guesser's
`dynamic_source(...)`: prompt lookup (decoder/guessers/lookup.py), the draft LM (decoder/guessers/draft.py), the
ParallelSpec and chain drafter (decoder/guessers/parallel.py), PPD prompt tokens (decoder/guessers/prompt_tokens.py).

Drafters that pay per level (draft LM, chain drafter) stop drafting when one more level is not
expected to pay for its pass and the wider forward (a marginal rule, CaDDTree's greedy stop); the
ParallelSpec drafter pays one pass per step, so it skips it when even its best guess would not pay.

Sampled drafts (lossless sampling with a draft LM): a node's number of children must not depend on
those children's own draws (the sibling procedure would then see a biased draw and lose exactness:
tests/test_dynamic_sampling.py shows such a rule failing the chi-square test). So at temperature > 0 the
draft LM draws, level by level, only children it keeps, counted from rank-level acceptance (the
sampled acceptance rows, corrected online) before they are drawn (decoder/guessers/draft_source.py); in a
hybrid, lookup's guesses are chosen first and the draft's children at their node are drawn without
their token, each sibling verified with its own proposal.

Commit: every pool node whose parent lies on the accepted path is an observation of its cell
(accepted iff its token is the target's token there); the maps move toward what is realised.

The decision's own cost is the plan's `dynamic.decide_s`, one constant for the run (the main job
records the median its replay measured, workflows/mainjob/predict.py). The session times every
decision and reports it, but nothing a clock reads steers a choice: drafter passes are priced at
the plan's draft_s, their wall time (`Pool.passes_s`) is only taken out of the decision's time.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from decoder.guesser import DecodeContext, Proposal, StepOutcome
from decoder.guessers.pool import Pool, Source, rank_paths
from decoder.guessers.registry import kind_of
from decoder.layout import layout_for
from planner.dynamic import DynamicSpec, OnlineMap, choose
from planner.errors import UserError
from planner.tree import DYNAMIC, Tree

# ---------------------------------------------------------------------------------------------- the guesser wrapper


class DynamicGuesser:
    """Runs a guesser (or a HybridGuesser) under a dynamic plan; `generate` wraps it when the plan's method is dynamic."""

    def __init__(self, inner, plan: Tree):
        self.inner, self.plan = inner, plan
        self.needs_hidden = inner.needs_hidden
        self.last_report: dict | None = None

    def check(self, plan: Tree | None, label: str = "plan") -> None:
        for kind, _ in _members(self.inner):
            if kind not in self.plan.dynamic.guessers:
                have = ", ".join(self.plan.dynamic.guessers)
                raise UserError(f"{label}: the dynamic plan has maps for {have}; the guesser needs one for {kind} "
                                f"(planner plan dynamic --accept <{kind}'s acceptance> ...)")

    def begin(self, target, plan: Tree, prompt_ids: torch.Tensor, ctx: DecodeContext) -> DynamicSession:
        spec: DynamicSpec = self.plan.dynamic
        sampled = ctx.sampling.rule == "lossless"
        # each guesser opens its own per-step source, over its own drafting code
        sources = [g.dynamic_source(spec.guessers[kind], spec, target, prompt_ids, ctx, sampled)
                   for kind, g in _members(self.inner)]
        return DynamicSession(self, spec, sources, ctx, sampled)


class HybridGuesser:
    """Prompt lookup's continuation and a drafter's candidates in one step's tree (lookup+draft,
    lookup+parallelspec, lookup+chain, lookup+ppd). Only dynamic plans run it."""

    def __init__(self, lookup, drafter, drafter_kind: str):
        self.lookup, self.drafter, self.drafter_kind = lookup, drafter, drafter_kind
        self.needs_hidden = drafter.needs_hidden
        self.source_dir = getattr(drafter, "source_dir", None)
        self.top_k = getattr(drafter, "top_k", 1)

    def check(self, plan: Tree | None, label: str = "plan") -> None:
        if plan is None or plan.method != DYNAMIC:
            raise UserError(f"{label}: a hybrid guesser (lookup+{self.drafter_kind}) runs dynamic plans only "
                            "(planner plan dynamic --accept LOOKUP_ACC --accept DRAFTER_ACC)")

    def begin(self, *args, **kwargs):
        raise UserError("a hybrid guesser runs dynamic plans only")


def guesser_kind(g) -> str:
    """The registered kind of a guesser that can fill a per-step pool (one with a `dynamic_source`)."""
    if not hasattr(g, "dynamic_source"):
        raise UserError(f"dynamic plans: no per-step source for the guesser {type(g).__name__}")
    return kind_of(g).name


def _members(g) -> list[tuple[str, object]]:
    if isinstance(g, HybridGuesser):
        return [(guesser_kind(g.lookup), g.lookup), (g.drafter_kind, g.drafter)]
    return [(guesser_kind(g), g)]


# ---------------------------------------------------------------------------------------------- the session


class DynamicSession:
    """One sequence under a dynamic plan: each step its sources fill one pool, the session keeps the
    paths that pay (planner.dynamic.choose) and proposes them; each commit corrects the maps."""

    def __init__(self, owner: DynamicGuesser, spec: DynamicSpec, sources: list[Source], ctx: DecodeContext,
                 sampled: bool):
        self.owner, self.spec, self.sources, self.ctx, self.sampled = owner, spec, sources, ctx, sampled
        self.maps = {s.kind: OnlineMap(s.model.base(), spec.prior_strength, spec.forget) for s in sources}
        # rank-0 acceptance per distance, corrected online: what a drafter expects before it drafts a level
        self.rank0 = {s.kind: OnlineMap(s.model.prior[:, 0].copy(), spec.prior_strength, spec.forget) for s in sources}
        # step cost by number of candidates: the forward's input grows by (1 + prompt slots) per node
        per_node = max(s.input_per_node for s in sources)
        fixed = max(s.input_fixed for s in sources)
        cost = np.array(spec.step_cost_s)
        n_max = min(spec.max_size, (len(cost) - fixed) // per_node)
        self.cost_n = cost[[fixed - 1 + per_node * n for n in range(n_max + 1)]]  # [n_max + 1]
        self.per_node, self.fixed = per_node, fixed
        self.max_input_length = fixed + per_node * n_max
        self.sizes: list[int] = []
        self.decide_s: list[float] = []
        self.expected: list[float] = []
        # the decision's cost per step, fixed for the run: the plan's recorded decide_s. Measured time
        # never feeds back, so a step's choice is a function of the plan and the text alone (a replay
        # over the text takes decoding's steps on any machine, under any load)
        self.decide_cost = spec.decide_s
        self.costs: list[float] = []  # the model's cost of each step: the plan's decide_s + drafting + step_cost
        self.drafting: list[float] = []  # the plan's price of each step's drafter passes (draft_s a pass)
        self.pool: Pool | None = None
        self.chosen: list[int] = []

    # the sources' view: c per candidate, and whether one more drafted level pays
    def c_of(self, kind: str, cells: np.ndarray) -> np.ndarray:
        return self.maps[kind].c[cells]

    def top1(self, kind: str, depth: int) -> float:
        """The corrected rank-0 acceptance at this distance (the prior's deepest row beyond it)."""
        c = self.rank0[kind].c
        return float(c[min(depth, len(c)) - 1])

    def worth_level(self, pool: Pool, best_new: float, draft_s: float) -> bool:
        """One more drafter pass pays when the best new path it can add raises tokens per second."""
        if len(pool.tokens) >= self.spec.max_size * 4 or best_new <= 0:
            return False
        now = choose(pool.probabilities(), self.cost_n, pool.sunk_s, len(self.cost_n) - 1) if pool.tokens else None
        tau, cost, n = (now.expected_tokens, now.cost_s, len(now.chosen)) if now else (1.0, pool.sunk_s + self.cost_n[0], 0)
        if n + 1 >= len(self.cost_n):
            return False
        more = (tau + best_new) / (cost + draft_s + self.cost_n[n + 1] - self.cost_n[n])
        return more > tau / cost

    def propose(self, root: torch.Tensor) -> Proposal:
        t0 = time.perf_counter()
        pool = Pool()
        pool.sunk_s = self.decide_cost  # the decision's own cost, priced into every size alike
        for s in self.sources:
            s.extend(pool, root, self)
        if pool.fixed is not None:
            chosen = pool.fixed
            expected = 1.0 + float(pool.probabilities()[chosen].sum()) if chosen else 1.0
            cost = pool.sunk_s + float(self.cost_n[len(chosen)])
        elif pool.tokens:
            ch = choose(pool.probabilities(), self.cost_n, pool.sunk_s, len(self.cost_n) - 1)
            chosen, expected, cost = ch.chosen, ch.expected_tokens, ch.cost_s
        else:
            chosen, expected, cost = [], 1.0, pool.sunk_s + float(self.cost_n[0])
        self.costs.append(cost)
        self.drafting.append(pool.sunk_s - self.decide_cost)
        self.pool, self.chosen = pool, chosen
        paths = rank_paths(pool.parent, chosen)
        top_k = 1 + max((p[-1] for p in paths), default=0)
        lay = self._layout(paths, top_k)
        tokens = torch.tensor([pool.tokens[i] for i in chosen], dtype=torch.long, device=root.device)
        q, fixed = None, None
        if self.sampled and pool.q:
            V = next(iter(pool.q.values())).shape[0]
            q = torch.zeros(1 + len(chosen), V, device=root.device)
            for t, u in enumerate([-1] + chosen):
                if u in pool.q:
                    q[t] = pool.q[u]
            # a hybrid's lookup guesses among the draws: point-mass proposals (decoder.verify.verify_sampled)
            fixed = [False] + [u not in pool.sampled for u in chosen]
        extra = None
        for s in self.sources:
            extra = s.extra_embeds(lay) if extra is None else extra
        self.sizes.append(len(chosen))
        self.expected.append(expected)
        self.decide_s.append(time.perf_counter() - t0 - pool.passes_s)  # reported only (decide_cost prices)
        return Proposal(lay, tokens, draft_probs=q, extra_embeds=extra,
                        deterministic=fixed if fixed is not None and any(fixed) else None)

    def _layout(self, paths, top_k: int):
        for s in self.sources:
            lay = s.layout(paths, top_k, self.ctx)
            if lay is not None:
                return lay
        return layout_for(paths, top_k, self.ctx.dtype, self.ctx.device)

    def commit(self, outcome: StepOutcome) -> None:
        pool, chosen = self.pool, self.chosen
        emitted = outcome.verdict.emitted
        on_path = {-1}
        node_of = [-1] + chosen  # tree index -> pool index
        for u in outcome.verdict.nodes[1:]:
            on_path.add(node_of[u])
        # every pool node whose parent is on the accepted path: was its token the target's there?
        obs: dict[str, tuple[list[int], list[float]]] = {}
        top: dict[str, tuple[list[int], list[float]]] = {}
        for i, (tok, par, d) in enumerate(zip(pool.tokens, pool.parent, pool.depth)):
            if par in on_path and d - 1 < len(emitted):
                hit = float(tok == emitted[d - 1])
                for kind, cell, _ in pool.cells[i]:
                    cs, hs = obs.setdefault(kind, ([], []))
                    cs.append(cell)
                    hs.append(hit)
                    if pool.rank[i] == 0:
                        cs, hs = top.setdefault(kind, ([], []))
                        cs.append(min(d, len(self.rank0[kind].c)) - 1)
                        hs.append(hit)
        for maps, seen in ((self.maps, obs), (self.rank0, top)):
            for kind, m in maps.items():
                cs, hs = seen.get(kind, ([], []))
                m.observe(np.array(cs, dtype=np.int64), np.array(hs))
        accepted = [node_of[u] for u in outcome.verdict.nodes[1:]]
        for s in self.sources:
            s.commit(outcome, pool, accepted)

    def report(self) -> dict:
        d = np.array(self.decide_s) if self.decide_s else np.zeros(1)
        tau, cost = float(np.sum(self.expected)), float(np.sum(self.costs))  # costs include the plan's decide_s
        plain = float(self.spec.step_cost_s[0])
        out = {"sizes": self.sizes, "expected_tokens": [round(x, 4) for x in self.expected],
               "predicted_cost_s": [round(x, 6) for x in self.costs],
               "predicted_draft_s": [round(x, 6) for x in self.drafting],
               # the session's own forecast over the run: expected tokens per predicted second, against a plain step
               "predicted_speedup": tau * plain / cost if cost > 0 and self.spec.profiled else None,
               "predicted_tokens_per_step": tau / max(len(self.expected), 1),
               "decide_s_median": float(np.median(d)), "decide_s_mean": float(d.mean()),
               "decide_s_priced": self.decide_cost,  # the plan's constant the choices were made with
               "corrections": {k: m.summary() for k, m in self.maps.items()},
               "corrected_c": {k: m.c.round(4).tolist() for k, m in self.maps.items()}}
        self.owner.last_report = out
        return out


def load_hybrid(request) -> HybridGuesser:
    """The registry's loader for a hybrid (planner/guessers.py): prompt lookup and the drafter named
    by the kind's members, the drafter's files in request.path."""
    from dataclasses import replace

    from decoder.guessers.registry import load_guesser

    spec = request.options["kind"]  # the hybrid's GuesserKind (load_guesser passes it)
    member, drafter = spec.members
    lookup = load_guesser(member, replace(request, path=None))
    return HybridGuesser(lookup, load_guesser(drafter, request), drafter)
