"""The race's pieces (workflows.mainjob.choose) on hand-made runs: the sign-flip test and its interval,
the selection's block order and its pairing with plain in time, load handling, elimination,
halving, the winner and the decision. Whole simulated races: tests/test_race.py."""
import math

import numpy as np
import pytest

from workflows.mainjob.choose import (
    LOADED_CORES,
    PAIRS,
    PLAIN,
    PLAIN_EVERY,
    Arm,
    Race,
    Run,
    speedup,
)
from workflows.mainjob.signflip import ALPHA, interval, sign_flip_p


def test_sign_flip_p_counts_the_patterns_that_reach_the_observed_sum():
    assert sign_flip_p(np.full(6, 0.1)) == pytest.approx(1 / 64)  # only the identity reaches it
    assert sign_flip_p([0.3, 0.3, 0.3, 0.3, 0.3, -0.01]) == pytest.approx(2 / 64)  # and flipping the small one
    assert sign_flip_p(np.full(6, -0.1)) == 1.0 and sign_flip_p([]) == 1.0
    x = np.random.default_rng(0).normal(size=7)
    assert sign_flip_p(x) + sign_flip_p(-x) == pytest.approx(1 + np.mean(np.abs(
        (1 - 2 * ((np.arange(128)[:, None] >> np.arange(7)) & 1)) @ np.abs(x) - x.sum()) < 1e-9))


def test_sign_flip_p_is_uniform_under_the_null():
    """Symmetric noise: P(p <= ALPHA) is the largest multiple of 1/64 not above ALPHA (n = 6)."""
    rng = np.random.default_rng(1)
    ps = np.array([sign_flip_p(rng.standard_t(3, size=6)) for _ in range(4000)])
    assert np.mean(ps <= ALPHA) == pytest.approx(math.floor(ALPHA * 64) / 64, abs=0.012)


def test_the_interval_inverts_the_test():
    rng = np.random.default_rng(2)
    for _ in range(20):
        x = rng.normal(0.1, 0.2, size=7)
        iv = interval(x)
        assert iv.lo < iv.mean < iv.hi and iv.mean == pytest.approx(math.exp(x.mean()))
        for d in (math.log(iv.lo) - 1e-6, math.log(iv.lo) + 1e-6):  # rejected just below its lower end only
            assert (sign_flip_p(x - d) <= ALPHA) == (d < math.log(iv.lo))
    few = interval([0.1, 0.2, 0.3, 0.2])  # 2^-4 > ALPHA: no shift is rejected
    assert few.lo == 0.0 and math.isinf(few.hi) and "no interval" in str(few)


def _race(n_plans=4, prompts=8, predicted=None, parallel=()):
    arms = [Arm(PLAIN, 1.0, 1.0, {p: 1.0 for p in range(prompts)})]
    for i in range(n_plans):
        pred = (predicted or {}).get(f"a{i}", 1.2)
        arms.append(Arm(f"a{i}", 1.0 + 0.1 * i, pred, {p: 1.0 / pred for p in range(prompts)},
                        parallel=f"a{i}" in parallel))
    return Race(arms, list(range(prompts)), seed=0)


def _runs(keys, prompt, seconds, start=0.0, others=0.0):
    """Runs back to back; seconds: a dict key -> seconds, or a function (key, start) -> seconds."""
    out, t = [], start
    for k in keys:
        s = seconds(k, t) if callable(seconds) else seconds[k]
        o = others(t) if callable(others) else others
        out.append(Run(k, prompt, s, t, o))
        t += s
    return out


def test_the_race_splits_its_prompts_into_selection_and_confirmation():
    r = _race(prompts=8)
    assert r.selection == [0, 1] and r.confirmation == [2, 3, 4, 5, 6, 7]
    r = _race(prompts=20)
    assert len(r.confirmation) == 12 and not set(r.selection) & set(r.confirmation)
    r = _race(prompts=3)
    assert r.selection == [0] and r.confirmation == [1, 2]


def test_a_selection_block_has_plain_at_both_ends_and_between_every_few_plans():
    r = _race(n_plans=7)
    order = r.selection_order()
    assert order[0] == order[-1] == PLAIN and sorted(k for k in order if k != PLAIN) == [f"a{i}" for i in range(7)]
    gaps = "".join("P" if k == PLAIN else "x" for k in order).split("P")
    assert max(len(g) for g in gaps) <= PLAIN_EVERY
    assert order.count(PLAIN) == 1 + math.ceil(7 / PLAIN_EVERY)
    assert len({tuple(r.selection_order()) for _ in range(10)}) > 1  # shuffled


def test_pairing_with_interpolated_plain_cancels_a_linear_drift():
    """Every arm as fast as plain, the machine slowing down 2 % a second: each ratio is 0."""
    r = _race(n_plans=5)
    order = r.selection_order()
    drift = lambda k, t: math.exp(0.02 * t)  # noqa: E731  (the run's time at its start; short runs)
    runs = _runs(order, 0, drift)
    redo = r.add_selection(0, runs)
    assert redo == []
    for a in r.arms[1:]:
        assert abs(a.ratios[0]) < 0.02 * 0.6  # within a fraction of one run's drift
    naive = [math.log(np.median([x.seconds for x in runs if x.key == PLAIN]) / x.seconds) for x in runs if x.key != PLAIN]
    assert max(abs(v) for v in naive) > 0.02  # a block-wide plain reference would not cancel it


def test_a_load_change_leaves_the_plans_around_it_unpaired_and_a_parallel_plan_uncounted():
    r = _race(n_plans=3, parallel=("a2",))
    order = [PLAIN, "a0", "a1", "a2", PLAIN]
    loaded_from = 2.5  # a0 and a1 free, a2 and the last plain loaded
    runs = _runs(order, 0, {PLAIN: 1.0, "a0": 1.0, "a1": 1.0, "a2": 1.0},
                 others=lambda t: 1.0 if t >= loaded_from else 0.0)
    assert [x.loaded for x in runs] == [False, False, False, True, True]
    redo = r.add_selection(0, runs)
    assert 0 in r.arm("a0").ratios and 0 in r.arm("a1").ratios  # paired with the free plain run before them
    assert redo == [] and 0 not in r.arm("a2").ratios and r.arm("a2").loaded_runs == 1  # parallel, loaded: out
    runs = _runs([PLAIN, "a2", PLAIN], 1, {PLAIN: 1.0, "a2": 0.7}, start=10, others=1.0)
    r.add_selection(1, runs)
    assert "free machine" in r.arm("a2").dropped  # only loaded runs: it cannot win
    r2 = _race(n_plans=1)
    runs = _runs([PLAIN, "a0", PLAIN], 0, {PLAIN: 1.0, "a0": 1.0}, others=lambda t: 1.0 if 0.5 < t < 1.5 else 0.0)
    assert r2.add_selection(0, runs) == ["a0"]  # loaded between two free plain runs: measured again


def test_a_loaded_machine_ranks_parallel_plans_last():
    """Their loaded runs would not count, so halving keeps plans whose runs will."""
    r = _race(n_plans=4, predicted={"a0": 5.0, "a1": 1.3, "a2": 1.2, "a3": 1.1}, parallel=("a0",))
    assert r.leader().key == "a0"
    r.loaded_now = True
    assert r.leader().key == "a1"
    r.halve(1)
    assert [a.key for a in r.candidates()] == ["a1", "a2"]
    r.add_selection(0, _runs([PLAIN, "a1", PLAIN], 0, {PLAIN: 1.0, "a1": 0.8}, others=0.0))
    assert not r.loaded_now  # the last run was on a free machine


def _with_ratios(r, ratios: dict[str, list[float]]):
    for k, vals in ratios.items():
        for p, v in enumerate(vals):
            r.arm(k).ratios[p] = v
    return r


def test_prune_drops_plans_slower_than_the_leader_or_plain_beyond_the_noise():
    r = _with_ratios(_race(n_plans=4), {"a0": [0.40, 0.42, 0.38, 0.41], "a1": [0.39, 0.41, 0.40, 0.40],
                                        "a2": [0.10, 0.12, 0.08, 0.11], "a3": [-0.3, -0.28, -0.32, -0.3]})
    dropped = {a.key for a in r.prune(4)}
    assert dropped == {"a2", "a3"} and r.arm("a1").running
    assert r.arm("a2").dropped.startswith("slower than a0:") and r.arm("a3").dropped.startswith("slower than")


def test_the_prior_ranks_plans_until_measurements_outweigh_it():
    r = _race(n_plans=2, predicted={"a0": 1.3, "a1": 1.1})
    assert r.leader().key == "a0"  # nothing measured: the prediction
    _with_ratios(r, {"a0": [0.05, 0.06, 0.04], "a1": [0.25, 0.26, 0.24]})
    assert r.leader().key == "a1"  # measured faster beyond the prior's weight
    halved = _race(n_plans=5, predicted={f"a{i}": 1.0 + 0.1 * i for i in range(5)})
    halved.halve(1)
    assert [a.key for a in halved.candidates()] == ["a2", "a3", "a4"]


def test_each_way_of_predicting_has_its_own_offset():
    """Replayed predictions all 25 % low here, the cost model's right: with one pooled offset the
    cost-model plan, predicted higher, would lead two plans measured equal; with an offset per way
    of predicting each prior is corrected by its own way's error and the measurements decide."""
    r = _race(n_plans=4, predicted={"a0": 1.45, "a1": 1.25, "a2": 1.2, "a3": 1.05})
    for key, how in (("a0", "cost model"), ("a1", "replay"), ("a2", "replay"), ("a3", "cost model")):
        r.arm(key).predicted_by = how
    spread = (-0.3, 0.0, 0.3)  # prompt to prompt: three prompts do not outweigh the prior
    _with_ratios(r, {k: [m + d for d in spread] for k, m in (("a0", 0.37), ("a1", 0.47), ("a2", 0.43), ("a3", 0.05))})
    off = r.offsets()
    assert off["replay"] == pytest.approx(-0.247, abs=1e-3) and abs(off["cost model"]) < 0.01
    assert r.leader().key == "a1"
    pooled = {None: off[None]}  # what one offset for every plan gives: the cost model's optimism wins
    assert max(["a0", "a1"], key=lambda k: r.score(r.arm(k), offsets=pooled)) == "a0"
    r.arm("a3").predicted_by = "never measured"  # a way no measured plan shares: the pooled offset
    r.arm("a3").ratios.clear()
    assert r.score(r.arm("a3")) == pytest.approx(math.log(1.05) - r.offsets()[None])


def test_the_winner_is_the_leader_or_a_cheaper_plan_tied_with_it():
    r = _with_ratios(_race(n_plans=3), {"a0": [0.30, 0.31], "a1": [0.305, 0.31], "a2": [0.1, 0.1]})
    assert r.select().key == "a0"  # a1 ties within TIE and a0 is cheaper
    r = _with_ratios(_race(n_plans=2), {"a0": [0.10, 0.12], "a1": [0.30, 0.31]})
    assert r.select().key == "a1"
    assert r.confirmation[:0] == [] and r.selection == [0, 1]


def _confirm(r, winner, plain_s, plan_s, prompts, others=0.0):
    r.winner = r.arm(winner)
    for p in prompts:
        order = r.confirmation_order(PAIRS)
        assert sorted(order) == sorted([winner, PLAIN] * PAIRS)
        r.add_confirmation(p, _runs(order, p, {PLAIN: plain_s, winner: plan_s}, others=others))


def test_the_decision_rests_on_the_confirmation_alone():
    r = _with_ratios(_race(n_plans=2), {"a0": [0.9, 0.9], "a1": [0.0, 0.1]})  # selection: a0 looks 2.5x
    _confirm(r, "a0", 1.0, 1.0 / 1.3, range(2, 8))
    d = r.decide()
    assert d.choice == "a0" and d.speedup.mean == pytest.approx(1.3) and d.p_value == pytest.approx(1 / 64)
    assert "confirmed on 6 other prompts" in d.reason and d.speedup.lo == pytest.approx(1.3)
    r = _with_ratios(_race(n_plans=1), {"a0": [0.9, 0.9]})
    _confirm(r, "a0", 1.0, 1.0, range(2, 8))  # as fast as plain where it was not selected
    d = r.decide()
    assert d.choice == PLAIN and "not faster beyond the noise" in d.reason
    r = _with_ratios(_race(n_plans=1), {"a0": [0.9, 0.9]})
    _confirm(r, "a0", 1.0, 0.5, range(2, 5))  # three prompts cannot reach ALPHA
    assert r.decide().choice == PLAIN


def test_loaded_pairs_of_a_parallel_winner_do_not_count():
    r = _with_ratios(_race(n_plans=1, parallel=("a0",)), {"a0": [0.3, 0.3]})
    _confirm(r, "a0", 1.0, 0.5, range(2, 8), others=2 * LOADED_CORES)
    assert r.arm("a0").pairs == [] and r.parallel_blocked()
    d = r.decide()
    assert d.choice == PLAIN and "could not be confirmed" in d.reason


def test_decide_without_plans_or_time():
    assert _race(n_plans=0).decide().choice == PLAIN
    r = _with_ratios(_race(n_plans=2), {"a0": [-0.2, -0.1], "a1": [-0.3, -0.3]})
    r.select()
    d = r.decide()
    assert d.choice == PLAIN and "slower than plain" in d.reason
    r = _with_ratios(_race(n_plans=1), {"a0": [0.3, 0.3]})
    r.select()
    assert "no time left" in r.decide().reason


def test_selection_speedup_and_the_race_record():
    r = _with_ratios(_race(n_plans=1), {"a0": [0.1, 0.2, 0.3, 0.2, 0.2]})
    up = speedup(r.arm("a0"), r.plain)
    assert up.mean == pytest.approx(math.exp(0.2)) and up.lo > 1.0 and up.n == 5
    assert speedup(r.plain).mean == 1.0
    r.add_selection(0, _runs([PLAIN, "a0", PLAIN], 0, {PLAIN: 1.0, "a0": 0.8}, others=0.05))
    doc = r.to_json()
    assert doc["alpha"] == ALPHA and doc["machine"]["runs"] == 3 and doc["machine"]["loaded_runs"] == 0
    assert doc["runs"][1][:2] == ["a0", 0] and doc["selection_prompts"] == [0]
