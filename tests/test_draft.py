"""Draft-model and prompt-lookup guessers in the one decoding loop: greedy output equals
model.generate, the drafter's cache follows the accepted path, plan checks, typical acceptance."""
import pytest
import torch
from test_decoder_utils import V, reference, static_tree, tiny_model

from decoder import generate
from decoder.torch_ops.forward import prefill
from decoder.guessers.draft import DraftModelGuesser, DraftSession
from decoder.guessers.lookup import PromptLookupGuesser, find_continuation
from planner.errors import UserError
from planner.tree import Tree, TreeState

torch.set_num_threads(1)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, V, (t,), generator=g) for t in (1, 4, 13)]


@pytest.mark.parametrize("target_family, draft_family", [("llama", "llama"), ("llama", "qwen2"), ("qwen2", "mistral")])
@pytest.mark.parametrize("plan", [None, static_tree("medusa", 7, 3), static_tree("sequoia", 9, 3, seed=4)],
                         ids=["chain", "medusa", "sequoia"])
def test_greedy_draft_decoding_equals_generate(target_family, draft_family, plan):
    target = tiny_model(target_family, seed=1)
    draft = tiny_model(draft_family, seed=2)
    g = DraftModelGuesser(draft, top_k=4)
    for ids in _prompts():
        assert generate(target, ids, plan=plan, guesser=g, max_new_tokens=23).tokens.tolist() == reference(target, ids, 23)


def test_a_good_drafter_is_accepted():
    target = tiny_model("llama", seed=1)
    g = DraftModelGuesser(tiny_model("llama", seed=1), top_k=4, depth=5)  # the target itself
    out = generate(target, _prompts()[1], plan=None, guesser=g, max_new_tokens=30)
    assert out.steps == 5 and out.tokens.tolist() == reference(target, _prompts()[1], 30)  # 6 tokens per step


def test_drafter_cache_equals_a_prefill_of_the_accepted_text(monkeypatch):
    """After every commit the drafter's cache holds exactly the accepted tokens it has fed."""
    target = tiny_model("llama", seed=1)
    draft = tiny_model("qwen2", seed=2)
    ids = _prompts()[2]
    checks = []
    commit = DraftSession.commit

    def checked(self, outcome):
        commit(self, outcome)
        emitted.extend(outcome.verdict.emitted)
        text = torch.cat([ids, torch.tensor(emitted)])  # everything accepted so far, the new root last
        seen = text[: text.numel() - 1 - len(self.unseen)]  # all but the root and the tokens still unseen
        want = prefill(draft, seen[None]).cache
        assert self.state.cache.get_seq_length() == seen.numel()
        for got, ref in zip(self.state.cache.layers, want.layers):
            torch.testing.assert_close(got.keys, ref.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values, ref.values, atol=1e-5, rtol=1e-5)
        checks.append(len(self.unseen))

    emitted: list[int] = []
    monkeypatch.setattr(DraftSession, "commit", checked)
    out = generate(target, ids, plan=static_tree("medusa", 6, 2), guesser=DraftModelGuesser(draft, top_k=4),
                   max_new_tokens=25)
    assert out.tokens.tolist() == reference(target, ids, 25) and len(checks) == out.steps - 1


def test_plan_and_vocabulary_checks():
    from test_decoder_utils import ppd_tree

    target = tiny_model("llama", seed=1)
    g = DraftModelGuesser(tiny_model("llama", seed=2), top_k=2)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(UserError, match="ppd plan needs PPD prompt tokens"):
        generate(target, ids, plan=ppd_tree(2, [0, 3, 6]), guesser=g, max_new_tokens=4)
    with pytest.raises(UserError, match="uses rank 3, the draft guesser gives top-2"):
        generate(target, ids, plan=static_tree("medusa", 20, 4), guesser=g, max_new_tokens=4)
    gap = Tree("medusa", [TreeState(0, [(0,), (1,), (2,), (0, 1)], 1.0, 5)], 1.0)  # (0, 1) without (0, 0)
    with pytest.raises(UserError, match="contiguous sibling ranks"):
        generate(target, ids, plan=gap, guesser=DraftModelGuesser(tiny_model("llama", seed=2)), max_new_tokens=4,
                 temperature=1.0)
    other = DraftModelGuesser(tiny_model("llama", vocab=V + 1, seed=2))
    with pytest.raises(UserError, match="share the target's tokenizer"):
        generate(target, ids, plan=None, guesser=other, max_new_tokens=4)


def test_typical_acceptance_works_with_drafters():
    target = tiny_model("llama", seed=1)
    g = DraftModelGuesser(tiny_model("llama", seed=1), top_k=4)
    for seed in range(5):
        out = generate(target, torch.tensor([3, 4]), plan=static_tree("medusa", 6, 2), guesser=g, max_new_tokens=10,
                       temperature=0.8, verify_rule="typical", seed=seed)
        assert out.tokens.numel() == 10 and sum(out.stats.accepted) > 0


def test_find_continuation():
    assert find_continuation([1, 2, 3, 9, 1, 2, 3], 3, 1, 2) == [9, 1]
    assert find_continuation([5, 1, 2, 7, 1, 2], 3, 1, 4) == [7, 1, 2]  # the 2-gram (1, 2)
    assert find_continuation([4, 8, 4, 6, 4], 2, 1, 1) == [6]  # most recent occurrence of (4,)
    assert find_continuation([1, 2, 3], 3, 1, 4) == []
    assert find_continuation([7], 3, 1, 4) == []


def test_prompt_lookup_decoding_equals_generate_and_accepts_repeats():
    target = tiny_model("llama", seed=1)
    ids = torch.tensor([5, 6, 7, 8, 9] * 3)
    ref = reference(target, ids, 30)
    seq = torch.cat([ids, torch.tensor(ref)])
    out = generate(target, ids, plan=None, guesser=PromptLookupGuesser(num_tokens=4), max_new_tokens=30)
    assert out.tokens.tolist() == ref
    # the model's own output repeats itself (greedy loops on a tiny model), so lookup finds it
    loops = any(seq[i: i + 3].tolist() == seq[j: j + 3].tolist() for i in range(len(seq) - 3) for j in range(i))
    assert not loops or sum(out.stats.accepted) > 0
    with pytest.raises(UserError, match="one chain"):
        generate(target, ids, plan=static_tree("medusa", 6, 2), guesser=PromptLookupGuesser(), max_new_tokens=4)


def test_acceptance_of_drafters_is_measured_along_their_chain():
    from decoder.guessers.parallel import ParallelDrafter, arch_of
    from planner.accept import from_entry
    from planner.cost import default_guessing
    from profiler.acceptance import measure_accuracy

    target = tiny_model("llama", seed=1)
    prompts = _prompts()
    same = measure_accuracy(target, DraftModelGuesser(tiny_model("llama", seed=1), top_k=3, depth=3), prompts,
                            max_new_tokens=20)
    assert [row[0] for row in same["accuracy"]] == [1.0, 1.0, 1.0]  # the target as its own drafter
    assert same["guesser"]["draft_passes"] == "depth" and same["guesser"]["draft_s"] > 0
    g = default_guessing("sequoia", from_entry(same))
    assert (g.prompt_tokens, g.draft_passes) == (False, "depth") and g.draft_s == same["guesser"]["draft_s"]
    ps = ParallelDrafter(arch_of(target.config), num_masks=2, top_k=3)
    got = measure_accuracy(target, ps, prompts, max_new_tokens=20)
    assert len(got["accuracy"]) == 3 and got["guesser"]["draft_passes"] == "one"
    look = measure_accuracy(target, PromptLookupGuesser(num_tokens=3), [torch.tensor([5, 6, 7, 8] * 4)],
                            max_new_tokens=20, depth=3, width=1)
    assert len(look["accuracy"]) == 3 and len(look["accuracy"][0]) == 1


def test_sampled_acceptance_of_a_draft_model():
    """A drafter equal to the target has every first child accepted; another one some (profiler/sampled.py:
    sum min(p, q) and the sibling procedure; its parts are tested in tests/test_sampled_acceptance.py)."""
    from decoder.verify import Sampling
    from profiler.sampled import draft_sampled_accuracy, sampled_continuations

    target = tiny_model("llama", seed=1)
    cont = sampled_continuations(target, _prompts()[:2], 6, Sampling(1.0))
    same = draft_sampled_accuracy(target, DraftModelGuesser(tiny_model("llama", seed=1), top_k=2), cont, 1, 2, samples=4)
    assert same["accuracy"][0] == pytest.approx([1.0, 0.0]) and same["positions"] == 12
    other = draft_sampled_accuracy(target, DraftModelGuesser(tiny_model("qwen2", seed=5), top_k=3), cont, 1, 3, samples=8)
    assert 0 < other["accuracy"][0][0] < 1 and sum(other["accuracy"][0]) <= 1.0 + 1e-9


def test_chain_drafter_takes_combs_and_refuses_branching_trees():
    """The chain drafter continues its rank-0 draft only: siblings on leaves (a comb) are fine and
    decode token-identically, so its acceptance can be measured with ranks; a branch is refused."""
    from decoder.guessers.parallel import ParallelDrafter, arch_of
    from profiler.acceptance import measure_accuracy

    target = tiny_model("llama", seed=1)
    chain = ParallelDrafter(arch_of(target.config), num_masks=2, top_k=3, mode="chain")
    comb = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 2)]
    st = TreeState(0, comb, 1.0, 1 + len(comb))
    for ids in _prompts():
        out = generate(target, ids, plan=Tree("medusa", [st], 1.0), guesser=chain, max_new_tokens=16)
        assert out.tokens.tolist() == reference(target, ids, 16)
    got = measure_accuracy(target, chain, _prompts(), max_new_tokens=12, width=3)
    assert len(got["accuracy"]) == 16 and len(got["accuracy"][0]) == 3
    branch = TreeState(0, [(0,), (1,), (1, 0)], 1.0, 4)
    with pytest.raises(UserError, match="rank-0 draft only"):
        generate(target, _prompts()[0], plan=Tree("medusa", [branch], 1.0), guesser=chain, max_new_tokens=4)
