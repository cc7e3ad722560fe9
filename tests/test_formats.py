"""Acceptance, profile and tree files: round trips, schema agreement, bad inputs."""
import json

import jsonschema
import numpy as np
import pytest

from planner.accept import from_entry, load_acceptance
from planner.errors import UserError
from planner.plan import SHARED_DIR, plan
from planner.profile import LatencyProfile, load_profile
from planner.tree import SCHEMA_PATH, load_tree, save_tree, tree_from_json

PUBLISHED = SHARED_DIR / "data" / "published_acceptance.json"
SCHEMA = json.loads(SCHEMA_PATH.read_text())


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


# ------------------------------------------------------------------ acceptance


def test_acceptance_round_trip_and_collection(tmp_path):
    acc = load_acceptance(f"{PUBLISHED}:ppd-vicuna-7b")
    assert acc.accuracy.shape == (3, 10) and not acc.positional
    assert acc.source["name"] == "ppd-vicuna-7b" and len(acc.source["sha256"]) == 16
    p = write(tmp_path, "a.json", acc.to_json())
    again = load_acceptance(str(p))
    np.testing.assert_array_equal(again.accuracy, acc.accuracy)
    pos = from_entry({"positional": [0.5, 0.25]})
    assert pos.positional and pos.rows(5).shape == (5, 2) and pos.max_depth is None
    np.testing.assert_array_equal(load_acceptance(str(write(tmp_path, "p.json", pos.to_json()))).accuracy, pos.accuracy)


def test_ragged_rows_and_rounding_above_one_are_accepted(tmp_path):
    """Real matrices are ragged (the PPD authors' Vicuna-13B rows have 10, 10 and 5 ranks): missing
    ranks have probability 0. Rows within the tolerance above 1 are rounding: scaled to sum 1."""
    acc = load_acceptance(str(write(tmp_path, "r.json", {"accuracy": [[0.5, 0.1, 0.05], [0.3], [0.6, 0.4005]]})))
    assert acc.accuracy.shape == (3, 3)
    assert acc.accuracy[1].tolist() == [0.3, 0.0, 0.0]
    assert acc.accuracy[2].sum() == pytest.approx(1.0, abs=1e-15) and acc.accuracy[2, 0] == pytest.approx(0.6 / 1.0005)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ({"accuracy": [[0.5, 1.2]]}, "outside \\[0, 1\\]"),
    ({"accuracy": [[0.5, -0.1]]}, "outside \\[0, 1\\]"),
    ({"accuracy": [[0.7, 0.4]]}, "sums to 1.1000"),
    ({"accuracy": []}, "non-empty"),
    ({"accuracy": [[]]}, "non-empty"),
    ({"accuracy": [["x"]]}, "must be a number"),
    ({"positional": [0.5], "accuracy": [[0.5]]}, "exactly one"),
    ([1, 2], "expected a JSON object"),
])
def test_acceptance_bad_inputs(tmp_path, content, message):
    p = write(tmp_path, "bad.json", content)
    with pytest.raises(UserError, match=message) as e:
        load_acceptance(str(p))
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_acceptance_missing_file_and_unknown_name(tmp_path):
    with pytest.raises(UserError, match="file not found"):
        load_acceptance(str(tmp_path / "nope.json"))
    with pytest.raises(UserError, match="no entry named 'nope'.*ppd-vicuna-7b"):
        load_acceptance(f"{PUBLISHED}:nope")
    with pytest.raises(UserError, match="collection file"):
        load_acceptance(str(PUBLISHED))
    with pytest.raises(UserError, match="depth 4 asked"):
        load_acceptance(f"{PUBLISHED}:ppd-vicuna-7b").rows(4)


# ------------------------------------------------------------------ profile


def test_profile_round_trip_and_fit_preferred(tmp_path):
    p = write(tmp_path, "prof.json", {"input_lengths": [1, 8, 64], "latency_s": [0.01, 0.01, 0.03], "device": "cpu"})
    prof = load_profile(str(p))
    assert prof.latency(36) == pytest.approx(0.02) and prof.source["device"] == "cpu"
    q = write(tmp_path, "rich.json", {"input_lengths": [1, 2], "latency_s": [9.0, 9.0],
                                       "fit": {"kind": "piecewise_linear", "input_lengths": [1, 4], "latency_s": [1.0, 2.0]}})
    assert load_profile(str(q)).latency(4) == pytest.approx(2.0)
    with pytest.raises(UserError, match="outside the profiled range 1..64"):
        prof.latency(65)


@pytest.mark.parametrize("content, message", [
    ("[", "not valid JSON"),
    ({"input_lengths": [1, 2]}, "missing field 'latency_s'"),
    ({"input_lengths": [1, 2], "latency_s": [0.1]}, "differ in length"),
    ({"input_lengths": [2, 1], "latency_s": [0.1, 0.2]}, "strictly increasing"),
    ({"input_lengths": [0, 1], "latency_s": [0.1, 0.2]}, "positive integer"),
    ({"input_lengths": [1, 2], "latency_s": [0.1, -0.2]}, "must be positive"),
])
def test_profile_bad_inputs(tmp_path, content, message):
    p = write(tmp_path, "bad.json", content)
    with pytest.raises(UserError, match=message):
        load_profile(str(p))


# ------------------------------------------------------------------ trees


def _trees():
    med = load_acceptance(f"{PUBLISHED}:medusa-vicuna-7b")
    ppd = load_acceptance(f"{PUBLISHED}:ppd-vicuna-7b")
    prof = LatencyProfile(np.array([1, 16, 128]), np.array([1.0, 1.0, 3.0]), {"file": "synthetic"})
    return [
        plan("medusa", med, size=20),
        plan("sequoia", med, size=20, max_depth=3),
        plan("ppd", ppd, input_length=40),
        plan("sequoia", med, profile=prof, max_size=30),
        plan("ppd", ppd, profile=prof, max_input_length=48),
    ]


def test_tree_round_trip_and_schema(tmp_path):
    for i, tree in enumerate(_trees()):
        path = tmp_path / f"t{i}.json"
        save_tree(tree, path)
        data = json.loads(path.read_text())
        jsonschema.validate(data, SCHEMA)
        back = load_tree(path)
        assert back.to_json() == data
        assert back.method == tree.method and back.states[0].nodes == tree.states[0].nodes


def _mutate(data, f):
    data = json.loads(json.dumps(data))
    f(data)
    return data


@pytest.mark.parametrize("change, message", [
    (lambda d: d["states"][0]["nodes"].insert(0, [1, 0]), "before its parent"),
    (lambda d: d["states"][0].update(input_length=3), "the tree has"),
    (lambda d: d.update(method="beam"), "expected one of"),
    (lambda d: d["states"][0]["nodes"].append([9, 9, 9]), "before its parent"),
    (lambda d: d["states"][0].update(expected_tokens=999), "impossible"),
    (lambda d: d.pop("states"), "missing field 'states'"),
])
def test_bad_trees_are_refused_by_both_checks(change, message):
    good = _trees()[1].to_json()
    bad = _mutate(good, change)
    with pytest.raises(UserError, match=message):
        tree_from_json(bad, "x.json")


def test_sequoia_contiguity_and_ppd_depth_checks():
    seq = _trees()[1].to_json()
    bad = _mutate(seq, lambda d: (d["states"][0]["nodes"].append([7]), d["states"][0].update(input_length=d["states"][0]["input_length"] + 1)))
    with pytest.raises(UserError, match="contiguous"):
        tree_from_json(bad, "x.json")
    jsonschema.validate(bad, SCHEMA)  # legal JSON shape: the meaning check is what refuses it
    ppd = _trees()[2].to_json()
    deep = _mutate(ppd, lambda d: d["states"][1]["nodes"].append([0, 0]) or d["states"][1]["prompt_tokens"].append(0)
                   or d["states"][1].update(input_length=d["states"][1]["input_length"] + 1))
    with pytest.raises(UserError, match="reaches depth 2, state 1"):
        tree_from_json(deep, "x.json")
    no_pt = _mutate(ppd, lambda d: d["states"][2].pop("prompt_tokens"))
    with pytest.raises(UserError, match="prompt_tokens"):
        tree_from_json(no_pt, "x.json")


def test_committed_example_trees_are_valid():
    trees = sorted(p for p in SCHEMA_PATH.parent.glob("*.json") if p.name != "schema.json")
    assert trees
    for p in trees:
        jsonschema.validate(json.loads(p.read_text()), SCHEMA)
        tree = load_tree(p)
        if tree.method == "ppd":
            pi = np.array([st.stationary_probability for st in tree.states])
            M = np.array([st.transitions for st in tree.states])
            np.testing.assert_allclose(pi @ M, pi, atol=1e-9)
