"""planner report: every figure is produced from small inputs, well-formed, with its numbers."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from planner.accept import load_acceptance
from planner.errors import UserError
from planner.plan import plan
from planner.profile import load_profile
from planner.tree import save_tree
from workflows.cli.main import main
from workflows.report.page import _layout, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.fixture
def inputs(tmp_path):
    acc = _write(tmp_path / "acc.json", {"ppd-x": {"accuracy": [[0.55, 0.12, 0.05], [0.3, 0.1, 0.05], [0.15, 0.07, 0.04]]},
                                          "medusa-x": {"accuracy": [[0.5, 0.1, 0.05], [0.3, 0.08, 0.04]]}})
    n = [1, 2, 4, 8, 16, 24, 32]
    lat_a = [0.010, 0.0101, 0.0102, 0.0105, 0.011, 0.0135, 0.016]
    lat_b = [0.020, 0.0205, 0.021, 0.023, 0.027, 0.032, 0.037]
    pa = _write(tmp_path / "a.json", {"device": "gpu-a", "model": "m", "context_length": 256, "input_lengths": n,
                                      "latency_s": lat_a, "p10_s": [x * 0.98 for x in lat_a], "p90_s": [x * 1.03 for x in lat_a]})
    pb = _write(tmp_path / "b.json", {"device": "cpu-b", "input_lengths": n, "latency_s": lat_b,
                                      "fit": {"kind": "piecewise_linear", "input_lengths": n, "latency_s": lat_b}})
    ppd_tree = plan("ppd", load_acceptance(f"{acc}:ppd-x"), profile=load_profile(pa), prompt_tokens=3)
    save_tree(ppd_tree, tmp_path / "ppd.json")
    save_tree(plan("medusa", load_acceptance(f"{acc}:medusa-x"), size=6), tmp_path / "medusa.json")
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"method": "ppd", "input_length": n_, "predicted_tokens_per_step": 1 + 0.1 * n_, "measured_tokens_per_step": 1 + 0.09 * n_,
             "predicted_speedup": 1.2 + 0.03 * n_, "measured_speedup": 1.1 + 0.03 * n_, "tree": f"trees/ppd-{n_}.json",
             "chosen": n_ == 8.5} for n_ in (4.0, 8.5, 12.333)]  # as planner autotune writes them
    rows.append({"method": "medusa", "input_length": 7, "predicted_tokens_per_step": 1.9, "measured_tokens_per_step": None,
                 "predicted_speedup": 1.7, "measured_speedup": None, "tree": "m.json"})
    _write(run / "summary.json", {"chosen": "trees/autotune-cpu-x.json", "identical_to_greedy": True, "rows": rows})
    return tmp_path, acc, pa, pb, run


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_full_report(inputs):
    pytest.importorskip("optuna")
    from workflows.tune.search import SearchSpace, parse_accept_spec, tune

    tmp, acc, pa, pb, run = inputs
    space = SearchSpace([parse_accept_spec(f"{acc}:ppd-x"), parse_accept_spec(f"{acc}:medusa-x")], max_size=16)
    tune(space, load_profile(pa), trials=6, storage=str(tmp / "s.db"), study_name="s", memory="input_length",
         progress=False, seed=0)
    index = write_report(tmp / "out", profiles=[pa, pb], accepts=[f"{acc}:ppd-x", f"{acc}:medusa-x"],
                         trees=[tmp / "ppd.json", tmp / "medusa.json"], run_dir=run, storage=str(tmp / "s.db"),
                         study_name="s", max_size=16)
    out = tmp / "out"
    want = {"latency.png", "tokens_per_step.png", "speedup.png", "run.png", "tree_ppd.png", "tree_medusa.png",
            "study_history.png", "study_pareto.png"}
    assert {p.name for p in out.glob("*.png")} == want
    for name in want:
        w, h = _png_size(out / name)
        assert 300 < w < 4000 and 200 < h < 6000, name
    page = index.read_text()
    assert set(re.findall(r"<img src='([^']+)'", page)) == want
    assert page.count("<table>") == len(want)
    rep = json.loads((out / "report.json").read_text())
    sections = {s["image"]: s for s in rep["sections"]}
    # numbers behind the figures agree with the planner, computed independently here
    lat = sections["latency.png"]["table"]
    assert len(lat) == 2 * 7 and lat[0]["latency_ms"] == pytest.approx(10.0)
    chosen = [r for r in sections["speedup.png"]["table"] if r.get("chosen")]
    assert len(chosen) == 2 * 2  # one per (method, profile)
    for r in chosen:
        if r["method"] == "medusa":
            prof = load_profile(pa if r["profile"].startswith("gpu-a") else pb)
            t = plan("medusa", load_acceptance(f"{acc}:medusa-x"), profile=prof, max_size=16)
            assert r["predicted_speedup"] == pytest.approx(t.predicted_speedup, abs=1e-4)
            assert r["input_length"] == t.max_input_length
    tps = [r for r in sections["tokens_per_step.png"]["table"] if r["method"] == "medusa"]
    for r in tps:
        t = plan("medusa", load_acceptance(f"{acc}:medusa-x"), size=r["input_length"] - 1)
        assert r["expected_tokens_per_step"] == pytest.approx(t.expected_tokens_per_step, abs=1e-4)
    assert [r["state"] for r in sections["tree_ppd.png"]["table"]] == [0, 1, 2, 3]
    run_table = sections["run.png"]["table"]
    assert len(run_table) == 4  # rows without measurements are listed, not drawn
    assert [r.get("chosen") for r in run_table] == [False, True, False, None]
    assert all("trial" in r for r in sections["study_pareto.png"]["table"])


def test_only_what_inputs_allow(inputs):
    tmp, acc, pa, pb, run = inputs
    write_report(tmp / "o1", accepts=[load_acceptance(f"{acc}:medusa-x")], max_size=8)  # objects work too
    assert {p.name for p in (tmp / "o1").glob("*.png")} == {"tokens_per_step.png"}
    assert "needs a latency profile" in (tmp / "o1" / "index.html").read_text()
    write_report(tmp / "o2", trees=[tmp / "ppd.json", tmp / "ppd.json"])  # same name twice: two files
    assert {p.name for p in (tmp / "o2").glob("*.png")} == {"tree_ppd.png", "tree_ppd_2.png"}


def test_layout_centres_parents():
    nodes = [(0,), (1,), (0, 0), (0, 1), (0, 2), (1, 0)]
    pos = _layout(nodes)
    leaves = [p for p in [()] + nodes if not any(q[:-1] == p for q in nodes)]
    xs = sorted(pos[p][0] for p in leaves)
    assert xs == [0.0, 1.0, 2.0, 3.0]  # leaves evenly spaced, no overlap
    assert pos[(0,)][0] == pytest.approx((pos[(0, 0)][0] + pos[(0, 2)][0]) / 2)
    assert all(pos[p][1] == len(p) for p in pos)


def test_cli_report_and_errors(inputs, capsys):
    tmp, acc, pa, pb, run = inputs
    assert main(["report", "--profile", pa, "--tree", str(tmp / "medusa.json"), "--out", str(tmp / "c")]) == 0
    assert (tmp / "c" / "index.html").exists() and (tmp / "c" / "latency.png").exists()
    (tmp / "bad").mkdir()
    _write(tmp / "bad" / "summary.json", {"rows": "x"})
    cases = [
        (["report", "--out", str(tmp / "e")], "nothing to draw"),
        (["report", "--run", str(tmp / "bad"), "--out", str(tmp / "e")], "summary.json: field 'rows'"),
        (["report", "--profile", str(tmp / "nope.json"), "--out", str(tmp / "e")], "nope.json: file not found"),
        (["report", "--study-name", "x", "--out", str(tmp / "e")], "--study-name needs --storage"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and err.startswith("planner report: error:") and err.count("\n") == 1, err
    pytest.importorskip("optuna")
    from workflows.tune.search import open_storage

    open_storage(str(tmp / "empty.db"))
    assert main(["report", "--storage", str(tmp / "empty.db"), "--out", str(tmp / "e")]) == 2
    assert "holds 0 studies" in capsys.readouterr().err
    with pytest.raises(UserError, match="expected a URL"):
        write_report(tmp / "e", storage=str(tmp / "x.txt"))


def test_measured_study_gets_predicted_versus_measured(inputs):
    pytest.importorskip("optuna")
    from workflows.tune.search import SearchSpace, parse_accept_spec, tune

    tmp, acc, pa, pb, run = inputs

    def evaluator(tree, cfg, src):  # stand-in for decoding: 90% of the predicted tokens per step
        return {"tokens_per_s": 50.0 * tree.expected_tokens_per_step, "tokens_per_step": 0.9 * tree.expected_tokens_per_step,
                "speedup": 1.0 + 0.1 * tree.expected_tokens_per_step}

    space = SearchSpace([parse_accept_spec(f"{acc}:medusa-x")], max_size=8)
    tune(space, load_profile(pa), trials=3, storage=str(tmp / "m.db"), study_name="m", objective="measured",
         evaluator=evaluator, progress=False, seed=0)
    write_report(tmp / "o", storage=str(tmp / "m.db"))
    rep = json.loads((tmp / "o" / "report.json").read_text())
    table = next(s["table"] for s in rep["sections"] if s["image"] == "study_measured.png")
    assert len(table) == 3
    for r in table:
        assert r["measured_tokens_per_step"] == pytest.approx(0.9 * r["predicted_tokens_per_step"], abs=1e-3)


# ---------------------------------------------------------------------------------------------- a main job's page


def _main_job_run(tmp_path, inputs_dir, choice: str, guesser: str) -> Path:
    """A main job's summary.json as workflows/mainjob/write.py writes it: two raced rows, the decision."""
    run = tmp_path / f"run-{guesser}"
    run.mkdir()
    rows = [{"label": "lookup+chain/dynamic-15", "guesser": "lookup+chain", "method": "dynamic", "size": 15,
             "input_length": 7.0, "predicted_tokens_per_step": 1.8, "measured_tokens_per_step": 2.6,
             "predicted_speedup": 1.6, "measured_speedup": 1.54, "measured_tokens_per_s": 17.5,
             "chosen": choice != "plain", "dropped": None, "identical_to_greedy": True},
            {"label": "ppd/ppd-4", "guesser": "ppd", "method": "ppd", "size": 4, "input_length": 3.4,
             "predicted_tokens_per_step": 1.2, "measured_tokens_per_step": 1.1, "predicted_speedup": 1.18,
             "measured_speedup": 0.9, "measured_tokens_per_s": 9.1, "chosen": False,
             "dropped": "slower than plain: 0.90x", "identical_to_greedy": True}]
    speedup = {"mean": 1.37, "lo": 1.17, "hi": 1.62, "prompts": 10, "level": 0.9} if choice != "plain" else \
        {"mean": 1.0, "lo": 1.0, "hi": 1.0, "prompts": 2, "level": 0.9}
    _write(run / "summary.json", {
        "chosen": str(run / "chosen.json"), "engine": "hf", "model": "smollm2-135m", "identical_to_greedy": True,
        "decision": {"choice": choice, "reason": "confirmed", "measured_speedup": speedup, "p_value": 0.005,
                     "predicted_speedup": 1.6, "guesser": guesser},
        "best_measured": {"label": "lookup+chain/dynamic-15", "measured_speedup": 1.54},
        "plain": {"tokens_per_s": 9.9, "prompts": 11},
        "generate": {"tokens_per_s": 9.0, "plain_vs_generate": 1.1, "prompts": 4},
        "rows": rows})
    return run


def _acceptance(path: Path, kind: str) -> str:
    """An acceptance file as `planner accept` writes it for a guesser kind (its record names the kind)."""
    return _write(path, {"accuracy": [[0.6, 0.1], [0.4, 0.1], [0.3, 0.05], [0.2, 0.05]],
                         "guesser": {"kind": kind, "draft_s": 0.001, "draft_passes": 1}})


@pytest.mark.parametrize("choice,guesser", [("lookup+chain/dynamic-15", "lookup+chain"), ("plain", "plain")])
def test_main_job_page_opens_with_the_decision_and_draws_the_chosen_guessers_figure(inputs, choice, guesser):
    from workflows.mainjob.measure import Measured
    from workflows.mainjob.write import figure_sources

    tmp, acc, pa, pb, _ = inputs
    run = _main_job_run(tmp, tmp, choice, guesser)
    accepts = {k: Measured(Path(p), load_acceptance(p)) for k, p in
               (("ppd", _acceptance(tmp / "accept-ppd.json", "ppd")), ("chain", _acceptance(tmp / "accept-chain.json", "chain")))}
    sources = figure_sources(read_summary(run), accepts)
    # the chosen guesser's acceptance (a hybrid's: its drafter's), never the ppd one; a plain decision: the best
    # measured plan's guesser
    assert [(s.label, s.methods) for s in sources] == [(str(tmp / "accept-chain.json"), ("chain",))]
    index = write_report(run / "report", profiles=[pa], accepts=sources, run_dir=run, max_size=8)
    page = index.read_text()
    first_img = page.index("<img")
    for text in ("<h2>Decision</h2>", "plain decoding", "The race", "ppd/ppd-4", "slower than plain"):
        assert text in page[:first_img], text
    assert page.index("<h2>Decision</h2>") < page.index("The race") < first_img
    if choice != "plain":
        assert "1.37x plain decoding" in page[:first_img] and "[1.17, 1.62]" in page[:first_img]
        assert "1.51x" in page[:first_img]  # against generate: 1.37 x plain's 1.1x generate, said to be composed
        assert "composed" in page[:first_img]
    rep = json.loads((run / "report" / "report.json").read_text())
    assert rep["decision"]["choice"] == choice
    images = [s["image"] for s in rep["sections"]]
    assert images[0] == "speedup.png" and images.index("run.png") < images.index("latency.png")
    speedup = rep["sections"][0]
    assert {r["acceptance"] for r in speedup["table"]} == {str(tmp / "accept-chain.json")}
    mark = [r for r in speedup["table"] if r.get("marked")]
    assert len(mark) == 1 and mark[0]["plan"] == "lookup+chain/dynamic-15" and mark[0]["input_length"] == 16
    assert mark[0]["measured_speedup"] == pytest.approx(1.37 if choice != "plain" else 1.54)


def read_summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("panels", [1, 3])
def test_speedup_figure_titles_stay_inside_the_figure(inputs, panels):
    from workflows.report.figures import fig_speedup
    from workflows.report.page import load_profile_input
    from workflows.tune.search import parse_accept_spec

    tmp, acc, pa, pb, _ = inputs
    sources = [parse_accept_spec(f"{acc}:ppd-x")] + [parse_accept_spec(f"{acc}:medusa-x")] * (panels - 1)
    section = fig_speedup(sources, [load_profile_input(pa)], max_size=8)
    fig = section.figure
    fig.canvas.draw()
    width, height = fig.bbox.width, fig.bbox.height
    texts = [fig._suptitle] + [ax.title for ax in fig.axes]
    for t in texts:
        box = t.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= width and box.y1 <= height, t.get_text()
