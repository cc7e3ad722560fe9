"""Batched decoding: every sequence's output equals decoding it alone (and model.generate), in the
packed (EMS-SD) and padded layouts, with several guessers, sequences ending at different steps,
a tree schedule by batch size; padding is counted; sampling stays lossless per sequence."""
import pytest
import torch
from test_decoder_utils import V, ppd_tree, reference, static_tree, tiny_model

from decoder import DraftModelGuesser, PromptLookupGuesser, PromptTokens, generate
from decoder.engines.hf.batch import PackedSegments, packed_attention_forward
from planner.tree import ScheduleEntry

torch.set_num_threads(1)


def _prompts(lengths=(1, 5, 9, 3, 14)):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, V, (t,), generator=g) for t in lengths]


def _noisy_copy(scale: float = 0.6):
    draft = tiny_model("llama", seed=1)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * w.std() * scale)
    return draft


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("kind", ["ppd", "ppd-static", "draft", "lookup"])
def test_each_sequence_equals_generate(model, layout, kind):
    prompts = _prompts()
    if kind == "ppd":
        plan, g = ppd_tree(3, [0, 4, 10, 16], seed=3), PromptTokens.random(model, 3, ensemble=2, top_k=4)
    elif kind == "ppd-static":
        plan, g = static_tree("medusa", 6, 2), PromptTokens.random(model, 2, top_k=4)
    elif kind == "draft":  # a noisy copy of the target: accepted paths of different lengths per sequence
        plan, g = static_tree("sequoia", 7, 3, seed=2), DraftModelGuesser(_noisy_copy(), top_k=4)
    else:
        plan, g = None, PromptLookupGuesser(num_tokens=3)
    outs = generate(model, prompts, plan=plan, guesser=g, max_new_tokens=17, layout=layout)
    for o, p in zip(outs, prompts):
        assert o.tokens.tolist() == reference(model, p, 17)
    stats = outs[0].batch.summary()
    assert stats["layout"] == layout and stats["steps"] == max(o.steps for o in outs)
    if layout == "packed":
        assert stats["padded_input_tokens"] == 0 and stats["cache_holes"] == 0
    if kind == "draft":
        assert sum(sum(o.stats.accepted) for o in outs) > 20
        if layout == "padded":
            assert stats["cache_holes"] > 0  # sequences accept different lengths: the vanilla layout pads


def test_sequences_that_end_early_leave_without_stalling_the_others(model):
    prompts = _prompts((4, 6, 2))
    ref = [reference(model, p, 30) for p in prompts]
    eos = ref[1][5]  # ends sequence 1 early (and any other that produces it)
    want = [reference(model, p, 30, eos=eos) for p in prompts]
    g = DraftModelGuesser(tiny_model("llama", seed=1), top_k=4)
    for layout in ("packed", "padded"):
        outs = generate(model, prompts, plan=None, guesser=g, max_new_tokens=30, eos_token_id=eos, layout=layout)
        assert [o.tokens.tolist() for o in outs] == want
        assert outs[0].batch.batch_sizes[0] == 3 and outs[0].batch.batch_sizes[-1] < 3


def test_schedule_picks_the_tree_for_the_live_batch_size(model):
    big, small = ppd_tree(2, [0, 3, 8], seed=1), ppd_tree(2, [0, 1, 2], seed=2)
    plan = ppd_tree(2, [0, 3, 8], seed=1)
    plan.schedule = [ScheduleEntry((1, 2), big), ScheduleEntry((3, 8), small), ScheduleEntry((9, 1 << 20), None)]
    prompts = _prompts((3, 8, 2, 11))
    eos = 51  # ends sequences 0 and 2 within four tokens (the tiny model loops on it); 1 and 3 never produce it
    pt = PromptTokens.random(model, 2, top_k=4)
    outs = generate(model, prompts, plan=plan, guesser=pt, max_new_tokens=20, layout="packed", eos_token_id=eos)
    for o, p in zip(outs, prompts):
        assert o.tokens.tolist() == reference(model, p, 20, eos=eos)
    assert outs[0].batch.batch_sizes[0] == 4 and 2 in outs[0].batch.batch_sizes
    late = outs[1].stats.planned_input_lengths[-5:]  # after the batch shrank to 2: `big`'s states
    assert max(late) > max(st.input_length for st in small.states)


def test_packed_attention_equals_each_sequence_alone():
    torch.manual_seed(0)
    H, d = 4, 8
    spans, lengths = [(0, 5), (5, 3)], [2, 3]
    blocks = [torch.tensor([[0.0, -1e9], [0.0, 0.0]]), torch.zeros(3, 3).masked_fill(torch.triu(torch.ones(3, 3), 1) > 0, -1e9)]
    q = torch.randn(1, H, 5, d)
    k = torch.randn(1, 2, 8 + 5, d)
    v = torch.randn(1, 2, 8 + 5, d)
    out, _ = packed_attention_forward(None, q, k, v, None, 0.5, packed_segments=PackedSegments(spans, lengths, blocks, 8))
    for i, ((a, n_ctx), n, blk) in enumerate(zip(spans, lengths, blocks)):
        q0 = sum(lengths[:i])
        kk = torch.cat([k[:, :, a: a + n_ctx], k[:, :, 8 + q0: 8 + q0 + n]], 2).repeat_interleave(2, 1)
        vv = torch.cat([v[:, :, a: a + n_ctx], v[:, :, 8 + q0: 8 + q0 + n]], 2).repeat_interleave(2, 1)
        s = (q[:, :, q0: q0 + n] @ kk.transpose(-1, -2)) * 0.5
        s[..., n_ctx:] += blk
        want = (s.softmax(-1) @ vv).transpose(1, 2)
        torch.testing.assert_close(out[:, q0: q0 + n], want, atol=1e-5, rtol=1e-5)


def test_batched_sampling_is_lossless_per_sequence():
    """Each sequence of a sampled batch follows the target's distribution (chi-square against exact
    enumeration, as the single-sequence test), in both layouts."""
    from test_decoder_sampling import _chi2, _exact_joint

    vocab = 6
    m = tiny_model("llama", vocab=vocab, seed=3)
    with torch.no_grad():
        m.lm_head.weight.mul_(0.5)
    settings = dict(temperature=1.3, top_k=5, top_p=0.95)
    joint = _exact_joint(m, [2], 2, settings)
    pt = PromptTokens.random(m, 2, top_k=3, seed=1)
    for layout in ("packed", "padded"):
        counts = {}
        for seed in range(400):
            outs = generate(m, [torch.tensor([2]), torch.tensor([2])], plan=static_tree("medusa", 6, 2), guesser=pt,
                            max_new_tokens=2, seed=seed * 2, layout=layout, **settings)
            for o in outs:
                key = tuple(o.tokens.tolist())
                counts[key] = counts.get(key, 0) + 1
        assert _chi2(counts, joint, 800) > 1e-3
