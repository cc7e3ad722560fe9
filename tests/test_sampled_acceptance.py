"""Acceptance under sampling from one teacher-forced pass (profiler/sampled.py): its parts against
exact small cases, and its prediction of the accepted tokens per step against real sampled decoding
on a tiny model, for prompt lookup (deterministic guesses) and a draft LM (sampled drafts); the
greedy measurement, which the planner used before, misses the same decoding by far more."""
import numpy as np
import pytest
import torch
from test_decoder_utils import tiny_model

from decoder import generate
from decoder.guessers.draft import DraftModelGuesser
from decoder.guessers.lookup import PromptLookupGuesser
from decoder.verify import Sampling
from profiler.acceptance import count_hits
from profiler.sampled import (
    draft_rows,
    draft_sampled_accuracy,
    replay_sampled_accuracy,
    sampled_continuations,
    sibling_shares,
    soft_counts,
)
from profiler.teacher_forced import greedy_continuations, replay_accuracy

torch.set_num_threads(1)

VOCAB = 16
DEPTH = 3
SETTING = Sampling(0.7, 0, 0.9)


def test_soft_counts_are_count_hits_when_p_is_one_hot():
    """At temperature -> 0 p is the argmax's point mass and the soft hit is the 0/1 hit."""
    g = torch.Generator().manual_seed(0)
    emitted = torch.randint(0, 4, (30,), generator=g)
    guesses = torch.randint(0, 4, (29, 3, 2), generator=g)
    guesses[::3, :, 0] = emitted[1:30:3, None]  # some rows right, so deeper distances count too
    probs = torch.nn.functional.one_hot(emitted, 4).float()
    h, t = soft_counts(guesses, emitted, probs)
    h0, t0 = count_hits(guesses, emitted)
    assert np.array_equal(t, t0) and np.allclose(h, h0)


def test_sibling_shares_exact_cases():
    p = torch.tensor([0.6, 0.3, 0.1, 0.0], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.2, 0.2], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    one = sibling_shares(p, q, 1, 0, g)
    assert one[0] == pytest.approx(0.7)  # sum min(p, q) = 1 - TV
    same = sibling_shares(p, p.clone(), 3, 200, g)
    assert same.tolist() == pytest.approx([1.0, 0.0, 0.0])
    many = sibling_shares(p, q, 4, 4000, g)
    assert many.sum() == pytest.approx(1.0, abs=0.03)  # every token drawable: some child is accepted
    short = sibling_shares(p, torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64), 3, 200, g)
    assert short.tolist() == pytest.approx([0.3, 0.0, 0.0])  # q's support is one token: no second child


def test_draft_rows_weigh_distances_by_the_chains_survival():
    shares = np.array([[0.5, 0.1], [0.4, 0.2], [1.0, 0.0]])
    hits, w = draft_rows(shares, 3)
    assert w.tolist() == [3.0, 0.5 + 0.4, 0.5 * 0.4]
    assert hits[0].tolist() == pytest.approx([1.9, 0.3])
    assert hits[1].tolist() == pytest.approx([0.5 * 0.4 + 0.4 * 1.0, 0.5 * 0.2 + 0.0])
    assert hits[2].tolist() == pytest.approx([0.2 * 1.0, 0.0])


@pytest.fixture(scope="module")
def world():
    target = tiny_model("llama", vocab=VOCAB, seed=3)  # a small vocabulary: loops that lookup can copy
    draft = tiny_model("qwen2", vocab=VOCAB, seed=11)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (8,), generator=g) for _ in range(4)]
    return target, draft, prompts


def _per_step(acc: dict) -> float:
    """Expected accepted tokens per step of a depth-DEPTH chain under the product model."""
    a = np.array(acc["accuracy"])[:DEPTH, 0]
    return float(sum(np.prod(a[:d]) for d in range(1, DEPTH + 1)))


def _decoded(target, guesser, prompts, s: Sampling) -> tuple[float, float]:
    """Mean accepted tokens per step (and its standard error) of real sampled decoding, 3 seeds."""
    acc = []
    for seed in range(1, 4):
        for ids in prompts:
            out = generate(target, ids, plan=None, guesser=guesser, max_new_tokens=64, seed=seed,
                           temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
            acc.extend(out.stats.accepted)
    return float(np.mean(acc)), float(np.std(acc) / np.sqrt(len(acc)))


def test_sampled_acceptance_predicts_sampled_decoding(world):
    target, draft, prompts = world
    cont = sampled_continuations(target, prompts, 64, SETTING, seed=0)
    greedy = greedy_continuations(target, prompts, 64)
    lookup = PromptLookupGuesser(DEPTH)
    chain = DraftModelGuesser(draft, top_k=1, depth=DEPTH)
    cases = {
        "lookup": (lookup, replay_sampled_accuracy(target, lookup, cont, DEPTH, 1),
                   replay_accuracy(target, lookup, greedy, DEPTH, 1)),
        "draft": (chain, draft_sampled_accuracy(target, chain, cont, DEPTH, 2, samples=8),
                  replay_accuracy(target, chain, greedy, DEPTH, 1)),
    }
    for name, (g, sampled, greedy_acc) in cases.items():
        assert sampled["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
        real, se = _decoded(target, g, prompts, SETTING)
        tolerance = 3 * se + 0.03
        assert abs(_per_step(sampled) - real) < tolerance, (name, _per_step(sampled), real, se)
        assert abs(_per_step(greedy_acc) - real) > tolerance, (name, _per_step(greedy_acc), real)


def test_calibration_under_sampling_scores_each_guess_with_p(world):
    """planner accept --calibrate --temperature: each observation is its guess's acceptance p(x)
    under the settings (expected hits, not 0/1 counts), p the warped distribution that drew the
    text; a drafter that samples its children is refused (its place in the tree cannot follow its
    own draw)."""
    from planner.errors import UserError
    from profiler.calibration import _drew, measure_calibration, observations

    target, draft, prompts = world
    prior = np.array([[0.2]] * DEPTH)
    doc = measure_calibration(target, PromptLookupGuesser(DEPTH), prompts, prior, max_new_tokens=48, max_depth=DEPTH,
                              sampling=SETTING)
    assert doc["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
    hits, totals = np.array(doc["hits"]), np.array(doc["totals"])
    assert totals.sum() > 50 and not np.allclose(hits, np.round(hits))  # expected hits, not counts
    out = generate(target, prompts[0], plan=None, guesser=PromptLookupGuesser(DEPTH), max_new_tokens=8, seed=3,
                   temperature=0.7, top_p=0.9)
    probs = _drew(target, prompts[0], out.tokens, SETTING)
    assert torch.allclose(probs.sum(1), torch.ones(len(out.tokens))) and probs.shape[0] == len(out.tokens)
    records = [([int(out.tokens[0])], [-1], [1], [0])]  # one node guessing the first token: its value is p(x)
    _, _, acc, _ = observations(records, out.tokens.tolist(), probs)
    assert acc[0] == pytest.approx(float(probs[0, out.tokens[0]]))
    with pytest.raises(UserError, match="samples its children"):
        measure_calibration(target, DraftModelGuesser(draft, top_k=2, depth=2), prompts[:1], prior, max_new_tokens=8,
                            sampling=SETTING)
