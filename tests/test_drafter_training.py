"""Drafter training: the group-wise layout equals the inference layout, the losses fall on a toy
target, checkpoints resume, and the trained drafters decode token-identically."""
import pytest
import torch
from test_decoder_utils import V, reference, static_tree, tiny_model

from decoder import generate
from decoder.guessers.draft import DraftModelGuesser
from decoder.torch_ops.draft_lm import build_draft_lm, load_draft_model, save_draft_lm
from decoder.guessers.parallel import ParallelDrafter, arch_of, slot_mask
from training import drafters
from training.teacher import TeacherData, coverage, frequent_vocab, teacher_data

torch.set_num_threads(1)


def _windows(n=24, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, V, (n, 1), generator=g)
    x = (start + torch.arange(T)) % V  # counting: a pattern a drafter can learn
    noise = torch.rand(n, T, generator=g) < 0.1
    return torch.where(noise, torch.randint(1, V, (n, T), generator=g), x)


@pytest.fixture(scope="module")
def target():
    m = tiny_model("llama", seed=1)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    return teacher_data(target, _windows(), k=8, hidden=True, progress=False, root=tmp_path_factory.mktemp("teacher"))


def test_teacher_data_is_cached_and_matches_the_target(target, data, tmp_path_factory):
    w = data.tokens[:2]
    with torch.no_grad():
        out = target(input_ids=w, output_hidden_states=True)
    top = torch.softmax(out.logits, -1).topk(8, -1)
    assert torch.equal(data.top_ids[:2].long(), top.indices)
    torch.testing.assert_close(data.hidden[:2].float(), out.hidden_states[-1], atol=2e-3, rtol=2e-3)
    again = teacher_data(target, _windows(), k=8, hidden=True, progress=False, root=tmp_path_factory.getbasetemp() / "teacher0")
    assert torch.equal(again.top_ids, data.top_ids)  # read back from the chunk files


def test_training_layout_equals_inference_layout(target, data):
    """Mask j of the group opened by slot s: the same logits in the training batch as at inference."""
    torch.manual_seed(0)
    d = ParallelDrafter(arch_of(target.config), num_masks=3).attach(target)
    with torch.no_grad():
        d.masks.normal_(std=0.5)
    T, K = data.tokens.shape[1], 3
    starts = torch.tensor([2, 9, 15])
    pos, vis = drafters.group_layout(T, starts, K, "cpu")
    feats, tok = data.hidden[:1].float(), data.tokens[:1]
    real = d.real_inputs(feats[:, : T - 1], tok[:, 1:])
    masks = d.masks[None, None].expand(1, 3, K, -1).reshape(1, -1, feats.shape[-1])
    mask = torch.zeros(1, 1, *vis.shape).masked_fill_(~vis[None, None], torch.finfo(torch.float32).min)
    with torch.no_grad():
        train_h = d.run(torch.cat([real, masks], 1), pos[None], mask)[0]
        for g, s in enumerate(starts.tolist()):
            from transformers import DynamicCache

            cache = DynamicCache(config=d.body.config)
            d.run(real[:, :s], torch.arange(s)[None], None, cache)  # the slots before s, already in the cache
            x = torch.cat([real[:, s: s + 1], d.masks[None]], 1)  # slot s and its group
            inf_h = d.run(x, (s + torch.arange(K + 1))[None], slot_mask(1, K, s, torch.float32, "cpu"), cache)[0]
            R = T - 1
            torch.testing.assert_close(inf_h[0], train_h[s], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(inf_h[1:], train_h[R + g * K: R + (g + 1) * K], atol=1e-5, rtol=1e-5)


def test_parallel_drafter_learns_and_decodes_identically(target, data, tmp_path):
    d = ParallelDrafter(arch_of(target.config), num_masks=2, top_k=4).attach(target)
    with torch.no_grad():
        d.masks.normal_(std=0.02)
    held = data.subset(torch.arange(12))
    before = drafters.evaluate_parallel(d, held, starts_every=2)
    cfg = drafters.DrafterConfig(steps=150, batch_size=4, groups=6, lr=1e-2, ckpt_every=50)
    params = [p for p in d.parameters() if p.requires_grad]
    res = drafters.train(d, params, lambda rows, gen: drafters.parallel_loss(d, data, rows, cfg, gen), data, tmp_path,
                         cfg, progress=False)
    after = drafters.evaluate_parallel(d, held, starts_every=2)
    assert sum(res.losses[-10:]) < 0.85 * sum(res.losses[:10])
    assert sum(after["top1"]) > sum(before["top1"]) + 0.3, (before["top1"], after["top1"])  # over 3 distances
    d.save(tmp_path / "ps")
    loaded = ParallelDrafter.load(tmp_path / "ps", top_k=4)
    ids = data.tokens[5, :9]
    for mode in ("parallel", "chain"):
        loaded.mode = mode
        out = generate(target, ids, plan=None if mode == "chain" else static_tree("medusa", 6, 3), guesser=loaded,
                       max_new_tokens=20)
        assert out.tokens.tolist() == reference(target, ids, 20)


def test_interrupted_run_resumes_into_the_same_run(target, data, tmp_path):
    """Ctrl-C mid-run keeps a checkpoint; --resume replays the same batches: losses and weights equal
    an uninterrupted run's."""
    cfg = drafters.DrafterConfig(steps=8, batch_size=2, groups=4, lr=1e-3, ckpt_every=3)

    def make():
        torch.manual_seed(0)
        return ParallelDrafter(arch_of(target.config), num_masks=2, top_k=4).attach(target)

    def fit(d, out, resume=False, stop_at=None):
        calls = []

        def loss(rows, gen):
            calls.append(1)
            if stop_at is not None and len(calls) == stop_at:
                raise KeyboardInterrupt
            return drafters.parallel_loss(d, data, rows, cfg, gen)

        params = [p for p in d.parameters() if p.requires_grad]
        return drafters.train(d, params, loss, data, out, cfg, resume=resume, progress=False)

    full = make()
    r_full = fit(full, tmp_path / "a")
    cut = make()
    r_cut = fit(cut, tmp_path / "b", stop_at=6)
    assert r_cut.interrupted and r_cut.step == 5
    resumed = make()
    r_res = fit(resumed, tmp_path / "b", resume=True)
    assert r_res.step == 8 and r_res.losses == r_full.losses
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


def test_draft_lm_learns_saves_and_decodes(target, data, tmp_path):
    draft = build_draft_lm(target, 1)
    params = [p for n, p in draft.named_parameters() if n.startswith("model.layers.") or n.startswith("model.norm.")]
    for p in params:
        p.requires_grad_(True)
    head = frequent_vocab(data, 64)
    assert coverage(data, head) > 0.5
    before = drafters.evaluate_draft_lm(draft, data.subset(torch.arange(4)), ranks=4)
    cfg = drafters.DrafterConfig(steps=40, batch_size=4, lr=3e-3)
    res = drafters.train(draft, params, lambda rows, gen: drafters.draft_lm_loss(draft, head, data, rows, cfg, gen), data,
                         tmp_path, cfg, progress=False)
    after = drafters.evaluate_draft_lm(draft, data.subset(torch.arange(4)), ranks=4)
    assert sum(res.losses[-10:]) < sum(res.losses[:10]) and after["top1"] > before["top1"]
    assert not any(p.requires_grad for p in target.parameters())  # the shared embedding and head stay frozen
    save_draft_lm(draft, tmp_path / "dl")
    assert (tmp_path / "dl" / "draft_lm.safetensors").stat().st_size < 2 * sum(p.numel() for p in params) + 4096
    back = load_draft_model(tmp_path / "dl", target)
    ids = data.tokens[3, :7]
    out = generate(target, ids, plan=static_tree("sequoia", 6, 2), guesser=DraftModelGuesser(back, top_k=4),
                   max_new_tokens=15)
    assert out.tokens.tolist() == reference(target, ids, 15)


def test_teacher_subset_and_restricted_targets():
    ids = torch.tensor([[3, 5, 7]])
    p = torch.tensor([[0.5, 0.3, 0.2]])
    cols, q = drafters.restricted_targets(ids, p, torch.tensor([3, 7]), 10)
    assert cols.tolist() == [[0, 0, 1]] and torch.allclose(q, torch.tensor([[0.5 / 0.7, 0.0, 0.2 / 0.7]]))
    d = TeacherData(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4, 2, dtype=torch.int32),
                    torch.zeros(3, 4, 2, dtype=torch.float16), None)
    assert len(d.subset(torch.tensor([0, 2]))) == 2


def test_restricted_head_is_the_full_heads_columns_and_follows_the_weights(target):
    """The gathered head rows are cached: they must equal the full head's columns, and be gathered
    again when the target's head changes in place."""
    ids = torch.tensor([5, 1, 7, 3])
    d = ParallelDrafter(arch_of(target.config), num_masks=2, head_ids=ids).attach(target)
    h = torch.randn(2, 3, target.config.hidden_size)
    assert torch.allclose(d.logits(h), d.logits(h, full=True)[..., ids])
    assert torch.equal(d.token_ids(torch.tensor([0, 2])), torch.tensor([5, 7]))
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(2.0)
    try:
        assert torch.allclose(d.logits(h), d.logits(h, full=True)[..., ids])
    finally:
        with torch.no_grad():
            target.get_output_embeddings().weight.div_(2.0)  # the fixture is shared
