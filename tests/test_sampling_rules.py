"""The lossless rules under temperature, top-k and top-p, for every kind of tree a guesser makes:
the first two tokens one verification step (and a plain step after it when needed) emits follow
the target's warped distribution, by chi-square against exact enumeration; each test also runs a
deliberately wrong rule and shows the same test fails.

A tiny world keeps this fast enough for many samples: the target's and the drafter's logits are
fixed random functions of the context over a 5-token vocabulary, so a sample costs one draft
(decoder.guessers.draft.draft_children, the drafters' own sampler), one verification (decoder.verify.verify,
the loop's rule) and no model. tests/test_sampling_decode.py runs the same rules end to end
through `generate` with tiny transformers models.

Sample size: a law at total variation distance d from the exact one has a chi-square divergence
of at least 4 d^2 (Cauchy-Schwarz), so the statistic's noncentrality is at least 4 d^2 n. With at
most 9 cells (the warped law of two tokens here: 8 degrees of freedom) and the test's level 1e-3,
n = 4700 detects any error of d = 0.05 with probability 0.99 (`samples_to_detect`).
"""
import numpy as np
import pytest
import torch
from scipy.stats import chi2, ncx2
from test_decoder_sampling import _chi2, _process

from decoder import verify
from decoder.guessers.draft import draft_children, fill_children
from decoder.layout import layout_for
from decoder.verify import Sampling, draw, probabilities

V = 5
N = 4700  # samples_to_detect(ERROR, 9 cells)
P_MIN = 1e-3
ERROR = 0.05  # total variation the tests must detect
SETTING = Sampling(1.5, 4, 0.85)  # top-k 4 then top-p 0.85: both cut, and their order matters here
PROMPT = (4, 1)
TARGET, DRAFT, LOOKUP = 3, 11, 29  # seeds of the world's three tables

# trees as (rank path, kind): s = drawn from the drafter's q, d = a deterministic guess
TREES = {
    "draft chain": [((0,), "s"), ((0, 0), "s")],
    "draft tree": [((0,), "s"), ((1,), "s"), ((2,), "s"), ((0, 0), "s"), ((0, 1), "s"), ((1, 0), "s")],
    "lookup chain": [((0,), "d"), ((0, 0), "d")],
    "hybrid": [((0,), "d"), ((1,), "s"), ((2,), "s"), ((0, 0), "s"), ((0, 1), "s"), ((1, 0), "d"), ((0, 0, 0), "s")],
}


def samples_to_detect(error: float, cells: int, level: float = P_MIN, power: float = 0.99) -> int:
    """The smallest n (in steps of 100) at which the chi-square test detects every law `error` away in
    total variation with probability `power`."""
    df = cells - 1
    crit = chi2.isf(level, df)
    n = 100
    while ncx2.sf(crit, df, 4 * error**2 * n) < power:
        n += 100
    return n


_memo: dict = {}


def world(seed: int, ctx: tuple) -> torch.Tensor:
    """The logits a table (target, drafter or lookup) gives after context `ctx`: fixed per context."""
    key = (seed, ctx)
    if key not in _memo:
        g = torch.Generator().manual_seed(seed * 1_000_003 + hash(ctx) % 1_000_003)
        _memo[key] = torch.randn(V, generator=g) * 1.5
    return _memo[key]


def _exact(s: Sampling) -> dict:
    """P(x1, x2) from the warped target, written independently of decoder.verify."""
    ref = dict(temperature=s.temperature, top_k=s.top_k or V, top_p=s.top_p)
    p1 = _process(world(TARGET, PROMPT), **ref)
    out = {}
    for a in range(V):
        if p1[a] > 0:
            p2 = _process(world(TARGET, PROMPT + (a,)), **ref)
            out.update({(a, b): p1[a] * p2[b] for b in range(V) if p2[b] > 0})
    return out


def nodes_with_children(tree, tok: dict):
    """Per node with children, parents first: (node, its context, its deterministic and sampled
    children, lookup's guesses for the deterministic ones). The caller fills tok[child] before the
    next node is read (a child's context holds its parents' tokens)."""
    paths = [p for p, _ in tree]
    kind = dict(tree)
    for u in [()] + paths:
        kids = sorted((p for p in paths if p[:-1] == u), key=lambda p: p[-1])
        if not kids:
            continue
        ctx = PROMPT + tuple(tok[u[:i]] for i in range(1, len(u) + 1))
        det = [p for p in kids if kind[p] == "d"]
        samp = [p for p in kids if kind[p] == "s"]
        yield u, ctx, det, samp, (world(LOOKUP, ctx).topk(len(det)).indices.tolist() if det else [])


def propose(tree, s: Sampling, gen):
    """One step's tree: tokens in layout order, q per node with sampled children, which are fixed.

    A node's deterministic children come first (lookup's guesses: the lookup table's best tokens);
    its sampled ones are drawn after them from the drafter's warped q without their tokens, and
    siblings beyond q's support are the drafter's next tokens by logit (decoder.guessers.draft.fill_children).
    (Dropping a draw equal to lookup's token instead of excluding it, as a pool merging equal paths
    would, is not wrong: the kept draws then follow q without that token all the same.)"""
    paths = [p for p, _ in tree]
    tok = {(): PROMPT[-1]}
    fixed = {(): False}
    q_rows = {}
    for u, ctx, det, samp, guesses in nodes_with_children(tree, tok):
        drawn, n_drawn = [], 0
        if samp:
            logits = world(DRAFT, ctx)
            t, q = draft_children(logits, len(samp), s, True, gen, exclude=guesses)
            drawn = t.tolist()
            q_rows[u] = q
            n_drawn = len(drawn)
            if len(drawn) < len(samp):
                have = torch.tensor(guesses + drawn, dtype=torch.long)
                drawn += fill_children(logits, have, len(samp) - len(drawn)).tolist()
        for i, p in enumerate(det):
            tok[p], fixed[p] = guesses[i], True
        for i, p in enumerate(samp):
            tok[p], fixed[p] = drawn[i], i >= n_drawn
    return paths, tok, fixed, q_rows


def first_two(tree, s: Sampling, gen) -> tuple[int, int]:
    paths, tok, fixed, q_rows = propose(tree, s, gen)
    order = [()] + paths
    ctxs = [PROMPT + tuple(tok[u[:i]] for i in range(1, len(u) + 1)) for u in order]
    logits = torch.stack([world(TARGET, c) for c in ctxs])  # [num_tree, V]: the target after each node
    tokens = torch.tensor([tok[u] for u in order])
    lay = layout_for(tuple(paths), 1 + max(p[-1] for p in paths), torch.float32, "cpu")
    q = None
    if q_rows:
        q = torch.zeros(len(order), V)
        for i, u in enumerate(order):
            if u in q_rows:
                q[i] = q_rows[u]
    det = [bool(fixed[u]) for u in order] if q is not None else None
    out = verify.verify(logits, tokens, lay, s, gen, q, det).emitted
    if len(out) < 2:  # nothing accepted: the next step is a plain one after the emitted token
        out.append(draw(probabilities(world(TARGET, PROMPT + (out[0],)), s), gen))
    return out[0], out[1]


def _p_value(tree, s: Sampling = SETTING, n: int = N, seed: int = 0) -> float:
    """The chi-square p-value of n samples against the exact law; 0 when a sample lies outside its support."""
    gen = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(n):
        key = first_two(tree, s, gen)
        counts[key] = counts.get(key, 0) + 1
    exact = _exact(s)
    if any(c not in exact for c in counts):
        return 0.0
    return _chi2(counts, exact, n)


def test_the_sample_size_detects_a_five_percent_error():
    cells = len(_exact(SETTING))
    assert cells <= 9
    assert samples_to_detect(ERROR, cells) <= N


@pytest.mark.parametrize("tree", list(TREES))
def test_the_rule_keeps_the_warped_distribution(tree):
    assert _p_value(TREES[tree]) > P_MIN


def _unwarped_target(logits, s):
    """The wrong rule: the drafter samples from its warped q, the target is only tempered."""
    return torch.softmax(logits.float() / s.temperature, dim=-1)


def _top_p_first(logits, s):
    """The wrong order: top-p on the tempered distribution, then top-k."""
    x = logits.float() / s.temperature
    x = x.masked_fill(~verify._nucleus(x, s.top_p), float("-inf"))
    kth = x.topk(s.top_k, dim=-1).values[..., -1:]
    return x.masked_fill(x < kth, float("-inf"))


# per tree, wrong rules as (what is replaced in decoder.verify, its wrong version); the lookup
# chain has no draft, so its "unwarped target" is only tempered while the warp is expected
WRONG = {
    "draft chain": [("probabilities", _unwarped_target)],
    "draft tree": [("without", lambda q, x: q), ("residual", lambda p, q: p)],
    "lookup chain": [("warp", _top_p_first)],
    "hybrid": [("residual", lambda p, q: p), ("warp", _top_p_first)],
}
N_WRONG = 1200  # each wrong rule is far off (p-values below 1e-6 here); the noncentrality grows with n,
# so a rule that fails at 1200 samples fails at N too, and the suite stays short


@pytest.mark.parametrize("tree,wrong", [(t, w) for t, ws in WRONG.items() for w, _ in ws])
def test_the_test_fails_for_a_wrong_rule(tree, wrong, monkeypatch):
    """probabilities: the drafter warps its q, the target is only tempered (warping the draft but not
    the target). warp: top-p before top-k. without: siblings verified as if drawn with replacement.
    residual: after a rejection the target's own p again (for lookup's guess: not zeroed)."""
    fn = dict(WRONG[tree])[wrong]
    monkeypatch.setattr(verify, wrong, fn)
    assert _p_value(TREES[tree], n=N_WRONG) < P_MIN


def test_the_wrong_order_is_a_different_distribution():
    """top-p before top-k changes the target's law of two tokens in this world (by 0.19 in total
    variation), so that wrong rule's failure is the order's, not chance's."""
    def law(warp_fn):
        out = {}
        p1 = warp_fn(world(TARGET, PROMPT), SETTING).softmax(-1)
        for a in range(V):
            p2 = warp_fn(world(TARGET, PROMPT + (a,)), SETTING).softmax(-1)
            out.update({(a, b): float(p1[a] * p2[b]) for b in range(V)})
        return out

    right, wrong = law(verify.warp), law(_top_p_first)
    assert 0.5 * sum(abs(right[c] - wrong[c]) for c in right) > 0.1
    exact = _exact(SETTING)
    assert all(np.isclose(right[c], exact.get(c, 0.0)) for c in right)
