"""PPD prompt-token training on a tiny random Llama (CPU): the inserted-block forward pass against
plain sequences, the loss going down, only the embeddings changing, checkpoint/resume, the CLI."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoder.guessers.prompt_tokens import PromptTokens, prompt_block_mask
from training import prompts as tp
from training.teacher import training_passes

REPO = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


def tiny_model(vocab=64, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def structured_windows(n, T, vocab=64, seed=0):
    """Windows with a learnable pattern (noisy counting), so that the teacher is not uniform noise."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    x = (start + torch.arange(T)) % vocab
    noise = torch.rand(n, T, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, (n, T), generator=g), x)


@pytest.mark.parametrize("P,E", [(3, 1), (2, 3)])
def test_inserted_blocks_equal_plain_sequences(P, E):
    """Slot (j, e) of the block after position i must equal the plain forward of
    x[0..i] followed by copies (0..j, e): positions i+1.., its ensemble chain only."""
    model = tiny_model()
    pt = tp.init_prompt_tokens(model, P, E, seed=1)
    x = torch.randint(0, 64, (2, 24))
    inserts = torch.tensor([[0, 7, 20], [3, 4, 15]])
    student, teacher = tp.prompt_forward(training_passes(model), pt.embeddings, E, x, inserts)
    assert student.shape == (2, 3, P, 64) and teacher.shape == (2, 24, 64)
    emb = model.get_input_embeddings()
    with torch.no_grad():
        assert torch.allclose(teacher, model(input_ids=x).logits, atol=1e-5)
        for b in range(2):
            for k in range(3):
                i = int(inserts[b, k])
                copies = []
                for e in range(E):
                    seq = torch.cat([emb(x[b, : i + 1]), pt.embeddings.view(P, E, -1)[:, e]])[None]
                    copies.append(model(inputs_embeds=seq).logits[0, i + 1 :])  # [P, V]
                ref = torch.stack(copies).mean(0)
                assert torch.allclose(student[b, k], ref, atol=1e-5), (b, k)


def test_insertion_mask_structure():
    inserts = torch.tensor([[2, 5]])
    P, E, T = 2, 2, 8
    mask = tp.insertion_mask(inserts, T, P, E, torch.float32)[0, 0]  # [m*P*E, T + m*P*E]
    visible = mask == 0
    S = P * E
    for k, i in enumerate([2, 5]):
        rows = slice(k * S, (k + 1) * S)
        assert visible[rows, : i + 1].all() and not visible[rows, i + 1 : T].any()
        assert torch.equal(visible[rows, T + k * S : T + (k + 1) * S], prompt_block_mask(P, E))
        other = [c for c in range(T, T + 2 * S) if not (T + k * S <= c < T + (k + 1) * S)]
        assert not visible[rows][:, other].any()


def test_sample_insertions_in_range():
    g = torch.Generator().manual_seed(0)
    pts = tp.sample_insertions(16, 20, 3, 8, g)
    assert pts.shape == (16, 8)
    assert int(pts.min()) >= 0 and int(pts.max()) <= 20 - 1 - 3
    assert all(len(set(r.tolist())) == 8 for r in pts)


def test_kl_loss_matches_manual():
    s, t = torch.randn(2, 3, 2, 5), torch.randn(2, 3, 2, 5)
    w = tp.distance_weights(2, 0.5)
    loss, per_d = tp.distill_loss(s, t, w)
    p, q = t.softmax(-1), s.softmax(-1)
    kl = (p * (p.log() - q.log())).sum(-1).mean(dim=(0, 1))
    assert torch.allclose(per_d, kl, atol=1e-6)
    assert torch.allclose(loss, kl[0] + 0.5 * kl[1], atol=1e-6)


def _fixed_loss(model, emb, E, x, inserts, P):
    with torch.no_grad():
        s, t = tp.prompt_forward(training_passes(model), emb, E, x, inserts)
        return tp.distill_loss(s, tp.teacher_targets(t, inserts, P), tp.distance_weights(P, 0.8))[0].item()


def _teach(model, windows, steps=60, lr=0.05):
    """Make the tiny model a real teacher: a few LM steps on the structured windows."""
    params = [p for p in model.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        x = windows[torch.randint(0, windows.shape[0], (8,), generator=g)]
        loss = torch.nn.functional.cross_entropy(model(input_ids=x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model


def test_training_lowers_loss_and_only_embeddings_change(tmp_path):
    # training draws from the global generator, and its float sums depend on the thread count: both fixed,
    # so the run is the same whichever test ran before it in this worker
    torch.manual_seed(0)
    torch.set_num_threads(1)
    windows = structured_windows(64, 32)
    model = _teach(tiny_model(), windows)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = tp.TrainConfig(num_prompt_tokens=3, ensemble=2, steps=40, batch_size=8, inserts=8, lr=0.05, ckpt_every=10)
    init = tp.init_prompt_tokens(model, 3, 2, cfg.seed)
    held = structured_windows(8, 32, seed=5)
    inserts = torch.arange(0, 28, 3)[None].expand(8, -1)
    loss0 = _fixed_loss(model, init.embeddings, 2, held, inserts, 3)
    result = tp.train_prompt_tokens(model, windows, tmp_path, cfg, progress=False)
    loss1 = _fixed_loss(model, result.prompt_tokens.embeddings, 2, held, inserts, 3)
    assert loss1 < 0.85 * loss0, (loss0, loss1)
    assert result.trained_parameters == 3 * 2 * 32
    assert not any(p.requires_grad for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not torch.equal(result.prompt_tokens.embeddings, init.embeddings)
    loaded = PromptTokens.load(tmp_path, model)
    assert torch.equal(loaded.embeddings, result.prompt_tokens.embeddings.detach())
    assert loaded.meta["training"]["steps"] == 40
    ev = tp.evaluate(model, loaded, held, ranks=5, stride=2)
    acc = torch.tensor(ev["accuracy"])
    assert acc.shape == (3, 5) and (acc.sum(1) <= 1 + 1e-9).all()
    # closer to the teacher on held-out windows than the initialisation: mean KL and top-5 over the
    # distances (top-1 of a 40-step run on a 64-token toy moves by a few hits: too noisy to test)
    wide = structured_windows(32, 32, seed=5)
    ev, ev0 = tp.evaluate(model, loaded, wide, ranks=5, stride=2), tp.evaluate(model, init, wide, ranks=5, stride=2)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(ev["kl"]) < 0.9 * mean(ev0["kl"]), (ev0["kl"], ev["kl"])
    assert mean(ev["top5"]) > mean(ev0["top5"]) + 0.04 and mean(ev["top5"]) > 5 / 64, (ev0["top5"], ev["top5"])


def test_evaluate_matches_brute_force():
    model = tiny_model(seed=3)
    pt = tp.init_prompt_tokens(model, 2, 1, seed=2)
    w = torch.randint(0, 64, (2, 16))
    ev = tp.evaluate(model, pt, w, ranks=4, stride=5)
    emb = model.get_input_embeddings()
    hits, n = torch.zeros(2, 4), 0
    with torch.no_grad():
        base = model(input_ids=w).logits  # [2, 16, V]
        for b in range(2):
            for i in range(0, 16 - 2, 5):
                seq = torch.cat([emb(w[b, : i + 1]), pt.embeddings])[None]
                guesses = model(inputs_embeds=seq).logits[0, i + 1 :].topk(4).indices  # [2, 4]
                for d in range(2):
                    hits[d] += (guesses[d] == base[b, i + 1 + d].argmax()).float()
                n += 1
    assert ev["count"] == n
    assert torch.allclose(torch.tensor(ev["accuracy"], dtype=torch.float64), (hits / n).double(), atol=1e-4)


def test_interrupt_then_resume_equals_uninterrupted(tmp_path, monkeypatch):
    windows = structured_windows(32, 24)
    model = tiny_model()
    cfg = tp.TrainConfig(num_prompt_tokens=2, ensemble=1, steps=8, batch_size=4, inserts=4, lr=0.05, ckpt_every=3)
    full = tp.train_prompt_tokens(model, windows, tmp_path / "full", cfg, progress=False)

    real = tp.distill_loss
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(tp, "distill_loss", flaky)
    part = tp.train_prompt_tokens(model, windows, tmp_path / "part", cfg, progress=False)
    assert part.interrupted and part.step == 5
    assert not (tmp_path / "part" / "prompt_tokens.safetensors").exists()  # nothing final written
    monkeypatch.setattr(tp, "distill_loss", real)
    resumed = tp.train_prompt_tokens(model, windows, tmp_path / "part", cfg, resume=True, progress=False)
    assert resumed.step == 8 and len(resumed.losses) == 8
    assert resumed.losses == full.losses
    assert torch.allclose(resumed.prompt_tokens.embeddings, full.prompt_tokens.embeddings, atol=1e-6)

    with pytest.raises(Exception, match="P=2, E=1"):
        tp.train_prompt_tokens(model, windows, tmp_path / "part", tp.TrainConfig(num_prompt_tokens=3, steps=9),
                               resume=True, progress=False)


def _planner(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "planner", "train-prompts", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_cli_bad_input_is_one_line():
    r = _planner("--out", "/tmp/never-written-x", "--decay", "1.5")
    assert r.returncode == 2 and r.stderr.strip() == "planner train-prompts: error: --decay: must be in (0, 1], got 1.5"
    r = _planner("--model", "/nonexistent/dir", "--out", "/tmp/never-written-x")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "nonexistent" in r.stderr


def test_cli_end_to_end(tmp_path):
    """A tiny model dir with the built-in tokenizer; train 4 steps, then resume to 6."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mdir = tmp_path / "m"
    cfg = LlamaConfig(vocab_size=4096, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(mdir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "models" / "builtin" / f, mdir / f)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"USER: question {i}? ASSISTANT: answer number {i} is here.</s>"}) + "\n"
                            for i in range(60)))
    out = tmp_path / "pt"
    common = ["--model", str(mdir), "--prompt-tokens", "2", "--batch-size", "2", "--seq-len", "32",
              "--inserts", "4", "--out", str(out), "--data", str(data), "--val-data", str(data), "--eval-windows", "2",
              "--threads", "1"]
    r = _planner(*common, "--steps", "4")
    assert r.returncode == 0, r.stderr
    first = json.loads((out / "training.json").read_text())
    assert first["steps"] == 4 and first["trained_parameters"] == 2 * 16
    r = _planner(*common, "--steps", "6", "--resume")
    assert r.returncode == 0, r.stderr
    second = json.loads((out / "training.json").read_text())
    assert second["steps"] == 6 and second["loss_curve_every_10"][0] == first["loss_curve_every_10"][0]
    from planner.accept import load_acceptance

    acc = load_acceptance(str(out / "accept_heldout.json"))
    assert acc.accuracy.shape == (2, 10)
    assert PromptTokens.load(out).num_prompt_tokens == 2
