"""Inputs that used to crash or mislead: each is a one-line error (exit 2, nothing written) or, for
real-world quirks (ragged acceptance rows, rounding above 1), handled as documented."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.accept import load_acceptance
from planner.plan import SHARED_DIR, plan
from planner.profile import load_profile
from workflows.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = SHARED_DIR / "data" / "published_acceptance.json"
RAGGED = {"accuracy": [[0.4, 0.15, 0.1, 0.05, 0.05, 0.03, 0.02, 0.02, 0.01, 0.01],
                       [0.3, 0.12, 0.08, 0.05, 0.03, 0.02, 0.02, 0.01, 0.01, 0.01],
                       [0.25, 0.1, 0.05, 0.03, 0.02]]}  # 10, 10 and 5 ranks, as the PPD authors' Vicuna-13B matrix
ABOVE_ONE = {"accuracy": [[0.6, 0.3, 0.1005], [0.5, 0.3, 0.2004], [0.5, 0.5, 0.0008]]}  # sums within 1e-3 above 1


def write(tmp_path, name, obj) -> str:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def plan_cli(capsys, *argv) -> tuple[int, str]:
    code = main(["plan", *map(str, argv)])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def profile(tmp_path):
    return write(tmp_path, "p.json", {"input_lengths": [1, 16, 64], "latency_s": [0.01, 0.011, 0.03]})


@pytest.mark.parametrize("content", [RAGGED, ABOVE_ONE])
@pytest.mark.parametrize("method", ["ppd", "medusa", "sequoia"])
def test_ragged_and_rounding_rows_plan_every_method(tmp_path, capsys, profile, content, method):
    acc = write(tmp_path, "a.json", content)
    out = tmp_path / "t.json"
    code, err = plan_cli(capsys, method, "--accept", acc, "--profile", profile, "-o", out)
    assert code == 0, err
    tree = json.loads(out.read_text())
    assert 1.0 <= tree["expected_tokens_per_step"] and tree["predicted_speedup"] > 0


@pytest.mark.parametrize("content", [RAGGED, ABOVE_ONE])
def test_ragged_and_rounding_rows_in_tune_and_report(tmp_path, profile, content):
    pytest.importorskip("optuna")
    pytest.importorskip("matplotlib")
    acc = write(tmp_path, "a.json", content)
    tune = main(["tune", "--accept", f"all={acc}", "--profile", profile, "--trials", "4", "--no-progress",
                 "-o", str(tmp_path / "best.json"), "--max-size", "16"])
    assert tune == 0 and (tmp_path / "best.json").is_file()
    rep = main(["report", "--accept", f"all={acc}", "--profile", profile, "--out", str(tmp_path / "rep"), "--max-size", "16"])
    assert rep == 0 and (tmp_path / "rep" / "index.html").is_file()


def test_decreasing_profile_is_refused(tmp_path, capsys):
    prof = write(tmp_path, "p.json", {"input_lengths": [1, 8, 64], "latency_s": [0.05, 0.02, 0.001]})
    out = tmp_path / "t.json"
    code, err = plan_cli(capsys, "medusa", "--accept", f"{PUBLISHED}:medusa-vicuna-7b", "--profile", prof, "-o", out)
    assert code == 2 and len(err.splitlines()) == 1
    assert "latency_s[1]" in err and "must not decrease" in err and not out.exists()
    # noise-sized dips are levelled, not refused
    p = load_profile(write(tmp_path, "q.json", {"input_lengths": [1, 2, 3], "latency_s": [0.010, 0.0099, 0.011]}))
    assert p.latency_s.tolist() == [0.010, 0.010, 0.011]


@pytest.mark.parametrize("value", ["nan", "inf", "-0.1"])
def test_draft_latency_must_be_finite(tmp_path, capsys, value):
    out = tmp_path / "t.json"
    code, err = plan_cli(capsys, "sequoia", "--accept", f"{PUBLISHED}:medusa-vicuna-7b", "--size", 5,
                         f"--draft-latency={value}", "-o", out)
    assert code == 2 and "draft latency" in err and len(err.splitlines()) == 1 and not out.exists()


def test_tune_rejects_nan_draft_latency(tmp_path, capsys, profile):
    pytest.importorskip("optuna")
    code = main(["tune", "--accept", f"{PUBLISHED}:medusa-vicuna-7b", "--profile", profile, "--draft-latency-ms", "nan",
                 "-o", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--draft-latency-ms" in err and not (tmp_path / "b.json").exists()


def test_output_that_is_a_directory_or_special_file_is_refused(tmp_path, capsys):
    d = tmp_path / "dir"
    d.mkdir()
    code, err = plan_cli(capsys, "medusa", "--accept", f"{PUBLISHED}:medusa-vicuna-7b", "--size", 3, "-o", d)
    assert code == 2 and "is a directory" in err and len(err.splitlines()) == 1
    if os.path.exists("/dev/full"):
        before = os.stat("/dev/full")
        code, err = plan_cli(capsys, "medusa", "--accept", f"{PUBLISHED}:medusa-vicuna-7b", "--size", 3, "-o", "/dev/full")
        assert code == 2 and "not a regular file" in err
        after = os.stat("/dev/full")
        assert (before.st_ino, before.st_mode) == (after.st_ino, after.st_mode)  # still the device, not replaced


def test_symlinked_output_writes_its_target(tmp_path, capsys):
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    code, _ = plan_cli(capsys, "medusa", "--accept", f"{PUBLISHED}:medusa-vicuna-7b", "--size", 3, "-o", link)
    assert code == 0 and link.is_symlink() and json.loads(target.read_text())["method"] == "medusa"


def test_plan_with_no_candidates_is_refused(tmp_path, capsys):
    # forward passes so steep that plain decoding wins: the best medusa tree is empty
    prof = write(tmp_path, "p.json", {"input_lengths": [1, 2, 64], "latency_s": [0.01, 0.1, 10.0]})
    out = tmp_path / "t.json"
    code, err = plan_cli(capsys, "medusa", "--accept", f"{PUBLISHED}:medusa-vicuna-7b", "--profile", prof, "-o", out)
    assert code == 2 and "no candidates" in err and not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["medusa", "--size", 10**9], "above the largest"),
    (["ppd", "--input-length", 10**9], "above the largest"),
    (["ppd", "--input-length", 64, "--prompt-tokens", 10**9], "above the largest"),
])
def test_huge_sizes_are_refused(tmp_path, capsys, argv, message):
    acc = f"{PUBLISHED}:{'ppd' if argv[0] == 'ppd' else 'medusa'}-vicuna-7b"
    code, err = plan_cli(capsys, argv[0], "--accept", acc, *argv[1:], "-o", tmp_path / "t.json")
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_huge_values_in_files_are_refused(tmp_path):
    from decoder.guessers.prompt_tokens import PromptTokens
    from planner.errors import UserError
    from planner.tree import load_tree

    tree = {"method": "ppd", "expected_tokens_per_step": 1.0, "prompt_tokens_max": 1_000_000_000,
            "states": [{"state": 0, "nodes": [], "input_length": 1, "expected_tokens": 1.0, "prompt_tokens": [0]}]}
    with pytest.raises(UserError, match="prompt_tokens_max' must be an integer in 1..16"):
        load_tree(write(tmp_path, "t.json", tree))
    d = tmp_path / "pt"
    d.mkdir()
    (d / "prompt_tokens.json").write_text(json.dumps({"num_prompt_tokens": 1_000_000_000, "ensemble": 1, "hidden_size": 8}))
    with pytest.raises(UserError, match="num_prompt_tokens' must be an integer in 1..16"):
        PromptTokens.load(d)


def test_profile_lengths_are_bounded_before_anything_is_built(capsys):
    for spec, message in (("1:300000000", "above the largest forward pass"), ("1:60000", "more than 4096 lengths")):
        code = main(["profile", "--model", "tiny", "--input-lengths", spec, "-o", "/tmp/never-written.json"])
        assert code == 2 and message in capsys.readouterr().err


def test_profile_lengths_are_bounded_by_memory(capsys):
    from decoder.engines.hf.load import load_model
    from decoder.engines.hf.memory import check_lengths
    from planner.errors import UserError

    tiny = load_model("tiny", device="cpu").model
    with pytest.raises(UserError, match="GiB are free"):
        # within the model's positions if it had them; far beyond this machine's memory
        check_lengths([60000], 10**7, None, tiny, batch_size=4096)


@pytest.mark.parametrize("argv, message", [
    (["--eps", "-0.5"], "--eps: expected a finite number in"),
    (["--temperature", "nan"], "--temperature: expected a finite number"),
    (["--verify", "lossless"], "--verify: 'lossless' samples, but temperature is 0"),
    (["--verify", "coupled"], "--verify: 'coupled' samples, but temperature is 0"),
    (["--verify", "coupled", "--temperature", "0.7", "--batch-size", "2"], "--verify coupled: decodes one prompt at a time"),
    (["--top-p", "0"], "--top-p"),
    (["--device", "gpu"], "--device: expected cpu, cuda or cuda:N, got 'gpu'"),
])
def test_decode_options_are_checked(tmp_path, argv, message):
    from test_decoder_utils import ppd_tree

    from planner.tree import save_tree

    tree = save_tree(ppd_tree(2, [0, 3, 6]), tmp_path / "t.json")
    r = subprocess.run([sys.executable, "-m", "planner", "decode", "--plan", str(tree), "--model", "tiny",
                        "--random-prompt-tokens", "2", "--prompt", "hi", "--max-new-tokens", "4", *argv,
                        "-o", str(tmp_path / "o.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "o.json").exists()


def test_prompt_tokens_with_missing_files_are_an_error_not_random(tmp_path):
    from test_decoder_utils import ppd_tree

    from planner.tree import save_tree

    tree = save_tree(ppd_tree(2, [0, 3, 6]), tmp_path / "t.json")
    d = tmp_path / "pt"
    d.mkdir()
    (d / "prompt_tokens.json").write_text(json.dumps({"num_prompt_tokens": 2, "ensemble": 1, "hidden_size": 32}))
    r = subprocess.run([sys.executable, "-m", "planner", "decode", "--plan", str(tree), "--model", "tiny",
                        "--prompt-tokens", str(d), "--prompt", "hi", "--max-new-tokens", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "prompt_tokens.safetensors: file not found" in r.stderr
    r = subprocess.run([sys.executable, "-m", "planner", "decode", "--plan", str(tree), "--model", "tiny",
                        "--prompt", "hi", "--max-new-tokens", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no prompt tokens ship for it" in r.stderr


def test_ppd_sweep_has_a_time_budget(tmp_path):
    import time

    acc = load_acceptance(f"{PUBLISHED}:ppd-vicuna-7b")
    prof = load_profile(write(tmp_path, "p.json", {"input_lengths": [1, 512], "latency_s": [0.01, 0.05]}))
    t0 = time.monotonic()
    tree = plan("ppd", acc, profile=prof, time_budget_s=0.5)
    assert time.monotonic() - t0 < 15
    swept = tree.settings["swept_input_lengths"]
    assert 2 <= swept < 512
    # coarse to fine: the sweep spans the range even when cut short
    lengths = [r["planned_input_length"] for r in tree.size_curve]
    assert min(lengths) <= 2 and max(lengths) >= 256


def test_requirements_pin_transformers_5():
    """5.x, below 5.25: from 5.25 transformers requires Hugging Face's `kernels` distribution, whose top-level
    module has the name of this project's kernels package (a fresh install then failed at import)."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '"transformers>=5.17,<5.25"' in text
    assert (ROOT / "kernels" / "__init__.py").is_file()  # the clash the upper bound avoids, while it lasts
