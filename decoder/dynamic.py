"""Per-step trees: the session side of a `dynamic` plan (planner/dynamic.py decides).

    out = generate(model, ids, plan="trees/dynamic-lookup.json", guesser=PromptLookupGuesser())
    out = generate(model, ids, plan=dyn, guesser=HybridGuesser(PromptLookupGuesser(), drafter))

Each step one `DynamicSession` asks its sources (one guesser, or lookup and a drafter for a hybrid)
for a pool of candidates with their live signals, maps every signal to c = P(accepted | parent
accepted) through the plan's calibration as corrected online so far, and keeps the n most probable
paths for the n (0: a plain step) that maximises expected tokens per second of this step
(planner.dynamic.choose). The kept nodes become an ordinary `Proposal` of the one loop
(decoder/loop.py): target, verification rules and caches are the static trees' own.

Drafters that pay per level (draft LM, chain drafter) stop drafting when one more level is not
expected to pay for its pass and the wider forward (a marginal rule, CaDDTree's greedy stop); the
ParallelSpec drafter pays one pass per step, so it skips it when even its best guess would not pay.

Sampled drafts (lossless sampling with a draft LM): a node's number of children must not depend on
those children's own draws (the sibling procedure would then see a biased draw and lose exactness:
tests/test_dynamic.py shows such a rule failing the chi-square test). So at temperature > 0 the
draft LM's tree is chosen from rank-level acceptance (the prior rows, corrected online with the
past steps' outcomes) before anything is drawn, and drafted as that shape.

Commit: every pool node whose parent lies on the accepted path is an observation of its cell
(accepted iff its token is the target's token there); the maps move toward what is realised.
"""
from __future__ import annotations

import time
import numpy as np
import torch

from decoder.cache import compact_cache, crop_cache
from decoder.engine import torch_model, vocab_size
from decoder.forward import kv, prefill
from decoder.guesser import DecodeContext, Proposal, StepOutcome
from decoder.layout import layout_for
from planner.dynamic import (
    DynamicSpec,
    GuesserModel,
    OnlineMap,
    choose,
    lookup_bins,
    path_probabilities,
    q_bins,
)
from planner.errors import UserError
from planner.tree import DYNAMIC, Tree

POOL_WIDTH = 4  # children drafted per expanded node (draft LM), guesses per distance used (Cartesian drafters)
EXPAND = 4  # nodes of a level a draft LM expands


class Pool:
    """One step's candidates, parents before children (parent -1: the root)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.c: list[float] = []  # the (corrected) conditional acceptance used to choose
        self.cells: list[tuple] = []  # per node: ((kind, flat cell), ...) it is an observation of
        self.rank: list[int] = []  # the guesser's own rank of the token among its siblings
        self.q: dict[int, torch.Tensor] = {}  # sampled drafts: node (-1: root) -> q [V] its children were drawn from
        self.sunk_s = 0.0  # drafting already paid this step (the plan's pass cost)
        self.passes_s = 0.0  # wall time of drafter passes (excluded from the decision's own cost)
        self.index: dict[tuple[int, int], int] = {}  # (parent, token) -> node: hybrid pools merge equal paths
        self.fixed: list[int] | None = None  # a shape chosen before drafting (sampled drafts)

    def add(self, token: int, parent: int, c: float, cell: tuple, rank: int = 0) -> int:
        key = (parent, token)
        i = self.index.get(key)
        if i is not None:  # the same path from two guessers: one node, the better estimate
            self.c[i] = max(self.c[i], c)
            self.cells[i] = self.cells[i] + (cell,)
            return i
        i = len(self.tokens)
        self.index[key] = i
        self.tokens.append(token)
        self.parent.append(parent)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.c.append(c)
        self.cells.append((cell,))
        self.rank.append(rank)
        return i

    def probabilities(self) -> np.ndarray:
        return path_probabilities(np.array(self.parent, dtype=np.int64), np.array(self.c))


def rank_paths(parent: list[int], chosen: list[int]) -> tuple[tuple[int, ...], ...]:
    """Rank paths of the chosen nodes (sorted, parents first): a node's rank is its place among its chosen siblings."""
    path = {-1: ()}
    kids: dict[int, int] = {}
    out = []
    for i in chosen:
        p = parent[i]
        r = kids.get(p, 0)
        kids[p] = r + 1
        path[i] = path[p] + (r,)
        out.append(path[i])
    return tuple(out)


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

    def begin(self, model, plan: Tree, prompt_ids: torch.Tensor, ctx: DecodeContext) -> "DynamicSession":
        spec: DynamicSpec = self.plan.dynamic
        sampled = ctx.sampling.rule == "lossless"
        if sampled and isinstance(self.inner, HybridGuesser) and self.inner.drafter_kind == "draft":
            raise UserError(f"{ctx.label}: lookup+draft decodes greedily (or with typical acceptance): sampled draft "
                            "children and lookup's fixed tokens need different lossless rules")
        sources = [_source(kind, g, spec, model, prompt_ids, ctx, sampled) for kind, g in _members(self.inner)]
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
    name = type(g).__name__
    if name == "PromptLookupGuesser":
        return "lookup"
    if name == "DraftModelGuesser":
        return "draft"
    if name == "ParallelDrafter":
        return "chain" if g.mode == "chain" else "parallelspec"
    if name == "PromptTokens":
        return "ppd"
    raise UserError(f"dynamic plans: no per-step source for the guesser {name}")


def _members(g) -> list[tuple[str, object]]:
    if isinstance(g, HybridGuesser):
        return [("lookup", g.lookup), (g.drafter_kind, g.drafter)]
    return [(guesser_kind(g), g)]


# ---------------------------------------------------------------------------------------------- the session


class DynamicSession:
    def __init__(self, owner: DynamicGuesser, spec: DynamicSpec, sources: list, ctx: DecodeContext, sampled: bool):
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
        self.decide_est = spec.decide_s  # running estimate of the decision's cost per step
        self.costs: list[float] = []  # the model's cost of each step (drafting + step_cost), before the decision's own
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
        pool.sunk_s = self.decide_est  # the decision's own time, priced into every size alike
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
        self.pool, self.chosen = pool, chosen
        paths = rank_paths(pool.parent, chosen)
        top_k = 1 + max((p[-1] for p in paths), default=0)
        lay = self._layout(paths, top_k)
        tokens = torch.tensor([pool.tokens[i] for i in chosen], dtype=torch.long, device=root.device)
        q = None
        if self.sampled and pool.q:
            V = next(iter(pool.q.values())).shape[0]
            q = torch.zeros(1 + len(chosen), V, device=root.device)
            for t, u in enumerate([-1] + chosen):
                if u in pool.q:
                    q[t] = pool.q[u]
        extra = None
        for s in self.sources:
            extra = s.extra_embeds(lay) if extra is None else extra
        self.sizes.append(len(chosen))
        self.expected.append(expected)
        self.decide_s.append(time.perf_counter() - t0 - pool.passes_s)
        self.decide_est += 0.1 * (self.decide_s[-1] - self.decide_est)
        return Proposal(lay, tokens, draft_probs=q, extra_embeds=extra)

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
        tau, cost = float(np.sum(self.expected)), float(np.sum(self.costs))  # costs include the decision estimate
        plain = float(self.spec.step_cost_s[0])
        out = {"sizes": self.sizes, "expected_tokens": [round(x, 4) for x in self.expected],
               "predicted_cost_s": [round(x, 6) for x in self.costs],
               # the session's own forecast over the run: expected tokens per predicted second, against a plain step
               "predicted_speedup": tau * plain / cost if cost > 0 and self.spec.profiled else None,
               "predicted_tokens_per_step": tau / max(len(self.expected), 1),
               "decide_s_median": float(np.median(d)), "decide_s_mean": float(d.mean()),
               "corrections": {k: m.summary() for k, m in self.maps.items()},
               "corrected_c": {k: m.c.round(4).tolist() for k, m in self.maps.items()}}
        self.owner.last_report = out
        return out


# ---------------------------------------------------------------------------------------------- sources


class _Source:
    kind = ""
    input_per_node = 1  # forward tokens per candidate
    input_fixed = 1  # forward tokens of a step without candidates

    def __init__(self, model: GuesserModel):
        self.model = model

    def layout(self, paths, top_k, ctx):
        return None

    def extra_embeds(self, lay):
        return None

    def prior_cells(self, depth, rank) -> np.ndarray:
        return self.model.cells(np.asarray(depth), np.asarray(rank), np.zeros(len(np.atleast_1d(depth)), dtype=np.int64))


def _source(kind: str, g, spec: DynamicSpec, model, prompt_ids, ctx, sampled: bool):
    gm = spec.guessers[kind]
    if kind == "lookup":
        return LookupSource(gm, g, spec, prompt_ids, ctx)
    if kind == "draft":
        if sampled:  # shapes from rank-level acceptance only (see the module docstring)
            gm = GuesserModel(gm.kind, gm.prior, None, gm.draft_s, gm.draft_passes)
        return DraftSource(gm, g, spec, model, prompt_ids, ctx, sampled)
    if kind in ("parallelspec", "chain"):
        return ParallelSource(gm, g, spec, model, prompt_ids, ctx)
    if kind == "ppd":
        return PPDSource(gm, g, spec, model, prompt_ids, ctx)
    raise UserError(f"dynamic plans: unknown guesser kind {kind}")


class LookupSource(_Source):
    """Prompt lookup with its signals: matched n-gram length and how often the n-gram (and the
    continuation so far) was followed by each proposed token in the text so far."""

    kind = "lookup"

    def __init__(self, gm, g, spec, prompt_ids, ctx):
        super().__init__(gm)
        self.g, self.k = g, min(spec.max_depth, 16)
        ids = prompt_ids.reshape(-1).tolist()
        self.buf = np.zeros(len(ids) + 4096, dtype=np.int64)
        self.T = len(ids) - 1  # everything before the root; the root joins at extend
        self.buf[: self.T] = ids[:-1]

    def _push(self, toks: list[int]) -> None:
        need = self.T + len(toks)
        if need > len(self.buf):
            self.buf = np.concatenate([self.buf, np.zeros(max(need, 2 * len(self.buf)) - len(self.buf), dtype=np.int64)])
        self.buf[self.T: need] = toks
        self.T = need

    def continuation(self) -> tuple[list[int], int, list[int]]:
        """(tokens, matched n-gram length, follow count per token): the most recent earlier
        occurrence of the longest suffix n-gram with a continuation, as decoder.lookup finds it."""
        h, T = self.buf, self.T
        for n in range(min(self.g.max_ngram, T - 1), self.g.min_ngram - 1, -1):
            m = np.ones(T - n, dtype=bool)  # candidate starts 0..T-n-1 (the suffix itself excluded)
            for j in range(n):
                m &= h[j: T - n + j] == h[T - n + j]
            starts = np.flatnonzero(m)
            if not len(starts):
                continue
            s = int(starts[-1])
            follow = h[s + n: min(s + n + self.k, T)].tolist()
            if not follow:
                continue
            counts, alive = [], starts
            for j, tok in enumerate(follow):
                alive = alive[alive + n + j < T]
                alive = alive[h[alive + n + j] == tok]
                counts.append(max(1, len(alive)))
            return follow, n, counts
        return [], 0, []

    def extend(self, pool: Pool, root: torch.Tensor, session: DynamicSession) -> None:
        self._push([int(root[0])])
        follow, n, counts = self.continuation()
        if not follow:
            return
        depth = np.arange(1, len(follow) + 1)
        bins = lookup_bins(np.full(len(follow), n), np.array(counts))
        cells = self.model.cells(depth, np.zeros(len(follow), dtype=np.int64), bins)
        c = session.c_of(self.kind, cells)
        parent = -1
        for tok, ci, cell, b in zip(follow, c.tolist(), cells.tolist(), bins.tolist()):
            parent = pool.add(tok, parent, ci, (self.kind, cell, b))

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        self._push(outcome.verdict.emitted[:-1])


def _cartesian(pool: Pool, kind: str, c: np.ndarray, tokens: np.ndarray, cells: np.ndarray, budget: int,
               sig: np.ndarray | None = None) -> None:
    """The `budget` most probable rank paths of a guess matrix whose guess at distance d does not
    depend on the path (c, tokens, cells [D, K]), best-first with a heap."""
    import heapq

    D, K = c.shape
    heap = [(-c[0, 0], 0, 0, -1, 1.0)]  # (-P, depth index, rank, parent pool index, parent P)
    added = 0
    while heap and added < budget:
        negP, d, r, parent, pP = heapq.heappop(heap)
        i = pool.add(int(tokens[d, r]), parent, float(c[d, r]), (kind, int(cells[d, r]), int(sig[d, r]) if sig is not None else 0), r)
        added += 1
        if r + 1 < K:
            heapq.heappush(heap, (-pP * c[d, r + 1], d, r + 1, parent, pP))
        if d + 1 < D:
            heapq.heappush(heap, (negP * c[d + 1, 0], d + 1, 0, i, -negP))


class ParallelSource(_Source):
    """The ParallelSpec drafter: one pass guesses every distance (Cartesian pool); chain mode: one
    pass per distance along its rank-0 draft (a comb), stopping when a level would not pay."""

    def __init__(self, gm, g, spec, model, prompt_ids, ctx):
        super().__init__(gm)
        from decoder.parallel import ParallelSession

        self.kind = "chain" if g.mode == "chain" else "parallelspec"
        g.attach(torch_model(model))
        g.to(device=ctx.device)
        depth = g.num_masks + 1 if g.mode == "parallel" else min(spec.max_depth, 16)
        nodes = tuple((0,) * d for d in range(1, depth + 1))
        self.s = ParallelSession(g, nodes, depth, prompt_ids.reshape(-1), ctx)
        self.d, self.depth, self.spec = g, depth, spec
        self.width = min(POOL_WIDTH, g.top_k)
        self.fresh = True  # pending slots not yet fed to the drafter

    def _guesses(self, hidden: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """hidden [k, H] -> top-width probabilities and token ids [k, width] on the host (one copy)."""
        probs = torch.softmax(self.d.logits(hidden).float(), dim=-1)
        top = probs.topk(self.width, dim=-1)
        ids = self.d.token_ids(top.indices)
        both = torch.stack([top.values, ids.float()]).cpu().numpy()
        return both[0], both[1].astype(np.int64)

    def _cells(self, q: np.ndarray, depth0: int) -> tuple[np.ndarray, np.ndarray]:
        """(flat cells, q bins) [D, K] of a guess matrix whose first row is distance depth0 + 1."""
        D, K = q.shape
        depth = np.repeat(np.arange(depth0 + 1, depth0 + D + 1), K)
        rank = np.tile(np.arange(K), D)
        bins = q_bins(q.reshape(-1))
        return self.model.cells(depth, rank, bins).reshape(D, K), bins.reshape(D, K)

    def extend(self, pool: Pool, root: torch.Tensor, session: DynamicSession) -> None:
        if self.s.pending is None:
            return
        gm = self.model
        if not session.worth_level(pool, session.top1(self.kind, 1), gm.draft_s):
            return  # the pass would not pay: the pending slots wait for the next pass
        t0 = time.perf_counter()
        feats, nxt, pos = self.s.pending
        real = self.d.real_inputs(feats, nxt)[None]
        self.fresh = False
        if self.d.mode == "parallel":
            k = self.depth - 1
            m, C = real.shape[1], self.s.cache.get_seq_length()
            from decoder.parallel import slot_mask

            x = torch.cat([real, self.d.masks[:k][None].to(real.dtype)], dim=1)
            last = int(pos[-1])
            positions = torch.cat([pos, last + torch.arange(1, k + 1, device=pos.device)])[None]
            hidden = self.d.run(x, positions, slot_mask(m, k, C, real.dtype, real.device), self.s.cache)[0]
            crop_cache(self.s.cache, C + m)
            q, toks = self._guesses(hidden[m - 1:])
            pool.passes_s += time.perf_counter() - t0
            pool.sunk_s += gm.draft_s
            cells, sig = self._cells(q, 0)
            c = session.c_of(self.kind, cells.reshape(-1)).reshape(cells.shape)
            _cartesian(pool, self.kind, c, toks, cells, self.spec.max_size, sig)
            return
        # chain: one pass per distance, its own feature as the next slot's input; siblings are leaves
        C = self.s.cache.get_seq_length()
        x, positions, parent, P = real, pos[None], -1, 1.0
        for d in range(self.depth):
            t0 = time.perf_counter()
            hidden = self.d.run(x, positions, None, self.s.cache)[0, -1:]
            q, toks = self._guesses(hidden)
            pool.passes_s += time.perf_counter() - t0
            pool.sunk_s += gm.draft_s
            cells, sig = self._cells(q, d)
            c = session.c_of(self.kind, cells.reshape(-1))
            head = parent
            for r in range(self.width):
                i = pool.add(int(toks[0, r]), head, float(c[r]), (self.kind, int(cells[0, r]), int(sig[0, r])), r)
                if r == 0:
                    parent = i
            P *= float(c[0])
            nxt_best = P * session.top1(self.kind, d + 2)
            if d + 1 >= self.depth or not session.worth_level(pool, nxt_best, gm.draft_s):
                break
            tok = torch.tensor([int(toks[0, 0])], device=hidden.device)
            x = self.d.real_inputs(hidden, tok)[None]
            positions = positions[:, -1:] + 1
        crop_cache(self.s.cache, C + real.shape[1])

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        old = self.s.pending if self.fresh else None  # a skipped pass: its slots still wait
        self.s.commit(outcome)
        if old is not None:
            self.s.pending = tuple(torch.cat([a, b]) for a, b in zip(old, self.s.pending))
        self.fresh = True


class PPDSource(_Source):
    """PPD prompt tokens: every tree node carries D prompt tokens, so whichever node ends the
    accepted path, its prompt tokens' logits give the next step's guesses for D distances."""

    kind = "ppd"

    def __init__(self, gm, g, spec, model, prompt_ids, ctx):
        super().__init__(gm)
        self.g, self.ctx = g, ctx
        self.D, self.E = g.num_distances, g.ensemble
        self.input_per_node = self.input_fixed = 1 + self.D * self.E
        self.table = g.input_embeddings().detach().to(device=ctx.device, dtype=ctx.dtype)
        self.width = min(POOL_WIDTH, g.top_k)
        self.guess: tuple[np.ndarray, np.ndarray] | None = None  # (q, tokens) [D, width]
        self.spec = spec

    def layout(self, paths, top_k, ctx):
        counts = (self.D,) * (len(paths) + 1)
        return layout_for(paths, max(top_k, 1), ctx.dtype, ctx.device, prompt_count=counts, ensemble=self.E)

    def extra_embeds(self, lay):
        return self.table[lay.slot_embedding]

    def extend(self, pool: Pool, root: torch.Tensor, session: DynamicSession) -> None:
        if self.guess is None:
            return
        q, toks = self.guess
        D, K = q.shape
        depth = np.repeat(np.arange(1, D + 1), K)
        bins = q_bins(q.reshape(-1))
        cells = self.model.cells(depth, np.tile(np.arange(K), D), bins).reshape(D, K)
        c = session.c_of(self.kind, cells.reshape(-1)).reshape(D, K)
        _cartesian(pool, self.kind, c, toks, cells, self.spec.max_size, bins.reshape(D, K))

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        lay = outcome.proposal.layout
        last = outcome.verdict.nodes[-1]
        slots = lay.slot_index[last, : self.D]  # [D, E]
        probs = torch.softmax(outcome.logits[slots].float().mean(dim=1), dim=-1)  # [D, V]
        top = probs.topk(self.width, dim=-1)
        both = torch.stack([top.values, top.indices.float()]).cpu().numpy()
        self.guess = (both[0], both[1].astype(np.int64))


class DraftSource(_Source):
    """A draft LM drafting level by level over its own KV cache. Greedy: each level expands the
    EXPAND most probable nodes with their top POOL_WIDTH children and stops when a level would not
    pay. Sampled: the shape is chosen first from rank-level acceptance, then drafted."""

    kind = "draft"

    def __init__(self, gm, g, spec, model, prompt_ids, ctx, sampled: bool):
        super().__init__(gm)
        self.m, self.ctx, self.sampled, self.spec = g.draft_model, ctx, sampled, spec
        vocab = vocab_size(model)
        if self.m.get_input_embeddings().weight.shape[0] != vocab:
            raise UserError(f"{g.label}: a drafter must share the target's vocabulary")
        ids = prompt_ids.reshape(-1)
        from decoder.draft import _empty_cache

        self.cache = prefill(self.m, ids[None, :-1]).cache if ids.numel() > 1 else _empty_cache(self.m)
        self.unseen: list[int] = []
        self.slots: dict[int, int] = {}  # pool node (-1: root) -> its row in the drafter's cache this step
        self.base = 0
        self.width = min(POOL_WIDTH, g.top_k)
        self.drafted = False

    def _first_pass(self, root: torch.Tensor) -> torch.Tensor:
        C = self.cache.get_seq_length()
        ids = torch.cat([torch.tensor(self.unseen, dtype=torch.long, device=root.device), root])[None]
        pos = torch.arange(C, C + ids.shape[1], device=root.device)[None]
        out = self.m(input_ids=ids, position_ids=pos, **kv(self.cache), use_cache=True, logits_to_keep=1)
        self.unseen = []
        self.base = self.cache.get_seq_length()
        self.slots = {-1: self.base - 1}
        return out.logits[0, -1]

    def _level_pass(self, pool: Pool, fed: list[int]) -> torch.Tensor:
        """One pass over pool nodes `fed` (one level): each sees the context and its fed ancestors -> logits [len(fed), V]."""
        L = self.cache.get_seq_length()
        visible = torch.zeros(len(fed), L + len(fed), dtype=torch.bool)
        visible[:, : self.base] = True
        for i, u in enumerate(fed):
            a = pool.parent[u]
            while a >= 0:
                visible[i, self.slots[a]] = True
                a = pool.parent[a]
            visible[i, L + i] = True
        dtype = self.m.get_input_embeddings().weight.dtype
        dev = self.ctx.device
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        pos = torch.tensor([[self.base - 1 + pool.depth[u] for u in fed]], device=dev)
        toks = torch.tensor([[pool.tokens[u] for u in fed]], device=dev)
        out = self.m(input_ids=toks, position_ids=pos, attention_mask=mask[None, None].to(dev),
                     **kv(self.cache), use_cache=True)
        for i, u in enumerate(fed):
            self.slots[u] = L + i
        return out.logits[0]

    def _children(self, logits: torch.Tensor, k: int):
        """(tokens [rows, k], q of them [rows, k] on the host, q rows [rows, V] when sampled)."""
        from decoder.draft import draft_children

        if not self.sampled:
            probs = torch.softmax(logits.float(), dim=-1)
            top = probs.topk(k, dim=-1)
            both = torch.stack([top.values, top.indices.float()]).cpu().numpy()
            return both[1].astype(np.int64), both[0], None
        toks, qs = [], []
        for row in logits:
            t, q = draft_children(row, k, self.ctx.sampling, True, self.ctx.generator)
            toks.append(t)
            qs.append(q)
        return torch.stack(toks).cpu().numpy(), None, qs

    def extend(self, pool: Pool, root: torch.Tensor, session: DynamicSession) -> None:
        gm = self.model
        self.drafted = False
        if self.sampled:
            return self._extend_sampled(pool, root, session)
        if not session.worth_level(pool, session.top1(self.kind, 1), gm.draft_s):
            self.unseen.append(int(root[0]))
            return
        self.drafted = True
        t0 = time.perf_counter()
        logits = self._first_pass(root)[None]
        frontier = [-1]
        for d in range(1, self.spec.max_depth + 1):
            toks, q, _ = self._children(logits, self.width)
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

    def _extend_sampled(self, pool: Pool, root: torch.Tensor, session: DynamicSession) -> None:
        """The shape from rank-level c alone (decided before any draw), then drafted level by level."""
        gm = self.model
        D, K = gm.prior.shape
        K = min(K, self.width)
        D = min(D, self.spec.max_depth)
        depth = np.repeat(np.arange(1, D + 1), K)
        cells = self.prior_cells(depth, np.tile(np.arange(K), D)).reshape(D, K)
        c = session.c_of(self.kind, cells.reshape(-1)).reshape(D, K)
        # sampled siblings must be contiguous draws: c made non-increasing in rank keeps best-first contiguous
        c = np.minimum.accumulate(c, axis=1)
        shape = Pool()
        _cartesian(shape, self.kind, c, np.arange(D * K).reshape(D, K), cells, self.spec.max_size)  # placeholder tokens
        # the shape's own paths: nodes are (parent, rank) pairs; tokens come from the draws below
        P = shape.probabilities()
        depth_of = np.array(shape.depth)
        passes = np.array([0] + [gm.draft_s * d for d in range(1, D + 1)])
        best, best_ratio = [], 1.0 / session.cost_n[0]
        order = np.lexsort((np.arange(len(P)), -P))
        for n in range(1, min(len(P), len(session.cost_n) - 1) + 1):
            sel = sorted(order[:n].tolist())
            tau = 1.0 + P[sel].sum()
            ratio = tau / (passes[int(depth_of[sel].max())] + session.cost_n[n])
            if ratio > best_ratio:
                best, best_ratio = sel, ratio
        if not best:
            self.unseen.append(int(root[0]))
            pool.fixed = []
            return
        self.drafted = True
        paths = rank_paths(shape.parent, best)
        kids: dict[tuple, int] = {}
        for p in paths:
            kids[p[:-1]] = max(kids.get(p[:-1], 0), p[-1] + 1)
        cell_of = {p: shape.cells[i][0] for p, i in zip(paths, best)}
        c_of = {p: shape.c[i] for p, i in zip(paths, best)}
        node = {(): -1}
        logits = {(): self._first_pass(root)}
        level = [()]
        chosen = []
        for d in range(1, max(len(p) for p in paths) + 1):
            fed_next = []
            for p in level:
                k = kids.get(p, 0)
                if not k:
                    continue
                toks, _, qs = self._children(logits[p][None], k)
                pool.q[node[p]] = qs[0]
                for r in range(k):
                    cp = p + (r,)
                    i = pool.add(int(toks[0, r]), node[p], c_of[cp], cell_of[cp], r)
                    node[cp] = i
                    chosen.append(i)
                    if kids.get(cp, 0):
                        fed_next.append(cp)
            pool.sunk_s += gm.draft_s
            if fed_next:
                out = self._level_pass(pool, [node[p] for p in fed_next])
                logits.update({p: out[j] for j, p in enumerate(fed_next)})
            level = fed_next
        pool.fixed = sorted(chosen)

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        """Keep the accepted nodes the drafter fed (a prefix of the path); the rest wait as unseen."""
        if not self.drafted:
            self.unseen.extend(outcome.verdict.emitted[:-1])
            return
        fed = []
        for u in accepted:
            if u not in self.slots:
                break
            fed.append(u)
        keep = torch.tensor([self.slots[u] - self.base for u in fed], dtype=torch.long)
        from decoder.draft import _cache_device

        compact_cache(self.cache, self.base, keep.to(_cache_device(self.cache)))
        self.unseen = list(outcome.verdict.emitted[len(fed):-1])



def load_hybrid(request) -> HybridGuesser:
    """The registry's loader for a hybrid (planner/guessers.py): prompt lookup and the drafter named
    by the kind's members, the drafter's files in request.path."""
    from dataclasses import replace

    from decoder.registry import load_guesser

    spec = request.options["kind"]  # the hybrid's GuesserKind (load_guesser passes it)
    member, drafter = spec.members
    lookup = load_guesser(member, replace(request, path=None))
    return HybridGuesser(lookup, load_guesser(drafter, request), drafter)
