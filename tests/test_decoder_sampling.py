"""Lossless sampling: tree decoding draws from the same distribution as plain sampling."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from test_decoder_utils import static_tree, tiny_model

from decoder import PromptTokens, generate
from planner.errors import UserError

torch.set_num_threads(1)

VOCAB = 6
SETTINGS = dict(temperature=1.3, top_k=5, top_p=0.95)
N_SAMPLES = 1200
P_MIN = 1e-3  # fixed seeds make the test deterministic; a correct sampler passes at this level


def _process(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference distribution, written independently of decoder.verify: temperature, top-k, top-p."""
    z = logits.double() / temperature
    order = torch.argsort(z, descending=True)
    z_sorted = z[order]
    z_sorted[top_k:] = float("-inf")
    p_sorted = torch.softmax(z_sorted, 0)
    cum_before = torch.cumsum(p_sorted, 0) - p_sorted
    p_sorted[cum_before >= top_p] = 0
    p = torch.zeros_like(z)
    p[order] = p_sorted / p_sorted.sum()
    return p.numpy()


def _exact_joint(model, prompt: list[int], n: int, settings) -> dict:
    """P(x_1..x_n) by enumeration over all prefixes."""
    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, pr in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            p = _process(logits, **settings)
            for x in range(VOCAB):
                if p[x] > 0:
                    nxt[prefix + (x,)] = pr * p[x]
        joint = nxt
    return joint


def _chi2(counts: dict, joint: dict, n: int) -> float:
    cells = sorted(joint, key=lambda c: -joint[c])
    exp = np.array([joint[c] * n for c in cells])
    obs = np.array([counts.get(c, 0) for c in cells], dtype=float)
    assert sum(counts.get(c, 0) for c in counts if c not in joint) == 0, "sampled an impossible sequence"
    big = exp >= 5  # pool the rare cells so the chi-square approximation holds
    exp_p = np.append(exp[big], exp[~big].sum())
    obs_p = np.append(obs[big], obs[~big].sum())
    if exp_p[-1] == 0:
        exp_p, obs_p = exp_p[:-1], obs_p[:-1]
    return float(chisquare(obs_p, exp_p).pvalue)


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", vocab=VOCAB, seed=3)
    with torch.no_grad():
        m.lm_head.weight.mul_(0.5)  # softer than the helper: flatter distributions test more branches
    return m


def test_lossless_tree_sampling_matches_plain_distribution(model):
    prompt = [2]
    n_tokens = 3
    joint = _exact_joint(model, prompt, n_tokens, SETTINGS)
    tree = static_tree("medusa", 6, 2)
    guesser = PromptTokens.random(model, 2, top_k=3, seed=1)
    counts: dict = {}
    accepted = 0
    for seed in range(N_SAMPLES):
        out = generate(model, torch.tensor(prompt), plan=tree, guesser=guesser, max_new_tokens=n_tokens, seed=seed, **SETTINGS)
        key = tuple(out.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(out.stats.accepted)
    assert accepted > N_SAMPLES // 2, "the test must exercise accepted candidates"
    assert _chi2(counts, joint, N_SAMPLES) > P_MIN
    # the same test rejects a distribution that is somewhat off (T = 0.7 instead of 1.3): it can fail
    wrong = _exact_joint(model, prompt, n_tokens, dict(SETTINGS, temperature=0.7))
    assert _chi2(counts, {c: wrong.get(c, 0.0) for c in joint if wrong.get(c, 0.0) > 0}, N_SAMPLES) < P_MIN


def test_plain_sampling_matches_exact_distribution(model):
    prompt = [4, 1]
    joint = _exact_joint(model, prompt, 2, SETTINGS)
    counts: dict = {}
    for seed in range(600):
        key = tuple(generate(model, torch.tensor(prompt), max_new_tokens=2, seed=seed, **SETTINGS).tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
    assert _chi2(counts, joint, 600) > P_MIN


def test_typical_acceptance_emits_supported_tokens(model):
    tree = static_tree("medusa", 6, 2)
    guesser = PromptTokens.random(model, 2, top_k=3, seed=1)
    for seed in range(20):
        out = generate(model, torch.tensor([1, 2]), plan=tree, guesser=guesser, max_new_tokens=6, seed=seed,
                       verify_rule="typical", temperature=1.0)
        assert out.tokens.numel() == 6 and int(out.tokens.max()) < VOCAB
    # at temperature 0 every rule is greedy: asking for a sampling rule there is refused, not ignored
    for rule in ("typical", "lossless"):
        with pytest.raises(UserError, match=f"verify rule: '{rule}' samples, but temperature is 0"):
            generate(model, torch.tensor([1, 2]), plan=tree, guesser=guesser, max_new_tokens=6, verify_rule=rule)
    ref = generate(model, torch.tensor([1, 2]), max_new_tokens=6).tokens
    out = generate(model, torch.tensor([1, 2]), plan=tree, guesser=guesser, max_new_tokens=6, verify_rule="greedy")
    assert torch.equal(out.tokens, ref)
