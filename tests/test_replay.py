"""Replaying a decode over the known greedy text (profiler/replay.py) gives the steps decoding takes:
per step the accepted length, for static trees and per-step plans of every guesser kind; the
calibration by replay (profiler/calibration_replay.py) collects the observations decoding does;
autotune's prediction phase prices the replayed steps and keeps the cost model beside it."""
import math

import numpy as np
import pytest
import torch
from test_decoder_utils import static_tree, tiny_model
from test_dynamic import ACC, _guesser, _profile, _prompts

from decoder import generate
from decoder.guessers.dynamic import HybridGuesser
from decoder.guessers.lookup import PromptLookupGuesser
from planner.dynamic_plan import plan_dynamic
from profiler.calibration import measure_calibration
from profiler.calibration_replay import calibrate_by_replay
from profiler.replay import PPDCapture, Rows, replay_plan, teachers
from profiler.teacher_forced import greedy_continuations

torch.set_num_threads(1)
N = 21


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=1)


def _teachers(target, hidden, ppd=None):
    capture = PPDCapture(ppd) if ppd is not None else None
    cont = greedy_continuations(target, _prompts(), N, ppd=capture)
    return teachers(target, cont, hidden, capture)


def _decoded_accepted(target, plan, g, ids):
    """Accepted candidates per step but the last: there decoding may accept a guess whose bonus token
    lies past max_new_tokens (the loop cuts it), which the text cannot tell, and the step count."""
    out = generate(target, ids, plan=plan, guesser=g, max_new_tokens=N)
    return list(out.stats.accepted[:-1]), out.steps


def _replayed(steps):
    return [s.accepted for s in steps[:-1]], len(steps)


def test_rows_keep_softmax_and_top_k():
    logits = torch.randn(5, 300)
    r = Rows.of(logits, keep=16)
    back = r.restore(range(5))
    assert torch.equal(back.topk(16).indices, logits.topk(16).indices)
    assert torch.allclose(torch.logsumexp(back, -1), torch.logsumexp(logits, -1), atol=1e-4)
    assert torch.allclose(back.softmax(-1).topk(4).values, logits.softmax(-1).topk(4).values, atol=1e-6)


@pytest.mark.parametrize("kind", ["lookup", "parallelspec", "chain", "lookup+parallelspec", "lookup+chain",
                                  "draft", "ppd"])
def test_replayed_dynamic_steps_equal_decoding(target, kind):
    kinds = kind.split("+")
    plan = plan_dynamic([(k, ACC[k]) for k in kinds], _profile(), max_size=8, max_depth=5)
    gs = [_guesser(k, target, "llama") for k in kinds]
    g = gs[0] if len(gs) == 1 else HybridGuesser(gs[0], gs[1], kinds[1])
    hidden = g.needs_hidden
    ts = _teachers(target, hidden, ppd=g if kind == "ppd" else None)
    for ids, t in zip(_prompts(), ts):
        steps = replay_plan(target, g, plan, t, N)
        out = generate(target, ids, plan=plan, guesser=g, max_new_tokens=N)
        # exact at every step, hybrids included: a session prices the plan's constant decide_s, never a clock
        assert _replayed(steps) == (list(out.stats.accepted[:-1]), out.steps), kind
        assert [s.size for s in steps] == out.stats.dynamic["sizes"], kind
        assert sum(s.accepted + 1 for s in steps) == N


class _SlowClock:
    """decoder.guessers.dynamic's clock on a machine as loaded as can be: each reading is a second
    after the last, so every decision measures a second or more (a forward here is 10-20 ms)."""

    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        self.t += 1.0
        return self.t


@pytest.mark.parametrize("kind", ["lookup", "lookup+parallelspec"])
def test_a_slow_decision_changes_no_choice(target, monkeypatch, kind):
    """A step's choice is a function of the plan and the text: decoding whose every decision is
    measured at seconds takes the sizes and accepts the tokens of its replay on an idle clock, and
    still reports the time it measured. Pricing the measured time into the choice (a running
    average, as sessions once did) fails this: seconds of sunk cost make every guess pay."""
    import decoder.guessers.dynamic as dynamic

    kinds = kind.split("+")
    plan = plan_dynamic([(k, ACC[k]) for k in kinds], _profile(), max_size=8, max_depth=5)
    gs = [_guesser(k, target, "llama") for k in kinds]
    g = gs[0] if len(gs) == 1 else HybridGuesser(gs[0], gs[1], kinds[1])
    ts = _teachers(target, g.needs_hidden)
    replayed = [replay_plan(target, g, plan, t, N) for t in ts]
    monkeypatch.setattr(dynamic, "time", _SlowClock())
    for ids, steps in zip(_prompts(), replayed):
        out = generate(target, ids, plan=plan, guesser=g, max_new_tokens=N)
        assert out.stats.dynamic["sizes"] == [s.size for s in steps], kind
        assert (list(out.stats.accepted[:-1]), out.steps) == _replayed(steps), kind
        assert out.stats.dynamic["decide_s_median"] >= 1.0  # measured and reported, never priced


def test_a_plan_records_its_measured_decision_cost_and_decodes_with_it(target, tmp_path):
    """The main job's recording (workflows/mainjob/predict.py): the decision is timed once over the
    text, the median is kept in the plan's file, and the plan then prices that constant into every
    step (its replay still equals decoding)."""
    from planner.tree import load_tree, save_tree
    from profiler.replay import measure_decide_s

    g = PromptLookupGuesser()
    plan = plan_dynamic([("lookup", ACC["lookup"])], _profile(), max_size=8, max_depth=5)
    ts = _teachers(target, False)
    decide = measure_decide_s(target, g, plan, ts, N)
    assert 0 < decide < 0.1
    plan.dynamic.decide_s = decide
    save_tree(plan, tmp_path / "plan.json")
    back = load_tree(tmp_path / "plan.json")
    assert back.dynamic.decide_s == decide
    for ids, t in zip(_prompts(), ts):
        steps = replay_plan(target, g, back, t, N)
        out = generate(target, ids, plan=back, guesser=g, max_new_tokens=N)
        assert _replayed(steps) == (list(out.stats.accepted[:-1]), out.steps)
        assert [s.size for s in steps] == out.stats.dynamic["sizes"]
        assert out.stats.dynamic["decide_s_priced"] == decide
        assert min(out.stats.dynamic["predicted_cost_s"]) >= decide + back.dynamic.step_cost_s[0] - 1e-6


def test_replayed_static_draft_tree_equals_decoding(target):
    """A draft LM's static tree, its passes replaced by its teacher-forced logits (exact on the text's path)."""
    g = _guesser("draft", target, "llama")
    plan = static_tree("sequoia", 9, 3, seed=4)
    ts = _teachers(target, False)
    for ids, t in zip(_prompts(), ts):
        steps = replay_plan(target, g, plan, t, N, teacher_drafts=True)
        assert _replayed(steps) == _decoded_accepted(target, plan, g, ids)


def test_replay_notices_a_wrong_text(target):
    """A continuation that is not the target's greedy text gives other steps: the comparison can fail."""
    g = PromptLookupGuesser()
    plan = plan_dynamic([("lookup", ACC["lookup"])], _profile(), max_size=8, max_depth=5)
    t = _teachers(target, False)[2]  # the repetitive prompt: lookup accepts there
    want = _decoded_accepted(target, plan, g, _prompts()[2])
    t.tokens = t.tokens.roll(1)
    assert _replayed(replay_plan(target, g, plan, t, N)) != want


@pytest.mark.parametrize("kind", ["lookup", "parallelspec", "draft", "ppd"])
def test_calibration_by_replay_equals_decoding(target, kind):
    g = _guesser(kind, target, "llama")
    ts = _teachers(target, g.needs_hidden, ppd=g if kind == "ppd" else None)
    got = calibrate_by_replay(target, g, ts, ACC[kind].accuracy)
    want = measure_calibration(target, g, _prompts(), ACC[kind].accuracy, max_new_tokens=N)
    assert got["observations"] == want["observations"] > 0
    assert np.allclose(np.array(got["p"], dtype=float), np.array(want["p"], dtype=float))


def test_an_eagle_heads_calibration_by_replay_equals_decoding(target, tmp_path):
    """The main job calibrates a head as it calibrates the other drafters: the replay feeds it the teacher's
    three feature streams outside any decode (it once failed there, under autograd, on the shipped head)."""
    from head_layouts import trained_like_head, write_eagle3

    from decoder.guessers.registry import LoadRequest, load_guesser

    folder = write_eagle3(trained_like_head(target, seed=1), tmp_path / "eagle3")
    g = load_guesser("eagle-head", LoadRequest(target, path=str(folder), top_k=4))
    ts = _teachers(target, [g.needs_hidden])  # one spec: the head's three layers
    got = calibrate_by_replay(target, g, ts, ACC["draft"].accuracy)
    want = measure_calibration(target, g, _prompts(), ACC["draft"].accuracy, max_new_tokens=N)
    assert got["observations"] == want["observations"] > 0
    assert np.allclose(np.array(got["p"], dtype=float), np.array(want["p"], dtype=float))


WARM = dict(temperature=0.9, top_k=0, top_p=0.95)


def _sampled_teachers(target, hidden):
    from decoder.verify import Sampling
    from profiler.sampled import sampled_continuations

    s = Sampling(**WARM)
    cont = sampled_continuations(target, _prompts(), N, s, seed=3)
    return teachers(target, cont, hidden), s


@pytest.mark.parametrize("kind", ["lookup", "parallelspec"])
def test_sampled_calibration_by_replay_equals_decoding(target, kind):
    """Under sampling a deterministic guesser's observations are scored with the target's warped p
    along the sampled text: by replay as `planner accept --calibrate --temperature` decodes them
    (same seeds, so the same text), and not the greedy 0/1 observations."""
    from decoder.verify import Sampling

    g = _guesser(kind, target, "llama")
    ts, s = _sampled_teachers(target, g.needs_hidden)
    got = calibrate_by_replay(target, g, ts, ACC[kind].accuracy, sampling=s)
    want = measure_calibration(target, g, _prompts(), ACC[kind].accuracy, max_new_tokens=N,
                               sampling=Sampling(**WARM), seed=3)
    assert got["observations"] == want["observations"] > 0
    assert np.allclose(np.array(got["p"], dtype=float), np.array(want["p"], dtype=float), atol=1e-6)
    assert got["sampling"] == want["sampling"]
    greedy = calibrate_by_replay(target, g, [t.__class__(t.prompt, t.tokens, t.hidden) for t in ts],
                                 ACC[kind].accuracy)
    assert not np.allclose(np.array(greedy["p"], dtype=float), np.array(got["p"], dtype=float))


def test_sampled_calibration_refuses_a_sampling_drafter(target):
    from planner.errors import UserError

    g = _guesser("draft", target, "llama")
    ts, s = _sampled_teachers(target, False)
    with pytest.raises(UserError, match="samples its children"):
        calibrate_by_replay(target, g, ts, ACC["draft"].accuracy, sampling=s)
    with pytest.raises(UserError, match="need their settings"):
        calibrate_by_replay(target, _guesser("lookup", target, "llama"), ts, ACC["lookup"].accuracy)


def test_sampled_replay_has_decodings_law(target):
    """A per-step lookup plan's accepted guesses per step, replayed over sampled continuations (what a
    sampled main job predicts from), against sampled decoding itself, over many seeds: the same law
    (the lossless rule emits each node's token with the warped p whatever was guessed). Replaying
    with the greedy rule's text instead (the continuation taken at temperature 0) must not match."""
    from decoder.verify import Sampling
    from profiler.sampled import sampled_continuations

    warm = Sampling(0.1, 0, 1.0)  # the toy model's logits are flat: a cool temperature still samples, and lookup hits
    g = PromptLookupGuesser()
    plan = plan_dynamic([("lookup", ACC["lookup"])], _profile(), max_size=8, max_depth=5)
    prompt = _prompts()[2]  # repetitive: lookup guesses often
    seeds = range(40)

    def rate(steps_per_run):
        acc = [a for run in steps_per_run for a in run]
        return sum(acc) / len(acc), np.std(acc) / np.sqrt(len(acc))

    decoded = [generate(target, prompt, plan=plan, guesser=g, max_new_tokens=N, seed=s, temperature=0.1).stats.accepted
               for s in seeds]
    cont = sampled_continuations(target, [prompt] * len(seeds), N, warm, seed=0)
    replayed = [[st.accepted for st in replay_plan(target, g, plan, t, N)] for t in teachers(target, cont, False)]
    greedy = [st.accepted for st in replay_plan(target, g, plan, _teachers(target, False)[2], N)]
    (m_d, se_d), (m_r, se_r) = rate(decoded), rate(replayed)
    assert m_d > 0.05  # lookup is accepted at all here
    assert abs(m_d - m_r) < 3 * math.hypot(se_d, se_r), (m_d, m_r)
    assert abs(sum(greedy) / len(greedy) - m_d) > 3 * math.hypot(se_d, se_r)


def _coupled_teachers(target, hidden):
    from decoder.verify import Sampling
    from profiler.sampled import sampled_continuations

    s = Sampling(**WARM, mode="coupled")
    cont = sampled_continuations(target, _prompts(), N, s, seed=3)
    return teachers(target, cont, hidden), s


@pytest.mark.parametrize("kind", ["lookup", "parallelspec", "chain", "lookup+chain", "draft", "lookup+draft"])
def test_coupled_replay_equals_coupled_decoding(target, kind):
    """Under coupled sampling (decoder/noise.py) the acceptance text is plain coupled sampling's with the
    prompt's seed, and the replay gives its sessions that noise: every guesser's aimed guesses, the
    draft LM's included, are the decode's, so the replayed steps are the coupled decode's steps; with
    the noise withheld (fixed top-k guesses) a drafter's replay is not."""
    kinds = kind.split("+")
    plan = plan_dynamic([(k, ACC[k]) for k in kinds], _profile(), max_size=8, max_depth=5)
    gs = [_guesser(k, target, "llama") for k in kinds]
    g = gs[0] if len(gs) == 1 else HybridGuesser(gs[0], gs[1], kinds[1])
    ts, s = _coupled_teachers(target, g.needs_hidden)
    for i, (ids, t) in enumerate(zip(_prompts(), ts)):
        out = generate(target, ids, plan=plan, guesser=g, max_new_tokens=N, seed=3 + i, verify_rule="coupled", **WARM)
        assert out.tokens.tolist() == t.tokens.tolist()  # the text is the decode's own
        steps = replay_plan(target, g, plan, t, N)
        assert _replayed(steps) == (list(out.stats.accepted[:-1]), out.steps), kind  # hybrids too: no clock decides
        assert [s.size for s in steps] == out.stats.dynamic["sizes"], kind


def test_a_coupled_replay_needs_the_texts_noise(target):
    """The draft LM replaced by the target itself aims right at every draw: replayed with the text's
    noise it accepts what the coupled decode accepts; with the noise withheld (fixed top-k guesses,
    accepted only where the draw is the argmax) the replay accepts less, so the noise is what makes it exact."""
    from decoder.guessers.draft import DraftModelGuesser

    plan = plan_dynamic([("draft", ACC["draft"])], None, max_size=8, max_depth=5)  # no latency: every guess pays
    g = DraftModelGuesser(target, top_k=4)
    ts, s = _coupled_teachers(target, False)
    aimed = blind = 0
    for i, (ids, t) in enumerate(zip(_prompts(), ts)):
        out = generate(target, ids, plan=plan, guesser=g, max_new_tokens=N, seed=3 + i, verify_rule="coupled", **WARM)
        got = _replayed(replay_plan(target, g, plan, t, N))
        assert got == (list(out.stats.accepted[:-1]), out.steps)
        aimed += sum(got[0])
        blind += sum(_replayed(replay_plan(target, g, plan, t.__class__(t.prompt, t.tokens, t.hidden, probs=t.probs), N))[0])
    assert aimed > blind


def test_coupled_calibration_scores_hits_and_calibrates_the_draft_lm(target):
    from decoder.verify import Sampling

    g = _guesser("draft", target, "llama")
    ts, s = _coupled_teachers(target, False)
    doc = calibrate_by_replay(target, g, ts, ACC["draft"].accuracy, sampling=s)
    assert doc["observations"] > 0 and doc["sampling"] == {"temperature": 0.9, "top_k": 0, "top_p": 0.95}
    lossless, s2 = _sampled_teachers(target, False)
    with pytest.raises(Exception, match="coupled"):
        calibrate_by_replay(target, g, lossless, ACC["draft"].accuracy, sampling=Sampling(**WARM, mode="coupled"))
