"""bench/serving_probe.py (the analysis) and bench/serving_probe/sitecustomize.py (the timers' import hook),
on hand-made probe files and a stand-in module: no vLLM needed."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import serving_probe as sp  # noqa: E402

K0 = {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 256, 0]]}


def write_server(folder: Path, pgid: int, config: dict | None, plugin: str, steps: list[tuple[int, int, int, float]],
                 wait_s: float = 0.001) -> None:
    """One server's two files: the API server's (one output batch per step) and the engine core's loop,
    a row per (requests, tokens, drafts, step seconds)."""
    leader = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    if config is not None:
        leader += ["--speculative-config", json.dumps(config)]
    head = {"pgid": pgid, "leader": leader, "plugin": plugin}
    engine, api, t = [], [], 100.0
    for reqs, tokens, drafts, step_s in steps:
        engine.append(["loop", t, wait_s, step_s, 0.001, 0.002, 0.0005 if drafts else 0.0, reqs, tokens, drafts])
        t += wait_s + step_s
        api.append(["out", t, 0.004, reqs])
    api.append(["in", 99.0, 0.0001])
    for pid, role, rows in ((pgid, "api", api), (pgid + 1, "engine", engine)):
        lines = [head | {"role": role, "pid": pid}] + rows
        (folder / f"{pgid}-{pid}.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")


def test_label_names_plain_config_and_plugin():
    assert sp.label(["python", "-m", "x"], "") == "vLLM plain"
    lab = sp.label(["python", "--speculative-config", json.dumps(K0)], "1")
    assert lab.endswith(" +plugin") and json.loads(lab.removesuffix(" +plugin")) == K0
    assert not sp.label(["python", "--speculative-config", json.dumps(K0)], "0").endswith("+plugin")


def test_server_stats_count_decode_steps_by_batch_and_the_plain_path():
    steps = [(4, 40, 0, 0.5),  # a prefill: not a decode step
             (4, 4, 0, 0.10), (4, 4, 0, 0.12), (4, 4, 0, 0.20),  # decode, nothing drafted
             (4, 8, 4, 0.30),  # decode with a draft for each request
             (2, 2, 0, 0.05), (0, 0, 0, 0.0)]  # two requests left; an idle turn
    loop = [["loop", 0.0, 0.01, s, 0.001, 0.002, 0.0, r, t, d] for r, t, d, s in steps]
    st = sp.server_stats({"engine": loop, "api": [["out", 0.0, 0.25, 4], ["in", 0.0, 0.5]]}, [2, 4, 8])
    assert st["steps"] == 6 and st["step_s"] == pytest.approx(1.27) and st["wait_s"] == pytest.approx(0.06)
    assert st["decode_4_n"] == 4 and st["decode_4_ms"] == pytest.approx(160.0)  # median of 100, 120, 200, 300
    assert st["plain_4_n"] == 3
    assert st["decode_2_n"] == 1 and st["decode_8_n"] == 0 and st["decode_8_ms"] is None
    assert st["api_out_s"] == 0.25 and st["api_in_s"] == 0.5


def test_summary_medians_over_servers_and_the_table_gives_ratios_to_plain(tmp_path):
    write_server(tmp_path, 10, None, "", [(16, 16, 0, 0.10)] * 5)
    write_server(tmp_path, 20, None, "", [(16, 16, 0, 0.12)] * 5)
    write_server(tmp_path, 30, K0, "1", [(16, 16, 0, 0.099)] * 5)
    summary = sp.summarise(sp.read_dir(tmp_path), [16])
    k0_name = sp.label(["--speculative-config", json.dumps(K0)], "1")
    plain, k0 = summary["vLLM plain"], summary[k0_name]
    assert plain["servers"] == 2 and k0["servers"] == 1
    assert plain["decode_16_ms"] == pytest.approx(110.0) and plain["step_s"] == pytest.approx(0.55)
    assert k0["decode_16_ms"] == pytest.approx(99.0) and k0["plain_16_n"] == 5
    text = sp.markdown(summary, tmp_path, [16])
    rows = [line for line in text.splitlines() if line.startswith(f"| {k0_name} |")]
    assert len(rows) == 2
    assert "| 0.5 (0.90) |" in rows[0]  # 0.495 s in steps against plain's 0.55
    assert "99.0 (0.90) (5; 5)" in rows[1]


def test_cli_refuses_a_missing_or_empty_folder(tmp_path, capsys):
    assert sp.main([str(tmp_path / "none")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert sp.main([str(tmp_path)]) == 2
    assert "no probe files" in capsys.readouterr().err


def test_cli_writes_json_and_markdown(tmp_path):
    probe = tmp_path / "probe"
    probe.mkdir()
    write_server(probe, 10, None, "", [(16, 16, 0, 0.1)] * 10)
    assert sp.main([str(probe), "--batches", "16", "--out", str(tmp_path / "r")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["batches"] == [16] and doc["summary"]["vLLM plain"]["decode_16_n"] == 10
    assert "| vLLM plain | 1 | 10 |" in (tmp_path / "r.md").read_text()
    assert sp.main([str(probe), "--batches", "x"]) == 2


def test_import_hook_patches_a_module_as_it_loads(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("probe_site", ROOT / "bench" / "serving_probe" / "sitecustomize.py")
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)  # TREE_PLANNER_PROBE unset: nothing installed
    assert not any(isinstance(f, site._Finder) for f in sys.meta_path)
    (tmp_path / "probe_target_mod.py").write_text("class C:\n    def f(self):\n        return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[types.ModuleType] = []

    def patch(module):
        seen.append(module)
        module.C.f = lambda self: 2

    monkeypatch.setattr(site, "PATCHES", {"probe_target_mod": patch})
    finder = site._Finder()
    sys.meta_path.insert(0, finder)
    try:
        import probe_target_mod
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("probe_target_mod", None)
    assert seen == [probe_target_mod] and probe_target_mod.C().f() == 2
