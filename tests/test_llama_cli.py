"""The workflows with --engine llama.cpp, end to end on the default model's GGUF file (small and fast):
profile -> accept -> plan dynamic -> decode from the plan alone, and the one-line refusals."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("Rewrite the following text in simpler words, keeping every fact.\n\nThe committee postponed the vote on "
          "the new budget because several members were absent, and the chair said the vote would be held next "
          "Tuesday at the usual time.")


def planner(*args, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "planner", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if ok and r.returncode != 0:
        raise AssertionError(f"planner {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    planner("profile", "--engine", "llama.cpp", "--input-lengths", "1:6", "--context-lengths", "64,160",
            "--time-budget", "4", "--threads", "1", "--no-progress", "-o", str(d / "profile.json"))
    prompts = d / "prompts.txt"
    prompts.write_text(PROMPT.replace("\n", " ") + "\nList three colours, then list them again in reverse order.\n")
    planner("accept", "--engine", "llama.cpp", "--guesser", "lookup", "--prompts", str(prompts), "--max-new-tokens",
            "24", "--calibrate", "--threads", "1", "--no-progress", "-o", str(d / "accept.json"))
    planner("plan", "dynamic", "--accept", f"lookup={d / 'accept.json'}", "--profile", str(d / "profile.json"),
            "-o", str(d / "plan.json"))
    return d


def test_profile_accept_plan_name_the_engine(flow):
    prof = json.loads((flow / "profile.json").read_text())
    assert prof["engine"] == "llama.cpp" and prof["llama_cpp"]["llamafile"] is False
    assert [s["context_length"] for s in prof["shapes"]] == [64, 160]
    assert {1, 6} <= set(prof["input_lengths"]) <= set(range(1, 7))  # coarse to fine: the ends first
    assert prof["decoder_overhead"]["fixed_s"] >= 0
    acc = json.loads((flow / "accept.json").read_text())
    assert acc["engine"] == "llama.cpp" and acc["guesser"]["kind"] == "lookup" and "calibration" in acc
    assert json.loads((flow / "plan.json").read_text())["engine"] == "llama.cpp"


def test_decode_follows_the_plans_engine_and_matches_plain(flow):
    out = flow / "decode.json"
    planner("decode", "--plan", str(flow / "plan.json"), "--prompt", PROMPT, "--max-new-tokens", "32",
            "--compare-plain", "--threads", "1", "--no-progress", "-o", str(out))
    doc = json.loads(out.read_text())
    assert doc["engine"] == "llama.cpp" and doc["summary"]["tokens"] == len(doc["results"][0]["tokens"])
    assert doc["summary"]["tokens_per_s"] > 0 and doc["summary"]["identical_to_plain"]
    from transformers import AutoTokenizer

    from decoder.engines.shipped import model_dir
    from workflows.cli.inputs import encode_prompts

    ids = encode_prompts(AutoTokenizer.from_pretrained(model_dir("smollm2-135m")), [PROMPT])[0].tolist()
    assert doc["results"][0]["prompt_ids"] == ids  # the chat template's ids, exactly what llama.cpp was fed


@pytest.mark.parametrize("args, message", [
    (["decode", "--engine", "llama.cpp", "--guesser", "parallelspec", "--prompt", "x"], "hidden states"),
    (["decode", "--engine", "llama.cpp", "--batch-size", "2", "--prompt", "x"], "--batch-size: not with --engine llama.cpp"),
    (["profile", "--engine", "graphs"], "only with --simulate"),
    (["profile", "--engine", "llama.cpp", "--model", "no-such.gguf"], "GGUF file not found"),
])
def test_refusals_are_one_line(args, message):
    r = planner(*args, ok=False)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_decode_with_a_contradicting_engine_is_refused(flow):
    r = planner("decode", "--plan", str(flow / "plan.json"), "--engine", "hf", "--prompt", "x", ok=False)
    assert r.returncode != 0 and "made for the llama.cpp engine" in r.stderr


def test_autotune_on_llama_cpp_writes_only_its_run_folder(tmp_path):
    """The llama.cpp main job end to end at toy sizes: a decision that names its engine, outputs identical to
    plain decoding, the oracle ceiling per race prompt, nothing written outside the run folder."""
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    run = tmp_path / "run"
    planner("autotune", "--engine", "llama.cpp", "--out", str(run), "--accept-prompts", "2", "--decode-prompts", "3",
            "--accept-tokens", "24", "--decode-tokens", "16", "--rounds", "1", "--profile-budget", "4", "--threads", "1",
            "--quiet", "--no-report")  # the report's figures: tests/test_autotune.py (the same pipeline)
    chosen = json.loads((run / "chosen.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert chosen["engine"] == "llama.cpp" and summary["engine"] == "llama.cpp"
    # the race measures plain on its selection prompts, and on the confirmation's when a plan is confirmed
    assert summary["identical_to_greedy"] and 1 <= summary["race_prompts"] <= 3
    assert len(summary["oracle_ceiling"]["per_prompt"]) == summary["race_prompts"]
    assert summary["oracle_ceiling"]["speedup"] >= 1.0
    assert {p.name for p in run.iterdir()} == {"profile.json", "accept-lookup.json", "trees", "chosen.json", "summary.json"}
    assert json.loads((run / "accept-lookup.json").read_text())["calibration"]["guesser"] == "lookup"
    assert subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout == before
