"""The sampling rules end to end through `generate` with tiny transformers models: the first two
tokens follow the target's warped distribution (chi-square against exact enumeration) for prompt
lookup's chain, for a draft LM's tree whose warped q runs out of tokens (siblings filled with
deterministic guesses, a mixed tree) and for a lookup+draft per-step tree; each also fails for a
wrong rule.

These check the glue (drafting, layouts, the loop, caches) with real models, so a sample costs a
few forwards: n = 1200 here detects a law 0.075 away in total variation with probability 0.9 at
the level 1e-3 over the 4 cells top-k 2 leaves of two tokens (tests/test_sampling_rules.py
`samples_to_detect`); the rules themselves are checked to 0.05 there, where a sample costs no model.
"""
import pytest
import torch
from test_decoder_sampling import _exact_joint
from test_decoder_utils import tiny_model
from test_sampling_rules import samples_to_detect

import decoder.verify as verify
from decoder import generate
from decoder.guessers.draft import DraftModelGuesser
from decoder.guessers.lookup import PromptLookupGuesser
from planner.tree import Tree, TreeState

torch.set_num_threads(1)

VOCAB = 6
N = 1200
N_WRONG = 400  # the wrong rules here sample sequences the right law never gives: they fail at once
P_MIN = 1e-3
SETTING = dict(temperature=1.3, top_k=2, top_p=0.95)  # top-k 2: a drafter's warped q holds two tokens at most


@pytest.fixture(scope="module")
def world():
    target = tiny_model("llama", vocab=VOCAB, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)  # flatter distributions reach more branches
    draft = tiny_model("qwen2", vocab=VOCAB, seed=11)
    with torch.no_grad():
        draft.lm_head.weight.mul_(0.3)
    return target, draft


def _p_value(target, guesser, plan, prompt, n: int = N) -> tuple[float, int]:
    """Chi-square p-value of the first two tokens over n seeds, and the candidates accepted."""
    from test_decoder_sampling import _chi2

    joint = _exact_joint(target, list(prompt), 2, dict(SETTING))
    counts, accepted = {}, 0
    for seed in range(n):
        out = generate(target, torch.tensor(prompt), plan=plan, guesser=guesser, max_new_tokens=2, seed=seed, **SETTING)
        key = tuple(out.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(out.stats.accepted)
    if any(c not in joint for c in counts):
        return 0.0, accepted
    return _chi2(counts, joint, n), accepted


def test_the_sample_size_is_what_the_docstring_says(world):
    cells = len(_exact_joint(world[0], [2], 2, dict(SETTING)))
    assert cells <= 4 and samples_to_detect(0.075, cells, power=0.9) <= N


def test_prompt_lookup_keeps_the_warped_distribution(world, monkeypatch):
    target, _ = world
    prompt = (2, 3, 2)  # the root 2 was seen before, followed by 3, 2: lookup proposes that chain
    p, accepted = _p_value(target, PromptLookupGuesser(2), None, prompt)
    assert accepted > N // 10, "the test must exercise accepted guesses"
    assert p > P_MIN
    monkeypatch.setattr(verify, "probabilities", lambda logits, s: torch.softmax(logits.float() / s.temperature, -1))
    assert _p_value(target, PromptLookupGuesser(2), None, prompt, N_WRONG)[0] < P_MIN  # the target unwarped


def test_a_draft_tree_past_its_warped_support_keeps_the_distribution(world, monkeypatch):
    """Three siblings under top-k 2: the third is the drafter's next token by logit, verified as a
    deterministic guess (decoder.guessers.draft.fill_children) in a tree of sampled ones."""
    target, draft = world
    tree = Tree("sequoia", [TreeState(0, [(0,), (1,), (2,)], 1.0, 4)], 1.0)
    fixed = []
    real = verify.verify_sampled

    def spy(*a, **k):
        fixed.append(a[6] if len(a) > 6 else k.get("deterministic"))
        return real(*a, **k)

    monkeypatch.setattr(verify, "verify_sampled", spy)
    p, accepted = _p_value(target, DraftModelGuesser(draft, top_k=3), tree, (2,))
    assert any(f is not None and any(f) for f in fixed), "the fill must be exercised"
    assert accepted > N // 10 and p > P_MIN
    monkeypatch.setattr(verify, "point", lambda x, like: verify.residual(like, like))  # fill checked as p itself
    assert _p_value(target, DraftModelGuesser(draft, top_k=3), tree, (2,), N_WRONG)[0] < P_MIN


def test_a_hybrid_per_step_tree_keeps_the_distribution(world, monkeypatch):
    """lookup+draft under sampling (a dynamic plan): lookup's guess first at its node, the draft
    LM's children drawn without it; the mixed tree is verified with each sibling's own proposal."""
    from decoder.guessers.dynamic import HybridGuesser
    from planner.accept import from_entry
    from planner.dynamic_plan import plan_dynamic

    target, draft = world
    draft_acc = from_entry({"accuracy": [[0.5, 0.3, 0.2]] * 3, "guesser": {"kind": "draft", "draft_s": 0.0}}, "draft")
    lookup_acc = from_entry({"accuracy": [[0.5]] * 3, "guesser": {"kind": "lookup"}}, "lookup")
    plan = plan_dynamic([("lookup", lookup_acc), ("draft", draft_acc)], None, max_size=5, max_depth=3)
    mixed = []
    real = verify.verify_sampled

    def spy(*a, **k):
        det = a[6] if len(a) > 6 else k.get("deterministic")
        mixed.append(det is not None and any(det) and not all(det[1:]))
        return real(*a, **k)

    monkeypatch.setattr(verify, "verify_sampled", spy)
    hybrid = HybridGuesser(PromptLookupGuesser(2), DraftModelGuesser(draft, top_k=3), "draft")
    p, accepted = _p_value(target, hybrid, plan, (2, 3, 2))
    assert sum(mixed) > N // 4, "the test must exercise trees with both kinds of sibling"
    assert accepted > N // 10 and p > P_MIN
    monkeypatch.setattr(verify, "residual", lambda p, q: p)  # after a rejection, the target's own p again
    assert _p_value(target, hybrid, plan, (2, 3, 2), N_WRONG)[0] < P_MIN
