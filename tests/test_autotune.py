"""planner autotune: the pipeline end to end on the built-in model (small settings), and its pieces."""
import json

import numpy as np
import pytest
import torch

from planner.accept import from_entry
from planner.errors import UserError
from planner.profile import LatencyProfile
from planner.tree import load_tree
from workflows.cli.inputs import REPO, held_out_prompts
from workflows.mainjob.candidates import pick, plan_candidates, real_input_length
from workflows.mainjob.measure import profile_lengths
from workflows.mainjob.pipeline import AutotuneSettings, autotune

ACC = from_entry({"accuracy": [[0.5, 0.2, 0.1, 0.05], [0.3, 0.15, 0.1, 0.05], [0.2, 0.1, 0.1, 0.05]]})


def flat_then_linear(knee: int, top: int = 64) -> LatencyProfile:
    n = np.arange(1, top + 1)
    return LatencyProfile(n, 0.01 * np.maximum(1.0, n / knee), {"file": "synthetic"})


@pytest.mark.parametrize("method", ["ppd", "medusa", "sequoia"])
def test_real_input_length_matches_the_decoder_layouts(method):
    from decoder import OracleGuesser

    cands = plan_candidates(method, ACC, flat_then_linear(16), prompt_tokens=3, ensemble=1, max_input_length=40)
    assert cands
    g = OracleGuesser(torch.arange(50), vocab_size=64, num_distances=3, top_k=4,
                      prompt_tokens=_random_prompt_tokens())
    for c in cands[:: max(1, len(cands) // 4)]:
        g.check(c.tree)
        pb = g.layouts(c.tree, torch.float32, "cpu")
        if method == "ppd":
            want = sum(st.stationary_probability * pb.states[st.state].input_length for st in c.tree.states)
        else:
            want = pb.states[0].input_length
        assert real_input_length(c.tree, ensemble=1) == pytest.approx(want)
        assert c.input_length <= 40 + 1e-9


def _random_prompt_tokens():
    from decoder import PromptTokens

    return PromptTokens(3, 1, hidden_size=8, top_k=4)


def test_pick_chooses_the_best_prediction_and_keeps_neighbours():
    cands = []
    for m in ("ppd", "medusa"):
        cands += plan_candidates(m, ACC, flat_then_linear(12), prompt_tokens=3, ensemble=1, max_input_length=32)
    best, tried = pick(cands, neighbours=2)
    assert best.predicted_speedup == max(c.predicted_speedup for c in cands)
    assert best in tried
    assert {c.method for c in tried} == {"ppd", "medusa"}
    same = sorted((c for c in cands if c.method == best.method), key=lambda c: (c.input_length, c.size))
    i = same.index(best)
    for c in same[max(0, i - 2): i + 3]:
        assert c in tried


def test_held_out_prompts_are_disjoint_and_held_out(tmp_path):
    rows = [{"question_id": q, "turns": [f"question {q}", "second"]} for q in range(81, 161)]
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    a, d = held_out_prompts(str(f), 8, 8)
    assert len(a) == len(d) == 8 and not set(a) & set(d)
    assert all(int(t.split()[1]) % 5 == 0 for t in a + d)
    with pytest.raises(UserError, match="held-out questions"):
        held_out_prompts(str(f), 10, 10)
    f.write_text("not json\n")
    with pytest.raises(UserError, match="line 1"):
        held_out_prompts(str(f), 1, 1)


def _tracked_state() -> str:
    import subprocess

    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                          cwd=str(REPO)).stdout


def test_autotune_end_to_end_on_the_builtin_model(tmp_path):
    before = _tracked_state()
    s = AutotuneSettings(model="builtin", guessers=("ppd", "lookup"), out=str(tmp_path / "run"), accept_prompts=2,
                         decode_prompts=4, accept_tokens=16, decode_tokens=12, max_input_length=10,
                         context_length=32, profile_budget_s=2.0, rounds=1, report=False, progress=False, threads=1)
    summary = autotune(s)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["identical_to_greedy"] is True and summary["identical_to_greedy"] is True
    assert {(r["guesser"], r["method"]) for r in saved["rows"]} == {
        ("ppd", "ppd"), ("ppd", "medusa"), ("ppd", "sequoia"), ("lookup", "chain"),
        ("ppd", "dynamic"), ("lookup", "dynamic"), ("lookup+ppd", "dynamic")}  # per-step trees and the hybrid race too
    for r in saved["rows"]:
        for key in ("method", "input_length", "predicted_tokens_per_step", "predicted_speedup", "cost_vs_plain_step"):
            assert isinstance(r[key], (int, float, str))
        assert r["input_length"] <= 10
        load_tree(r["tree"])
        if r["measured_speedup"] is not None:  # raced on at least one prompt: errors reported
            assert r["prompts"] >= 1 and r["identical_to_greedy"] is True
            for key in ("error_tokens_per_step", "error_step_s", "error_speedup", "measured_step_s", "predicted_step_s"):
                assert isinstance(r[key], float)
    d = saved["decision"]
    chosen = load_tree(tmp_path / "run" / "chosen.json")  # the decision, always written, plain included
    if d["choice"] == "plain":
        assert not chosen.states[0].nodes and chosen.settings["guesser"] == "plain"
        assert not any(r["chosen"] for r in saved["rows"])
    else:
        (row,) = [r for r in saved["rows"] if r["chosen"]]
        assert row["label"] == d["choice"] and d["measured_speedup"]["lo"] > 1.0
        assert chosen.method == row["method"]
    assert d["reason"] and saved["chosen"].endswith("chosen.json")
    for name in ("profile.json", "accept-ppd.json", "accept-lookup.json"):
        assert (tmp_path / "run" / name).is_file()
    assert json.loads((tmp_path / "run" / "accept-lookup.json").read_text())["positions"] == 2 * 16
    for kind in ("lookup", "ppd"):  # calibrated by replaying the shared decode: dynamic plans use it
        assert json.loads((tmp_path / "run" / f"accept-{kind}.json").read_text())["calibration"]["observations"] > 0
    by = {r["label"]: r["prediction"]["method"] for r in saved["rows"]}
    assert all(m == "replay" for m in by.values()), by  # every finalist predicted from its replayed steps
    assert saved["prediction_error"]["predicted_by"] == ["replay"] or not saved["prediction_error"]["rows"]
    assert _tracked_state() == before  # the main job writes into its run folder only


def test_autotune_runs_every_drafter_and_pearl(tmp_path):
    """Every drafter kind goes through acceptance, planning and decoding (untrained drafters on the
    toy model: the point is that each path runs and stays identical to greedy decoding)."""
    import torch

    from decoder.engines.hf.load import load_model
    from decoder.torch_ops.draft_lm import build_draft_lm, save_draft_lm
    from decoder.guessers.parallel import ParallelDrafter, arch_of

    target = load_model("builtin", device="cpu", dtype="fp32").model
    torch.manual_seed(0)
    save_draft_lm(build_draft_lm(target, 1), tmp_path / "draft")
    ParallelDrafter(arch_of(target.config), num_masks=2, top_k=4).save(tmp_path / "ps")
    s = AutotuneSettings(model="builtin", guessers=("draft", "parallelspec", "chain"), out=str(tmp_path / "run"),
                         guesser_dirs={"draft": str(tmp_path / "draft"), "parallelspec": str(tmp_path / "ps"),
                                       "chain": str(tmp_path / "ps")},
                         accept_prompts=1, decode_prompts=3, accept_tokens=12,
                         decode_tokens=10, max_input_length=8, context_length=32, profile_budget_s=2.0, rounds=1,
                         report=False, progress=False, threads=1)
    summary = autotune(s)
    assert summary["identical_to_greedy"] is True
    assert {r["guesser"] for r in summary["rows"]} >= {"draft", "parallelspec", "chain"}
    assert summary["pearl"]["split"] == [1, 1] and [s["split"] for s in summary["pearl"]["splits"]] == [[1, 1]]
    pearl = [r for r in summary["rows"] if r["guesser"] == "pearl"]
    assert pearl and all(load_tree(r["tree"]).settings["pearl"]["threads"] == [1, 1] for r in pearl)  # decode runs it so
    for kind in ("draft", "parallelspec", "chain"):
        acc = json.loads((tmp_path / "run" / f"accept-{kind}.json").read_text())
        assert len(acc["accuracy"][0]) > 1  # ranks measured (the chain's as a comb)


def test_profile_lengths_are_dense_where_trees_are_small_and_end_at_the_maximum():
    assert profile_lengths(10) == list(range(1, 11))
    got = profile_lengths(64)
    assert got[:16] == list(range(1, 17)) and got[-1] == 64 and 18 in got and 17 not in got and 36 in got
    assert profile_lengths(70)[-2:] == [64, 70] and profile_lengths(80)[-2:] == [72, 80]


def test_a_busy_machine_is_measured_on_its_free_cores(monkeypatch):
    """No --threads and another process holding a core: autotune measures on the cores left free
    (profiler.load.free_threads), says so, and skips PEARL (two jobs on their own cores); on a quiet
    machine nothing changes. chosen.json's raced_with.free_cores then lets decode take the cores free
    when it runs (tests/test_plan_settings.py)."""
    from types import SimpleNamespace

    import profiler.load as load
    import profiler.machine as machine
    from workflows.mainjob.pipeline import AutotuneSettings
    from workflows.mainjob.step import _pearl_fits, _threads

    said = []
    lends = SimpleNamespace(caps=SimpleNamespace(torch_modules=True))
    monkeypatch.setattr(machine, "cores", lambda: 2)
    monkeypatch.setattr(load, "other_cores", lambda seconds=0.5: 0.05)
    assert _threads(AutotuneSettings(), said.append) == (None, False) and not said
    monkeypatch.setattr(load, "other_cores", lambda seconds=0.5: 1.0)
    assert _threads(AutotuneSettings(), said.append) == (1, True)
    assert said == ["other processes keep 1.0 cores busy: measuring on 1 of 2 threads (--threads overrides; "
                    "the plan decodes on the cores free when it runs)"]
    assert _threads(AutotuneSettings(threads=2), said.append) == (2, False)  # --threads: as asked
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # measuring on the one free core
        assert _pearl_fits(SimpleNamespace(free_cores=True, say=said.append, engine=lends)) is False
        assert "PEARL not measured" in said[-1]
        # --threads 1 asked for (not cut by the load): measured
        assert _pearl_fits(SimpleNamespace(free_cores=False, say=said.append, engine=lends)) is True
        nothing_lent = SimpleNamespace(caps=SimpleNamespace(torch_modules=False))
        assert _pearl_fits(SimpleNamespace(free_cores=False, say=said.append, engine=nothing_lent)) is False
    finally:
        torch.set_num_threads(before)
