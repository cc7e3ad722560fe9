"""Lossless sampling with sampled drafts (a draft model's tree, siblings drawn without replacement):
the first three generated tokens follow the target's own distribution, checked against exact
enumeration by chi-square for several trees and temperatures; the same test fails for the two
classic wrong rules (no residual after a rejection; siblings treated as drawn with replacement)."""
import pytest
import torch
from test_decoder_sampling import _chi2, _exact_joint
from test_decoder_utils import tiny_model

import decoder.verify as verify
from decoder import generate
from decoder.guessers.draft import DraftModelGuesser
from planner.tree import Tree, TreeState

torch.set_num_threads(1)

VOCAB = 6
N_SAMPLES = 800
P_MIN = 1e-3
N_WRONG = 800  # the wrong-rule checks: both wrong rules give p below 1e-13 at 800 draws here (the right
# rule 0.11), so a test of N_SAMPLES draws is shown to catch them
TREES = {
    "chain-2": [(0,), (0, 0)],
    "width-3": [(0,), (1,), (2,)],
    "tree-6": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],
}
SETTINGS = {
    "T1.3-topk5-topp.95": dict(temperature=1.3, top_k=5, top_p=0.95),
    "T0.7": dict(temperature=0.7),
}


def _tree(nodes) -> Tree:
    st = TreeState(0, list(nodes), 1.0, 1 + len(nodes))
    return Tree("sequoia", [st], 1.0)


def _draft(scale: float):
    draft = tiny_model("qwen2", vocab=VOCAB, seed=11)
    with torch.no_grad():
        draft.lm_head.weight.mul_(scale)
    return draft


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", vocab=VOCAB, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)  # flatter distributions reach more branches
    return target, _draft(0.3)  # a drafter that disagrees with the target often


def _counts(target, draft, nodes, settings, n=N_SAMPLES, prompt=(2,)):
    g = DraftModelGuesser(draft, top_k=4)
    counts, accepted = {}, 0
    for seed in range(n):
        out = generate(target, torch.tensor(prompt), plan=_tree(nodes), guesser=g, max_new_tokens=3, seed=seed, **settings)
        key = tuple(out.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(out.stats.accepted)
    return counts, accepted


# two of the six (tree, setting) pairs: the rules themselves are checked for every tree kind, fast and
# to a 5 % error, in tests/test_sampling_rules.py; these end-to-end runs check the drafting glue
@pytest.mark.parametrize("tree,setting", [("chain-2", "T0.7"), ("tree-6", "T1.3-topk5-topp.95")])
def test_sampled_draft_trees_keep_the_target_distribution(models, tree, setting):
    target, draft = models
    joint = _exact_joint(target, [2], 3, dict(dict(temperature=1.0, top_k=VOCAB, top_p=1.0), **SETTINGS[setting]))
    counts, accepted = _counts(target, draft, TREES[tree], SETTINGS[setting])
    assert accepted > N_SAMPLES // 4, "the test must exercise accepted draft tokens"
    assert _chi2(counts, joint, N_SAMPLES) > P_MIN


@pytest.fixture(scope="module")
def peaked(models):
    """A peaked drafter (removing its favourite token changes q a lot), the exact joint, and the
    right rule's p-value with it: computed once for both wrong rules."""
    target, _ = models
    draft = _draft(2.0)
    settings = SETTINGS["T1.3-topk5-topp.95"]
    joint = _exact_joint(target, [2], 3, dict(dict(top_k=VOCAB, top_p=1.0), **settings))
    counts, _ = _counts(target, draft, TREES["width-3"], settings, n=N_WRONG)
    return draft, joint, _chi2(counts, joint, N_WRONG)


@pytest.mark.parametrize("wrong", ["no residual", "with replacement"])
def test_the_test_fails_for_a_wrong_rule(models, peaked, monkeypatch, wrong):
    target, _ = models
    draft, joint, right_p = peaked
    settings = SETTINGS["T1.3-topk5-topp.95"]
    assert right_p > P_MIN  # the right rule passes with this drafter
    if wrong == "no residual":  # after a rejection keep sampling from p itself
        monkeypatch.setattr(verify, "residual", lambda p, q: p)
    else:  # the next sibling treated as a fresh draw from the same q
        monkeypatch.setattr(verify, "without", lambda q, x: q)
    counts, _ = _counts(target, draft, TREES["width-3"], settings, n=N_WRONG)
    assert _chi2(counts, joint, N_WRONG) < P_MIN


def test_greedy_draft_trees_equal_generate(models):
    from test_decoder_utils import reference

    target, draft = models
    for nodes in TREES.values():
        out = generate(target, torch.tensor([2, 5]), plan=_tree(nodes), guesser=DraftModelGuesser(draft, top_k=4),
                       max_new_tokens=12)
        assert out.tokens.tolist() == reference(target, torch.tensor([2, 5]), 12)
