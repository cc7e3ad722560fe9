"""Top-p (nucleus) filtering of a few rows without sorting the vocabulary.

vLLM 0.32's CPU backend filters top-p by sorting each row's whole vocabulary (apply_top_k_top_p_pytorch):
about 5-8 ms a row for SmolLM2's 49,152 tokens on a 2-core EPYC, paid by the rejection sampler for every
drafted position of a sampled request, on top of the bonus row a plain step pays too. The nucleus at a
top-p below 1 usually holds a few dozen tokens, so the likeliest CANDIDATES[0] (then CANDIDATES[1]) tokens,
found by a partial selection, hold it whole; a row whose nucleus is wider is left to the caller's sort.

The rule is vLLM's: a token is kept when the tokens strictly likelier than it hold less than p of the mass
(vLLM: its ascending cumulative mass exceeds 1 - p), so the likeliest token is always kept. Imports torch
only: the project's tests check it against a sort without vLLM.
"""
from __future__ import annotations

import torch

CANDIDATES = (64, 1024)


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """logits [rows, vocab] (temperature applied), top_p [rows] in (0, 1] -> logits with every token outside
    its row's nucleus at -inf, written in place (as vLLM's does); None, untouched, when some row's nucleus is
    wider than the largest candidate count (then sort). A row with top-p 1 is left whole."""
    rows = torch.nonzero(top_p < 1).squeeze(1)  # [filtered rows]
    if rows.numel() == 0:
        return logits
    every_row = rows.numel() == logits.shape[0]
    part = logits if every_row else logits[rows]  # [filtered rows, vocab]
    filtered = _filter(part, top_p[rows].to(torch.float64).unsqueeze(1))
    if filtered is None:
        return None
    if not every_row:
        logits[rows] = filtered
    return logits


def _filter(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor | None:
    vocab = logits.shape[1]
    probs = logits.softmax(dim=-1, dtype=torch.float32)  # [rows, vocab]
    for m in CANDIDATES:
        m = min(m, vocab)
        top, idx = probs.topk(m, dim=-1)  # [rows, m], likeliest first
        top = top.to(torch.float64)
        above = top.cumsum(dim=-1) - top  # [rows, m]: the mass of the candidates likelier than each
        # every token outside the candidates has at least their whole mass above it: filtered out when that is p
        if m == vocab or bool((top.sum(dim=-1, keepdim=True) >= p).all()):
            kept = logits.gather(1, idx).masked_fill_(above >= p, float("-inf"))  # [rows, m]
            return logits.fill_(float("-inf")).scatter_(1, idx, kept)
    return None
