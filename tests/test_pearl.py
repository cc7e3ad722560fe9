"""PEARL (decoder/guessers/pearl.py) and its planning model (planner/pearl.py).

Decoder: greedy output equals model.generate for unrelated, near and identical drafters, every
prompt length 1..13, gammas 1..6, EOS and max_new_tokens inside a round; concurrent and serial
runs are identical; both caches equal from-scratch prefills after every round; sampled outputs
follow the target's distribution (chi-square against exact enumeration), and the same test fails
without the residual. Chain: an oracle drafter with known alpha visits mode A as often as pi_A
says. Planner: closed forms against a Monte Carlo simulation of the algorithm's accept/reject draws.
"""
import copy
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_decoder_sampling import _chi2, _exact_joint
from test_decoder_utils import reference, tiny_model

import decoder.guessers.pearl as pearl
from decoder.torch_ops.forward import prefill
from decoder import generate
from decoder.guessers.pearl import Pearl, split_threads
from planner.accept import from_entry
from planner.errors import UserError
from planner.pearl import (
    alpha_from_acceptance,
    alpha_from_counts,
    alpha_from_mat,
    choose_gamma,
    eta_from_times,
    predict_pearl,
    predict_sd,
    stationary,
    tau_pearl,
    tau_sd,
)
from planner.profile import LatencyProfile

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def noisy_copy(model, sigma: float, seed: int):
    """The target with relative Gaussian noise on every weight: a drafter that agrees often, not always."""
    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * sigma * p.std())
    return d.eval()


@pytest.fixture(scope="module")
def pairs():
    llama = tiny_model("llama", seed=0)
    qwen = tiny_model("qwen2", seed=2)
    return {
        "unrelated": (llama, tiny_model("qwen2", seed=1)),  # nearly every draft rejected: mode A
        "near": (llama, noisy_copy(llama, 0.1, 1)),  # both modes, B rejections
        "self": (llama, llama),  # every draft accepted: mode B
        "qwen-near": (qwen, noisy_copy(qwen, 0.2, 3)),
    }


def _prompt(n: int) -> torch.Tensor:
    return (torch.arange(1, n + 1) * 37 + 5) % 120 + 1


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("pair", ["unrelated", "near", "self", "qwen-near"])
def test_greedy_equals_generate(pairs, pair):
    target, draft = pairs[pair]
    modes = {"A": 0, "B": 0, "B-rejected": 0}
    for n in range(1, 14):  # prompt lengths 1..13, gammas cycling 1, 2, 3, 5
        gamma = (1, 2, 3, 5)[n % 4]
        out = generate(target, _prompt(n), Pearl(draft, gamma, concurrent=n % 2 == 0), max_new_tokens=16)
        assert out.tokens.tolist() == reference(target, _prompt(n), 16), (n, gamma)
        for r in out.stats.rounds:
            modes[r.mode] += 1
            modes["B-rejected"] += r.mode == "B" and r.accepted < r.checks
    ref = reference(target, _prompt(7), 24)
    for gamma in range(1, 7):
        assert generate(target, _prompt(7), Pearl(draft, gamma), max_new_tokens=24).tokens.tolist() == ref, gamma
    if pair in ("near", "qwen-near"):  # the comparison covered both modes and rejections in B
        assert modes["A"] > 10 and modes["B"] > 10 and modes["B-rejected"] > 5, modes


def test_stops_inside_a_round_at_max_new_tokens_and_eos(pairs):
    target, _ = pairs["self"]
    ids = _prompt(5)
    ref = reference(target, ids, 30)
    # self-drafting at gamma 5: A emits 1, every B round 5, so 7 tokens end inside the second B round
    out = generate(target, ids, Pearl(target, 5), max_new_tokens=7)
    assert out.tokens.tolist() == ref[:7]
    assert out.stats.rounds[-1].produced == 5 and out.stats.rounds[-1].emitted == 1
    cut = 0
    for k in range(2, 20):
        eos = ref[k]
        if eos in ref[:k]:
            continue
        for pair in ("self", "near"):
            out = generate(target, ids, Pearl(pairs[pair][1], 4), max_new_tokens=30, eos_token_id=eos)
            assert out.tokens.tolist() == reference(target, ids, 30, eos=eos) == ref[: k + 1]
            cut += out.stats.rounds[-1].produced > out.stats.rounds[-1].emitted
    assert cut >= 3  # EOS fell inside a round, not only at its end


def test_concurrent_and_serial_runs_are_identical(pairs):
    target, draft = pairs["near"]
    for seed, settings in [(0, {}), (1, dict(temperature=1.0)), (2, dict(temperature=0.8, top_k=20, top_p=0.9))]:
        a = generate(target, _prompt(6), Pearl(draft, 3, concurrent=True), max_new_tokens=40, seed=seed, **settings)
        b = generate(target, _prompt(6), Pearl(draft, 3, concurrent=False), max_new_tokens=40, seed=seed, **settings)
        assert a.tokens.tolist() == b.tokens.tolist()
        assert [(r.mode, r.accepted, r.produced) for r in a.stats.rounds] == \
               [(r.mode, r.accepted, r.produced) for r in b.stats.rounds]
    s = b.stats.summary()
    assert s["booked_s"] <= s["total_s"] and not s["concurrent"]
    sides = {(e.side, e.phase) for e in a.stats.events}
    assert {("draft", "draft"), ("target", "pre-verify"), ("target", "verify"), ("coordinator", "decide")} <= sides


def _assert_cache_equals_prefill(model, cache, ids: list[int]):
    ref = prefill(model, torch.tensor([ids])).cache
    assert cache.get_seq_length() == len(ids)
    for got, want in zip(cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("settings", [{}, dict(temperature=1.0)], ids=["greedy", "sampled"])
def test_caches_equal_prefill_after_every_round(pairs, settings):
    target, draft = pairs["near"]
    seen = {"A": 0, "B": 0}

    def check(st):
        seen[st.mode] += 1
        _assert_cache_equals_prefill(target, st.target_cache, st.accepted[:-1])  # never a rejected token
        _assert_cache_equals_prefill(draft, st.draft.cache, (st.accepted + st.pending)[:-1])

    for n, seed in ((1, 0), (5, 0), (5, 1)):  # under sampling one seed can stay in mode B: both modes must be seen
        generate(target, _prompt(n), Pearl(draft, 3, on_round=check), max_new_tokens=30, seed=seed, **settings)
    assert seen["A"] > 3 and seen["B"] > 3


class Recording(torch.nn.Module):
    """A model that records the torch thread count each of its forwards ran at."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.generation_config = model, model.config, model.generation_config
        self.seen = []

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, **kw):
        self.seen.append(torch.get_num_threads())
        return self.model(**kw)


def test_each_side_runs_at_its_own_thread_count(pairs):
    target, draft = pairs["near"]
    for split in ((2, 1), (1, 2), (1, 1)):
        for concurrent in (True, False):
            t, d = Recording(target), Recording(draft)
            generate(t, _prompt(4), Pearl(d, 3, threads=split, concurrent=concurrent), max_new_tokens=12)
            assert (set(t.seen), set(d.seen)) == ({split[0]}, {split[1]}), (split, concurrent)
    assert torch.get_num_threads() == 1  # the caller's count is restored


def test_bad_arguments_are_one_line_errors(pairs):
    target, draft = pairs["near"]
    for kw, more, msg in [(dict(gamma=0), {}, "gamma"), (dict(gamma=2), dict(max_new_tokens=600), "positions"),
                          (dict(gamma=2, threads=(1, 0)), {}, "threads")]:
        with pytest.raises(UserError, match=msg):
            generate(target, _prompt(3), Pearl(draft, **kw), **more)
    with pytest.raises(UserError, match="vocabulary"):
        generate(target, _prompt(3), Pearl(tiny_model("llama", vocab=64), 2))
    assert split_threads(2) == (1, 1) and split_threads(3) == (2, 1) and split_threads(1) == (1, 1)


# ---------------------------------------------------------------------------------------------- sampling

VOCAB = 6
N_SAMPLES = 800
P_MIN = 1e-3
N_WRONG = 800  # the no-residual check: p near 1e-25 at 800 draws here (the right rule 0.37), so
# a test of N_SAMPLES draws is shown to catch it
SETTINGS = dict(temperature=1.3, top_k=5, top_p=0.95)


@pytest.fixture(scope="module")
def small():
    target = tiny_model("llama", vocab=VOCAB, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)  # flatter distributions reach more branches
    return target


def _draft(scale: float):
    draft = tiny_model("qwen2", vocab=VOCAB, seed=11)
    with torch.no_grad():
        draft.lm_head.weight.mul_(scale)
    return draft


def _counts(target, draft, gamma: int, concurrent: bool, n: int = N_SAMPLES):
    counts, modes = {}, {"A": 0, "B": 0, "accepted": 0}
    for seed in range(n):
        out = generate(target, torch.tensor([2]), Pearl(draft, gamma, concurrent=concurrent), max_new_tokens=3, seed=seed,
                       **SETTINGS)
        key = tuple(out.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        for r in out.stats.rounds:
            modes[r.mode] += 1
            modes["accepted"] += r.accepted
    return counts, modes


def test_sampling_keeps_the_target_distribution(small):
    joint = _exact_joint(small, [2], 3, SETTINGS)
    counts, modes = _counts(small, _draft(0.3), 2, True)
    assert modes["B"] > N_SAMPLES // 4 and modes["accepted"] > N_SAMPLES // 2, modes  # both modes exercised
    assert _chi2(counts, joint, N_SAMPLES) > P_MIN


def test_the_sampling_test_fails_without_the_residual(small, monkeypatch):
    draft = _draft(2.0)  # a peaked drafter: p and p - q differ a lot
    joint = _exact_joint(small, [2], 3, SETTINGS)
    counts, modes = _counts(small, draft, 1, False, N_WRONG)  # gamma 1, serial
    assert modes["B"] > N_WRONG // 4
    assert _chi2(counts, joint, N_WRONG) > P_MIN  # the real rule passes with this drafter
    monkeypatch.setattr(pearl, "residual", lambda p, q: p)  # after a rejection, sample p itself
    counts, _ = _counts(small, draft, 1, False, N_WRONG)
    assert _chi2(counts, joint, N_WRONG) < P_MIN


# ---------------------------------------------------------------------------------------------- the chain


class OracleDrafter(torch.nn.Module):
    """The target's greedy token with probability alpha, else its runner-up (always rejected), drawn
    independently per forward: the i.i.d. acceptance the planning model assumes."""

    def __init__(self, model, alpha: float, seed: int):
        super().__init__()
        self.model, self.alpha = model, alpha
        self.config = model.config
        self.gen = torch.Generator().manual_seed(seed)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, input_ids, **kw):
        logits = self.model(input_ids=input_ids, **kw).logits.clone()  # [1, n, V]
        wrong = torch.rand(logits.shape[:-1], generator=self.gen) >= self.alpha  # [1, n]
        second = torch.nn.functional.one_hot(logits.topk(2, dim=-1).indices[..., 1], logits.shape[-1]).bool()
        return SimpleNamespace(logits=logits.masked_fill(second & wrong[..., None], float(logits.max()) + 1.0),
                               hidden_states=None)


def _chain_fraction_sd(alpha: float, gamma: int, rounds: int) -> float:
    """Asymptotic sd of the fraction of rounds in A: a two-state chain with second eigenvalue
    lam = 1 - P(A->B) - P(B->A) = alpha^gamma - alpha has variance pi_A pi_B (1 + lam) / ((1 - lam) n)."""
    pi_a, pi_b = stationary(alpha, gamma)
    lam = alpha ** gamma - alpha
    return float(np.sqrt(pi_a * pi_b * (1 + lam) / ((1 - lam) * rounds)))


def test_mode_a_frequency_matches_pi_a_on_an_oracle_drafter(pairs):
    target, _ = pairs["near"]
    alpha, gamma = 0.7, 3
    rounds, a_rounds, tokens, acc, rej = 0, 0, 0, 0, 0
    for seed in range(3):
        out = generate(target, _prompt(3 + seed), Pearl(OracleDrafter(target, alpha, seed), gamma), max_new_tokens=450)
        assert out.tokens.tolist() == reference(target, _prompt(3 + seed), 450)
        s = out.stats.summary()
        rounds += s["rounds"] - 1  # the last round is cut by max_new_tokens
        a_rounds += s["mode_a"] - (out.stats.rounds[-1].mode == "A")
        tokens += sum(r.produced for r in out.stats.rounds[:-1])
        acc, rej = acc + s["accepted"], rej + s["rejected"]
    pi_a, _ = stationary(alpha, gamma)
    sd = _chain_fraction_sd(alpha, gamma, rounds)
    assert abs(a_rounds / rounds - pi_a) < 4 * sd, (a_rounds / rounds, pi_a, sd)
    assert abs(tokens / rounds / tau_pearl(alpha, gamma) - 1) < 0.07
    assert abs(alpha_from_counts(acc, rej) - alpha) < 0.04
    # alpha = 1 (the target drafts for itself): after the first round, B forever; gamma tokens a round
    out = generate(target, _prompt(4), Pearl(target, gamma), max_new_tokens=61)
    assert [r.mode for r in out.stats.rounds] == ["A"] + ["B"] * 20 and stationary(1.0, gamma) == (0.0, 1.0)


# ---------------------------------------------------------------------------------------------- planning model


def simulate(alpha: float, gamma: int, rounds: int, seed: int) -> tuple[float, float, float]:
    """The algorithm's accept/reject draws, round by round: (fraction of rounds in A, tokens per
    round, tokens per SD step with the same draws)."""
    rng = np.random.default_rng(seed)
    mode, in_a, tokens = "A", 0, 0
    for _ in range(rounds):
        checks = 1 if mode == "A" else gamma
        ok = rng.random(checks) < alpha
        i = int(np.argmin(ok)) if not ok.all() else checks  # accepted before the first rejection
        in_a += mode == "A"
        tokens += checks if i == checks else i + 1
        mode = "B" if i == checks else "A"
    draws = rng.random((rounds, gamma)) < alpha  # SD: gamma drafts, accepted prefix + 1
    sd_tokens = (np.cumprod(draws, axis=1).sum(axis=1) + 1).mean()
    return in_a / rounds, tokens / rounds, float(sd_tokens)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_closed_forms_match_monte_carlo(alpha, gamma):
    n = 40_000
    frac_a, tau, sd_tau = simulate(alpha, gamma, n, seed=gamma)
    pi_a, pi_b = stationary(alpha, gamma)
    assert pi_a + pi_b == pytest.approx(1.0)
    assert abs(frac_a - pi_a) < 4 * _chain_fraction_sd(alpha, gamma, n) + 2.0 / n  # + the first round, always A
    assert tau == pytest.approx(tau_pearl(alpha, gamma), rel=0.02)
    assert sd_tau == pytest.approx(tau_sd(alpha, gamma), rel=0.02)
    closed = (1 - alpha ** gamma) / ((1 - alpha) * (1 + alpha - alpha ** gamma)) if alpha < 1 else gamma
    assert tau_pearl(alpha, gamma) == pytest.approx(closed)


def _profile(l1: float, per_token: float) -> LatencyProfile:
    n = np.arange(1, 17)
    return LatencyProfile(n, l1 + per_token * (n - 1))


def test_round_times_speedup_and_gamma_choice():
    prof = _profile(0.030, 0.002)  # L(n) = 30 ms + 2 ms per extra token
    p = predict_pearl(0.8, 4, 0.006, prof, eta=1.0)
    assert p.round_a_s == pytest.approx(max(4 * 0.006, 0.030)) and p.round_b_s == pytest.approx(max(0.024, 0.036))
    assert p.speedup == pytest.approx(p.tokens_per_round * 0.030 / (p.pi_a * p.round_a_s + p.pi_b * p.round_b_s))
    serial = predict_pearl(0.8, 4, 0.006, prof, eta=0.0)  # no overlap: both jobs one after the other
    assert serial.round_b_s == pytest.approx(0.024 + 0.036) and serial.speedup < p.speedup
    sd = predict_sd(0.8, 4, 0.006, prof)
    assert sd.step_s == pytest.approx(0.024 + 0.038)  # gamma t_d + L(gamma + 1) and sd.tokens_per_step == pytest.approx(tau_sd(0.8, 4))
    choice = choose_gamma(0.8, 0.006, prof, eta=1.0, gammas=range(1, 11))
    assert choice.c == pytest.approx(5.0) and choice.paper_gamma == 5
    assert choice.gamma == max(choice.predictions, key=lambda q: q.speedup).gamma
    assert choose_gamma(0.99, 0.006, prof, gammas=range(1, 11)).gamma > choose_gamma(0.3, 0.006, prof, gammas=range(1, 11)).gamma
    assert eta_from_times(0.02, 0.03, 0.03) == 1.0 and eta_from_times(0.02, 0.03, 0.05) == 0.0
    assert eta_from_times(0.02, 0.03, 0.04) == pytest.approx(0.5)
    with pytest.raises(UserError, match="alpha"):
        stationary(1.5, 2)


def test_alpha_from_an_acceptance_file_and_from_mat():
    acc = from_entry({"accuracy": [[0.8, 0.1], [0.6, 0.1], [0.7, 0.0], [0.0, 0.0]]})
    assert alpha_from_acceptance(acc) == pytest.approx(0.7)  # mean over distances; the undefined 0 is left out
    assert alpha_from_acceptance(acc, "first") == pytest.approx(0.8)
    assert alpha_from_acceptance(acc, "geometric") == pytest.approx((0.8 * 0.6 * 0.7) ** (1 / 3))
    assert alpha_from_mat(27.95) == pytest.approx(0.9655, abs=1e-4)
    assert predict_pearl(alpha_from_mat(3.0), 2, 0.01, _profile(0.03, 0.0)).mean_accepted_run == pytest.approx(3.0)


# ---------------------------------------------------------------------------------------------- command and bench


def test_decode_pearl_command(tmp_path, capsys):
    from decoder.engines.hf.load import load_model
    from decoder.torch_ops.draft_lm import build_draft_lm, save_draft_lm
    from workflows.cli.main import main

    save_draft_lm(build_draft_lm(load_model("tiny", device="cpu").model, 1), tmp_path / "draft")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["Hello there"]}\n{"text": "Another prompt"}\n')
    out = tmp_path / "out.json"
    base = ["decode", "--model", "tiny", "--prompts", str(prompts), "--max-new-tokens", "10", "--no-progress"]
    for serial in ([], ["--pearl-serial"]):
        rc = main(base + ["--guesser", f"draft:{tmp_path / 'draft'}", "--pearl", "--gamma", "3", "--compare-plain",
                          "-o", str(out)] + serial)
        assert rc == 0
        s = json.loads(out.read_text())["summary"]
        assert s["identical_to_plain"] is True and s["rounds"] == s["steps"] == s["mode_a"] + s["mode_b"]
        assert s["mean_tokens_per_round"] == pytest.approx(s["tokens_per_step"]) and "speedup" in s
    capsys.readouterr()
    assert main(base + ["--guesser", "lookup", "--pearl"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--pearl: needs --guesser draft" in err and "\n" not in err


def test_bench_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_pearl.py"), "--smoke", "--threads", "1",
                        "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "smoke: ok" in r.stdout
    doc = json.loads((tmp_path / "pearl.json").read_text())
    assert all(row["identical_to_plain"] for row in doc["runs"]) and (tmp_path / "pearl.png").is_file()


def test_thread_splits_worth_measuring():
    from profiler.overlap import pearl_splits

    assert pearl_splits(1) == [(1, 1)] and pearl_splits(2) == [(1, 1)]
    assert pearl_splits(4) == [(3, 1), (2, 2)] and pearl_splits(5) == [(4, 1), (3, 2)]
    assert all(a + b == 16 for a, b in pearl_splits(16))
