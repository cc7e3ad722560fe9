"""Draft-model guessing: a small causal LM with the target's tokenizer proposes a token tree.

    guesser = DraftModelGuesser(draft_model)          # any Hugging Face causal LM, same vocabulary
    out = generate(target, ids, plan="trees/sequoia-draft.json", guesser=guesser)   # plan=None: a chain

The tree's shape comes from the plan (medusa or sequoia trees over draft ranks; no plan: a chain
of `depth` tokens, classic speculative decoding). Each step the drafter runs one pass per tree
level over its own KV cache: first the tokens it has not seen yet (the last step's accepted leaf,
if any, and the root), then the nodes of each level that have children, as a tree with a dense
mask. A node's children are its rank-ordered guesses: at temperature 0 (and for typical
acceptance) the top-k tokens of the drafter's distribution; for lossless sampling, tokens drawn
without replacement, in order, from the drafter's warped distribution q (the target's temperature,
top-k, top-p), with q handed to verification (decoder.verify.verify_sampled); siblings beyond q's
support are the drafter's next tokens by logit, verified as deterministic guesses.
After verification the drafter's cache keeps exactly the accepted tokens it has fed (KV compaction,
as the target's), so it always equals a prefill of the accepted text.

`DraftCache` is that mechanic, once: the static trees' `DraftSession` is built on it, and so is
`DraftSource`, the draft LM's per-step pool under a dynamic plan (decoder/guessers/dynamic.py), which
expands the most probable nodes level by level while a level pays, or under lossless sampling
drafts a shape chosen before any draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder.engine import vocab_size
from decoder.guesser import DecodeContext, Proposal, StepOutcome
from decoder.guessers.draft_cache import DraftCache
from decoder.guessers.draft_source import DraftSource, SampledDraftSource
from decoder.guessers.pool import rank_paths
from decoder.torch_ops.draft import HFDraft
from decoder.layout import layout_for
from decoder.verify import Sampling, draw_children, probabilities
from planner.dynamic import DynamicSpec, GuesserModel
from planner.errors import UserError
from planner.tree import PPD, Tree, path_parents, tree_depths


def chain_nodes(depth: int) -> tuple[tuple[int, ...], ...]:
    """A chain of `depth` rank-0 guesses (speculative decoding's draft of `depth` tokens)."""
    return tuple((0,) * d for d in range(1, depth + 1))


def plan_nodes(plan: Tree | None, depth: int, label: str) -> tuple[tuple[int, ...], ...]:
    """The static tree a drafter fills: the plan's (medusa or sequoia), or a chain of `depth`."""
    if plan is None:
        return chain_nodes(depth)
    if plan.method == PPD:
        raise UserError(f"{label}: a ppd plan needs PPD prompt tokens; drafters run medusa or sequoia trees "
                        "(planner plan medusa|sequoia --accept <the drafter's acceptance>)")
    nodes = tuple(plan.states[0].nodes)
    if not nodes:
        raise UserError(f"{label}: the {plan.method} tree has no candidates")
    return nodes


def contiguous(nodes) -> bool:
    """Every sibling rank r > 0 has its rank r - 1 sibling: the first k draws of sampling without replacement."""
    present = set(nodes)
    return all(p[-1] == 0 or p[:-1] + (p[-1] - 1,) in present for p in nodes)


@dataclass
class TreeShape:
    """A static tree's structure, host side: parents, levels and rank-ordered children."""

    nodes: tuple[tuple[int, ...], ...]
    parents: list[int]  # tree index of each token's parent (root: -1)
    depth: list[int]
    children: list[list[int]]  # per tree index, children in rank order

    @classmethod
    def of(cls, nodes) -> "TreeShape":
        parents = path_parents(nodes)
        children: list[list[int]] = [[] for _ in parents]
        for i in sorted(range(1, len(parents)), key=lambda i: nodes[i - 1][-1]):
            children[parents[i]].append(i)
        return cls(tuple(nodes), parents, tree_depths(parents), children)

    def level(self, d: int) -> list[int]:
        """Tree indices at depth d that have children (leaves are never fed to the drafter)."""
        return [u for u in range(len(self.parents)) if self.depth[u] == d and self.children[u]]


def draft_children(logits: torch.Tensor, k: int, s: Sampling, sampled: bool, gen,
                   exclude=()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Up to k child tokens from the drafter's logits [V] at one node, in rank order, and q [V] when
    they were sampled (without replacement, decoder.verify.draw_children) rather than taken as the top-k.

    q is the drafter's own warped distribution (the target's temperature, top-k and top-p): on
    SmolLM2 and its draft LM at T = 0.7 / top-p 0.9 its first child is accepted more often than
    with the unwarped softmax(logits / T) (docs/sampling.md). A warped q can hold fewer than k
    tokens: then fewer come back (`fill_children` completes a static tree's siblings).
    exclude: earlier siblings' tokens (a hybrid's deterministic guesses), never drawn.
    """
    if not sampled:
        return logits.float().topk(k).indices, None
    q = probabilities(logits, s)  # [V]
    return torch.tensor(draw_children(q, k, gen, exclude), dtype=torch.long, device=logits.device), q


def fill_children(logits: torch.Tensor, have: torch.Tensor, n: int) -> torch.Tensor:
    """n more siblings after `have` once q's support is spent: the drafter's best other tokens by
    logit, as deterministic guesses (point-mass proposals; decoder.verify.verify_sampled). They
    depend on the node's logits alone, never on a draw, so the tree keeps its shape losslessly."""
    x = logits.float().clone()
    x[have] = float("-inf")
    return x.topk(n).indices


class DraftModelGuesser:
    """A drafter that proposes trees: a draft LM (any Hugging Face causal LM with the target's vocabulary)
    or any decoder/drafter.py `DraftModel` (EAGLE heads, decoder/guessers/eagle.py).

    top_k: ranks a plan may use per node; depth: the chain length when no plan is given.
    `drafter` is the DraftModel every pass goes through (PEARL, MTAD and the teacher-forced acceptance
    pass take it too).
    """

    def __init__(self, draft, top_k: int = 8, depth: int = 4, label: str = "draft model", grow: "Grow | None" = None):
        if top_k < 1 or depth < 1:
            raise UserError(f"{label}: top_k and depth must be at least 1")
        self.grow = grow  # without a plan: trees grown at run time as SGLang and TensorRT-LLM grow them
        self.drafter = HFDraft(draft, label) if isinstance(draft, torch.nn.Module) else draft
        self.needs_hidden = self.drafter.features  # the target features it reads (decoder/engine.py Features)
        self.top_k = top_k
        self.depth = depth
        self.label = label

    @property
    def num_distances(self) -> int:
        return self.depth

    def check(self, plan: Tree | None, label: str = "plan") -> None:
        nodes = plan_nodes(plan, self.depth, label)
        ranks = max(r for p in nodes for r in p)
        if ranks >= self.top_k:
            raise UserError(f"{label}: the plan uses rank {ranks}, the draft guesser gives top-{self.top_k} per node")

    def begin(self, target, plan: Tree | None, prompt_ids: torch.Tensor, ctx: DecodeContext) -> "DraftSession":
        self._check_vocab(target)
        sampled = ctx.sampling.rule == "lossless"
        if plan is None and self.grow is not None:
            if sampled:
                raise UserError(f"{ctx.label}: run-time grown trees rank deterministic top-k guesses; under lossless "
                                "sampling give a plan (a sequoia tree) or a dynamic plan")
            return GrownSession(self.drafter, self.grow, prompt_ids, ctx)
        nodes = plan_nodes(plan, self.depth, ctx.label)
        if sampled and not contiguous(nodes):
            raise UserError(f"{ctx.label}: lossless sampling with a draft model needs contiguous sibling ranks "
                            "(a sequoia tree): a child is the next draw without replacement")
        return DraftSession(self.drafter, nodes, prompt_ids, ctx, sampled)

    def dynamic_source(self, gm: GuesserModel, spec: DynamicSpec, target, prompt_ids: torch.Tensor,
                       ctx: DecodeContext, sampled: bool) -> "DraftSource":
        self._check_vocab(target)
        if sampled:  # children counted from rank-level acceptance before they are drawn (decoder/guessers/draft_source.py)
            gm = GuesserModel(gm.kind, gm.prior, None, gm.draft_s, gm.draft_passes)
            return SampledDraftSource(gm, self.drafter, self.top_k, spec, prompt_ids, ctx, sampled)
        return DraftSource(gm, self.drafter, self.top_k, spec, prompt_ids, ctx, sampled)

    def _check_vocab(self, target) -> None:
        vocab = vocab_size(target)
        if self.drafter.vocab_size != vocab:
            raise UserError(f"{self.label}: vocabulary of {self.drafter.vocab_size} tokens, the target has {vocab}: "
                            "a drafter must share the target's tokenizer")


class DraftSession(DraftCache):
    """A static tree (the plan's, or a chain) drafted level by level: a node's children are its
    rank-ordered guesses, top-k or drawn without replacement (`draft_children`)."""

    def __init__(self, drafter, nodes, prompt_ids: torch.Tensor, ctx: DecodeContext, sampled: bool):
        super().__init__(drafter, prompt_ids, ctx.prompt_hidden)
        self.ctx, self.sampled = ctx, sampled
        self.shape = TreeShape.of(nodes)
        self.layout = layout_for(nodes, max(r for p in nodes for r in p) + 1, ctx.dtype, ctx.device)
        self.max_input_length = self.layout.input_length

    @torch.inference_mode()
    def propose(self, root: torch.Tensor) -> Proposal:
        if not self.ready:  # nothing to condition on yet (a feature reader at a one-token prompt): a plain step
            self.skip(int(root[0]))
            return Proposal(layout_for((), 1, self.ctx.dtype, self.ctx.device), root.new_empty(0))
        sh = self.shape
        V = self.drafter.vocab_size
        tokens = torch.zeros(len(sh.parents), dtype=torch.long, device=root.device)  # [num_tree], root first
        tokens[0] = root[0]
        q_all = torch.zeros(len(sh.parents), V, device=root.device) if self.sampled else None  # [num_tree, V]
        fixed = [False] * len(sh.parents)  # siblings filled in after a warped q's support ran out
        logits = {0: self.first_pass(root)}  # tree index -> drafter logits [V] at that node
        for d in range(max(sh.depth)):
            for u in sh.level(d):
                kids = sh.children[u]
                toks, q = draft_children(logits[u], len(kids), self.ctx.sampling, self.sampled, self.ctx.generator)
                if len(toks) < len(kids):
                    for c in kids[len(toks):]:
                        fixed[c] = True
                    toks = torch.cat([toks, fill_children(logits[u], toks, len(kids) - len(toks))])
                tokens[kids] = toks
                if q is not None:
                    q_all[u] = q
            fed = sh.level(d + 1)
            if fed:
                out = self.level_pass(fed, sh.parents, tokens[fed], [sh.depth[u] for u in fed])  # [len(fed), V]
                logits.update(zip(fed, out))
        return Proposal(self.layout, tokens[1:], draft_probs=q_all, deterministic=fixed if any(fixed) else None)

    def commit(self, outcome: StepOutcome) -> None:
        """Keep the accepted tokens the drafter has fed; the rest of the accepted path waits as unseen."""
        self.keep_outcome(outcome.verdict.nodes[1:], outcome)


@dataclass(frozen=True)
class Grow:
    """An EAGLE-2 tree grown at run time, as SGLang (--speculative-num-steps, --speculative-eagle-topk,
    --speculative-num-draft-tokens) and TensorRT-LLM's dynamic tree take it (planner/export_heads.py prices it)."""

    steps: int  # S drafter passes (the tree's depth)
    topk: int  # K children per expanded node, and the frontier's width
    draft_tokens: int  # N nodes verified, root included

    def __post_init__(self):
        most = 1 + self.topk * (1 + (self.steps - 1) * self.topk)
        if self.steps < 1 or self.topk < 1 or not 2 <= self.draft_tokens <= most:
            raise UserError(f"grown tree (steps {self.steps}, topk {self.topk}, draft tokens {self.draft_tokens}): "
                            "expected steps, topk >= 1 and 2 <= draft tokens <= 1 + all nodes drafted")


class GrownSession(DraftCache):
    """Each step: the root's top K children, then S - 1 passes over the K most probable nodes of the last
    level (each drafts its top K), then the N - 1 most probable drafted nodes (by the drafter's own path
    probability) are verified. Greedy: guesses are the drafter's top-k."""

    def __init__(self, drafter, grow: Grow, prompt_ids: torch.Tensor, ctx: DecodeContext):
        super().__init__(drafter, prompt_ids, ctx.prompt_hidden)
        self.g, self.ctx = grow, ctx
        self.max_input_length = grow.draft_tokens
        self.chosen: list[int] = []

    @torch.inference_mode()
    def propose(self, root: torch.Tensor) -> Proposal:
        if not self.ready:
            self.skip(int(root[0]))
            self.chosen = []
            return Proposal(layout_for((), 1, self.ctx.dtype, self.ctx.device), root.new_empty(0))
        K = self.g.topk
        tokens: list[int] = []
        parent: list[int] = []
        score: list[float] = []  # log path probability under the drafter
        frontier, logits = [-1], self.first_pass(root)[None]
        for d in range(1, self.g.steps + 1):
            logp = torch.log_softmax(logits.float(), dim=-1).topk(K, dim=-1)
            vals, ids = logp.values.tolist(), logp.indices.tolist()
            level = []
            for j, u in enumerate(frontier):
                base = 0.0 if u < 0 else score[u]
                for r in range(K):
                    level.append(len(tokens))
                    tokens.append(ids[j][r])
                    parent.append(u)
                    score.append(base + vals[j][r])
            if d == self.g.steps:
                break
            frontier = sorted(level, key=lambda i: -score[i])[:K]
            logits = self.level_pass(frontier, parent, torch.tensor([tokens[i] for i in frontier], device=root.device),
                                     [d] * len(frontier))
        # path probabilities only fall along a path, so the best N - 1 are ancestor-closed; parents first by index
        self.chosen = sorted(sorted(range(len(tokens)), key=lambda i: (-score[i], i))[: self.g.draft_tokens - 1])
        lay = layout_for(rank_paths(parent, self.chosen), K, self.ctx.dtype, self.ctx.device)
        return Proposal(lay, torch.tensor([tokens[i] for i in self.chosen], dtype=torch.long, device=root.device))

    def commit(self, outcome: StepOutcome) -> None:
        self.keep_outcome([self.chosen[i - 1] for i in outcome.verdict.nodes[1:]], outcome)


def load(request) -> DraftModelGuesser:
    """The registry's loader (planner/guessers.py): the drafter in request.path, opened by the target engine
    (Engine.open_drafter: the project's draft LM on its embedding and head, or a causal LM folder)."""
    depth = request.depth if request.depth is not None else 4
    return DraftModelGuesser(request.target.open_drafter(request.path), top_k=request.top_k or 8, depth=depth,
                             label=str(request.path))
