"""decoder.verify's warping equals transformers' own warpers (temperature, then top-k, then top-p),
ties and edge cases included; its samplers draw from the distribution they are given."""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decoder.verify import Sampling, draw, draw_children, probabilities, warp

P_MIN = 1e-3


def _transformers(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """What generate(do_sample=True) samples from: its warpers in its order, then softmax."""
    x = logits.float()[None] if logits.dim() == 1 else logits.float()
    ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
    if s.temperature != 1.0:
        x = TemperatureLogitsWarper(s.temperature)(ids, x)
    if s.top_k:
        x = TopKLogitsWarper(s.top_k)(ids, x)
    if s.top_p < 1.0:
        x = TopPLogitsWarper(s.top_p)(ids, x)
    return x.softmax(-1).reshape(logits.shape)


def _same(logits: torch.Tensor, s: Sampling) -> None:
    ours, theirs = probabilities(logits, s), _transformers(logits, s)
    assert torch.equal(ours > 0, theirs > 0), f"kept sets differ for {s}"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


SETTINGS = [Sampling(0.7, 0, 0.9), Sampling(1.0, 50, 1.0), Sampling(1.3, 5, 0.95), Sampling(0.5, 3, 0.5),
            Sampling(1.0, 0, 0.3), Sampling(2.0, 1, 1.0), Sampling(0.9, 0, 0.999), Sampling(1.0, 0, 1e-6)]


@pytest.mark.parametrize("s", SETTINGS, ids=str)
def test_random_logits_match_transformers(s):
    g = torch.Generator().manual_seed(0)
    for V, scale in ((8, 1.0), (100, 3.0), (49152, 4.0), (4096, 0.05)):  # 0.05: nearly flat, the nucleus is huge
        logits = torch.randn(2, V, generator=g) * scale
        _same(logits, s)
        _same(logits[0], s)  # one row as the verifier walks a path


@pytest.mark.parametrize("s", SETTINGS + [Sampling(1.0, 2, 1.0), Sampling(1.0, 0, 0.5), Sampling(1.0, 0, 0.75)], ids=str)
def test_ties_and_edges_match_transformers(s):
    cases = [
        torch.zeros(6),  # every token tied: top-k keeps all, top-p keeps the higher ids
        torch.tensor([3.0, 1.0, 1.0, 1.0, 1.0, -2.0]),  # ties right after the best token
        torch.tensor([2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),  # a tie at the top
        torch.tensor([1.0, float("-inf"), 1.0, 0.5, float("-inf"), 0.0]),  # tokens already banned
        torch.tensor([5.0, 4.0, 3.0]),  # top_k beyond the vocabulary
        torch.cat([torch.full((70,), 1.0), torch.zeros(200)]),  # a tie group crossing the first 64 the search reads
    ]
    for logits in cases:
        _same(logits, s)


def test_the_fast_path_is_what_is_checked():
    """The cases above pass through the top-m search, not only through the full-sort fallback:
    on peaked logits without ties near the cut no row is recomputed."""
    from decoder import verify

    calls = []
    real = verify._nucleus_sorted
    verify._nucleus_sorted = lambda x, p: calls.append(1) or real(x, p)
    try:
        g = torch.Generator().manual_seed(5)
        _same(torch.randn(4, 49152, generator=g) * 4, Sampling(0.7, 0, 0.9))
    finally:
        verify._nucleus_sorted = real
    assert not calls


def test_draw_follows_its_distribution():
    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    g = torch.Generator().manual_seed(1)
    n = 4000
    counts = np.bincount([draw(p, g) for _ in range(n)], minlength=5)
    assert counts[1] == 0
    keep = p.numpy() > 0
    assert chisquare(counts[keep], p.numpy()[keep] * n).pvalue > P_MIN


def test_draw_children_is_sampling_without_replacement():
    """Ordered pairs from draw_children against the exact law q(a) q(b) / (1 - q(a)), excluded token never drawn."""
    q = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    g = torch.Generator().manual_seed(2)
    n = 4000
    counts: dict = {}
    for _ in range(n):
        pair = tuple(draw_children(q, 2, g, exclude=(3,)))
        counts[pair] = counts.get(pair, 0) + 1
    r = q.clone()
    r[3] = 0
    r = r / r.sum()
    exact = {(a, b): float(r[a] * r[b] / (1 - r[a])) for a, b in itertools.permutations(range(5), 2) if r[a] * r[b] > 0}
    assert set(counts) <= set(exact)
    cells = sorted(exact)
    assert chisquare([counts.get(c, 0) for c in cells], [exact[c] * n for c in cells]).pvalue > P_MIN
    assert draw_children(torch.tensor([0.0, 1.0, 0.0]), 3, g) == [1]  # the support runs out: fewer children


def test_warp_keeps_logits_inside_the_support():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    w = warp(logits, Sampling(0.5, 2, 1.0))
    assert w[:2].tolist() == [4.0, 2.0] and torch.isinf(w[2:]).all()
