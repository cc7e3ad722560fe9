"""The autotuner's choice by measurement (workflows.choose) on synthetic timings: a faster measured
plan beats a better predicted one, plain wins when every plan is slower, ties go to the cheaper
plan, and the race drops a clearly slower plan and halves when time is short."""
import math

import numpy as np
import pytest

from workflows.choose import PLAIN, Arm, Race, bootstrap, decide, log_ratios, speedup


def _arm(key, cost, ratio, prompts=8, noise=0.02, predicted=1.0, seed=0, base=None):
    """An arm whose time on prompt p is plain's divided by `ratio`, with multiplicative noise."""
    rng = np.random.default_rng(seed)
    base = base or {p: 1.0 + 0.5 * (p % 3) for p in range(prompts)}  # prompts of different lengths
    return Arm(key, cost, predicted, seconds={p: base[p] / ratio * math.exp(rng.normal(0, noise)) for p in base})


def _plain(prompts=8, base=None):
    return _arm(PLAIN, 1.0, 1.0, prompts, noise=0.0, base=base)


def test_a_faster_measured_plan_beats_a_better_predicted_one():
    arms = [_plain(), _arm("predicted-best", 1.5, 1.05, predicted=1.6, seed=1), _arm("measured-best", 1.3, 1.4, predicted=1.1, seed=2)]
    d = decide(arms)
    assert d.choice == "measured-best"
    assert d.speedup.lo > 1.3 and d.speedup.mean == pytest.approx(1.4, rel=0.03)
    assert "fastest measured" in d.reason


def test_plain_wins_when_every_plan_is_slower():
    d = decide([_plain(), _arm("a", 1.2, 0.9, seed=1), _arm("b", 1.6, 0.7, seed=2)])
    assert d.choice == PLAIN and "slower than plain" in d.reason


def test_plain_wins_when_the_best_plan_is_within_the_noise_of_plain():
    """A plan 'faster' by less than the noise is no reason to leave plain decoding: plain is cheaper."""
    d = decide([_plain(), _arm("noisy", 1.4, 1.02, noise=0.15, seed=3)])
    assert d.choice == PLAIN and "beyond the noise" in d.reason


def test_ties_within_the_noise_go_to_the_cheaper_plan():
    base = {p: 1.0 for p in range(8)}
    arms = [_plain(base=base), _arm("big-tree", 2.0, 1.36, seed=1, base=base, noise=0.08),
            _arm("short-chain", 1.2, 1.30, seed=2, base=base, noise=0.08)]
    assert speedup(arms[1], arms[0]).mean > speedup(arms[2], arms[0]).mean  # big-tree measured faster ...
    d = decide(arms)
    assert d.choice == "short-chain" and "cheaper" in d.reason  # ... but within the noise, and dearer
    # ... but not when the expensive plan is faster beyond the noise
    arms[1] = _arm("big-tree", 2.0, 1.6, seed=1, base=base, noise=0.02)
    assert decide(arms).choice == "big-tree"


def test_a_plan_that_left_the_race_is_never_chosen():
    arms = [_plain(), _arm("wrong", 1.0, 2.0, seed=1), _arm("ok", 1.0, 1.2, seed=2)]
    arms[1].dropped = "output differs from plain greedy decoding on prompt 0"
    assert decide(arms).choice == "ok"


def test_bootstrap_interval_covers_the_mean_and_needs_enough_prompts():
    x = np.log(np.array([1.1, 1.3, 1.2, 1.25, 1.15]))
    iv = bootstrap(x)
    assert iv.lo < iv.mean < iv.hi and iv.mean == pytest.approx(math.exp(x.mean()))
    two = bootstrap(x[:2])
    assert two.lo == 0.0 and math.isinf(two.hi)  # two prompts decide nothing
    assert bootstrap(np.zeros(6)).lo == pytest.approx(1.0)


def test_paired_ratios_use_the_prompts_both_decoded():
    a = Arm("a", 1.0, seconds={0: 1.0, 1: 2.0, 5: 1.0})
    b = Arm("b", 1.0, seconds={0: 2.0, 1: 2.0, 2: 9.0})
    assert np.allclose(log_ratios(a, b), [math.log(2.0), 0.0])
    assert speedup(a, b).n == 2


def test_the_race_drops_a_clearly_slower_plan_and_keeps_close_ones():
    race = Race([_plain(3), _arm("fast", 1.2, 1.5, 3, seed=1), _arm("close", 1.2, 1.45, 3, noise=0.1, seed=2),
                 _arm("slow", 1.2, 0.8, 3, seed=3)])
    dropped = race.prune(1)
    assert [a.key for a in dropped] == ["slow"] and "slower than" in race.arms[3].dropped
    assert race.arms[2].running and race.plain.running


def test_halving_keeps_the_faster_half_and_plain():
    race = Race([_plain(3)] + [_arm(f"p{i}", 1.0, 1.0 + 0.1 * i, 3, seed=i) for i in range(5)])
    race.halve(2)
    assert [a.key for a in race.running()] == [PLAIN, "p2", "p3", "p4"]
    for a in race.arms:
        a.predicted_s = {7: 1.0}
    assert race.stage_seconds([7]) == 4.0
