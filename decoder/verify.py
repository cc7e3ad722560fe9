"""Verification: which candidates the base model accepts, and the token it adds after them.

Random draws use a CPU torch.Generator (the same one on any device). All rules return a
`Verdict`: the accepted tree indices [a+1] starting with the root (on the device, for the KV
compaction, and on the host), and the emitted tokens [a+1] on the host: the accepted candidates'
tokens followed by the base model's own token at the last accepted node, which is also the next
step's root (kept on the device).
Greedy verification reads the device once per step: the winning path, its length and the tokens
along it come back in one copy (every extra read is a device sync on a GPU).
See docs/algorithms.md, section 'Verification', and docs/sampling.md (warping, hybrid trees).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder.layout import StepLayout
from planner.sampling import RULES, Sampling  # noqa: F401  (decoder.verify.Sampling)


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> the warped logits in float32 (-inf outside the kept support), in
    transformers' order: temperature, then top-k, then top-p (its TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper with min_tokens_to_keep = 1).

    top-k keeps every token tied with the k-th logit. top-p keeps the smallest set, best first,
    whose mass reaches p, ties and float rounding at the cut settled as transformers settles them.
    The set is found among the top m tokens (m grows until it holds the set), not by sorting the
    vocabulary: a full sort of 49152 logits costs more than the rest of a sampled step's
    bookkeeping together (`_nucleus`).
    """
    x = logits.float()
    if s.temperature != 1.0:
        x = x / s.temperature
    V = x.shape[-1]
    if s.top_k and s.top_k < V:
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        x = x.masked_fill(~_nucleus(x, s.top_p), float("-inf"))
    return x


NUCLEUS_MARGIN = 3e-5  # closer to top_p than this, the float rounding of transformers' tail sum decides


def _nucleus(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool [..., V]: the tokens top-p keeps, as transformers' TopPLogitsWarper keeps them: a token
    stays when the mass of the tokens before it (best first) is below top_p; the best always stays.

    Fast path: the cut is found among the top m tokens (m grows until it holds it) with the head's
    mass summed in float64. Two things only transformers' own full sort can settle, so a row where
    either happens is recomputed its way (`_nucleus_sorted`): tokens of equal probability on both
    sides of the cut (its unstable sort picks which stay), and a cut within NUCLEUS_MARGIN of top_p
    (it sums the dropped tail in float32, whose rounding then decides)."""
    V = x.shape[-1]
    if V <= 256:  # a small vocabulary: transformers' own sort is the cheaper path
        return _nucleus_sorted(x.reshape(-1, V), top_p).reshape(x.shape)
    probs = x.softmax(-1)
    m = 64
    while True:
        vals, idx = probs.topk(m, dim=-1)  # [..., m] descending
        v64 = vals.double()
        before = v64.cumsum(-1) - v64
        keep = before < top_p
        keep[..., 0] = True
        count = keep.sum(-1, keepdim=True)  # [..., 1]
        if m == V or bool((count < m).all()):
            break
        m = min(4 * m, V)
    out = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(-1, idx, keep)
    cut = count.clamp(max=m - 1)
    inside = count < m
    tie = inside & (vals.gather(-1, cut) == vals.gather(-1, count - 1))
    near = (top_p - before.gather(-1, count - 1) < NUCLEUS_MARGIN) | (inside & (before.gather(-1, cut) - top_p < NUCLEUS_MARGIN))
    redo = (tie | near)[..., 0]
    if bool(redo.any()):
        flat_x, flat_out = x.reshape(-1, V), out.reshape(-1, V)
        for r in redo.reshape(-1).nonzero().flatten().tolist():
            flat_out[r] = _nucleus_sorted(flat_x[r: r + 1], top_p)[0]
    return out


def _nucleus_sorted(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' own computation, for rows [R, V] the fast path cannot settle: the full
    ascending sort, the float32 cumulative mass, drop what stays within 1 - top_p, keep the last."""
    sorted_x, order = torch.sort(x, descending=False)
    drop = sorted_x.softmax(-1).cumsum(-1) <= (1 - top_p)
    drop[..., -1:] = False
    return ~drop.scatter(-1, order, drop)


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> the sampling distribution [..., V] (temperature, top-k, top-p; `warp`)."""
    return warp(logits, s).softmax(-1)


def draw(p: torch.Tensor, generator) -> int:
    """One token from a distribution p [V] (any non-negative weights with a positive sum), by the
    inverse of its cumulative sum in float64: one uniform number and O(V) work (torch.multinomial
    takes milliseconds over a 49152-token vocabulary on a CPU). Tokens of weight 0 are never drawn."""
    c = p.detach().to("cpu", torch.float64).cumsum(-1)
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(c[-1])
    return min(int(torch.searchsorted(c, torch.tensor([u], dtype=torch.float64), right=True)), p.shape[-1] - 1)


def draw_children(q: torch.Tensor, k: int, generator, exclude=()) -> list[int]:
    """k tokens drawn from q [V] without replacement, in order (each from q with the earlier ones,
    and the tokens in `exclude`, removed and renormalised): the sampled siblings verify_sampled
    expects. Fewer than k when q's support runs out."""
    q = q.detach().to("cpu", torch.float64).clone()
    for x in exclude:
        q[x] = 0.0
    out = []
    for _ in range(k):
        if float(q.sum()) <= 0:
            break
        x = draw(q, generator)
        out.append(x)
        q[x] = 0.0
    return out


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
    """Medusa typical acceptance: p(x) > min(eps, delta * exp(-H(p))) at the parent.
    Not lossless: its output does not follow the target's distribution (only with --verify typical)."""
    p = probabilities(logits, s)  # [num_tree, V]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [num_tree]
    threshold = torch.minimum(torch.full_like(entropy, s.eps), s.delta * torch.exp(-entropy))
    parent = buf.parents
    ok = p[parent, tokens] > threshold[parent]
    ok[0] = True
    b, a, (toks,) = _best_path(ok, buf, tokens)
    nodes = buf.paths_list[b][: a + 1]
    last = draw(p[nodes[-1]], generator)
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
            last = draw(q, generator) if float(q.sum()) > 0 else int(logits[u].argmax())
            break
    return _verdict(path, toks, last, tokens.device)


def verify_coupled(logits: torch.Tensor, tokens: torch.Tensor, buf: StepLayout, s: Sampling, noise) -> Verdict:
    """Coupled sampling (decoder/noise.py): at each node of the walked path the next token is drawn
    with the noise of its index (noise.cursor + depth); the walk moves to the child holding it, and
    the first node without one emits it. The emitted text is plain sampling's with the same seed."""
    if noise is None:
        raise ValueError("verify_coupled: needs the decode's PositionNoise (DecodeContext.noise)")
    toks = tokens.cpu().tolist()
    u, path = 0, [0]
    while True:
        y = noise.draw(probabilities(logits[u], s), noise.cursor + len(path) - 1)  # only nodes on the path
        nxt = next((c for c in buf.children[u].tolist() if c >= 0 and toks[c] == y), None)
        if nxt is None:
            return _verdict(path, toks, y, tokens.device)
        u = nxt
        path.append(u)


def _verdict(path: list[int], toks: list[int], last: int, device) -> Verdict:
    emitted = [toks[i] for i in path[1:]] + [last]
    return Verdict(torch.tensor(path, dtype=torch.long, device=device), path, emitted,
                   torch.tensor([last], dtype=torch.long, device=device))


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


def point(x: int, like: torch.Tensor) -> torch.Tensor:
    """The proposal of a deterministic guess: all mass on x."""
    d = torch.zeros_like(like)
    d[x] = 1.0
    return d


def verify_sampled(logits: torch.Tensor, tokens: torch.Tensor, buf: StepLayout, s: Sampling, generator,
                   draft_probs: torch.Tensor, deterministic: list[bool] | None = None) -> Verdict:
    """Multi-draft recursive rejection (SpecInfer / Sequoia), every sibling checked against what is
    left of the target with its own proposal distribution, in rank order:

      a sampled child x (drawn from its parent's q with every earlier sibling's token removed,
      decoder.verify.draw_children) is accepted with min(1, p(x) / q(x)); a deterministic child x
      (deterministic[c]: a fixed guess, such as prompt lookup's, in a hybrid tree) has the point
      mass on x as its proposal, so it is accepted with p(x). On rejection
      p <- norm(max(p - proposal, 0)) and q loses x for the later siblings. If every child is
      rejected, the token comes from what is left of p.

    By induction over the siblings the emitted token follows p whatever the proposals, as long as
    each child's token was drawn from the proposal it is checked with given everything before it:
    a node's number of children may depend on earlier siblings, never on a child's own draw.
    tests/test_draft_sampling.py and tests/test_sampling_rules.py check the output distribution by
    exact enumeration and show wrong rules fail.
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
            if deterministic is not None and deterministic[c]:
                proposal = point(x, p)
            else:
                if float(q[x]) <= 0:
                    raise RuntimeError(f"verify_sampled: tree node {c} (token {x}) lies outside the q it was drawn from")
                proposal = q
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < min(1.0, float(p[x]) / float(proposal[x])):
                u, moved = c, True
                path.append(c)
                break
            p, q = residual(p, proposal), without(q, x)
        if not moved:
            last = draw(p, generator) if float(p.sum()) > 0 else int(logits[u].argmax())
            break
    return _verdict(path, toks, last, tokens.device)


def verify(logits: torch.Tensor, tokens: torch.Tensor, buf: StepLayout, s: Sampling, generator=None,
           draft_probs: torch.Tensor | None = None, deterministic: list[bool] | None = None, noise=None) -> Verdict:
    """logits [num_tree, V], tokens [num_tree] (root first). draft_probs [num_tree, V]: the draft
    distribution each node's sampled children were drawn from; None: every guess is deterministic.
    deterministic [num_tree]: which nodes are fixed guesses in a tree that also has sampled ones.
    noise: the decode's decoder.noise.PositionNoise (the coupled rule's draws; it ignores draft_probs)."""
    rule = s.rule
    if rule == "greedy":
        if logits.device.type == "cpu" and buf.depth == buf.num_tree - 1 and not logits.requires_grad:
            return verify_greedy_chain(logits.float(), tokens, buf)
        return verify_greedy(logits, tokens, buf)
    if rule == "coupled":
        return verify_coupled(logits, tokens, buf, s, noise)
    if rule == "typical":
        return verify_typical(logits, tokens, buf, s, generator)
    if rule == "lossless":
        if draft_probs is not None:
            return verify_sampled(logits, tokens, buf, s, generator, draft_probs, deterministic)
        return verify_lossless(logits, tokens, buf, s, generator)
    raise ValueError(f"unknown verification rule {rule!r}")


def sample(logits: torch.Tensor, s: Sampling, generator=None) -> torch.Tensor:
    """One token from logits [V] under the same rules (plain decoding)."""
    if s.temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    return torch.tensor([draw(probabilities(logits, s), generator)], dtype=torch.long, device=logits.device)
