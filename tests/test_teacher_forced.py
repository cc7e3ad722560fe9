"""Teacher-forced acceptance (profiler.teacher_forced) gives the counts of root-only decoding per
guesser (profiler.acceptance.measure_accuracy), for every kind of guesser, from one decode."""
import pytest
import torch
from test_decoder_utils import V, tiny_model

from decoder import PromptTokens
from decoder.guessers.draft import DraftModelGuesser
from decoder.guessers.lookup import PromptLookupGuesser
from decoder.guessers.parallel import ParallelDrafter, arch_of
from profiler.acceptance import measure_accuracy
from decoder.torch_ops.draft import HFDraft
from profiler.teacher_forced import draft_lm_guesses, greedy_continuations, replay_accuracy

torch.set_num_threads(1)
N = 16


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=1)


def _prompts():
    g = torch.Generator().manual_seed(3)
    out = [torch.randint(1, V, (int(t),), generator=g) for t in (5, 9, 3)]
    return out + [torch.tensor([5, 6, 7, 8] * 4)]  # a repetitive one, so lookup finds matches


def _same(a, b):
    assert a["counts"] == b["counts"] and a["totals"] == b["totals"] and a["positions"] == b["positions"]


@pytest.fixture(scope="module")
def cont(target):
    return greedy_continuations(target, _prompts(), N)


def test_ppd_rides_along_the_shared_decode(target):
    pt = PromptTokens.random(target, 3, seed=5, top_k=4)
    c = greedy_continuations(target, _prompts(), N, ppd=pt)
    _same(c.ppd, measure_accuracy(target, pt, _prompts(), max_new_tokens=N))
    plain = greedy_continuations(target, _prompts(), N)
    assert [t.tolist() for t in c.tokens] == [t.tolist() for t in plain.tokens]  # the same greedy text


@pytest.mark.parametrize("kind", ["lookup", "parallel", "chain", "draft", "draft-self"])
def test_counts_equal_root_only_decoding(target, cont, kind):
    depth, width = 3, (1 if kind == "lookup" else 3)
    if kind == "lookup":
        g = PromptLookupGuesser(num_tokens=3)
    elif kind in ("parallel", "chain"):
        torch.manual_seed(0)
        g = ParallelDrafter(arch_of(target.config), num_masks=2, top_k=3, mode=kind)
    else:  # a different drafter, and the target as its own drafter (every rank-0 guess right: deep rows counted)
        g = DraftModelGuesser(tiny_model("llama", seed=2 if kind == "draft" else 1), top_k=3, depth=3)
    want = measure_accuracy(target, g, _prompts(), max_new_tokens=N, depth=depth, width=width, allow_empty=True)
    got = replay_accuracy(target, g, cont, depth, width)
    _same(got, want)
    assert got["guesser"]["draft_s"] >= 0 and got["accuracy"] == want["accuracy"]
    if kind == "draft-self":
        assert [row[0] for row in got["accuracy"]] == [1.0, 1.0, 1.0]


def test_a_wrong_offset_is_caught(target, cont):
    """The test above can fail: shifting the drafter's rows by one position changes the counts."""
    from profiler.acceptance import count_hits

    draft = tiny_model("llama", seed=1)
    ids, toks = cont.prompts[0], cont.tokens[0]
    good = draft_lm_guesses(HFDraft(draft), ids, toks, 3, 3)
    emitted = torch.cat([ids[-1:], toks])
    h_good, _ = count_hits(good, emitted[: good.shape[0] + 1])
    h_bad, _ = count_hits(torch.roll(good, 1, dims=0), emitted[: good.shape[0] + 1])
    assert h_good[0, 0] == toks.numel() and h_bad[0, 0] < h_good[0, 0]
