"""A new engine is one module and one registration (planner/engines.py): a toy engine (tests/toy_engine.py,
a bigram table) registered in a few lines runs profile, accept, plan, decode and the main job through the
same code paths as the shipped engines, and the registry refuses what an engine cannot do in one line."""
from __future__ import annotations

import json

import pytest

from planner.engines import EngineCaps, EngineDefaults, EngineKind, kind, names, register, unregister
from planner.errors import UserError
from workflows.cli.main import main

TOY_CAPS = EngineCaps("toy", hidden_states=False, input_embeddings=False, trees=True, batches=False)
TOY_DEFAULTS = EngineDefaults(decode_tokens=12, rounds=1, budget_minutes=2.0, decode_prompts=3, turns=1,
                              max_input_length=8, context_lengths=(32,), profile_context_lengths=(32,),
                              profile_time_budget_s=1.0, profile_budget_s=2.0, sampled_rule="coupled")


@pytest.fixture
def toy():
    spec = register(EngineKind("toy", "a bigram table (tests)", "toy_engine:open_engine", TOY_CAPS, TOY_DEFAULTS,
                               refuses=(("--device", "it has no devices"),)))
    yield spec
    unregister("toy")


def test_a_toy_engine_runs_every_command_and_the_main_job(toy, tmp_path, capsys):
    prof, acc, plan, out, run = (tmp_path / n for n in ("p.json", "a.json", "plan.json", "d.json", "run"))
    assert main(["profile", "--engine", "toy", "--input-lengths", "1:8", "--no-progress", "-o", str(prof)]) == 0
    profile = json.loads(prof.read_text())
    assert profile["engine"] == "toy" and profile["context_length"] == 32 and profile["shape"] == "tree"
    assert main(["accept", "--engine", "toy", "--guesser", "lookup", "--num-prompts", "3", "--max-new-tokens", "24",
                 "--calibrate", "--no-progress", "-o", str(acc)]) == 0
    assert json.loads(acc.read_text())["engine"] == "toy"
    assert main(["plan", "dynamic", "--accept", str(acc), "--profile", str(prof), "--max-size", "6", "-q",
                 "-o", str(plan)]) == 0
    assert json.loads(plan.read_text())["engine"] == "toy"  # a plan takes its profile's engine
    assert main(["decode", "--plan", str(plan), "--num-prompts", "2", "--max-new-tokens", "16", "--compare-plain",
                 "--no-progress", "-o", str(out)]) == 0  # no --engine: the plan names it
    doc = json.loads(out.read_text())
    assert doc["engine"] == "toy" and doc["summary"]["identical_to_plain"] is True
    assert main(["autotune", "--engine", "toy", "--out", str(run), "--accept-prompts", "2", "--accept-tokens", "16",
                 "--no-report", "--quiet"]) == 0
    chosen, summary = (json.loads((run / f).read_text()) for f in ("chosen.json", "summary.json"))
    assert chosen["engine"] == "toy" and summary["engine"] == "toy" and summary["identical_to_greedy"] is True
    assert set(summary["accept"]) == {"lookup"}  # the only shipped guesser a chain-scoring bigram engine runs
    assert summary["settings"]["decode_tokens"] == TOY_DEFAULTS.decode_tokens  # the engine's defaults, as data


def test_what_an_engine_lacks_is_refused_in_one_line(toy, capsys):
    assert main(["decode", "--engine", "toy", "--guesser", "parallelspec", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "needs hidden states" in err and "--engine hf" in err and len(err.strip().splitlines()) == 1
    assert main(["decode", "--engine", "toy", "--device", "cpu", "--prompt", "x"]) == 2
    assert "--device: not with --engine toy (it has no devices)" in capsys.readouterr().err


def test_the_registry_is_the_list_of_engines(toy):
    assert names()[:2] == ["hf", "llama.cpp"] and "toy" in names()
    assert kind("toy").caps.trees and not kind("toy").caps.hidden_states
    with pytest.raises(UserError, match="--engine nope: expected one of hf, llama.cpp"):
        kind("nope")
    with pytest.raises(ValueError, match="registered twice"):
        register(EngineKind("toy", "again", "toy_engine:open_engine", TOY_CAPS))


def test_an_engine_whose_library_is_missing_says_how_to_install_it(toy, monkeypatch):
    from decoder.engines.registry import EngineRequest, open_engine

    unregister("toy")
    register(EngineKind("toy", "needs a library", "toy_engine:open_engine", TOY_CAPS, requires="no_such_library_xyz",
                        install="scripts/install_engine.sh toy"))
    monkeypatch.setenv("TREE_PLANNER_NO_INSTALL", "1")
    with pytest.raises(UserError, match=r"no_such_library_xyz is not installed \(run bash scripts/install_engine.sh toy"):
        open_engine("toy", EngineRequest())
