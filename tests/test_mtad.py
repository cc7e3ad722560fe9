"""MTAD (decoder/guessers/mtad.py, planner/mtad.py): greedy identity at temperature 0, the joint rule on
synthetic tables, target sampling under an unreachable threshold (chi-square), no NaN outside the
warped support, the beam-reordered drafter cache, exact beam search, the planning model (replay,
DP vs Monte Carlo, the perplexity cap), the CLI and the benchmark's smoke mode."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from test_decoder_sampling import _chi2, _exact_joint
from test_decoder_utils import V, reference, tiny_model

from decoder import generate
from decoder.torch_ops.forward import prefill
from decoder.guessers.mtad import (
    MTADGuesser,
    MTADSession,
    beam_step,
    beam_trie,
    draft_logprobs,
    log_ratios,
    verify_joint,
    verify_joint_tree,
    warped_logprobs,
)
from decoder.verify import Sampling, probabilities
from profiler.text_quality import distinct_n, perplexity
from planner.errors import UserError
from planner.mtad import (
    IncrementLattice,
    MTADSettings,
    accepted_length,
    accepted_lengths,
    choose,
    discretise,
    expected_accepted,
    expected_accepted_iid,
    pareto_front,
    walks_from_json,
    walks_to_json,
)
from planner.profile import LatencyProfile

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, V, (t,), generator=g) for t in (1, 4, 13)]


@pytest.fixture(scope="module")
def pair():
    return tiny_model("llama", seed=1), tiny_model("qwen2", seed=2)


# ---------------------------------------------------------------------------------------------- temperature 0


@pytest.mark.parametrize("width, gamma, tau", [(1, 1, 0.1), (3, 3, 0.05), (4, 5, 1.0)])
def test_temperature_zero_is_greedy_decoding(pair, width, gamma, tau):
    """p~ is one-hot: a prefix passes iff it is all argmax, so the text is model.generate's; the
    same guesser without a threshold runs the run's rule (greedy)."""
    target, draft = pair
    joint, g = MTADGuesser(draft, width, gamma, tau_acc=tau), MTADGuesser(draft, width, gamma)
    for ids in _prompts():
        ref = reference(target, ids, 23)
        assert generate(target, ids, None, joint, 23, temperature=0, top_k=20, top_p=0.9).tokens.tolist() == ref
        assert generate(target, ids, None, g, 23).tokens.tolist() == ref


def test_a_good_drafter_is_accepted_at_temperature_zero():
    """The target as its own drafter: one beam is its greedy draft, all accepted (5 tokens per
    step); two beams propose the most likely pair of sequences' best, which greedy need not take."""
    target = tiny_model("llama", seed=1)
    ref = reference(target, _prompts()[1], 30)
    for width, steps in ((1, 6), (2, None)):
        out = generate(target, _prompts()[1], None, MTADGuesser(tiny_model("llama", seed=1), width, 4, tau_acc=0.5), 30,
                       temperature=0, top_k=20, top_p=0.9)
        assert out.tokens.tolist() == ref and (steps is None or out.steps == steps)


# ---------------------------------------------------------------------------------------------- the rule


def _chain_logits(lp_draft: list[float], next_row: dict[int, float], vocab: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [gamma + 1, vocab] (log-probabilities: temperature 1, no warp) where row j-1
    gives draft token x_j = j probability exp(lp_draft[j-1]) and the rest (almost all) to the last
    token; the last row is `next_row` ({token: prob}). Tokens: [root 0, 1, 2, .., gamma]."""
    g = len(lp_draft)
    rows = []
    for j, lp in enumerate(lp_draft, start=1):
        p = torch.full((vocab,), 1e-12, dtype=torch.float64)
        p[j] = math.exp(lp)
        p[-1] = 1 - math.exp(lp)
        rows.append(p.log())
    last = torch.full((vocab,), 1e-12, dtype=torch.float64)
    for t, pr in next_row.items():
        last[t] = pr
    rows.append(last.log())
    return torch.stack(rows).float(), torch.arange(g + 1)


def test_the_longest_passing_prefix_is_accepted_even_after_a_failure():
    """log tau = log 0.1 = -2.30; D = [-1, -2, +1.5, -5]: S = -1 pass, -3 fail, -1.5 pass, -6.5 fail -> 3."""
    D = [-1.0, -2.0, 1.5, -5.0]
    lp = [math.log(0.2), math.log(0.05), math.log(0.5), math.log(0.001)]
    lq = torch.tensor([a - d for a, d in zip(lp, D)])
    assert bool((lq <= 0).all())
    logits, tokens = _chain_logits(lp, {4: 0.001, 7: 0.999})
    s = Sampling(1.0)
    v = verify_joint(logits, tokens, lq, s, 0.1, torch.Generator().manual_seed(0))
    assert v.nodes == [0, 1, 2, 3] and v.emitted[:3] == [1, 2, 3] and v.emitted[3] in (4, 7)
    assert v.path.tolist() == [0, 1, 2, 3] and int(v.root) == v.emitted[3]
    np.testing.assert_allclose(v.log_ratios, D, atol=1e-5)
    assert accepted_length(D, 0.1) == 3
    # (a first-failure rule would stop at 1); the whole draft passes at tau 0, no prefix beyond 0 at tau 1 or inf
    assert accepted_length(D, 0.0) == 4 and accepted_length(D, 1.0) == 0 and accepted_length(D, math.inf) == 0
    assert accepted_length(D, math.exp(-1.5)) == 3 and accepted_length(D, math.exp(-1.4)) == 1
    # y is sampled from the target after the accepted prefix (row 3), not from a residual
    ys = [verify_joint(logits, tokens, lq, s, 0.1, torch.Generator().manual_seed(k)).emitted[-1] for k in range(200)]
    assert set(ys) <= {4, 7} and ys.count(7) > 190


def test_tokens_outside_the_warped_support_fail_without_nan():
    lp = [math.log(0.3), math.log(0.3), math.log(0.3)]
    logits, tokens = _chain_logits(lp, {7: 1.0})
    logits[0, 1] = -30.0  # x_1 falls out of the target's top-2
    lq = torch.tensor([-1.0, -1.0, -1.0])
    s = Sampling(1.0, top_k=2)
    for tau, accepted in ((0.5, 0), (1e-9, 0), (0.0, 3)):  # tau 0 accepts every draft, even out of support
        v = verify_joint(logits, tokens, lq, s, tau, torch.Generator().manual_seed(0))
        assert len(v.nodes) - 1 == accepted
        assert v.log_ratios[0] == -math.inf and not any(math.isnan(d) for d in v.log_ratios)
    inf = torch.tensor([-math.inf, -math.inf, 0.0, -1.0])
    assert not torch.isnan(log_ratios(inf, torch.tensor([-math.inf, -1.0, -math.inf, -2.0]))).any()
    assert accepted_lengths(np.array([[-np.inf, 5.0], [1.0, -np.inf]]), 0.5).tolist() == [0, 1]


def test_warping_matches_the_samplers_support():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g) * 3
    for s in (Sampling(1.0, 20, 0.9), Sampling(0.7), Sampling(1.3, 0, 0.8), Sampling(1.0, 5, 1.0)):
        lp = warped_logprobs(logits, s)
        p = probabilities(logits, s)
        assert torch.equal(torch.isfinite(lp), p > 0)
        torch.testing.assert_close(lp.exp(), p, atol=1e-6, rtol=1e-5)
    one_hot = warped_logprobs(logits, Sampling(0.0))
    assert torch.equal(one_hot.argmax(-1), logits.argmax(-1)) and (torch.isfinite(one_hot).sum(-1) == 1).all()
    assert torch.isfinite(draft_logprobs(logits, Sampling(0.0, 20, 0.9))).sum(-1).max() <= 20  # T=0: q~ at T=1


def test_tau_zero_accepts_every_draft(pair):
    target, draft = pair
    out = generate(target, _prompts()[2], None, MTADGuesser(draft, 2, 3, tau_acc=0.0), 24, temperature=1.0, top_k=20,
                   top_p=0.9)
    assert out.stats.accepted == [3] * out.steps and out.tokens.numel() == 24


# ---------------------------------------------------------------------------------------------- distribution

VOCAB = 6
SETTINGS = dict(temperature=1.3, top_k=5, top_p=0.95)


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_model("llama", vocab=VOCAB, seed=3)
    draft = tiny_model("qwen2", vocab=VOCAB, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)
        draft.lm_head.weight.mul_(0.3)
    return target, draft


def _counts(target, draft, tau, n, n_tokens=3):
    g = MTADGuesser(draft, 2, 2, tau_acc=tau)
    counts = {}
    for seed in range(n):
        out = generate(target, torch.tensor([2]), None, g, n_tokens, seed=seed, **SETTINGS)
        key = tuple(out.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_an_unreachable_threshold_reproduces_target_sampling(small_pair):
    """tau = inf: no prefix beyond 0 passes, so every token is y ~ p~: the target's own sampling
    (while the drafter still beam-samples and draws from the shared generator). The same test
    rejects MTAD at tau 0 (drafter beams accepted): MTAD is not lossless."""
    target, draft = small_pair
    n = 800
    joint = _exact_joint(target, [2], 3, SETTINGS)
    assert _chi2(_counts(target, draft, math.inf, n), joint, n) > 1e-3
    joint2 = _exact_joint(target, [2], 2, SETTINGS)
    counts = _counts(target, draft, 0.0, 300, n_tokens=2)
    outside = sum(k for c, k in counts.items() if c not in joint2)  # drafts the warped target never samples
    inside = {c: k for c, k in counts.items() if c in joint2}
    assert outside > 0 or _chi2(inside, joint2, sum(inside.values())) < 1e-3


@pytest.mark.parametrize("support", [0, 2])
def test_gumbel_top_w_draws_in_proportion_to_exp_score(support):
    """The first of W draws is candidate (b, v) with probability exp(score) / sum exp(score); with
    `support` (q~ keeps its top-k) only those entries are perturbed: the same law."""
    scores = torch.tensor([0.0, -0.5])
    log_q = torch.log_softmax(torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.2, -3.0]]), -1)
    if support:
        log_q = log_q.masked_fill(log_q < log_q.topk(support, -1).values[:, -1:], -math.inf).log_softmax(-1)
    cand = (scores[:, None] + log_q).reshape(-1)
    want = torch.softmax(cand.double(), 0).numpy()
    g = torch.Generator().manual_seed(0)
    firsts = np.zeros(6)
    for _ in range(3000):
        parent, token, new = beam_step(scores, log_q, 1, g, support)
        firsts[int(parent) * 3 + int(token)] += 1
        assert float(new) == pytest.approx(float(cand[int(parent) * 3 + int(token)]))
    keep = want > 0
    assert firsts[~keep].sum() == 0 and chisquare(firsts[keep], want[keep] * 3000).pvalue > 1e-3
    parent, token, new = beam_step(scores, log_q, 4, g, support)
    assert len(set(zip(parent.tolist(), token.tolist()))) == 4 and bool(torch.isfinite(new).all())  # distinct


def test_deterministic_beam_search_finds_the_most_likely_draft(small_pair):
    """W = V^2 beams over gamma 3 keep every 2-token prefix, so the best final beam is the joint
    argmax of q~ over all V^3 drafts: this fails if the cache rows do not follow their beams."""
    _, draft = small_pair
    ctx_ids = torch.tensor([3, 1, 4])
    s = Sampling(0.0)
    session = MTADGuesser(draft, VOCAB * VOCAB, 3, beams="best").begin(draft, None, ctx_ids, _ctx(s))
    prop = session.propose(ctx_ids[-1:])
    with torch.no_grad():
        best, best_lp = None, -math.inf
        for a in range(VOCAB):
            for b in range(VOCAB):
                logits = draft(torch.cat([ctx_ids, torch.tensor([a, b])])[None]).logits[0, -3:]
                lq = draft_logprobs(logits, s)
                for c in range(VOCAB):
                    lp = float(lq[0, a] + lq[1, b] + lq[2, c])
                    if lp > best_lp:
                        best, best_lp = [a, b, c], lp
    assert prop.tokens.tolist() == best
    assert float(prop.draft_logq.sum()) == pytest.approx(best_lp, abs=1e-4)


def _ctx(s: Sampling, seed: int = 0):
    from decoder.guesser import DecodeContext

    return DecodeContext(s, torch.Generator().manual_seed(seed), torch.float32, torch.device("cpu"), "test")


def _assert_cache(cache, model, text: torch.Tensor):
    want = prefill(model, text[None]).cache
    assert cache.get_seq_length() == text.numel()
    for got, ref in zip(cache.layers, want.layers):
        assert got.keys.shape[0] == 1  # one row between steps
        torch.testing.assert_close(got.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, ref.values, atol=1e-5, rtol=1e-5)


def test_the_drafter_cache_follows_the_selected_beam(pair, monkeypatch):
    """After drafting, one row equal to a prefill of the context, the root and the chosen beam's
    first gamma - 1 tokens, whose log q~ the proposal reports; after the commit, one row equal to a
    prefill of the accepted text (less what waits as unseen)."""
    target, draft = pair
    ids = _prompts()[2]
    text: list[int] = []
    checks = {"propose": 0, "commit": 0}
    propose, commit = MTADSession.propose, MTADSession.commit
    s = Sampling(1.0, 20, 0.9)

    def checked_propose(self, root):
        prop = propose(self, root)
        ctx = torch.cat([ids, torch.tensor(text, dtype=torch.long)])  # ends with the root
        x = prop.tokens
        _assert_cache(self.state.cache, draft, torch.cat([ctx, x[:-1]]))
        with torch.no_grad():
            lq = draft_logprobs(draft(torch.cat([ctx, x[:-1]])[None]).logits[0, -x.numel():], s)
        torch.testing.assert_close(prop.draft_logq.float(), lq.gather(1, x[:, None])[:, 0], atol=1e-4, rtol=1e-4)
        checks["propose"] += 1
        return prop

    def checked_commit(self, outcome):
        commit(self, outcome)
        text.extend(outcome.verdict.emitted)
        full = torch.cat([ids, torch.tensor(text, dtype=torch.long)])
        _assert_cache(self.state.cache, draft, full[: full.numel() - 1 - len(self.unseen)])
        checks["commit"] += 1

    monkeypatch.setattr(MTADSession, "propose", checked_propose)
    monkeypatch.setattr(MTADSession, "commit", checked_commit)
    accepted = 0
    for seed in range(1, 6):  # until a run accepts drafts (which run does depends on the sampler's draws)
        text.clear()
        checks.update(propose=0, commit=0)
        out = generate(target, ids, None, MTADGuesser(draft, 3, 3, beams="best", tau_acc=0.05), 30, seed=seed,
                       temperature=1.0, top_k=20, top_p=0.9)
        assert checks["propose"] == out.steps and checks["commit"] == out.steps - 1
        accepted = max(out.stats.accepted)
        if accepted >= 1:
            break
    assert accepted >= 1  # accepted drafts were exercised (unseen tokens included)


# ---------------------------------------------------------------------------------------------- all beams as one tree


def test_beam_trie_shares_prefixes_and_keeps_parents_first():
    nodes, toks, beam_nodes = beam_trie([[1, 2, 3], [1, 2, 4], [5, 6, 7], [1, 2, 3]])
    assert nodes == [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0)]
    assert toks == [1, 5, 2, 6, 3, 4, 7]
    assert beam_nodes == [[1, 3, 5], [1, 3, 6], [2, 4, 7], [1, 3, 5]]


def test_the_beam_with_the_longest_passing_prefix_wins():
    """Two beams share x_1; beam 0 (the better draft score) fails at x_2, beam 1 passes both: beam 1
    wins and y comes from after its last token. With one beam the tree rule is verify_joint."""
    Vs = 5
    s = Sampling(0.0)
    # tree: root 0, node 1 = token 2 (shared), node 2 = token 3 (beam 0), node 3 = token 4 (beam 1)
    tokens = torch.tensor([0, 2, 3, 4])
    logits = torch.full((4, Vs), -5.0)
    logits[0, 2] = logits[1, 4] = logits[3, 1] = logits[2, 0] = 5.0  # greedy: 2 then 4 then 1
    beam_nodes = torch.tensor([[1, 2], [1, 3]])
    logq = torch.zeros(2, 2)
    v = verify_joint_tree(logits, tokens, beam_nodes, logq, torch.tensor([0.0, -1.0], dtype=torch.float64), s, 0.5)
    assert v.nodes == [0, 1, 3] and v.emitted == [2, 4, 1] and v.path.tolist() == [0, 1, 3]
    one = verify_joint_tree(logits[[0, 1, 2]], tokens[[0, 1, 2]], beam_nodes[:1], logq[:1],
                            torch.zeros(1, dtype=torch.float64), s, 0.5)
    ref = verify_joint(logits[[0, 1, 2]], tokens[[0, 1, 2]], logq[0], s, 0.5)
    assert (one.nodes, one.emitted, one.log_ratios) == (ref.nodes, ref.emitted, ref.log_ratios)
    assert one.nodes == [0, 1] and one.emitted == [2, 4]  # beam 0 alone: x_1 passes, x_2 fails, y = greedy 4


def test_scoring_all_beams_accepts_at_least_the_best_beam_and_keeps_the_cache_exact(pair, monkeypatch):
    """At temperature 0 both modes are greedy decoding; the tree accepts the longest all-greedy beam,
    so never fewer tokens per step than the best-scoring beam alone. After every commit the drafter
    cache is one row equal to a prefill of the accepted text (less what waits as unseen)."""
    target, draft = pair
    ids = _prompts()[2]
    text: list[int] = []
    commit = MTADSession.commit

    def checked_commit(self, outcome):
        commit(self, outcome)
        text.extend(outcome.verdict.emitted)
        full = torch.cat([ids, torch.tensor(text, dtype=torch.long)])
        _assert_cache(self.state.cache, draft, full[: full.numel() - 1 - len(self.unseen)])

    monkeypatch.setattr(MTADSession, "commit", checked_commit)
    tree = generate(target, ids, None, MTADGuesser(draft, 4, 3, tau_acc=0.1), 30, temperature=0.0, top_k=20, top_p=0.9)
    monkeypatch.setattr(MTADSession, "commit", commit)
    best = generate(target, ids, None, MTADGuesser(draft, 4, 3, beams="best", tau_acc=0.1), 30, temperature=0.0, top_k=20,
                    top_p=0.9)
    assert tree.tokens.tolist() == best.tokens.tolist() == reference(target, ids, 30)
    assert sum(tree.stats.accepted) / tree.steps >= sum(best.stats.accepted) / best.steps
    assert max(tree.stats.input_lengths) > 4  # more than one beam was scored
    text.clear()
    monkeypatch.setattr(MTADSession, "commit", checked_commit)
    generate(target, ids, None, MTADGuesser(draft, 3, 3, tau_acc=0.05), 30, seed=1, temperature=1.0, top_k=20, top_p=0.9)


# ---------------------------------------------------------------------------------------------- planning model


def test_replayed_acceptance_equals_a_direct_count(pair):
    rng = np.random.default_rng(0)
    walks = rng.normal(-0.6, 1.0, size=(500, 5))
    walks[rng.random(walks.shape) < 0.1] = -np.inf
    for tau in (0.0, 0.05, 0.3, 0.9, 1.0):
        direct = []
        for w in walks:  # the rule written out: the last prefix whose running sum clears log tau
            s, best = 0.0, 0
            for i, d in enumerate(w, start=1):
                s += d
                if tau == 0 or s >= math.log(tau):
                    best = i
            direct.append(best)
        assert accepted_lengths(walks, tau).tolist() == direct
        for g in (1, 3, 5):
            assert expected_accepted(walks, g, tau) == pytest.approx(np.mean([accepted_length(w[:g], tau) for w in walks]))
    assert np.array_equal(walks_from_json(walks_to_json({(2, 5): walks}))[(2, 5)].round(5), walks.round(5))
    # on walks measured while decoding, the replay is exactly the decoder's own count
    target, draft = pair
    g = MTADGuesser(draft, 2, 4, tau_acc=0.3)
    out = generate(target, _prompts()[2], None, g, 40, seed=2, temperature=1.0, top_k=20, top_p=0.9)
    assert expected_accepted(np.array(g.walks), 4, 0.3) == pytest.approx(np.mean(out.stats.accepted))


def test_iid_walk_dp_matches_monte_carlo():
    lat = IncrementLattice(0.25, np.array([-6, -2, 0, 1, 3]), np.array([0.2, 0.25, 0.2, 0.15, 0.1]), dead=0.1)
    rng = np.random.default_rng(1)
    n, gamma = 200_000, 5
    steps = rng.choice(len(lat.ks) + 1, size=(n, gamma), p=np.append(lat.probs, lat.dead))
    values = np.append(lat.ks * lat.step, -np.inf)[steps]
    for tau in (0.0, 0.1, 0.45, 1.0, 1.7):
        mc = accepted_lengths(values, tau)
        dp = expected_accepted_iid(lat, gamma, tau)
        assert abs(dp - mc.mean()) < 4 * mc.std() / math.sqrt(n) + 1e-9, (tau, dp, mc.mean())
    emp = discretise(values[:, 0], 0.25)
    assert emp.dead == pytest.approx(0.1, abs=0.01) and set(emp.ks.tolist()) == set(lat.ks.tolist())


def _profile():
    n = np.arange(1, 11)
    return LatencyProfile(n, 0.030 + 0.002 * (n - 1))


def test_the_planner_respects_the_perplexity_cap():
    rng = np.random.default_rng(3)
    walks = {(w, g): rng.normal(-0.4 + 0.1 * w, 1.0, size=(300, g)) for w in (2, 4) for g in (2, 3, 4, 5)}
    draft_s = {2: 0.004, 4: 0.005}
    ppl = {}
    for w in (2, 4):
        for g in (2, 3, 4, 5):
            for t in (0.05, 0.1, 0.3, 0.9):
                ppl[MTADSettings(w, g, t)] = 10.0 * (1.0 + 0.1 * g - 0.2 * t + 0.02 * w)
    free = choose(walks, ppl, 10.0, _profile(), draft_s)
    capped = choose(walks, ppl, 10.0, _profile(), draft_s, max_perplexity_ratio=1.2)
    assert free.chosen.speedup == max(p.speedup for p in free.points)
    assert capped.chosen.perplexity_ratio <= 1.2
    assert capped.chosen.speedup == max(p.speedup for p in capped.points if p.perplexity_ratio <= 1.2)
    assert free.chosen.perplexity_ratio > 1.2  # the cap binds: the fastest point is excluded
    assert choose(walks, ppl, 10.0, _profile(), draft_s, max_perplexity_ratio=0.5).chosen is None
    front = pareto_front(free.points)
    for p in front:  # no point beats a front point on both axes
        assert not any(q.speedup > p.speedup and q.perplexity < p.perplexity for q in free.points)
    assert capped.chosen in front
    p = capped.chosen  # speed model: (E[i*] + 1) L(1) / (gamma t_d(W) + L(gamma + 1))
    e = expected_accepted(walks[(p.settings.width, p.settings.gamma)], p.settings.gamma, p.settings.tau_acc)
    step = p.settings.gamma * draft_s[p.settings.width] + 0.030 + 0.002 * p.settings.gamma
    assert p.speedup == pytest.approx((e + 1) * 0.030 / step)
    json.dumps(capped.to_json())


@pytest.mark.parametrize("spec, message", [("4,3", "expected W,GAMMA,TAU"), ("a,3,0.1", "integers W, GAMMA"),
                                           ("0,3,0.1", "W must be an integer in 1..64"),
                                           ("4,99,0.1", "GAMMA must be an integer in 1..32"),
                                           ("4,3,1.5", "TAU must be a number in [0, 1]"),
                                           ("4,3,nan", "TAU must be a number in [0, 1]")])
def test_bad_settings_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MTADSettings.parse(spec)
    assert MTADSettings.parse("4,3,0.1") == MTADSettings(4, 3, 0.1)


# ---------------------------------------------------------------------------------------------- quality


def test_quality_figures(pair):
    assert distinct_n([[1, 2, 1, 2, 1]], 2) == pytest.approx(2 / 4)
    assert distinct_n([[1, 2, 3], [1, 2, 3]], 3) == 1.0 and distinct_n([[1]], 2) is None
    target, _ = pair
    ids = _prompts()[1]
    out = reference(target, ids, 6)
    with torch.no_grad():
        logits = target(torch.cat([ids, torch.tensor(out)])[None]).logits[0, ids.numel() - 1: -1]
    lp = logits.double().log_softmax(-1).gather(1, torch.tensor(out)[:, None]).sum()
    assert perplexity(target, [ids], [out]) == pytest.approx(math.exp(-float(lp) / 6), rel=1e-5)


# ---------------------------------------------------------------------------------------------- CLI and benchmark


def test_decode_cli_writes_mtad_quality(tmp_path):
    from decoder.engines.hf.load import load_model
    from decoder.torch_ops.draft_lm import build_draft_lm, save_draft_lm
    from workflows.cli.main import main

    target = load_model("tiny", device="cpu").model
    save_draft_lm(build_draft_lm(target, 1), tmp_path / "draft")
    out = tmp_path / "out.json"
    rc = main(["decode", "--model", "tiny", "--device", "cpu", "--guesser", f"draft:{tmp_path / 'draft'}",
               "--mtad", "2,3,0.1", "--temperature", "1", "--top-k", "20", "--top-p", "0.9", "--prompt", "Hello there",
               "--prompt", "Another prompt", "--max-new-tokens", "10", "--compare-plain", "--max-perplexity-ratio", "3",
               "-o", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert doc["method"] == "mtad" and doc["mtad"] == {"width": 2, "gamma": 3, "tau_acc": 0.1, "beams": "tree",
                                                       "lossless": False}
    assert s["perplexity"] > 0 and s["plain_perplexity"] > 0 and s["draft_perplexity"] > 0
    assert s["perplexity_ratio"] == pytest.approx(s["perplexity"] / s["plain_perplexity"])
    assert isinstance(s["within_perplexity_cap"], bool) and s["tokens_per_step"] >= 1 and "speedup" in s
    assert 0 < s["distinct_2"] <= 1 and all(len(r["tokens"]) == 10 for r in doc["results"])


@pytest.mark.parametrize("extra, message", [
    (["--mtad", "2,3,0.1"], "--mtad: needs --guesser draft"),
    (["--mtad", "2,3,0.1", "--guesser", "lookup"], "--mtad: needs --guesser draft"),
    (["--mtad", "2,3", "--guesser", "draft:x"], "--mtad 2,3: expected W,GAMMA,TAU"),
    (["--mtad", "2,0,0.1", "--guesser", "draft:x"], "GAMMA must be an integer in 1..32"),
    (["--mtad", "2,3,2", "--guesser", "draft:x"], "TAU must be a number in [0, 1]"),
    (["--mtad", "2,3,0.5", "--guesser", "draft:x", "--batch-size", "2"], "--batch-size 1"),
    (["--mtad", "2,3,0.5", "--guesser", "draft:x", "--max-perplexity-ratio", "1.1"], "with --compare-plain"),
    (["--max-perplexity-ratio", "1.1"], "--max-perplexity-ratio: needs --mtad"),
])
def test_bad_mtad_options_are_one_line_errors(capsys, extra, message):
    from workflows.cli.main import main

    rc = main(["decode", "--model", "tiny", "--prompt", "x"] + extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("planner decode: error: ") and message in err and "\n" not in err


def test_bench_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_mtad.py"), "--smoke", "--threads", "1",
                        "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "smoke: ok" in r.stdout
    doc = json.loads((tmp_path / "mtad.json").read_text())
    assert {"plain", "speculative"} <= {m["method"] for m in doc["methods"]} and doc["choice"]["points"]
    assert (tmp_path / "mtad.md").is_file() and (tmp_path / "mtad.png").is_file()


def test_a_bigger_beam_tree_costs_its_measured_forward():
    """The W beams' tree costs L(measured mean size), not L(gamma + 1)."""
    from planner.mtad import predict, step_seconds

    prof = LatencyProfile(np.arange(1, 17), np.linspace(0.01, 0.04, 16))
    st = MTADSettings(4, 3, 0.1)
    chain = step_seconds(st, prof, {4: 0.002})
    tree = step_seconds(st, prof, {4: 0.002}, forward_tokens=9.0)
    assert chain == pytest.approx(3 * 0.002 + float(prof.latency(4)) + float(prof.overhead(4)))
    assert tree == pytest.approx(3 * 0.002 + float(prof.latency(9.0)) + float(prof.overhead(9.0))) and tree > chain
    walks = {(4, 3): np.zeros((5, 3))}
    assert predict(walks, st, prof, {4: 0.002}, {(4, 3): 9.0}).speedup < predict(walks, st, prof, {4: 0.002}).speedup
