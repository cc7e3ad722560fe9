"""Verification: which candidates the base model accepts, and the token it adds after them.

Random draws use a CPU torch.Generator (the same one on any device). All rules return a
`Verdict`: the accepted tree indices [a+1] starting with the root (on the device, for the KV
compaction, and on the host), and the emitted tokens [a+1] on the host: the accepted candidates'
tokens followed by the base model's own token at the last accepted node, which is also the next
step's root (kept on the device).
Greedy verification reads the device once per step: the winning path, its length and the tokens
along it come back in one copy (every extra read is a device sync on a GPU).
See docs/algorithms.md, section 'Verification'.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decoder.layout import StepLayout
from planner.errors import UserError

RULES = ("auto", "greedy", "typical", "lossless")


@dataclass(frozen=True)
class Sampling:
    """How the base model's distribution is formed; identical for plain and tree decoding."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    mode: str = "auto"  # auto (greedy at T=0, else lossless), greedy, typical, lossless
    eps: float = 0.09  # typical acceptance: hard threshold
    delta: float = 0.3  # typical acceptance: entropy-scaled threshold

    def __post_init__(self):
        for name, lo, hi in (("temperature", 0.0, math.inf), ("top_p", 0.0, 1.0), ("eps", 0.0, 1.0), ("delta", 0.0, math.inf)):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not lo <= x <= hi:
                raise UserError(f"{name}: expected a finite number in [{lo}, {hi}], got {x!r}")
        if self.top_p == 0:
            raise UserError("top_p: expected a number in (0, 1], got 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k: expected an integer >= 0, got {self.top_k!r}")
        if self.mode not in RULES:
            raise UserError(f"verify rule: expected one of {', '.join(RULES)}, got {self.mode!r}")
        if self.mode in ("typical", "lossless") and self.temperature == 0:
            raise UserError(f"verify rule: '{self.mode}' samples, but temperature is 0, where every rule is greedy; "
                            "give a temperature > 0, or the rule greedy (or auto)")

    @property
    def rule(self) -> str:
        if self.temperature <= 0 or self.mode == "greedy":
            return "greedy"
        return "lossless" if self.mode == "auto" else self.mode


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> the base model's sampling distribution [..., V] (temperature, top-k, top-p)."""
    x = logits.float() / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= s.top_p  # keep the smallest prefix reaching top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x.softmax(-1)


@dataclass
class Verdict:
    path: torch.Tensor  # [a+1] long tree indices, root first, on the logits' device
    nodes: list[int]  # the same indices on the host
    emitted: list[int]  # [a+1] tokens: accepted candidates, then the base model's token
    root: torch.Tensor  # [1] long, emitted[-1] on the device: the next step's root


def _best_path(node_ok: torch.Tensor, buf: StepLayout, *per_node: torch.Tensor) -> tuple[int, int, list[list[int]]]:
    """node_ok [num_tree] bool (root True) -> (best path row b, accepted length a, per_node values along row b).

    One device-to-host copy: the row index, its length and each `per_node` [num_tree] tensor
    gathered along the winning row (depth + 1 values each)."""
    ok = node_ok[buf.paths[:, 1:]] & buf.path_valid  # [L, depth]
    length = ok.long().cumprod(dim=1).sum(dim=1)  # [L]
    best = length.argmax().view(1)  # [1], stays on the device (indexing with it would sync)
    row = buf.paths.index_select(0, best)[0]  # [depth + 1]
    host = torch.cat([best, length.index_select(0, best)] + [t[row] for t in per_node]).tolist()
    w = buf.depth + 1
    return host[0], host[1], [host[2 + i * w: 2 + (i + 1) * w] for i in range(len(per_node))]


def verify_greedy(logits: torch.Tensor, tokens: torch.Tensor, buf: StepLayout) -> Verdict:
    """logits [num_tree, V], tokens [num_tree]: accept a candidate equal to the argmax at its parent."""
    top = logits.argmax(dim=-1)  # [num_tree]
    ok = tokens == top[buf.parents]
    ok[0] = True
    b, a, (toks, tops) = _best_path(ok, buf, tokens, top)
    path = buf.paths[b, : a + 1]
    return Verdict(path, buf.paths_list[b][: a + 1], toks[1: a + 1] + [tops[a]], top[path[a:]])


def verify_greedy_chain(logits: torch.Tensor, tokens: torch.Tensor, buf: StepLayout) -> Verdict:
    """verify_greedy for a chain on the CPU, in numpy: one argmax per row and a prefix match, no small
    torch ops (each costs microseconds; against llama.cpp's ~9 ms forward they add up)."""
    top = logits.numpy().argmax(axis=1)  # [num_tree]
    toks = tokens.tolist()
    a = 0
    while a + 1 < len(toks) and toks[a + 1] == top[a]:
        a += 1
    last = int(top[a])
    return Verdict(buf.paths[0, : a + 1], list(range(a + 1)), toks[1: a + 1] + [last],
                   torch.tensor([last], dtype=torch.long))


def verify_typical(logits: torch.Tensor, tokens: torch.Tensor, buf: StepLayout, s: Sampling, generator) -> Verdict:
    """Medusa typical acceptance: p(x) > min(eps, delta * exp(-H(p))) at the parent; not lossless."""
    p = probabilities(logits, s)  # [num_tree, V]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [num_tree]
    threshold = torch.minimum(torch.full_like(entropy, s.eps), s.delta * torch.exp(-entropy))
    parent = buf.parents
    ok = p[parent, tokens] > threshold[parent]
    ok[0] = True
    b, a, (toks,) = _best_path(ok, buf, tokens)
    nodes = buf.paths_list[b][: a + 1]
    last = int(torch.multinomial(p[nodes[-1]].cpu(), 1, generator=generator))
    return Verdict(buf.paths[b, : a + 1], nodes, toks[1: a + 1] + [last],
                   torch.tensor([last], dtype=torch.long, device=tokens.device))


def verify_lossless(logits: torch.Tensor, tokens: torch.Tensor, buf: StepLayout, s: Sampling, generator) -> Verdict:
    """Deterministic guesses: children in rank order, accept x with prob p(x), else zero it and renormalise.

    Walks one root-to-leaf path (at most depth x children iterations), not the whole tree.
    """
    toks = tokens.cpu().tolist()
    u, path = 0, [0]
    while True:
        q = probabilities(logits[u], s).cpu()  # [V], only for nodes on the walked path
        moved = False
        for c in buf.children[u].tolist():
            if c < 0:
                break
            total = float(q.sum())
            x = toks[c]
            if total > 0 and float(torch.rand((), generator=generator)) * total < float(q[x]):
                u, moved = c, True
                path.append(c)
                break
            q[x] = 0.0
        if not moved:
            last = int(torch.multinomial(q / q.sum(), 1, generator=generator)) if float(q.sum()) > 0 else int(logits[u].argmax())
            break
    emitted = [toks[i] for i in path[1:]] + [last]
    return Verdict(torch.tensor(path, dtype=torch.long, device=tokens.device), path, emitted,
                   torch.tensor([last], dtype=torch.long, device=tokens.device))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): what is left of the target's distribution after a rejected draw from q.
    When nothing is left (p <= q everywhere, so the rejection had probability 0), p itself."""
    r = (p - q).clamp_min(0)
    total = float(r.sum())
    return r / total if total > 0 else p


def without(q: torch.Tensor, x: int) -> torch.Tensor:
    """q with token x removed and renormalised: the next sibling's draw, sampling without replacement."""
    q = q.clone()
    q[x] = 0.0
    total = float(q.sum())
    return q / total if total > 0 else q


def verify_sampled(logits: torch.Tensor, tokens: torch.Tensor, buf: StepLayout, s: Sampling, generator,
                   draft_probs: torch.Tensor) -> Verdict:
    """Sampled drafts (SpecInfer / Sequoia): node u's children were drawn from q_u without
    replacement, in rank order. Accept child x with probability min(1, p(x) / q(x)); on rejection
    p <- norm(max(p - q, 0)) and q loses x (renormalised) for the next sibling; if every child is
    rejected, the token comes from what is left of p. The output distribution is the target's
    (tests/test_draft_sampling.py checks it by exact enumeration and shows wrong rules fail).
    """
    toks = tokens.cpu().tolist()
    u, path = 0, [0]
    while True:
        p = probabilities(logits[u], s).double().cpu()  # [V] the target at u
        q = draft_probs[u].double().cpu()  # [V] the draft at u, before any draw
        moved = False
        for c in buf.children[u].tolist():
            if c < 0:
                break
            x = toks[c]
            ratio = float(p[x]) / float(q[x]) if float(q[x]) > 0 else float("inf")
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, ratio):
                u, moved = c, True
                path.append(c)
                break
            p, q = residual(p, q), without(q, x)
        if not moved:
            last = int(torch.multinomial(p, 1, generator=generator)) if float(p.sum()) > 0 else int(logits[u].argmax())
            break
    emitted = [toks[i] for i in path[1:]] + [last]
    return Verdict(torch.tensor(path, dtype=torch.long, device=tokens.device), path, emitted,
                   torch.tensor([last], dtype=torch.long, device=tokens.device))


def verify(logits: torch.Tensor, tokens: torch.Tensor, buf: StepLayout, s: Sampling, generator=None,
           draft_probs: torch.Tensor | None = None) -> Verdict:
    """logits [num_tree, V], tokens [num_tree] (root first). draft_probs [num_tree, V]: the draft
    distribution each node's children were sampled from (sampled drafts); None: deterministic guesses."""
    rule = s.rule
    if rule == "greedy":
        if logits.device.type == "cpu" and buf.depth == buf.num_tree - 1 and not logits.requires_grad:
            return verify_greedy_chain(logits.float(), tokens, buf)
        return verify_greedy(logits, tokens, buf)
    if rule == "typical":
        return verify_typical(logits, tokens, buf, s, generator)
    if rule == "lossless":
        if draft_probs is not None:
            return verify_sampled(logits, tokens, buf, s, generator, draft_probs)
        return verify_lossless(logits, tokens, buf, s, generator)
    raise ValueError(f"unknown verification rule {rule!r}")


def sample(logits: torch.Tensor, s: Sampling, generator=None) -> torch.Tensor:
    """One token from logits [V] under the same rules (plain decoding)."""
    if s.temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial(probabilities(logits, s).cpu(), 1, generator=generator).to(logits.device)
