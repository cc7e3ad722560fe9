"""Verification: which candidates the base model accepts, and the token it adds after them.

Random draws use a CPU torch.Generator (the same one on any device). All rules return (accepted tree indices [a+1] starting with the root, emitted tokens [a+1]):
the accepted candidates' tokens followed by the base model's own token at the last accepted node.
See ../shared/notes/ALGORITHMS.md section 5.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder.buffers import StepBuffers


@dataclass(frozen=True)
class Sampling:
    """How the base model's distribution is formed; identical for plain and tree decoding."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    mode: str = "auto"  # auto (greedy at T=0, else lossless), greedy, typical, lossless
    eps: float = 0.09  # typical acceptance: hard threshold
    delta: float = 0.3  # typical acceptance: entropy-scaled threshold

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


def _best_path(node_ok: torch.Tensor, buf: StepBuffers) -> tuple[torch.Tensor, int]:
    """node_ok [num_tree] bool (root True) -> (tree indices of the longest accepted path, its length a)."""
    ok = node_ok[buf.paths[:, 1:]] & buf.path_valid  # [L, depth]
    length = ok.long().cumprod(dim=1).sum(dim=1)  # [L]
    best = int(length.argmax())
    a = int(length[best])
    return buf.paths[best, : a + 1], a


def verify_greedy(logits: torch.Tensor, tokens: torch.Tensor, buf: StepBuffers):
    """logits [num_tree, V], tokens [num_tree]: accept a candidate equal to the argmax at its parent."""
    top = logits.argmax(dim=-1)  # [num_tree]
    ok = tokens == top[buf.parents]
    ok[0] = True
    path, a = _best_path(ok, buf)
    return path, torch.cat([tokens[path[1:]], top[path[-1:]]])


def verify_typical(logits: torch.Tensor, tokens: torch.Tensor, buf: StepBuffers, s: Sampling, generator):
    """Medusa typical acceptance: p(x) > min(eps, delta * exp(-H(p))) at the parent; not lossless."""
    p = probabilities(logits, s)  # [num_tree, V]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [num_tree]
    threshold = torch.minimum(torch.full_like(entropy, s.eps), s.delta * torch.exp(-entropy))
    parent = buf.parents
    ok = p[parent, tokens] > threshold[parent]
    ok[0] = True
    path, a = _best_path(ok, buf)
    last = torch.multinomial(p[path[-1]].cpu(), 1, generator=generator).to(tokens.device)
    return path, torch.cat([tokens[path[1:]], last])


def verify_lossless(logits: torch.Tensor, tokens: torch.Tensor, buf: StepBuffers, s: Sampling, generator):
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
    path_t = torch.tensor(path, dtype=torch.long)
    emitted = torch.tensor([toks[i] for i in path[1:]] + [last], dtype=torch.long)
    return path_t.to(tokens.device), emitted.to(tokens.device)


def verify(logits: torch.Tensor, tokens: torch.Tensor, buf: StepBuffers, s: Sampling, generator=None):
    rule = s.rule
    if rule == "greedy":
        return verify_greedy(logits, tokens, buf)
    if rule == "typical":
        return verify_typical(logits, tokens, buf, s, generator)
    if rule == "lossless":
        return verify_lossless(logits, tokens, buf, s, generator)
    raise ValueError(f"unknown verification rule {rule!r}")


def sample(logits: torch.Tensor, s: Sampling, generator=None) -> torch.Tensor:
    """One token from logits [V] under the same rules (plain decoding)."""
    if s.temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial(probabilities(logits, s).cpu(), 1, generator=generator).to(logits.device)
