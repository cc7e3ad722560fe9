"""Coupled sampling (decoder/noise.py, verify_rule="coupled"): every token is drawn with Gumbel
noise keyed by the run's seed and the token's index, so a plan emits plain sampling's text.

- the rule on the tiny world of tests/test_sampling_rules.py, for every kind of tree there (draft
  children as the Gumbel top-k of the drafter's warped q, lookup's fixed guesses, a hybrid): the
  first two tokens equal plain coupled sampling's with the same seed, and follow the warped law
  (chi-square against exact enumeration, n detecting a 5 % error); wrong rules fail the same test
  (the noise keyed by the step instead of the index, top-p before top-k);
- end to end with the built-in model: lookup, a static draft LM tree, and each per-step hybrid
  (lookup+draft, lookup+parallelspec, lookup+chain) emit plain decoding's coupled text, seed by seed;
- the guesses aimed at the noise are accepted more than fixed top-k guesses where the drafter
  is the target itself.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_decoder_sampling import _chi2
from test_hybrids import ACC, _drafter, _prompts
from test_sampling_rules import (
    DRAFT,
    P_MIN,
    PROMPT,
    SETTING,
    TARGET,
    TREES,
    N,
    V,
    _exact,
    _top_p_first,
    nodes_with_children,
    world,
)

import decoder.verify as verify
from decoder import DraftModelGuesser, PromptLookupGuesser, generate
from decoder.torch_ops.draft_lm import build_draft_lm
from decoder.guessers.dynamic import HybridGuesser
from decoder.layout import layout_for
from decoder.noise import PositionNoise, noisy_top_k
from decoder.verify import Sampling, probabilities
from planner.tree import Tree, TreeState
from workflows.mainjob.candidates import dynamic_candidates

torch.set_num_threads(1)

COUPLED = Sampling(SETTING.temperature, SETTING.top_k, SETTING.top_p, "coupled")
N_WRONG = 1200


def _propose(tree, noise: PositionNoise):
    """One step's tree: lookup's fixed guesses first at a node, then the drafter's Gumbel top-k of its
    warped q with the noise of the children's index (what decoder/guessers/draft_source.py does)."""
    paths = [p for p, _ in tree]
    tok = {(): PROMPT[-1]}
    for u, ctx, det, samp, guesses in nodes_with_children(tree, tok):
        if samp:
            q = probabilities(world(DRAFT, ctx), COUPLED)
            g = noise.gumbel(noise.cursor + len(u), V)
            ranked = [x for x in noisy_top_k(q[None], g[None], V)[0].tolist() if x not in guesses]
            guesses += ranked[: len(samp)]
        for p, x in zip(det + samp, guesses):
            tok[p] = x
    return paths, tok


def coupled_first_two(tree, seed: int) -> tuple[int, int]:
    noise = PositionNoise(seed)
    noise.cursor = len(PROMPT)
    paths, tok = _propose(tree, noise)
    order = [()] + paths
    ctxs = [PROMPT + tuple(tok[u[:i]] for i in range(1, len(u) + 1)) for u in order]
    logits = torch.stack([world(TARGET, c) for c in ctxs])
    tokens = torch.tensor([tok[u] for u in order])
    lay = layout_for(tuple(paths), 1 + max(p[-1] for p in paths), torch.float32, "cpu")
    out = verify.verify(logits, tokens, lay, COUPLED, None, noise=noise).emitted
    if len(out) < 2:  # the next step: a plain one after the emitted token
        out.append(noise.draw(probabilities(world(TARGET, PROMPT + (out[0],)), COUPLED), noise.cursor + 1))
    return out[0], out[1]


def plain_first_two(seed: int) -> tuple[int, int]:
    noise = PositionNoise(seed)
    a = noise.draw(probabilities(world(TARGET, PROMPT), COUPLED), len(PROMPT))
    return a, noise.draw(probabilities(world(TARGET, PROMPT + (a,)), COUPLED), len(PROMPT) + 1)


def _p_value(tree, n: int) -> float:
    counts: dict = {}
    for seed in range(n):
        key = coupled_first_two(tree, seed)
        counts[key] = counts.get(key, 0) + 1
    exact = _exact(SETTING)
    if any(c not in exact for c in counts):
        return 0.0
    return _chi2(counts, exact, n)


@pytest.mark.parametrize("tree", list(TREES))
def test_a_coupled_step_emits_plain_samplings_tokens(tree):
    accepted = 0
    for seed in range(400):
        got = coupled_first_two(TREES[tree], seed)
        assert got == plain_first_two(seed), seed
        paths, tok = _propose(TREES[tree], _cursor(PositionNoise(seed)))
        accepted += any(len(p) == 1 and tok[p] == got[0] for p in paths)
    if any(k == "s" for _, k in TREES[tree]):  # this world's lookup table guesses outside the warped support
        assert accepted > 40, "the test must exercise accepted guesses"


def _cursor(noise):
    noise.cursor = len(PROMPT)
    return noise


@pytest.mark.parametrize("tree", list(TREES))
def test_the_coupled_rule_keeps_the_warped_distribution(tree):
    assert _p_value(TREES[tree], N) > P_MIN


def _noise_of_the_step(logits, tokens, buf, s, noise):
    """The wrong rule: every node of a step drawn with the noise of the step's first index."""
    toks = tokens.tolist()
    u, path = 0, [0]
    while True:
        y = noise.draw(probabilities(logits[u], s), noise.cursor)
        nxt = next((c for c in buf.children[u].tolist() if c >= 0 and toks[c] == y), None)
        if nxt is None:
            return verify._verdict(path, toks, y, tokens.device)
        u = nxt
        path.append(u)


@pytest.mark.parametrize("tree", ["draft chain", "hybrid"])
def test_the_test_fails_for_a_wrong_coupled_rule(tree, monkeypatch):
    monkeypatch.setattr(verify, "verify_coupled", _noise_of_the_step)
    assert _p_value(TREES[tree], N_WRONG) < P_MIN
    monkeypatch.undo()
    monkeypatch.setattr(verify, "warp", _top_p_first)
    assert _p_value(TREES[tree], N_WRONG) < P_MIN


def test_the_noise_depends_on_seed_and_index_only():
    a, b = PositionNoise(3), PositionNoise(3)
    for i in (7, 2, 7, 40):
        assert torch.equal(a.gumbel(i, 50), b.gumbel(i, 50))
    assert not torch.equal(a.gumbel(1, 50), a.gumbel(2, 50))
    assert not torch.equal(a.gumbel(1, 50), PositionNoise(4).gumbel(1, 50))


# ------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def builtin():
    from decoder.engines.hf.load import load_model

    return load_model("builtin", device="cpu", dtype="fp32").model


WARP = dict(temperature=0.8, top_k=0, top_p=0.9)


def _same_as_plain(target, guesser, plan, prompts, seeds=range(6), n=20) -> int:
    accepted = 0
    for ids in prompts:
        for seed in seeds:
            ref = generate(target, ids, max_new_tokens=n, seed=seed, verify_rule="coupled", **WARP).tokens.tolist()
            out = generate(target, ids, plan=plan, guesser=guesser, max_new_tokens=n, seed=seed, verify_rule="coupled", **WARP)
            assert out.tokens.tolist() == ref, (seed, ids.tolist())
            accepted += sum(out.stats.accepted)
    return accepted


def test_lookup_and_a_draft_tree_emit_plain_coupled_text(builtin):
    prompts = _prompts(builtin.config.vocab_size)
    assert _same_as_plain(builtin, PromptLookupGuesser(num_tokens=4), None, prompts) > 0
    torch.manual_seed(7)
    tree = Tree("medusa", [TreeState(0, [(0,), (1,), (0, 0), (0, 1), (1, 0)], 1.0, 6)], 1.0)
    _same_as_plain(builtin, DraftModelGuesser(build_draft_lm(builtin, 1), top_k=2), tree, prompts)


@pytest.mark.parametrize("drafter", ["draft", "parallelspec", "chain"])
def test_each_per_step_hybrid_emits_plain_coupled_text(builtin, drafter):
    (cand,) = dynamic_candidates(f"lookup+{drafter}", {"lookup": ACC["lookup"], drafter: ACC[drafter]}, None, max_size=8)
    g = HybridGuesser(PromptLookupGuesser(num_tokens=6), _drafter(drafter, builtin), drafter)
    assert _same_as_plain(builtin, g, cand.tree, _prompts(builtin.config.vocab_size)) > 0


def test_guesses_aimed_at_the_noise_are_accepted_more(builtin):
    """The draft LM replaced by the target itself: its Gumbel top-1 is the target's draw whenever the
    two warped distributions agree, where a fixed top-1 guess is accepted with p(x) only."""
    from decoder.guessers.draft_source import DraftSource

    (cand,) = dynamic_candidates("draft", {"draft": ACC["draft"]}, None, max_size=4)
    ids = _prompts(builtin.config.vocab_size)[0]
    aimed = _same_as_plain(builtin, DraftModelGuesser(builtin, top_k=4), cand.tree, [ids], seeds=range(4))
    real = DraftSource._children

    def fixed(self, logits, k, d):
        ctx, self.ctx = self.ctx, replace(self.ctx, noise=None)
        try:
            return real(self, logits, k, d)
        finally:
            self.ctx = ctx

    DraftSource._children = fixed
    try:
        top_k = _same_as_plain(builtin, DraftModelGuesser(builtin, top_k=4), cand.tree, [ids], seeds=range(4))
    finally:
        DraftSource._children = real
    assert aimed > 1.3 * top_k


def test_coupled_acceptance_rows_are_what_a_coupled_decode_accepts():
    """profiler.sampled.coupled_shares (a draft LM's acceptance rows under the coupled rule): a drafter
    equal to the target is always right at rank 0; otherwise each rank's share is the chance the aimed
    child is the draw, estimated against decoding it with decoder.noise directly."""
    from profiler.sampled import coupled_shares, sibling_shares

    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(40, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(40, generator=gen) * 2, -1)
    assert coupled_shares(p, p, 3, 200, gen).tolist() == [1.0, 0.0, 0.0]
    shares = coupled_shares(p, q, 3, 4000, gen)
    hits = np.zeros(3)
    for seed in range(2000):
        g = PositionNoise(seed).gumbel(5, 40)
        y = int((torch.log(p) + g).argmax())
        top = noisy_top_k(q[None], g[None], 3)[0].tolist()
        if y in top:
            hits[top.index(y)] += 1
    assert np.allclose(shares, hits / 2000, atol=0.035)
    # coupled: at most the drawn child's sum min(p, q) at rank 0 (the maximal coupling)
    assert shares[0] <= sibling_shares(p.double(), q.double(), 1, 0, gen)[0] + 0.03
