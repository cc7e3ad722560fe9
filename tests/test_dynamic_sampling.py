"""Dynamic draft-LM trees under lossless sampling keep the target's distribution: the first three
tokens against exact enumeration by chi-square (as tests/test_draft_sampling.py does for static
trees); the same test fails when the tree's arrangement follows the drawn children's own q
(best-first by draft confidence after the draws), which biases the sibling procedure."""
import pytest
import torch
from test_decoder_sampling import _chi2, _exact_joint
from test_decoder_utils import tiny_model

import decoder.guessers.draft_source as draft_sampled
from decoder import generate
from decoder.guessers.draft import DraftModelGuesser
from planner.accept import from_entry
from planner.dynamic_plan import plan_dynamic

torch.set_num_threads(1)

VOCAB = 6
N_SAMPLES = 800
P_MIN = 1e-3
N_WRONG = 800  # the shape check: the wrong arrangement gives p near 1e-48 at 800 draws here (the right one
# 0.55), so a test of N_SAMPLES draws is shown to catch it (at 400 it gave p 0.03: too few)
SETTINGS = dict(temperature=1.3, top_k=5, top_p=0.95)


def _plan():
    acc = from_entry({"accuracy": [[0.5, 0.3, 0.2]] * 3, "guesser": {"kind": "DraftModelGuesser", "draft_s": 0.0}}, "draft")
    return plan_dynamic([("draft", acc)], None, max_size=5, max_depth=3)


def _draft(scale: float):
    draft = tiny_model("qwen2", vocab=VOCAB, seed=11)
    with torch.no_grad():
        draft.lm_head.weight.mul_(scale)
    return draft


@pytest.fixture(scope="module")
def target():
    t = tiny_model("llama", vocab=VOCAB, seed=3)
    with torch.no_grad():
        t.lm_head.weight.mul_(0.5)
    return t


def _counts(target, draft, n=N_SAMPLES):
    plan, g = _plan(), DraftModelGuesser(draft, top_k=4)
    counts, accepted, sizes = {}, 0, set()
    for seed in range(n):
        out = generate(target, torch.tensor([2]), plan=plan, guesser=g, max_new_tokens=3, seed=seed, **SETTINGS)
        key = tuple(out.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(out.stats.accepted)
        sizes.update(out.stats.dynamic["sizes"])
    return counts, accepted, sizes


def test_dynamic_draft_trees_keep_the_target_distribution(target):
    joint = _exact_joint(target, [2], 3, dict(dict(top_k=VOCAB, top_p=1.0), **SETTINGS))
    counts, accepted, sizes = _counts(target, _draft(0.3))
    assert accepted > N_SAMPLES // 4, "the test must exercise accepted draft tokens"
    assert max(sizes) >= 3
    assert _chi2(counts, joint, N_SAMPLES) > P_MIN


def test_the_test_fails_when_the_shape_follows_the_draws(target, monkeypatch):
    joint = _exact_joint(target, [2], 3, dict(dict(top_k=VOCAB, top_p=1.0), **SETTINGS))
    draft = _draft(2.0)  # peaked: the draws' order and their q order differ often enough
    counts, _, _ = _counts(target, draft, N_WRONG)
    assert _chi2(counts, joint, N_WRONG) > P_MIN  # the right rule passes with this drafter
    draws = draft_sampled.draw_children

    def by_confidence(q, k, gen, exclude=()):  # EAGLE-2 style: siblings best-first by their drawn q
        return sorted(draws(q, k, gen, exclude), key=lambda x: -float(q[x]))

    monkeypatch.setattr(draft_sampled, "draw_children", by_confidence)
    counts, _, _ = _counts(target, draft, N_WRONG)
    assert _chi2(counts, joint, N_WRONG) < P_MIN
