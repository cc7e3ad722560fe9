"""Batched decoding (EMS-SD): the accepted-length law against the worked numbers of docs/seed-systems.md
(section 'EMS-SD') and a seeded simulation, per-batch-size plans and their schedule in tree files,
`planner plan --batch-sizes`."""
import json

import jsonschema
import numpy as np
import pytest

from planner.accept import load_acceptance
from planner.batch import (
    ContextCost,
    chain_law,
    expected_max,
    expected_padding,
    padding_ratio,
    plan_chain_schedule,
    plan_schedule,
    predict_batch,
    tree_law,
    tree_with_schedule,
)
from planner.cost import Guessing, padded_step_latency, predict, step_latency
from planner.errors import UserError
from planner.plan import SHARED_DIR, plan
from planner.profile import LatencyProfile, load_batch_profiles, load_profile
from planner.tree import SCHEMA_PATH, ScheduleEntry, load_tree, save_tree, tree_from_json
from workflows.cli.main import main

PUBLISHED = SHARED_DIR / "data" / "published_acceptance.json"
MEDUSA = f"{PUBLISHED}:medusa-vicuna-7b"
PPD = f"{PUBLISHED}:ppd-vicuna-7b"
SCHEMA = json.loads(SCHEMA_PATH.read_text())
# The forward pass stays flat to fewer new tokens per row as the batch grows: a big tree at
# batch size 1, a small one at 4, plain decoding at 16 (a step of 2 tokens costs 1.5 plain ones).
SERIES = [
    {"batch_size": 1, "input_lengths": [1, 24, 256], "latency_s": [0.02, 0.02, 0.1]},
    {"batch_size": 2, "input_lengths": [1, 24, 256], "latency_s": [0.02, 0.02, 0.1]},
    {"batch_size": 4, "input_lengths": [1, 8, 256], "latency_s": [0.022, 0.024, 0.3]},
    {"batch_size": 16, "input_lengths": [1, 2, 256], "latency_s": [0.03, 0.045, 1.2]},
]


def _profiles():
    return {s["batch_size"]: LatencyProfile(np.array(s["input_lengths"]), np.array(s["latency_s"]),
                                            {"file": "synthetic", "batch_size": s["batch_size"]}) for s in SERIES}


@pytest.fixture
def profile_file(tmp_path):
    p = tmp_path / "profile.json"
    first = SERIES[0]
    p.write_text(json.dumps({"input_lengths": first["input_lengths"], "latency_s": first["latency_s"],
                             "batch_size": 1, "series": SERIES, "device": "cpu"}))
    return p


# ------------------------------------------------------------------ the law of tau: closed forms


def test_chain_numbers_of_the_notes():
    """docs/seed-systems.md, section 'EMS-SD': p = 0.7, k = 4, b = 8 gives E[tau_max] 4.85 vs E[tau] 2.77 and
    E[r] 0.428; p = 0.9, k = 7, b = 16 gives E[r] 0.288 (about 30 % wasted at 90 % accuracy)."""
    law = chain_law(0.7, 4)
    assert law.mean == pytest.approx((1 - 0.7**5) / (1 - 0.7))  # 2.7731
    assert round(law.mean, 2) == 2.77
    assert expected_max(law, 8) == pytest.approx(4.849456, abs=1e-6)
    assert round(expected_max(law, 8), 2) == 4.85
    assert padding_ratio(law, 8) == pytest.approx(0.427653, abs=1e-6)
    assert round(padding_ratio(law, 8), 3) == 0.428
    assert expected_padding(law, 8) == pytest.approx(4.849456 - 2.7731, abs=1e-6)
    assert round(padding_ratio(chain_law(0.9, 7), 16), 3) == 0.288


def test_one_sequence_pads_nothing_and_padding_grows_with_the_batch():
    law = chain_law(0.8, 5)
    assert expected_max(law, 1) == pytest.approx(law.mean) and padding_ratio(law, 1) == 0.0
    ratios = [padding_ratio(law, b) for b in (1, 2, 4, 8, 16, 64)]
    maxima = [expected_max(law, b) for b in (1, 2, 4, 8, 16, 64)]
    assert np.all(np.diff(ratios) > 0) and np.all(np.diff(maxima) > 0) and maxima[-1] <= 6.0


def test_tree_law_mean_is_the_plans_tau():
    """E[tau] of the law equals the planner's tau: one tree, and the stationary mixture of PPD states."""
    med, ppd = load_acceptance(MEDUSA), load_acceptance(PPD)
    for tree, acc in ((plan("medusa", med, size=20), med), (plan("sequoia", med, size=20, max_depth=3), med),
                      (plan("ppd", ppd, input_length=40), ppd)):
        law = tree_law(tree, acc)
        assert law.mean == pytest.approx(tree.expected_tokens_per_step, abs=1e-9)
        assert np.all(np.diff(law.survival) <= 1e-12) and law.survival[0] == 1.0


# ------------------------------------------------------------------ the closed forms against a simulation


def _simulate_chain(rng, p, k, b, steps):
    hits = rng.random((steps, b, k)) < p
    return 1 + np.cumprod(hits, axis=2).sum(axis=2)  # [steps, b]: leading successes + the root


def _simulate_tree(rng, nodes, rows, b, steps):
    """Under the independence model: at each distance the right token has rank r with probability
    rows[d, r] (none with the rest); a step accepts the longest tree path that follows them."""
    depth, ranks = rows.shape
    probs = np.concatenate([rows, 1 - rows.sum(axis=1, keepdims=True)], axis=1)
    right = np.stack([rng.choice(ranks + 1, size=(steps, b), p=probs[d]) for d in range(depth)], axis=-1)
    present = set(nodes)
    tau = np.ones((steps, b), dtype=int)
    for s in range(steps):
        for i in range(b):
            path = ()
            for d in range(depth):
                path = path + (int(right[s, i, d]),)
                if path not in present:
                    break
                tau[s, i] += 1
    return tau


def _moments(tau):
    tmax = tau.max(axis=1)
    return tau.mean(), tmax.mean(), (1 - tau[:, 0] / tmax).mean()


def test_closed_forms_match_a_seeded_simulation_of_a_chain():
    rng = np.random.default_rng(1234)
    tau = _simulate_chain(rng, 0.7, 4, 8, 40_000)
    mean, tmax, ratio = _moments(tau)
    law = chain_law(0.7, 4)
    assert mean == pytest.approx(law.mean, abs=0.02)
    assert tmax == pytest.approx(expected_max(law, 8), abs=0.02)
    assert ratio == pytest.approx(padding_ratio(law, 8), abs=0.01)


def test_closed_forms_match_a_seeded_simulation_of_a_tree():
    acc = load_acceptance(MEDUSA)
    tree = plan("medusa", acc, size=12, max_depth=3)
    nodes, rows = tree.states[0].nodes, acc.rows(3)
    tau = _simulate_tree(np.random.default_rng(7), nodes, rows, 4, 6_000)
    law = tree_law(tree, acc)
    empirical = [(tau >= j).mean() for j in range(1, len(law.survival) + 1)]
    np.testing.assert_allclose(empirical, law.survival, atol=0.015)
    mean, tmax, ratio = _moments(tau)
    assert mean == pytest.approx(law.mean, abs=0.03)
    assert tmax == pytest.approx(expected_max(law, 4), abs=0.03)
    assert ratio == pytest.approx(padding_ratio(law, 4), abs=0.01)


# ------------------------------------------------------------------ per-sequence speedup at batch b


def test_packed_is_the_one_cost_model_and_padding_costs():
    ppd = load_acceptance(PPD)
    prof = _profiles()[4]
    tree = plan("ppd", ppd, input_length=24)
    packed = predict_batch(tree, ppd, prof, 4)
    assert packed.speedup == pytest.approx(predict(tree, prof, Guessing()).speedup)
    padded = predict_batch(tree, ppd, prof, 4, layout="padded")
    assert padded.step_latency_s >= packed.step_latency_s and padded.speedup <= packed.speedup
    priced = predict_batch(tree, ppd, prof, 4, layout="padded", context=ContextCost(1e-5, 128))
    extra = 4 * 1e-5 * (priced.context_growth - 1) * 128 / 2
    assert priced.step_latency_s == pytest.approx(padded.step_latency_s + extra)
    plain = predict_batch(None, ppd, prof, 4)
    assert plain.speedup == 1.0 and plain.padding_ratio == 0.0


def test_padded_inputs_are_the_longest_of_the_batch():
    ppd, med = load_acceptance(PPD), load_acceptance(MEDUSA)
    prof = _profiles()[4]
    tree = plan("ppd", ppd, input_length=30)
    assert padded_step_latency(tree, prof, 1) == pytest.approx(step_latency(tree, prof))  # nothing to pad
    costs = [padded_step_latency(tree, prof, b) for b in (1, 2, 8, 64)]
    assert np.all(np.diff(costs) >= -1e-12)
    longest = max(step_latency(type(tree)("ppd", [st], 1.0, prompt_tokens_max=tree.prompt_tokens_max), prof)
                  for st in tree.states if (st.stationary_probability or 0) > 0)
    assert costs[-1] <= longest + 1e-12
    static = plan("medusa", med, size=10)
    assert padded_step_latency(static, prof, 16) == pytest.approx(step_latency(static, prof))


# ------------------------------------------------------------------ plans per batch size


def test_schedule_picks_smaller_trees_as_the_batch_grows_and_merges_neighbours():
    acc = load_acceptance(MEDUSA)
    entries = plan_schedule("medusa", acc, _profiles(), [1, 2, 4, 16], max_size=30)
    assert [e.batch_sizes for e in entries] == [(1, 3), (4, 15), (16, 16)]  # 1 and 2 share a profile: merged
    assert [len(e.points) for e in entries] == [2, 1, 1]
    sizes = [len(e.tree.states[0].nodes) if e.tree else 0 for e in entries]
    assert sizes[0] == 23 and sizes[0] > sizes[1] > sizes[2] >= 0
    assert all(e.predicted_speedup >= 1.0 and e.layout == "packed" for e in entries)
    padded = plan_schedule("medusa", acc, _profiles(), [1, 4, 16], layout="padded",
                           context=ContextCost(1e-4, 128), max_size=30)
    assert padded[-1].tree is None and padded[-1].predicted_speedup == 1.0  # KV padding makes b = 16 plain
    tree = tree_with_schedule(padded)
    assert tree.for_batch(1).shape() == tree.shape() and tree.for_batch(16) is None and tree.for_batch(999) is None
    assert tree.for_batch(5).shape() == padded[1].tree.shape()


def test_chain_schedule_plans_chains():
    acc = load_acceptance(MEDUSA)
    entries = plan_chain_schedule(acc, _profiles(), [1, 4, 16], Guessing())
    ks = [e.tree.depth if e.tree else 0 for e in entries]
    assert all(all(r == 0 for p in e.tree.states[0].nodes for r in p) for e in entries if e.tree)
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]


def test_missing_batch_size_and_plain_everywhere_are_one_line_errors():
    acc = load_acceptance(MEDUSA)
    with pytest.raises(UserError, match="no latency series for batch size 8 \\(measured: 1, 2, 4, 16\\)"):
        plan_schedule("medusa", acc, _profiles(), [1, 8], max_size=30)
    slow = {1: LatencyProfile(np.array([1, 256]), np.array([0.01, 2.56]), {"file": "steep"})}
    with pytest.raises(UserError, match="plain decoding is predicted fastest at every planned batch size"):
        tree_with_schedule(plan_schedule("medusa", acc, slow, [1], max_size=30))


# ------------------------------------------------------------------ profiles per batch size


def test_load_batch_profiles(tmp_path, profile_file):
    profiles = load_batch_profiles(profile_file)
    assert sorted(profiles) == [1, 2, 4, 16]
    assert profiles[4].latency(8) == pytest.approx(0.024) and profiles[4].source["batch_size"] == 4
    assert profiles[16].source["device"] == "cpu" and len(profiles[1].source["sha256"]) == 16
    assert load_profile(profile_file).latency(24) == pytest.approx(0.02)  # the top level, unchanged
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"input_lengths": [1, 8], "latency_s": [0.01, 0.02]}))
    assert list(load_batch_profiles(plain)) == [1]


@pytest.mark.parametrize("content, message", [
    ({"series": []}, "field 'series' must be a non-empty list"),
    ({"series": [{"input_lengths": [1], "latency_s": [1.0]}]}, "missing field 'series\\[0\\].batch_size'"),
    ({"series": [dict(SERIES[0]), dict(SERIES[0])]}, "field 'series\\[1\\].batch_size' repeats batch size 1"),
    ({"series": [dict(SERIES[0], batch_size=0)]}, "field 'series\\[0\\].batch_size' must be an integer >= 1"),
    ({"series": [dict(SERIES[0], latency_s=[0.1, -1, 0.2])]}, "field 'series\\[0\\].latency_s\\[1\\]' must be positive"),
    ({"series": [dict(SERIES[0], input_lengths=[1, 2])]}, "'series\\[0\\].input_lengths' and 'series\\[0\\].latency_s' differ"),
    ({"series": [SERIES[0]], "decoder_overhead": {"fixed_s": -1, "per_token_s": 0}}, "field 'decoder_overhead.fixed_s'"),
    ({"series": ["x"]}, "field 'series\\[0\\]' must be an object"),
])
def test_batch_profile_bad_inputs(tmp_path, content, message):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(content))
    with pytest.raises(UserError, match=message) as e:
        load_batch_profiles(p)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(p))


# ------------------------------------------------------------------ the schedule in tree files


def _scheduled_tree():
    acc = load_acceptance(MEDUSA)
    return tree_with_schedule(plan_schedule("medusa", acc, _profiles(), [1, 4, 16], max_size=30))


def test_schedule_round_trip_and_schema(tmp_path):
    tree = _scheduled_tree()
    path = tmp_path / "s.json"
    save_tree(tree, path)
    data = json.loads(path.read_text())
    jsonschema.validate(data, SCHEMA)
    assert [e["batch_sizes"] for e in data["schedule"]] == [[1, 3], [4, 15], [16, 16]]
    back = load_tree(path)
    assert back.to_json() == data
    assert back.for_batch(2).shape() == back.shape() and back.for_batch(100).shape() == back.schedule[-1].tree.shape()
    assert back.schedule[1].points[0]["batch_size"] == 4


def test_old_files_load_unchanged_and_serve_every_batch_size():
    old = sorted(p for p in SCHEMA_PATH.parent.glob("*.json") if p.name != "schema.json")[0]
    tree = load_tree(old)
    assert tree.schedule is None and "schedule" not in tree.to_json()
    assert tree.for_batch(1) is tree and tree.for_batch(64) is tree
    with pytest.raises(ValueError):
        tree.for_batch(0)


def _mutate(data, f):
    data = json.loads(json.dumps(data))
    f(data)
    return data


@pytest.mark.parametrize("change, message", [
    (lambda d: d["schedule"][1].update(batch_sizes=[5, 15]), "should start at 4"),
    (lambda d: d["schedule"][1].update(batch_sizes=[3, 15]), "should start at 4"),
    (lambda d: d["schedule"][0].update(batch_sizes=[2, 3]), "should start at 1"),
    (lambda d: d["schedule"][0].update(batch_sizes=[3, 1]), "lo <= hi"),
    (lambda d: d["schedule"][0].pop("tree"), "missing field 'schedule\\[0\\].tree'"),
    (lambda d: d["schedule"][1]["tree"].update(schedule=[]), "must not hold a schedule"),
    (lambda d: d["schedule"][0].update(layout="diagonal"), "field 'schedule\\[0\\].layout'"),
    (lambda d: d["schedule"][0].update(predicted_speedup=-1), "field 'schedule\\[0\\].predicted_speedup'"),
    (lambda d: d["schedule"][0].update(tree=d["schedule"][1]["tree"]), "differs from the top-level tree"),
    (lambda d: d["schedule"][1]["tree"]["states"][0]["nodes"].insert(0, [1, 0]),
     "schedule\\[1\\].tree: field 'states\\[0\\].nodes\\[0\\]'"),
    (lambda d: d.update(schedule=[]), "field 'schedule' must be a non-empty list"),
])
def test_bad_schedules_are_refused(change, message):
    bad = _mutate(_scheduled_tree().to_json(), change)
    with pytest.raises(UserError, match=message) as e:
        tree_from_json(bad, "x.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x.json")


def test_schema_refuses_a_nested_schedule_and_a_method_mismatch_is_refused():
    data = _scheduled_tree().to_json()
    nested = _mutate(data, lambda d: d["schedule"][1]["tree"].update(schedule=json.loads(json.dumps(d["schedule"]))))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(nested, SCHEMA)
    tree = _scheduled_tree()
    tree.schedule[1].tree.method = "sequoia"
    with pytest.raises(UserError, match="schedule\\[1\\].tree.method"):
        save_tree(tree, "/nonexistent/never-written.json")


def test_plain_at_batch_size_one_keeps_the_first_tree_on_top():
    tree = _scheduled_tree()
    entries = [ScheduleEntry((1, 3), None, 1.0, 1.0, "packed")] + tree.schedule[1:]
    top = tree_with_schedule(entries)
    assert top.for_batch(1) is None and top.shape() == entries[1].tree.shape()
    tree_from_json(top.to_json(), "x.json")


# ------------------------------------------------------------------ planner plan --batch-sizes


def test_plan_cli_writes_a_schedule_with_one_line_per_range(tmp_path, capsys, profile_file):
    out = tmp_path / "t.json"
    assert main(["plan", "medusa", "--accept", MEDUSA, "--profile", str(profile_file), "--batch-sizes", "16,1,4",
                 "--max-size", "30", "-o", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    ranges = [line for line in err if line.startswith("  batch ")]
    assert [line.split(":")[0].strip() for line in ranges] == ["batch 1-3", "batch 4-15", "batch 16+"]
    data = json.loads(out.read_text())
    jsonschema.validate(data, SCHEMA)
    assert data["settings"]["batch_sizes"] == [1, 4, 16] and data["settings"]["layout"] == "packed"
    assert data["provenance"]["profile"]["file"] == str(profile_file)
    ppd = tmp_path / "p.json"
    assert main(["plan", "ppd", "--accept", PPD, "--profile", str(profile_file), "--batch-sizes", "1,16",
                 "--layout", "padded", "--max-input-length", "24", "--time-budget", "2", "-q", "-o", str(ppd)]) == 0
    assert load_tree(ppd).schedule[0].layout == "padded"


@pytest.mark.parametrize("args, message", [
    (["--batch-sizes", "1,4"], "--batch-sizes needs --profile"),
    (["--layout", "padded", "--size", "5"], "--layout needs --batch-sizes"),
    (["--kv-latency", "1e-5", "--size", "5"], "--kv-latency needs --batch-sizes"),
    (["--batch-sizes", "1,x", "--profile", "P"], "--batch-sizes: expected comma-separated integers"),
    (["--batch-sizes", "0,2", "--profile", "P"], "--batch-sizes: expected comma-separated integers"),
    (["--batch-sizes", "1,8", "--profile", "P"], "no latency series for batch size 8"),
    (["--batch-sizes", "1", "--profile", "P", "--layout", "padded", "--kv-latency", "-1"], "KV latency must be"),
])
def test_plan_cli_batch_option_errors(tmp_path, capsys, profile_file, args, message):
    out = tmp_path / "t.json"
    args = [str(profile_file) if a == "P" else a for a in args]
    assert main(["plan", "medusa", "--accept", MEDUSA, *args, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not out.exists()
