"""Tuned for the user's sampling settings: the flags on every command (one-line errors), the files
recording what they were made for, `planner decode` warning when run with other settings, and
autotune end to end under temperature / top-p on the built-in model."""
import json

import pytest
import torch

from planner.tree import load_tree
from workflows.cli.main import main

BAD = [
    (["--temperature", "-1"], "--temperature: expected a finite number in [0, 100]"),
    (["--temperature", "nan"], "--temperature: expected a finite number in [0, 100]"),
    (["--temperature", "1e9"], "--temperature: expected a finite number in [0, 100]"),
    (["--temperature", "0.7", "--top-p", "0"], "--top-p: expected a number in (0, 1]"),
    (["--temperature", "0.7", "--top-p", "1.5"], "--top-p: expected a finite number in [0.0, 1.0]"),
    (["--temperature", "0.7", "--top-k", "-3"], "--top-k: expected an integer >= 0"),
    (["--temperature", "0.7", "--top-k", "99999999"], "--top-k: expected an integer in 0..1000000"),
]


@pytest.mark.parametrize("command", [["decode"], ["accept", "-o", "x.json"], ["autotune"],
                                     ["plan", "medusa", "--accept", "a.json"], ["tune", "--accept", "a.json", "-o", "b.json"]])
@pytest.mark.parametrize("flags,message", BAD)
def test_bad_sampling_flags_are_one_line_errors(command, flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"accuracy": [[0.5, 0.2]]}))
    code = main(command + flags)
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "b.json").exists()


def test_typical_acceptance_is_asked_for(capsys):
    assert main(["autotune", "--verify", "typical"]) == 2
    assert "--verify typical: samples; give --temperature > 0" in capsys.readouterr().err
    assert main(["tune", "--accept", "x.json", "--allow-typical", "-o", "y.json"]) == 2
    assert "--allow-typical: typical acceptance samples" in capsys.readouterr().err


def test_mismatch_lines():
    from planner.sampling import Sampling, mismatch, record

    s = Sampling(0.7, 0, 0.9)
    assert mismatch(record(s), s, "plan") is None
    assert mismatch(None, Sampling(0.0), "plan") is None  # a file from before: greedy, as it was made
    line = mismatch(None, s, "--plan x.json")
    assert line == ("--plan x.json was tuned for greedy decoding, this run uses temperature 0.7, top-p 0.9: its "
                    "choice may not be the fastest here")
    assert "top-k 50" in mismatch(record(s), Sampling(1.0, 50, 1.0), "p")


def test_plan_records_its_settings_and_notes_acceptance_measured_under_others(tmp_path, capsys):
    acc = tmp_path / "a.json"
    acc.write_text(json.dumps({"accuracy": [[0.5, 0.2], [0.4, 0.1]],
                               "sampling": {"temperature": 0.7, "top_k": 0, "top_p": 0.9}}))
    out = tmp_path / "t.json"
    assert main(["plan", "medusa", "--accept", str(acc), "--size", "3", "-o", str(out), "-q",
                 "--temperature", "0.7", "--top-p", "0.9"]) == 0
    assert capsys.readouterr().err == ""
    assert load_tree(out).settings["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
    assert main(["plan", "medusa", "--accept", str(acc), "--size", "3", "-o", str(out), "-q"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("planner plan: note: --accept") and "measured under temperature 0.7, top-p 0.9" in err
    assert len(err.splitlines()) == 1


def test_autotune_under_sampling_on_the_builtin_model(tmp_path, capsys):
    from decoder.engines.hf.load import load_model
    from decoder.torch_ops.draft_lm import build_draft_lm, save_draft_lm
    from workflows.mainjob.pipeline import AutotuneSettings, autotune

    target = load_model("builtin", device="cpu", dtype="fp32").model
    torch.manual_seed(0)
    save_draft_lm(build_draft_lm(target, 1), tmp_path / "draft")
    run = tmp_path / "run"
    s = AutotuneSettings(model="builtin", guessers=("ppd", "lookup", "draft"), guesser_dirs={"draft": str(tmp_path / "draft")},
                         out=str(run), accept_prompts=2, decode_prompts=4, accept_tokens=16, decode_tokens=12,
                         max_input_length=10, context_length=32, profile_budget_s=2.0, rounds=1, report=False,
                         progress=False, threads=1, temperature=0.7, top_p=0.9)
    summary = autotune(s)
    want = {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
    assert summary["sampling"] == want and summary["distribution_exact"] is True
    assert summary["identical_to_greedy"] is None  # outputs are not compared when sampling
    for kind in ("ppd", "lookup", "draft"):
        assert json.loads((run / f"accept-{kind}.json").read_text())["sampling"] == want
    # lookup's per-step confidence calibrated on the sampled text (p-scored); the draft LM keeps its rows
    cal = json.loads((run / "accept-lookup.json").read_text())["calibration"]
    assert cal["sampling"] == want and cal["observations"] > 0 and "sampled decode" in cal["source"]
    assert "calibration" not in json.loads((run / "accept-draft.json").read_text())
    # a plan of deterministic guesses is predicted by replaying the sampled text (exact in law); a sampled
    # draft's acceptance hangs on its own draw, and PPD's logits were not captured: the cost model
    by = {r["label"]: (r["guesser"], r["prediction"]["method"]) for r in summary["rows"]}
    assert all(m == ("replay" if g == "lookup" else "cost model") for g, m in by.values()), by
    rows = {(r["guesser"], r["method"]) for r in summary["rows"]}
    assert ("draft", "medusa") not in rows  # sampled children need contiguous sibling ranks
    assert all(load_tree(r["tree"]).settings["sampling"] == want for r in summary["rows"])
    assert load_tree(run / "chosen.json").settings["sampling"] == want
    capsys.readouterr()
    code = main(["decode", "--plan", str(run / "chosen.json"), "--model", "builtin", "--num-prompts", "1",
                 "--max-new-tokens", "2", "--no-progress"])
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert code == 0 and len(err) == 1 and "tuned for temperature 0.7, top-p 0.9, this run uses greedy decoding" in err[0]


def test_autotune_with_coupled_sampling_checks_every_plan_against_plain_sampling(tmp_path, capsys):
    """--verify coupled (the CLI's default under sampling): every raced plan emits plain sampling's
    text with the same seed, so the race compares them (a differing plan would leave it), chosen.json
    records the rule and `planner decode --plan` runs it."""
    from decoder.engines.hf.load import load_model
    from workflows.mainjob.pipeline import AutotuneSettings, autotune

    load_model("builtin", device="cpu", dtype="fp32")
    run = tmp_path / "run"
    s = AutotuneSettings(model="builtin", guessers=("ppd", "lookup"), out=str(run), accept_prompts=2, decode_prompts=4,
                         accept_tokens=16, decode_tokens=12, max_input_length=10, context_length=32, profile_budget_s=2.0,
                         rounds=1, report=False, progress=False, threads=1, temperature=0.7, top_p=0.9, verify="coupled")
    summary = autotune(s)
    assert summary["verify"] == "coupled" and summary["distribution_exact"] is True
    assert summary["identical_to_greedy"] is None and summary["identical_to_plain_sampling"] is True
    raced = [r for r in summary["rows"] if r["measured_speedup"] is not None]
    assert raced and all(r["identical_to_plain_sampling"] is True for r in raced)
    chosen = load_tree(run / "chosen.json")
    assert chosen.settings["verify"] == "coupled"
    if chosen.settings.get("guesser") not in (None, "plain"):
        out = tmp_path / "out.json"
        capsys.readouterr()
        assert main(["decode", "--plan", str(run / "chosen.json"), "--model", "builtin", "--num-prompts", "1",
                     "--max-new-tokens", "4", "--temperature", "0.7", "--top-p", "0.9", "--no-progress",
                     "-o", str(out)]) == 0
        assert json.loads(out.read_text())["settings"]["verify"] == "coupled"
