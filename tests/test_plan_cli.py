"""`planner plan` end to end: outputs, automatic size with a profile, one-line errors, nothing half-written."""
import json
import subprocess
import sys

import jsonschema
import pytest

from planner.plan import SHARED_DIR
from planner.tree import SCHEMA_PATH, load_tree
from workflows.cli.main import main

PUBLISHED = SHARED_DIR / "data" / "published_acceptance.json"
MEDUSA = f"{PUBLISHED}:medusa-vicuna-7b"
PPD = f"{PUBLISHED}:ppd-vicuna-7b"
SCHEMA = json.loads(SCHEMA_PATH.read_text())


@pytest.fixture
def profile(tmp_path):
    p = tmp_path / "profile.json"  # flat to a knee at 24 tokens, then linear
    p.write_text(json.dumps({"input_lengths": [1, 24, 256], "latency_s": [0.02, 0.02, 0.1]}))
    return str(p)


def run(*argv):
    return main(["plan", *map(str, argv)])


@pytest.mark.parametrize("argv, method, n_states", [
    (["medusa", "--accept", MEDUSA, "--size", 63], "medusa", 1),
    (["sequoia", "--accept", MEDUSA, "--size", 40, "--max-depth", 3], "sequoia", 1),
    (["ppd", "--accept", PPD, "--input-length", 120], "ppd", 4),
    (["ppd", "--accept", PPD, "--input-length", 30, "--prompt-tokens", 2, "--paper"], "ppd", 3),
])
def test_plan_writes_valid_trees(tmp_path, capsys, argv, method, n_states):
    out = tmp_path / "tree.json"
    assert run(*argv, "-o", out) == 0
    assert "wrote" in capsys.readouterr().err
    data = json.loads(out.read_text())
    jsonschema.validate(data, SCHEMA)
    tree = load_tree(out)
    assert tree.method == method and len(tree.states) == n_states
    assert data["provenance"]["acceptance"]["name"] in {"medusa-vicuna-7b", "ppd-vicuna-7b"}
    if method != "ppd":
        assert len(tree.states[0].nodes) == argv[argv.index("--size") + 1]
    else:
        assert tree.max_input_length <= argv[argv.index("--input-length") + 1]


def test_plan_to_stdout(capsys):
    assert run("medusa", "--accept", MEDUSA, "--size", 5, "-q") == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["states"][0]["nodes"]) == 5


@pytest.mark.parametrize("method", ["medusa", "sequoia", "ppd"])
def test_profile_chooses_size_and_records_curve(tmp_path, profile, method):
    out = tmp_path / "auto.json"
    extra = ["--max-input-length", 64] if method == "ppd" else ["--max-size", 60]
    assert run(method, "--accept", PPD if method == "ppd" else MEDUSA, "--profile", profile, *extra, "-q", "-o", out) == 0
    data = json.loads(out.read_text())
    jsonschema.validate(data, SCHEMA)
    curve = data["size_curve"]
    assert len(curve) >= 59
    best = max(r["predicted_speedup"] for r in curve)
    assert data["predicted_speedup"] >= best - 1e-9  # per-state budgets may only add to the best shared size
    assert data["predicted_speedup"] > 1.0
    if method != "ppd":  # flat latency to 24 tokens: the best tree fills the flat part
        assert data["states"][0]["input_length"] == 24


@pytest.mark.parametrize("content, args, message", [
    ("{oops", [], "not valid JSON"),
    (json.dumps({"accuracy": [[0.3, 1.5]]}), [], "outside [0, 1]"),
    (json.dumps({"accuracy": [[0.6, 0.6]]}), [], "sums to 1.2000"),
    (json.dumps({"accuracy": [[0.6, 0.2]]}), ["--size", "0"], "--size must be >= 1"),
    (json.dumps({"accuracy": [[0.6, 0.2]]}), ["--size", "-3"], "--size must be >= 1"),
    (json.dumps({"accuracy": [[0.6, 0.2]]}), ["--size", "9"], "only 2 paths"),
    (json.dumps({"accuracy": [[0.6, 0.2]]}), [], "needs --size"),
])
def test_bad_inputs_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, content, args, message):
    acc = tmp_path / "acc.json"
    acc.write_text(content)
    out = tmp_path / "out.json"
    assert run("medusa", "--accept", acc, *args, "-o", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("planner plan: error: ") and err.count("\n") == 1 and message in err
    assert not out.exists() and list(tmp_path.iterdir()) == [acc]


def test_max_depth_is_a_maximum(tmp_path, capsys):
    """--max-depth beyond what the acceptance covers plans within the covered depth, with one note."""
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"accuracy": [[0.6, 0.2]]}))
    out = tmp_path / "out.json"
    assert run("medusa", "--accept", acc, "--max-depth", "3", "--size", "2", "-q", "-o", out) == 0
    data = json.loads(out.read_text())
    assert max(len(p) for p in data["states"][0]["nodes"]) == 1 and data["settings"]["max_depth"] == 1
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "covers distances 1..1" in err and "within depth 1" in err


@pytest.mark.parametrize("args, message", [
    (["medusa", "--accept", "/nonexistent/acc.json", "--size", 3], "file not found"),
    (["medusa", "--accept", f"{PUBLISHED}:nope", "--size", 3], "no entry named 'nope'"),
    (["ppd", "--accept", PPD, "--input-length", 30, "--prompt-tokens", 4], "distances 1..4"),
    (["ppd", "--accept", PPD, "--size", 30], "not --size"),
    (["ppd", "--accept", PPD], "needs --input-length"),
    (["ppd", "--accept", PPD, "--input-length", 30, "--max-depth", 2], "not --max-depth"),
    (["ppd", "--accept", PPD, "--input-length", 0], "--input-length must be >= 1"),
])
def test_bad_options(tmp_path, capsys, args, message):
    out = tmp_path / "out.json"
    assert run(*args, "-o", out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not out.exists()


def test_plan_does_not_import_torch(tmp_path):
    code = (
        "import sys; from workflows.cli.main import main; "
        f"rc = main(['plan', 'ppd', '--accept', {PPD!r}, '--input-length', '40', '-q', '-o', {str(tmp_path / 't.json')!r}]); "
        "heavy = [m for m in ('torch', 'transformers', 'optuna', 'matplotlib') if m in sys.modules]; "
        "assert rc == 0 and not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_mentions_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    for opt in ("--accept", "--size", "--max-depth", "--input-length", "--prompt-tokens", "--profile",
                "--max-size", "--max-input-length", "--draft-latency", "--paper", "--shared-budget", "FILE:NAME"):
        assert opt in text
