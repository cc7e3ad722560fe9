"""MTAD: beam-sampled drafts from a small model, joint likelihood-ratio acceptance by the target
(docs/seed-systems.md, section 'MTAD'; docs/algorithms.md, section 'Verification'). Deliberately not lossless.

    guesser = MTADGuesser(drafter, width=4, gamma=3, tau_acc=0.1)    # a DraftModel, or a transformers LM
    out = generate(engine, ids, None, guesser, temperature=1.0, top_k=20, top_p=0.9)   # decoder/loop.py

One step:
  1. draft   the session beam-samples W beams of gamma tokens over the drafter's own cache (one
             sequence: each beam step feeds the W beams' tokens as tree inputs, each seeing the
             context and its own beam's earlier tokens): candidates (b, v) score s_b + log q~(v | beam b)
             and W distinct ones are drawn with probability proportional to exp(score) (Gumbel-top-W;
             at temperature 0 the top W, deterministically). The W final beams are proposed as one
             tree, the union of their prefixes (beams="best": the highest-likelihood beam as a chain).
  2. score   the target runs [root, tree] in one forward pass (decoder/loop.py's Steps).
  3. verify  `verify_joint_tree`: per beam, with D_j = log p~(x_j) - log q~(x_j), the longest prefix
             i* with sum_{j<=i*} D_j >= log tau_acc (i = 0 always passes; planner.mtad.accepted_length
             is the one rule); the beam with the longest i* wins, ties to the higher draft
             likelihood; emit x_1..x_{i*} and y ~ p~(. | context, x_1..x_{i*}) (no residual).
  4. commit  the target's cache and the drafter's keep the accepted text (the winning beam's fed tokens).

Warping: p~ and q~ are the same warp (temperature, then top-k, then top-p; the paper: top-k 20, top-p
0.9) of the target's and the drafter's logits, in log space: tokens outside the warped support have
log-probability -inf and simply fail, never NaN. At temperature 0 p~ is one-hot (greedy) and the
drafter's scores use its distribution at temperature 1 under the same top-k/top-p, so the beams are
a deterministic beam search rather than W copies of the greedy draft.

What the output follows (and why it is not the target's distribution): a step appends the block
(x_1..x_{i*}, y) where x is the final beam B_W,gamma(q~) picks (a mode-seeking draw from the
drafter's joint distribution), i* = i*(x) is a deterministic function of x, and y ~ p~(. | x_{1..i*}):

    P(block = (x_1..x_i, y)) = sum_{x' : x'_{1..i} = x_{1..i}, i*(x') = i} B(x') * p~(y | context, x_{1..i}).

Speculative sampling accepts x_j with probability min(1, p~/q~) and resamples the rejected mass
from the residual norm(max(p~ - q~, 0)), which makes the block follow p~ exactly. MTAD does neither:
accepted tokens come from B (beam-selected, not from p~), and nothing puts back the mass the
threshold removes, so the text leans to sequences both models find likely (lower perplexity).
Only y is a plain target draw. Limits: tau_acc = inf (allowed here, not by the CLI) never accepts:
exactly sampling from p~; tau_acc = 0 accepts every draft: drafter beam sampling plus one target
token per step; temperature 0 with tau_acc > 0: greedy decoding of the target, token for token
(P_i is 0 for an all-argmax prefix, -inf otherwise, and -Q_i >= 0 >= log tau_acc).

One loop: MTADGuesser is an ordinary guesser whose proposals carry the joint rule
(`Proposal.rule`, with tau_acc given), which decoder/loop.py's Steps call instead of decoder.verify.verify;
the warp (temperature, top_k, top_p) is the run's, used for the target and the drafter alike (the paper:
temperature 1, top-k 20, top-p 0.9: MTAD_SAMPLING). The drafter is reached only through decoder/drafter.py's
protocol. By default (beams="tree") the target scores all W final
beams in one forward pass as a tree (shared prefixes once) and the beam with the longest passing
prefix wins (ties to the higher draft likelihood); beams="best" scores only the highest-likelihood
beam (the paper's reading; docs/seed-systems.md, section 'MTAD'). What the output follows is the same argument with
B the beam the verdict picked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch

from decoder.engine import vocab_size
from decoder.guesser import DecodeContext, Proposal, StepOutcome
from decoder.guessers.draft import chain_nodes
from decoder.layout import layout_for
from decoder.torch_ops.draft import HFDraft
from decoder.verify import Sampling, Verdict, sample, warp
from planner.errors import UserError
from planner.mtad import accepted_length, log_threshold

# ---------------------------------------------------------------------------------------------- warping in log space


def warped_logprobs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> log p~ [..., V] in float32: temperature, then top-k, then top-p, as
    decoder.verify.warp keeps them (transformers' order and ties), -inf outside the support.
    Temperature 0: one-hot."""
    x = logits.float()
    if s.temperature <= 0:
        top = x.argmax(-1, keepdim=True)
        return torch.full_like(x, -math.inf).scatter_(-1, top, 0.0)
    return warp(x, s).log_softmax(-1)


def draft_logprobs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """log q~ for the beam scores: the target's warp; at temperature 0 the drafter's warped
    distribution at temperature 1 (a one-hot q~ would make every beam the greedy draft)."""
    if s.temperature <= 0:
        s = Sampling(1.0, s.top_k, s.top_p)
    return warped_logprobs(logits, s)


def log_ratios(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """D = log p~ - log q~ in float64, -inf wherever either side is -inf (never NaN)."""
    lp, lq = log_p.double(), log_q.double()
    ok = torch.isfinite(lp) & torch.isfinite(lq)
    return torch.where(ok, lp - lq.masked_fill(~ok, 0.0), torch.full_like(lp, -math.inf))


# ---------------------------------------------------------------------------------------------- beam sampling


def gumbel(shape, generator, device) -> torch.Tensor:
    """Standard Gumbel noise from the CPU generator (the same draws on any device)."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
    return (-torch.log(-torch.log(u))).to(device)


def beam_step(scores: torch.Tensor, log_q: torch.Tensor, width: int, generator=None, support: int = 0):
    """scores [B] (beam log-likelihoods s_b), log_q [B, V] -> (parent [W'], token [W'], new scores [W']).

    Candidates (b, v) score s_b + log q~(v | b). With a generator: Gumbel-top-W, which draws W
    distinct candidates without replacement with probability proportional to exp(score) (Eq. 2);
    without: the top W. W' = min(W, candidates). A beam whose score is -inf (fewer than W
    candidates in the support) is kept for a static shape and never wins.
    support: when q~ keeps at most this many tokens per row (its top-k), only those are candidates
    (the same draw, with noise for B x support entries instead of B x V)."""
    V = log_q.shape[-1]
    if support and support < V:
        lq, vocab_idx = log_q.topk(support, dim=-1)  # [B, k]: every finite entry of each row
    else:
        lq, vocab_idx = log_q, None
    cand = (scores[:, None].double() + lq.double()).reshape(-1)  # [B k]
    keys = cand if generator is None else cand + gumbel(cand.shape, generator, cand.device)
    idx = keys.topk(min(width, cand.numel())).indices  # [W']
    k = lq.shape[-1]
    parent, col = idx // k, idx % k
    token = col if vocab_idx is None else vocab_idx[parent, col]
    return parent, token, cand[idx]


@dataclass
class BeamProposal(Proposal):
    """A chain proposal with the drafter's log q~ of each proposed token and the final beam scores."""

    draft_logq: torch.Tensor | None = None  # [gamma] float, log q~(x_j | x_<j) of the chosen beam
    beam_scores: torch.Tensor | None = None  # [W'] joint log q~ of every final beam


BEAM_MODES = ("tree", "best")


class MTADGuesser:
    """A drafter (the target's vocabulary) that proposes the best of W beam-sampled drafts of gamma tokens."""

    needs_hidden = False
    top_k = 1

    def __init__(self, drafter, width: int = 4, gamma: int = 4, label: str = "draft model",
                 tau_acc: float | None = None, beams: str = "tree"):
        for name, x in (("width", width), ("gamma", gamma)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise UserError(f"{label}: MTAD {name} must be an integer >= 1, got {x!r}")
        if beams not in BEAM_MODES:
            raise UserError(f"{label}: MTAD beams must be one of {', '.join(BEAM_MODES)}, got {beams!r}")
        # tree: the target scores all W final beams in one pass (shared prefixes once) and the beam
        # with the longest passing prefix wins; best: only the highest-likelihood beam (the paper)
        self.beams = beams
        if tau_acc is not None:
            log_threshold(tau_acc)  # a one-line error for a bad threshold
        self.drafter = HFDraft(drafter, label) if isinstance(drafter, torch.nn.Module) else drafter
        if self.drafter.features:
            raise UserError(f"{label}: MTAD's beams are fed the drafter's own tokens only; a drafter that reads "
                            "the target's features cannot draft them")
        self.width, self.gamma, self.label = width, gamma, label
        # tau_acc: proposals carry the joint rule with this threshold (None: the run's own rule,
        # e.g. greedy or lossless verification of beam drafts); walks: D_1..D_gamma per step of the last decode
        self.tau_acc = tau_acc
        self.walks: list[list[float]] = []

    @property
    def num_distances(self) -> int:
        return self.gamma

    def check(self, plan, label: str = "plan") -> None:
        if plan is not None:
            raise UserError(f"{label}: MTAD drafts a chain of gamma tokens; it takes no plan")

    def begin(self, target, plan, prompt_ids: torch.Tensor, ctx: DecodeContext) -> "MTADSession":
        vocab = vocab_size(target)
        if self.drafter.vocab_size != vocab:
            raise UserError(f"{self.label}: vocabulary of {self.drafter.vocab_size} tokens, the target has {vocab}: "
                            "a drafter must share the target's tokenizer")
        self.walks = []
        return MTADSession(self, prompt_ids, ctx)


class MTADSession:
    """Between steps the drafter's cache (decoder/drafter.py's DraftState) holds the accepted text it has
    fed. A beam step feeds the W beams' tokens as W inputs of one pass, each seeing the context and its
    own beam's earlier inputs (`slots`); the commit keeps the accepted beam's fed tokens and drops the rest."""

    def __init__(self, guesser: MTADGuesser, prompt_ids: torch.Tensor, ctx: DecodeContext):
        self.width, self.gamma, self.ctx = guesser.width, guesser.gamma, ctx
        self.tau_acc, self.walks, self.tree = guesser.tau_acc, guesser.walks, guesser.beams == "tree"
        self.layout = layout_for(chain_nodes(self.gamma), 1, ctx.dtype, ctx.device)
        self.max_input_length = 1 + self.gamma * (self.width if self.tree else 1)
        self.state = guesser.drafter.open(prompt_ids.reshape(-1), None)
        self.beam_slots: list[list[int]] = [[]]  # per final beam: the cache slots of its fed tokens
        self.beam_nodes: list[list[int]] = []  # tree: tree index of each final beam's tokens
        self.unseen: list[int] = []  # accepted tokens not yet in the drafter's cache (before the root)
        self.base = 0  # cache length after the step's first pass (context + unseen + root)
        self.sampled = ctx.sampling.temperature > 0

    @torch.inference_mode()
    def propose(self, root: torch.Tensor) -> BeamProposal:
        s = self.ctx.sampling
        gen = self.ctx.generator if self.sampled else None
        log_q = draft_logprobs(self._first_pass(root)[None], s)  # [1, V]
        scores = torch.zeros(1, dtype=torch.float64, device=root.device)
        toks = torch.zeros(1, 0, dtype=torch.long, device=root.device)  # [B, t] each beam's tokens
        lqs = torch.zeros(1, 0, dtype=torch.float64, device=root.device)  # [B, t] their log q~
        slots: list[list[int]] = [[]]  # [B] each beam's fed tokens' cache slots
        for t in range(self.gamma):
            parent, token, scores = beam_step(scores, log_q, self.width, gen, s.top_k)
            toks = torch.cat([toks[parent], token[:, None]], 1)
            lqs = torch.cat([lqs[parent], log_q[parent, token].double()[:, None]], 1)
            slots = [slots[b] for b in parent.tolist()]
            if t + 1 < self.gamma:  # the last token is never fed: the target scores it
                logits, slots = self._beam_pass(token, slots, self.base + t)
                log_q = draft_logprobs(logits, s)  # [B, V]
        best = int(scores.argmax())
        if self.tree:
            self.beam_slots = slots
            return self._tree_proposal(toks, lqs, scores, best)
        # the chosen beam's fed tokens stay, the other beams' go
        self.state.keep(self.base, [u - self.base for u in slots[best]])
        self.beam_slots = [list(range(self.base, self.base + len(slots[best])))]
        chain = torch.arange(1, self.gamma + 1, device=toks.device)[None]  # the one beam's tree indices
        rule = None if self.tau_acc is None else partial(
            _joint_rule, beam_nodes=chain, draft_logq=lqs[best: best + 1], beam_scores=scores[best: best + 1],
            tau_acc=self.tau_acc, walks=self.walks)
        return BeamProposal(self.layout, toks[best], rule=rule, draft_logq=lqs[best], beam_scores=scores)

    def _tree_proposal(self, toks, lqs, scores, best: int) -> "BeamProposal":
        """All final beams as one tree (their union of prefixes); the drafter's cache keeps every beam's fed
        tokens until the commit knows which beam the verdict followed."""
        nodes, node_tokens, self.beam_nodes = beam_trie(toks.tolist())
        width = max(p[-1] for p in nodes) + 1
        layout = layout_for(tuple(nodes), width, self.ctx.dtype, self.ctx.device)
        tokens = torch.tensor(node_tokens, dtype=torch.long, device=toks.device)
        beam_nodes = torch.tensor(self.beam_nodes, dtype=torch.long, device=toks.device)  # [W', gamma]
        rule = None if self.tau_acc is None else partial(
            _joint_rule, beam_nodes=beam_nodes, draft_logq=lqs, beam_scores=scores, tau_acc=self.tau_acc,
            walks=self.walks)
        return BeamProposal(layout, tokens, rule=rule, draft_logq=lqs[best], beam_scores=scores)

    def _first_pass(self, root: torch.Tensor) -> torch.Tensor:
        """The unseen accepted tokens and the root, as a causal chain: the root's logits [V]."""
        C = self.state.length
        ids = torch.cat([torch.tensor(self.unseen, dtype=torch.long, device=root.device), root])  # [m]
        pos = torch.arange(C, C + ids.numel(), device=root.device)
        out = self.state.forward(ids, pos, None, None, last_only=True)
        self.unseen = []
        self.base = self.state.length
        return out.logits[-1]

    def _beam_pass(self, tokens: torch.Tensor, slots: list[list[int]], position: int):
        """One token per beam [B] at `position`, each seeing the context and its own beam's fed tokens:
        (logits [B, V], each beam's slots with its new token's)."""
        L, B = self.state.length, tokens.numel()
        visible = torch.zeros(B, L + B, dtype=torch.bool)
        visible[:, : self.base] = True
        for b, own in enumerate(slots):
            visible[b, own] = True
            visible[b, L + b] = True
        pos = torch.full((B,), position, dtype=torch.long, device=tokens.device)
        out = self.state.forward(tokens, pos, visible, None)
        return out.logits, [own + [L + b] for b, own in enumerate(slots)]

    def commit(self, outcome: StepOutcome) -> None:
        """Keep the accepted draft tokens the drafter has fed (at most gamma - 1); the rest waits as unseen."""
        a = len(outcome.verdict.nodes) - 1
        b = 0
        if self.tree:  # a beam whose prefix is the accepted path (any such beam fed it)
            b = next((i for i, path in enumerate(self.beam_nodes) if path[:a] == outcome.verdict.nodes[1:]), 0)
        fed = min(a, self.gamma - 1)
        self.state.keep(self.base, [u - self.base for u in self.beam_slots[b][:fed]])
        self.unseen = outcome.verdict.emitted[fed:a]


def beam_trie(beams: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int], list[list[int]]]:
    """Beams [W'][gamma] of token ids -> (rank paths of the union of their prefixes, parents first;
    each node's token; per beam the tree index of each of its tokens, root = 0). Ranks are the
    order in which a node's distinct children first appear."""
    index: dict[tuple[int, ...], int] = {(): 0}
    path_of: dict[tuple[int, ...], tuple[int, ...]] = {(): ()}
    children: dict[tuple[int, ...], int] = {}
    nodes, node_tokens = [], []
    for j in range(len(beams[0])):  # by depth, so parents come first
        for beam in beams:
            prefix = tuple(beam[: j + 1])
            if prefix in index:
                continue
            parent = prefix[:-1]
            rank = children.get(parent, 0)
            children[parent] = rank + 1
            path_of[prefix] = path_of[parent] + (rank,)
            nodes.append(path_of[prefix])
            node_tokens.append(beam[j])
            index[prefix] = len(nodes)
    beam_nodes = [[index[tuple(beam[: j + 1])] for j in range(len(beam))] for beam in beams]
    return nodes, node_tokens, beam_nodes


# ---------------------------------------------------------------------------------------------- verification


@dataclass
class JointVerdict(Verdict):
    log_ratios: list[float] = field(default_factory=list)  # D_1..D_gamma of the whole draft (the walk)


def _joint_rule(logits, tokens, s: Sampling, generator, *, beam_nodes, draft_logq, beam_scores, tau_acc,
                walks: list) -> "JointVerdict":
    """The joint rule as a proposal's own verification (decoder.guesser.Proposal.rule); every
    step's winning walk D_1..D_gamma is kept (the planner replays them), the last step's included."""
    verdict = verify_joint_tree(logits, tokens, beam_nodes, draft_logq, beam_scores, s, tau_acc, generator)
    walks.append(verdict.log_ratios)
    return verdict


def verify_joint(logits: torch.Tensor, tokens: torch.Tensor, draft_logq: torch.Tensor, s: Sampling, tau_acc: float,
                 generator=None) -> "JointVerdict":
    """One beam as a chain: logits [gamma + 1, V] over tokens [root, x_1..x_gamma], draft_logq [gamma]
    = log q~(x_j). P_i - Q_i = sum_{j<=i} D_j with D_j = log p~(x_j | x_<j) - log q~(x_j | x_<j);
    accept the longest prefix i* with P_i - Q_i >= log tau_acc (i = 0 always passes), emit
    x_1..x_{i*} and y ~ p~(. | x_{1..i*}) (argmax at temperature 0)."""
    chain = torch.arange(1, tokens.numel(), device=tokens.device)[None]  # [1, gamma]
    return verify_joint_tree(logits, tokens, chain, draft_logq[None], torch.zeros(1, dtype=torch.float64), s,
                             tau_acc, generator)


def verify_joint_tree(logits: torch.Tensor, tokens: torch.Tensor, beam_nodes: torch.Tensor, draft_logq: torch.Tensor,
                      beam_scores: torch.Tensor, s: Sampling, tau_acc: float, generator=None) -> JointVerdict:
    """The joint rule over all beams scored as one tree. logits [num_tree, V] (root first), tokens
    [num_tree] (root first), beam_nodes [W', gamma] tree indices, draft_logq [W', gamma] log q~.

    Each beam b is a path; its walk D_bj = log p~(x_bj | its prefix) - log q~(x_bj) gives its
    accepted length i*_b (the longest passing prefix). The winner has the longest i*_b, ties to the
    higher draft likelihood; emit its x_1..x_{i*} and y ~ p~ after them. With one beam this is
    verify_joint. One host copy for the walks, the tokens, the tree indices and the argmaxes."""
    W, g = beam_nodes.shape
    parents = torch.cat([beam_nodes.new_zeros(W, 1), beam_nodes[:, :-1]], 1)  # [W', g] tree index before x_bj
    x = tokens[beam_nodes]  # [W', g]
    log_p = warped_logprobs(logits, s)[parents, x]  # [W', g]
    D = log_ratios(log_p, draft_logq.to(log_p.device))
    host = torch.cat([D.reshape(-1), x.reshape(-1).double(), beam_nodes.reshape(-1).double(),
                      logits.argmax(-1).double()]).tolist()
    rows = lambda k: [host[k * W * g + b * g: k * W * g + (b + 1) * g] for b in range(W)]  # noqa: E731
    walks, toks, nodes, tops = rows(0), rows(1), rows(2), host[3 * W * g:]
    lengths = [accepted_length(w, tau_acc) for w in walks]
    scores = beam_scores.tolist()
    b = max(range(W), key=lambda k: (lengths[k], scores[k]))
    i = lengths[b]
    path = [0] + [int(u) for u in nodes[b][:i]]
    last = path[-1]
    y = int(tops[last]) if s.temperature <= 0 else int(sample(logits[last], s, generator))
    dev = tokens.device
    return JointVerdict(torch.tensor(path, dtype=torch.long, device=dev), path, [int(t) for t in toks[b][:i]] + [y],
                        torch.tensor([y], dtype=torch.long, device=dev), walks[b])


MTAD_SAMPLING = Sampling(1.0, 20, 0.9)  # the paper's warp (temperature 1, top-k 20, top-p 0.9)


def load(request) -> MTADGuesser:
    """The registry's loader (planner/guessers.py): the drafter in request.path, opened by the target engine
    (Engine.open_drafter); options width, gamma, tau_acc, beams."""
    o = request.options
    return MTADGuesser(request.target.open_drafter(request.path), width=o.get("width", 4), gamma=o.get("gamma", 4),
                       label=str(request.path), tau_acc=o.get("tau_acc"), beams=o.get("beams", "tree"))
