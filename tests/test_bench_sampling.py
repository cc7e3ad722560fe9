"""The sampling benchmarks run end to end on the toy model (--smoke), so they work when the lead
re-runs them: every contender decodes every prompt under both settings, and the files say what ran."""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    """A bench/ script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LLAMA_ROWS = {"llama.cpp generate", "llama.cpp plain loop", "llama.cpp plan"}


def _llama_available() -> bool:
    """The llama.cpp rows run when llama-cpp-python and the model's GGUF are there (else skipped, said why)."""
    import importlib.util

    from decoder.engines.shipped import gguf_file
    from planner.errors import UserError

    if importlib.util.find_spec("llama_cpp") is None:
        return False
    try:
        return gguf_file("smollm2-135m").is_file()
    except UserError:
        return False


def test_bench_sampling_smoke(tmp_path):
    out = tmp_path / "sampling"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_sampling.py"), "--smoke", "--no-progress",
                        "--threads", "2", "--out", str(out), "--loaded-ok"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    # the llama.cpp engine keeps torch on one thread for itself: the transformers rows keep the asked two
    assert doc["machine"]["torch_threads"] == 2
    assert set(doc["settings"]) == {"t0.7-p0.9", "t1.0-k50"}
    llama = _llama_available()
    for block in doc["settings"].values():
        res = block["results"]
        rows = {"generate", "plain loop", "greedy-tuned plan", "sampling-tuned"}
        assert set(res) == rows | (LLAMA_ROWS if llama else set())
        assert all(x["tokens_per_s"] > 0 and len(x["per_prompt_speedup"]) == 2 for x in res.values())
        if llama:  # llama.cpp's own sampling, this project's loop and a lookup plan in llama.cpp, against llama.cpp's
            assert res["llama.cpp generate"]["speedup_vs_llama_cpp_generate"] == 1.0
            assert res["llama.cpp plan"]["mean_accepted"] is not None
            assert res["llama.cpp generate"]["mean_accepted"] is None
            assert any("own chain" in n for n in block["llama_notes"])
        assert res["generate"]["speedup_vs_generate"] == 1.0 and res["generate"]["mean_accepted"] is None
        assert res["greedy-tuned plan"]["mean_accepted"] is not None  # a lookup chain: steps counted
        pair = block["paired"]["greedy-tuned plan"]  # the sampling-tuned plan against it, prompt by prompt
        ratios = [a / b for a, b in zip(res["sampling-tuned"]["per_prompt_speedup"],
                                        res["greedy-tuned plan"]["per_prompt_speedup"])]
        assert pair["prompts"] == 2 and abs(pair["mean"] - math.prod(ratios) ** 0.5) < 1e-9
        assert pair["faster_on"] == sum(r > 1 for r in ratios)
        assert set(block["per_token_warp_and_draw_s"]) == {"transformers warpers + multinomial",
                                                           "decoder.verify probabilities + draw"}
    assert "| sampling-tuned |" in out.with_suffix(".md").read_text()


def test_bench_draft_q_smoke(tmp_path):
    out = tmp_path / "draft_q"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_draft_q.py"), "--smoke", "--out", str(out),
                        "--loaded-ok"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    for block in doc["settings"].values():
        res = block["results"]
        aimed = {k for k in res if k.startswith("coupled: Gumbel top-k of q warped at temperature")}
        assert len(aimed) == 2  # the default --aim 0.5,0.75
        assert set(res) - aimed == {"warped q", "tempered softmax q", "deterministic top-k guesses",
                                    "coupled: Gumbel top-k of warped q"}
        assert all(0 <= x["first_child"] <= 1 and 0 <= x["any_of_4"] <= 1 + 1e-9 for x in res.values())


def test_bench_sampling_plans_on_the_committed_runs(tmp_path):
    """Each planner is optimal for the acceptance it is given, so valued under the sampled acceptance
    the tree planned from it is never worse than the one planned from greedy acceptance; and valued
    under the greedy acceptance instead (a wrong valuation) the order turns somewhere."""
    mod = _bench("bench_sampling_plans")
    out = tmp_path / "plans"
    assert mod.main(["--out", str(out), "--slopes", "0,0.03"]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert {r["guesser"] for r in doc["rows"]} >= {"lookup", "chain", "parallelspec", "draft"}
    assert all(r["ratio"] >= 1 - 1e-9 for r in doc["rows"])
    greedy = mod.load_acceptance(str(mod.GREEDY_RUN / "accept-parallelspec.json"))
    sampled = mod.load_acceptance(str(mod.SAMPLED_RUN / "accept-parallelspec.json"))
    prof = mod.load_profile(str(mod.GREEDY_RUN / "profile.json"))
    assert mod.compare(greedy, sampled, "medusa", prof)["ratio"] > 1.0
    assert mod.compare(sampled, greedy, "medusa", prof)["ratio"] > 1.0  # roles swapped: greedy's own tree wins there


def test_bench_sampling_plans_bad_input(tmp_path, capsys):
    mod = _bench("bench_sampling_plans")
    assert mod.main(["--greedy-run", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_sampling_plans: error:") and "profile" in err and "\n" not in err
    assert mod.main(["--slopes", "a,b", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_bench_sampling_steps_bad_input(tmp_path, capsys):
    mod = _bench("bench_sampling_steps")
    assert mod.main(["--a", str(tmp_path / "none.json"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_sampling_steps: error:") and "none.json" in err and "\n" not in err
    static = tmp_path / "static.json"
    static.write_text('{"method": "medusa"}')
    assert mod.main(["--a", str(static), "--out", str(tmp_path / "x")]) == 2
    assert "field dynamic" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
    hybrid = mod.hybrid({"dynamic": {"step_cost_s": [1.0]}}, {"dynamic": {"step_cost_s": [2.0], "guessers": {"g": 1}}})
    assert hybrid == {"dynamic": {"step_cost_s": [1.0], "guessers": {"g": 1}}}


def test_bench_sampling_steps_slopes(tmp_path, capsys):
    mod = _bench("bench_sampling_steps")
    for bad in ("x", "2", "0.1,-0.1"):
        assert mod.main(["--slopes", bad, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("bench_sampling_steps: error: --slopes") and "\n" not in err
    assert not (tmp_path / "x.json").exists()
    doc = {"dynamic": {"step_cost_s": [0.04, 0.05, 0.041, 0.06]}}
    assert mod.sloped(doc, 0.1)["dynamic"]["step_cost_s"] == pytest.approx([0.04, 0.044, 0.048, 0.052])
    assert doc["dynamic"]["step_cost_s"][1] == 0.05  # a copy
    # each step priced at its input length, lengths past the curve at its end
    assert mod.modeled_seconds([1, 3, 9], [1.0, 2.0, 3.0, 4.0], [0.0, 0.5, 0.25]) == pytest.approx(8.75)
    a = {"dynamic": {"guessers": {"lookup": {"draft_s": 0.0}, "chain": {"draft_s": 0.004}}}}
    b = {"dynamic": {"guessers": {"lookup": {"draft_s": 0.0, "prior": [1]}, "chain": {"draft_s": 0.005}}}}
    assert mod.drafting_from(b, a) == {"dynamic": {"guessers": {"lookup": {"draft_s": 0.0, "prior": [1]},
                                                                "chain": {"draft_s": 0.004}}}}
    assert b["dynamic"]["guessers"]["chain"]["draft_s"] == 0.005


def test_bench_sampling_steps_frozen():
    """--frozen: the plan's priors and calibrations as tuned, which its own loader accepts and no run moves."""
    import numpy as np

    from planner.dynamic import OnlineMap
    from planner.tree import tree_from_json

    mod = _bench("bench_sampling_steps")
    doc = json.loads((ROOT / "reports" / "shared-autotune-cpu-smollm2-135m" / "chosen.json").read_text())
    cold = mod.frozen(doc)
    assert cold["dynamic"]["prior_strength"] == 1e6 and doc["dynamic"]["prior_strength"] == 4.0
    assert tree_from_json(cold, "frozen").dynamic.prior_strength == 1e6
    base = np.array([0.2, 0.5, 0.9])
    m = OnlineMap(base, 1e6, 0.95)
    for _ in range(500):  # a long run in which every guess fails
        m.observe(np.array([0, 1, 2]), np.zeros(3))
    assert np.abs(m.c - base).max() < 1e-4
    live = OnlineMap(base, 4.0, 0.95)
    live.observe(np.array([0, 1, 2]), np.zeros(3))
    assert np.abs(live.c - base).max() > 0.1  # the correction the frozen plan lacks
