"""The llama.cpp engine under the user's sampling settings, on the default model's own GGUF file:
lookup's sampled acceptance and its calibration as the hf engine defines them (profiler/sampled.py,
profiler/calibration.py), `planner accept` and `planner autotune --engine llama.cpp --temperature ...`
end to end at toy sizes, the files recording their settings, and the one-line refusals."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from planner.errors import UserError
from planner.sampling import Sampling

pytest.importorskip("llama_cpp")
ROOT = Path(__file__).resolve().parents[1]
WARM = Sampling(0.7, 0, 0.9)
RECORD = {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
N_NEW = 24
SEED = 3
# the committed llama.cpp main job's profile: reusing it keeps the end-to-end run to the phases under test
PROFILE = ROOT / "reports" / "autotune-llama.cpp-cpu-smollm2-135m" / "profile.json"
PROMPTS = ["List three colours of the rainbow, then repeat the list in reverse order.",
           "Rewrite the following text in simpler words, keeping every fact.\n\nThe committee postponed the vote on "
           "the new budget because several members were absent, and the chair said the vote would be held next "
           "Tuesday at the usual time."]


@pytest.fixture(scope="module")
def engine():
    from decoder.engines.llama_cpp.engine import LlamaEngine
    from decoder.engines.shipped import gguf_file

    try:
        eng = LlamaEngine(gguf_file("smollm2-135m"), n_ctx=1024, threads=1)
    except UserError as e:
        pytest.skip(str(e))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from decoder.engines.shipped import model_dir
    from workflows.cli.inputs import encode_prompts

    return encode_prompts(AutoTokenizer.from_pretrained(model_dir("smollm2-135m")), PROMPTS)


@pytest.fixture(scope="module")
def lookup(engine):
    from decoder.guessers.registry import LoadRequest, load_guesser

    return load_guesser("lookup", LoadRequest(engine, depth=6))


def test_sampled_acceptance_at_top_k_1_is_the_greedy_record(engine, prompts, lookup):
    """Top-k 1 makes the warped p the argmax's point mass: the sampled continuation is the greedy one and
    every guess's p(x) its 0/1 hit, so the sampled record must equal the greedy record exactly (which
    tests/test_llama_engine.py checks against decoding). A p row misaligned with the token it drew breaks it."""
    from profiler.sampled import replay_sampled_accuracy, sampled_continuations
    from profiler.teacher_forced import greedy_continuations, replay_accuracy

    cont = sampled_continuations(engine, prompts, N_NEW, Sampling(0.7, 1, 1.0), seed=SEED)
    greedy = greedy_continuations(engine, prompts, N_NEW)
    assert [t.tolist() for t in cont.tokens] == [t.tolist() for t in greedy.tokens]
    soft = replay_sampled_accuracy(engine, lookup, cont, 6, 1)
    hard = replay_accuracy(engine, lookup, greedy, 6, 1)
    assert soft["totals"] == hard["totals"] and np.array_equal(np.array(soft["counts"]), np.array(hard["counts"]))
    assert soft["sampling"] == {"temperature": 0.7, "top_k": 1, "top_p": 1.0} and "sampling" not in hard


def test_sampled_calibration_replayed_equals_sampled_decoding(engine, prompts, lookup):
    """autotune --engine llama.cpp --temperature calibrates lookup by replaying its one sampled continuation
    per prompt, each guess scored with p(x): exactly what `planner accept --calibrate --temperature` measures
    by decoding sampled in llama.cpp with the same seeds (the same text), and not the greedy 0/1 observations."""
    from profiler.calibration import measure_calibration, replay_calibration
    from profiler.sampled import sampled_continuations

    cont = sampled_continuations(engine, prompts, N_NEW, WARM, seed=SEED)
    for toks, p in zip(cont.tokens, cont.probs):  # every token drawn from the p recorded for it
        assert bool((p[range(len(toks)), toks] > 0).all()) and np.allclose(p.sum(1).numpy(), 1.0, atol=1e-5)
    prior = np.array([[0.3]] * 6)
    replayed = replay_calibration(lookup, cont.prompts, cont.tokens, prior, probs=cont.probs, sampling=WARM)
    decoded = measure_calibration(engine, lookup, prompts, prior, max_new_tokens=N_NEW, sampling=WARM, seed=SEED)
    assert replayed["observations"] == decoded["observations"] > 0
    assert np.allclose(np.array(replayed["hits"], dtype=float), np.array(decoded["hits"], dtype=float), atol=1e-6)
    assert replayed["sampling"] == decoded["sampling"] == RECORD
    as_greedy = replay_calibration(lookup, cont.prompts, cont.tokens, prior)
    assert not np.allclose(np.array(as_greedy["hits"], dtype=float), np.array(replayed["hits"], dtype=float))


def _main(capsys, *args: str) -> tuple[int, str]:
    from workflows.cli.main import main

    code = main(list(args))
    return code, capsys.readouterr().err.strip()


def test_accept_records_its_settings_and_plan_notes_others(tmp_path, capsys):
    """planner accept --engine llama.cpp --temperature: the record and its calibration say what they were
    measured under; planner plan dynamic made for other settings notes it in one line."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(p.replace("\n", " ") for p in PROMPTS) + "\n")
    acc = tmp_path / "accept.json"
    code, _ = _main(capsys, "accept", "--engine", "llama.cpp", "--prompts", str(prompts), "--max-new-tokens", "16",
                    "--temperature", "0.7", "--top-p", "0.9", "--calibrate", "--threads", "1", "--no-progress",
                    "-o", str(acc))
    doc = json.loads(acc.read_text())
    assert code == 0 and doc["engine"] == "llama.cpp" and doc["guesser"]["kind"] == "lookup"
    assert doc["sampling"] == doc["calibration"]["sampling"] == RECORD
    plan = tmp_path / "plan.json"
    code, err = _main(capsys, "plan", "dynamic", "--accept", f"lookup={acc}", "-o", str(plan),
                      "--temperature", "0.7", "--top-p", "0.9")
    assert code == 0 and "note" not in err
    code, err = _main(capsys, "plan", "dynamic", "--accept", f"lookup={acc}", "-o", str(plan))
    notes = [line for line in err.splitlines() if "note" in line]
    assert code == 0 and len(notes) == 1 and "measured under temperature 0.7, top-p 0.9" in notes[0]


def test_autotune_under_sampling_records_its_settings(tmp_path, capsys):
    """The llama.cpp main job at toy sizes under T 0.7 / top-p 0.9: sampled acceptance and calibration, a
    race that compares speeds only, every plan recording the settings, and `planner decode` of the decision
    at other settings warning in one line."""
    run = tmp_path / "run"
    reuse = ["--profile", str(PROFILE)] if PROFILE.is_file() else ["--profile-budget", "3"]
    code, _ = _main(capsys, "autotune", "--engine", "llama.cpp", "--out", str(run), "--accept-prompts", "2",
                    "--decode-prompts", "2", "--accept-tokens", str(N_NEW), "--decode-tokens", "12", "--rounds", "1",
                    "--threads", "1", "--quiet", "--no-report", "--temperature", "0.7", "--top-p", "0.9", *reuse)
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["identical_to_greedy"] is None and summary["sampling"] == RECORD
    assert summary["distribution_exact"] is True and summary["verify"] == "lossless"
    assert all(r["identical_to_greedy"] is None and r["identical_to_plain_sampling"] is None for r in summary["rows"])
    accept = json.loads((run / "accept-lookup.json").read_text())
    assert accept["sampling"] == accept["calibration"]["sampling"] == RECORD
    chosen = json.loads((run / "chosen.json").read_text())
    trees = [json.loads(p.read_text()) for p in (run / "trees").iterdir()]
    assert chosen["engine"] == "llama.cpp" and trees
    assert all(t["settings"]["sampling"] == RECORD and t["settings"]["distribution_exact"] for t in [chosen] + trees)
    decode = ["decode", "--plan", str(run / "chosen.json"), "--prompt", "Say hello.", "--max-new-tokens", "4",
              "--threads", "1", "--no-progress"]
    code, err = _main(capsys, *decode)
    assert code == 0 and len(err.splitlines()) == 1
    assert err.startswith("planner decode: warning: --plan") and "tuned for temperature 0.7, top-p 0.9" in err
    code, err = _main(capsys, *decode, "--temperature", "0.7", "--top-p", "0.9")
    assert code == 0 and "warning" not in err


@pytest.mark.parametrize("args, message", [
    (["autotune", "--engine", "llama.cpp", "--temperature", "0.7", "--guessers", "ppd"],
     "needs non-token input embeddings"),
    (["autotune", "--engine", "llama.cpp", "--temperature", "0.7", "--top-p", "1.5"],
     "--top-p: expected a finite number in [0.0, 1.0]"),
    (["accept", "--engine", "llama.cpp", "--temperature", "0.7", "--top-p", "1.5", "-o", "x.json"],
     "--top-p: expected a finite number in [0.0, 1.0]"),
    (["accept", "--engine", "llama.cpp", "--temperature", "0.7", "--plan", "t.json", "-o", "x.json"],
     "--plan: state transitions are measured greedily"),
])
def test_refusals_are_one_line(args, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "planner", *args], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()
