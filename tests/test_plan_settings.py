"""A plan carries what it was raced with (planner/plan_settings.py): typed, checked on load, and
`planner decode --plan` runs it the same way with no other flag (issue 30 item 1)."""
import json
import shutil

import pytest
import torch
from test_decoder_utils import static_tree

from planner.errors import UserError
from planner.plan_settings import RacedWith, digest, file_ref, plan_settings
from planner.tree import MEDUSA, Tree, TreeState, load_tree, save_tree
from workflows.cli.main import main

torch.set_num_threads(1)


def test_runtime_settings_are_typed_and_checked():
    run = plan_settings({"guesser": "lookup", "pad_to": {"3": 4}, "pearl": {"gamma": 3, "threads": [1, 1]},
                         "decision": "anything else is a record"})
    assert run.guesser == "lookup" and run.pad_to == {3: 4} and run.pearl.threads == (1, 1)
    for bad, field in (({"guesser": "nope"}, "settings.guesser"), ({"pad_to": {"4": 2}}, "settings.pad_to"),
                       ({"pearl": {"gamma": 0}}, "settings.pearl.gamma"),
                       ({"raced_with": {"engine": "tpu"}}, "settings.raced_with.engine"),
                       ({"raced_with": {"profile": {"path": "p.json", "sha256": "x"}}}, "settings.raced_with.profile")):
        with pytest.raises(UserError, match=f"plan.json: .*{field}"):
            plan_settings(bad, "plan.json")
    assert plan_settings(None).raced_with is None  # older files: no runtime fields at all


def test_a_bad_runtime_field_fails_when_the_plan_loads(tmp_path):
    tree = static_tree("medusa", 4, 2)
    tree.settings = {"pad_to": {"2": 1}}
    path = save_tree(tree, tmp_path / "t.json")
    with pytest.raises(UserError, match="t.json: field 'settings.pad_to'"):
        load_tree(path)


def test_file_references_are_relative_to_the_plan_and_checked(tmp_path):
    run = tmp_path / "run"
    (run / "trees").mkdir(parents=True)
    (run / "profile.json").write_text("{}")
    guesser = tmp_path / "models" / "g"
    guesser.mkdir(parents=True)
    (guesser / "w.bin").write_bytes(b"\x00\x01")
    ref = file_ref(run / "profile.json", run / "trees")
    assert ref.path == "../profile.json" and ref.check(run / "trees", "x", "profile") == run / "trees" / "../profile.json"
    g = file_ref(guesser, run)
    assert g.path == "../models/g" and g.sha256 == digest(guesser)
    (guesser / "w.bin").write_bytes(b"\x00\x02")
    with pytest.raises(UserError, match="x: the guesser's files ../models/g changed since the plan was raced"):
        g.check(run, "x", "the guesser's files")
    (run / "profile.json").unlink()
    with pytest.raises(UserError, match="x: profile ../profile.json .* is missing"):
        ref.check(run / "trees", "x", "profile")


def _raced_plan(tmp_path, profile_src):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(profile_src, run / "profile.json")
    tree = Tree(MEDUSA, [TreeState(0, [(0,), (0, 0)], 1.5, 3)], 1.5)  # a chain: what lookup proposes
    tree.settings = {"guesser": "lookup",
                     "raced_with": RacedWith("hf", 1, file_ref(run / "profile.json", run), None).to_json()}
    return save_tree(tree, run / "chosen.json"), run


def test_decode_runs_the_plan_as_raced_and_says_so(tmp_path, capsys):
    from workflows.cli.inputs import REPO

    plan, run = _raced_plan(tmp_path, REPO / "profiles" / "cpu-builtin.json")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello hello hello\n")
    out = tmp_path / "out.json"
    assert main(["decode", "--plan", str(plan), "--model", "tiny", "--prompts", str(prompts), "--max-new-tokens", "6",
                 "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "decoding as raced: matmul paths of" in err and "1 threads" in err
    assert json.loads(out.read_text())["matmul_paths_profile"].endswith("profile.json")
    (run / "profile.json").write_text((run / "profile.json").read_text().replace("}", ", \"x\": 1}", 1))
    assert main(["decode", "--plan", str(plan), "--model", "tiny", "--prompts", str(prompts), "--max-new-tokens", "6"]) == 2
    assert "profile (matmul paths) profile.json changed since the plan was raced" in capsys.readouterr().err
    # a flag overrides the record: here no profile at all is read
    other = tmp_path / "other.json"
    shutil.copy(REPO / "profiles" / "cpu-builtin.json", other)
    assert main(["decode", "--plan", str(plan), "--model", "tiny", "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--profile", str(other), "--no-progress"]) == 0


def test_free_threads_leave_the_cores_other_processes_hold(monkeypatch):
    import profiler.load as load

    for others, threads, want in ((None, 2, 2), (0.1, 2, 2), (0.49, 2, 2), (1.0, 2, 1), (1.6, 4, 2), (3.9, 4, 1),
                                  (8.0, 2, 1)):
        monkeypatch.setattr(load, "other_cores", lambda seconds=0.5, o=others: o)
        assert load.free_threads(threads) == (want, others)


def test_a_plan_raced_on_free_cores_decodes_on_the_cores_free_now(tmp_path, capsys, monkeypatch):
    import profiler.load as load
    from workflows.cli.inputs import REPO

    plan, run = _raced_plan(tmp_path, REPO / "profiles" / "cpu-builtin.json")
    tree = load_tree(plan)
    raced = dict(tree.settings["raced_with"], free_cores=True)
    tree.settings = dict(tree.settings, raced_with=raced)
    save_tree(tree, plan)
    assert plan_settings(load_tree(plan).settings).raced_with.free_cores
    with pytest.raises(UserError, match="settings.raced_with.free_cores"):
        plan_settings({"raced_with": {"free_cores": "yes"}}, "plan.json")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello hello hello\n")
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(load, "other_cores", lambda seconds=0.5: 0.0)  # a quiet machine now: every core
        assert main(["decode", "--plan", str(plan), "--model", "tiny", "--prompts", str(prompts),
                     "--max-new-tokens", "4"]) == 0
        assert "2 threads (the cores free now; raced on the 1 a busy machine left)" in capsys.readouterr().err
        monkeypatch.setattr(load, "other_cores", lambda seconds=0.5: 1.0)  # one core taken now
        assert main(["decode", "--plan", str(plan), "--model", "tiny", "--prompts", str(prompts),
                     "--max-new-tokens", "4"]) == 0
        assert "1 threads (the cores free now" in capsys.readouterr().err
    finally:
        torch.set_num_threads(1)
