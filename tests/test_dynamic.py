"""Dynamic plans (trees chosen at every step): greedy output equals model.generate for every
guesser and hybrid on tiny random target/draft pairs; the decision model's pieces against brute
force; online correction falls back to plain steps; the plan file round-trips."""
import itertools

import numpy as np
import pytest
import torch
from test_decoder_utils import V, reference, tiny_model

from decoder import generate
from decoder.guessers.draft import DraftModelGuesser
from decoder.guessers.dynamic import HybridGuesser
from decoder.guessers.lookup import PromptLookupGuesser
from decoder.guessers.parallel import ParallelDrafter, arch_of
from decoder.guessers.prompt_tokens import PromptTokens
from planner.accept import from_entry
from planner.dynamic import (
    choose,
    fit_calibration,
    isotonic,
    lookup_bins,
    path_probabilities,
    q_bins,
    reliability,
)
from planner.dynamic_plan import plan_dynamic
from planner.errors import UserError
from planner.profile import LatencyProfile
from planner.tree import load_tree, save_tree

torch.set_num_threads(1)


def _accept(kind: str, rows, **rec):
    return from_entry({"accuracy": rows, "guesser": {"kind": kind, **rec}}, label=kind)


ACC = {
    "lookup": _accept("PromptLookupGuesser", [[0.4], [0.8], [0.85], [0.9]]),
    "draft": _accept("DraftModelGuesser", [[0.5, 0.2, 0.1, 0.05]] * 4, draft_s=0.002, draft_passes="depth"),
    "parallelspec": _accept("ParallelDrafter", [[0.5, 0.2, 0.1, 0.05]] * 3, draft_s=0.002, draft_passes="one"),
    "chain": _accept("ParallelDrafter", [[0.5, 0.2, 0.1, 0.05]] * 4, draft_s=0.002, draft_passes="depth"),
    "ppd": _accept("ppd", [[0.5, 0.2, 0.1, 0.05]] * 2, num_prompt_tokens=2, ensemble=1),
}


def _profile(knee=1.5):
    n = np.arange(1, 129)
    return LatencyProfile(n, 0.01 * np.where(n == 1, 1.0, knee + 0.01 * n))


def _prompts():
    g = torch.Generator().manual_seed(0)
    rep = torch.randint(1, V, (6,), generator=g)
    return [torch.randint(1, V, (t,), generator=g) for t in (1, 13)] + [torch.cat([rep, rep, rep[:3]])]


def _guesser(kind, target, family):
    if kind == "lookup":
        return PromptLookupGuesser()
    if kind == "draft":
        return DraftModelGuesser(tiny_model(family, seed=2), top_k=4)
    if kind in ("parallelspec", "chain"):
        torch.manual_seed(3)
        return ParallelDrafter(arch_of(target.config), num_masks=2, top_k=4,
                               mode="chain" if kind == "chain" else "parallel").to(torch.float32)
    return PromptTokens.random(target, 2, seed=5, top_k=4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["lookup", "draft", "parallelspec", "chain", "ppd",
                                  "lookup+draft", "lookup+parallelspec", "lookup+chain", "lookup+ppd"])
@pytest.mark.parametrize("profiled", [False, True], ids=["flat", "knee"])
def test_greedy_dynamic_equals_generate(family, kind, profiled):
    target = tiny_model(family, seed=1)
    kinds = kind.split("+")
    plan = plan_dynamic([(k, ACC[k]) for k in kinds], _profile() if profiled else None, max_size=8, max_depth=5)
    gs = [_guesser(k, target, "mistral" if family == "qwen2" else "llama") for k in kinds]
    g = gs[0] if len(gs) == 1 else HybridGuesser(gs[0], gs[1], kinds[1])
    for ids in _prompts():
        out = generate(target, ids, plan=plan, guesser=g, max_new_tokens=21)
        assert out.tokens.tolist() == reference(target, ids, 21)
        assert len(out.stats.dynamic["sizes"]) == out.steps
        assert all(s <= 8 for s in out.stats.dynamic["sizes"])


def test_a_perfect_drafter_grows_trees_and_a_useless_one_falls_back():
    target = tiny_model("llama", seed=1)
    plan = plan_dynamic([("draft", ACC["draft"])], _profile(1.2), max_size=8, max_depth=5)
    ids = _prompts()[1]
    good = generate(target, ids, plan=plan, guesser=DraftModelGuesser(tiny_model("llama", seed=1), top_k=4),
                    max_new_tokens=40)
    assert good.tokens.tolist() == reference(target, ids, 40)
    assert good.steps < 20 and max(good.stats.dynamic["sizes"]) >= 3
    bad = generate(target, ids, plan=plan, guesser=DraftModelGuesser(tiny_model("llama", seed=7), top_k=4),
                   max_new_tokens=40)
    assert bad.tokens.tolist() == reference(target, ids, 40)
    sizes = bad.stats.dynamic["sizes"]
    # within a few steps the corrected map says the drafter's guesses do not pay: plain steps
    assert sum(s == 0 for s in sizes[5:]) >= 0.7 * len(sizes[5:])


def test_lookup_falls_back_on_text_that_never_repeats_its_continuations():
    target = tiny_model("llama", seed=1)
    plan = plan_dynamic([("lookup", _accept("PromptLookupGuesser", [[0.95]] * 4))], _profile(1.5), max_size=8)
    out = generate(target, _prompts()[2], plan=plan, guesser=PromptLookupGuesser(), max_new_tokens=40)
    assert out.tokens.tolist() == reference(target, _prompts()[2], 40)
    c = np.array(out.stats.dynamic["corrected_c"]["lookup"])
    assert c.min() < 0.95  # corrected away from the over-confident prior


def test_choose_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 7))
        parent = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, n)])
        c = rng.uniform(0, 1, n)
        P = path_probabilities(parent, c)
        cost = np.sort(rng.uniform(1, 3, n + 1))
        ch = choose(P, cost, 0.1)
        best = 1.0 / (0.1 + cost[0])
        for k in range(1, n + 1):
            for sub in itertools.combinations(range(n), k):
                if all(parent[i] < 0 or parent[i] in sub for i in sub):  # a tree
                    best = max(best, (1 + P[list(sub)].sum()) / (0.1 + cost[k]))
        assert ch.expected_tokens / ch.cost_s == pytest.approx(best)
        assert all(parent[i] < 0 or parent[i] in ch.chosen for i in ch.chosen)


def test_isotonic_is_monotone_and_least_squares():
    y, w = np.array([0.1, 0.5, 0.3, 0.2, 0.9]), np.array([1, 2, 1, 1, 3.0])
    f = isotonic(y, w)
    assert np.all(np.diff(f) >= -1e-12)
    assert f.tolist() == pytest.approx([0.1, 1.5 / 4, 1.5 / 4, 1.5 / 4, 0.9])


def test_calibration_fits_monotone_maps_and_round_trips():
    rng = np.random.default_rng(1)
    q = rng.uniform(0, 1, 4000)
    depth = rng.integers(1, 6, 4000)
    acc = rng.uniform(0, 1, 4000) < q * 0.8
    cal = fit_calibration("q", depth, q_bins(q), acc)
    assert np.all(np.diff(cal.p, axis=1) >= -1e-12)
    assert cal.p[0, -1] == pytest.approx(0.76, abs=0.08) and cal.p[0, 0] < 0.1
    rel = reliability(cal, depth, q_bins(q), acc)
    assert all(abs(r["predicted"] - r["realised"]) < 0.15 for r in rel if r["n"] > 100)
    lb = lookup_bins(np.array([1, 3, 5]), np.array([1, 2, 9]))
    assert lb.tolist() == [0, 9, 15]
    entry = {"accuracy": [[0.3], [0.8]], "calibration": cal.to_json()}
    a = from_entry(entry, "x")
    assert np.allclose(a.source["calibration"].p, cal.p, atol=1e-5)
    with pytest.raises(UserError, match="calibration.p"):
        from_entry({"accuracy": [[0.3]], "calibration": {**cal.to_json(), "p": [[2.0]]}}, "x")


def test_dynamic_plan_file_round_trips_and_bad_files_fail(tmp_path):
    plan = plan_dynamic([("lookup", ACC["lookup"]), ("parallelspec", ACC["parallelspec"])], _profile(), 8, 5,
                        decide_s=1.2345e-4)
    save_tree(plan, tmp_path / "d.json")
    back = load_tree(tmp_path / "d.json")
    assert back.method == "dynamic" and back.dynamic.max_size == 8 and set(back.dynamic.guessers) == {"lookup", "parallelspec"}
    assert back.dynamic.step_cost_s == pytest.approx(plan.dynamic.step_cost_s)
    assert back.dynamic.decide_s == 1.2345e-4  # exactly: every step's choice prices it
    import json

    d = json.loads((tmp_path / "d.json").read_text())
    d["dynamic"]["decide_s"] = -1e-6
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match="dynamic.decide_s"):
        load_tree(tmp_path / "bad.json")
    del d["dynamic"]["decide_s"]  # a plan written before decide_s was recorded: unmeasured, 0
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert load_tree(tmp_path / "old.json").dynamic.decide_s == 0.0
    with pytest.raises(UserError, match="decide_s"):
        plan_dynamic([("lookup", ACC["lookup"])], None, 8, decide_s=float("nan"))
    d["dynamic"]["max_size"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match="dynamic.max_size"):
        load_tree(tmp_path / "bad.json")
    del d["dynamic"]
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match="missing field 'dynamic'"):
        load_tree(tmp_path / "bad.json")


def test_a_plan_without_the_guessers_map_is_refused():
    target = tiny_model("llama", seed=1)
    plan = plan_dynamic([("lookup", ACC["lookup"])], None, 4)
    with pytest.raises(UserError, match="maps for lookup"):
        generate(target, _prompts()[1], plan=plan, guesser=DraftModelGuesser(tiny_model("llama", seed=2)), max_new_tokens=4)


@pytest.mark.parametrize("kind", ["lookup", "draft", "parallelspec", "ppd"])
def test_calibration_is_measured_for_every_guesser(kind):
    from profiler.calibration import measure_calibration

    target = tiny_model("llama", seed=1)
    g = _guesser(kind, target, "llama")
    if kind == "draft":
        g = DraftModelGuesser(tiny_model("llama", seed=1), top_k=4)  # the target itself: deep, right guesses
    doc = measure_calibration(target, g, _prompts(), ACC[kind].accuracy, max_new_tokens=24)
    cal = from_entry({"accuracy": [[0.5]], "calibration": doc}, "x").source["calibration"]
    assert cal.signal == ("lookup" if kind == "lookup" else "q") and doc["observations"] > 10
    assert np.all(np.diff(cal.p, axis=1) >= -1e-9) if kind != "lookup" else True
    assert doc["reliability"] and all(0 <= r["realised"] <= 1 for r in doc["reliability"])
    if kind == "draft":  # the drafter is the target: its top guess is always right
        assert max(r["realised"] for r in doc["reliability"] if r["depth_bin"] == 1) == 1.0


def test_report_draws_the_reliability_diagram(tmp_path):
    import json

    from workflows.report.page import write_report

    rng = np.random.default_rng(2)
    q = rng.uniform(0, 1, 2000)
    depth = rng.integers(1, 4, 2000)
    acc = rng.uniform(0, 1, 2000) < q
    cal = fit_calibration("q", depth, q_bins(q), acc)
    cal.reliability = reliability(cal, depth, q_bins(q), acc)
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"accuracy": [[0.5, 0.2]], "calibration": cal.to_json()}))
    write_report(tmp_path / "rep", accepts=[f"medusa={path}"])
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    sec = [s for s in rep["sections"] if s["title"].startswith("Calibration")]
    assert sec and sec[0]["table"][0]["expected_calibration_error"] < 0.05
    assert (tmp_path / "rep" / "reliability.png").is_file()


def test_dynamic_candidates_for_autotune_decode():
    from workflows.mainjob.candidates import dynamic_candidates

    target = tiny_model("llama", seed=1)
    cands = dynamic_candidates("lookup+draft", {"lookup": ACC["lookup"], "draft": ACC["draft"]}, _profile(), sizes=(4, 8))
    assert [c.size for c in cands] == [4, 8] and all(c.method == "dynamic" and c.guesser == "lookup+draft" for c in cands)
    assert all(c.predicted_speedup > 0 and c.predicted_tokens_per_step >= 1 for c in cands)
    g = HybridGuesser(PromptLookupGuesser(), DraftModelGuesser(tiny_model("llama", seed=2), top_k=4), "draft")
    ids = _prompts()[2]
    assert generate(target, ids, plan=cands[0].tree, guesser=g, max_new_tokens=12).tokens.tolist() == reference(target, ids, 12)
    with pytest.raises(UserError, match="no acceptance for draft"):
        dynamic_candidates("lookup+draft", {"lookup": ACC["lookup"]}, None)


def test_cli_accept_calibrate_plan_dynamic_and_decode_a_hybrid(tmp_path, capsys):
    """planner accept --calibrate, planner plan dynamic with two files, planner decode --guesser lookup+ppd -o."""
    import json

    from workflows.cli.main import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "one two three one two three one two"}\n{"text": "Hello there, hello there"}\n')
    common = ["--model", "tiny", "--prompts", str(prompts), "--max-new-tokens", "16", "--no-progress"]
    assert main(["accept", "--guesser", "lookup", "--calibrate", *common, "-o", str(tmp_path / "l.json")]) == 0
    assert json.loads((tmp_path / "l.json").read_text())["calibration"]["signal"] == "lookup"
    ppd = tmp_path / "ppd.json"
    ppd.write_text(json.dumps({"accuracy": [[0.3, 0.1], [0.2, 0.1]], "guesser": {"kind": "ppd", "num_prompt_tokens": 2}}))
    plan = tmp_path / "dyn.json"
    assert main(["plan", "dynamic", "--accept", str(tmp_path / "l.json"), "--accept", str(ppd), "--max-size", "6",
                 "-o", str(plan), "-q"]) == 0
    out = tmp_path / "run.json"
    assert main(["decode", "--plan", str(plan), "--guesser", "lookup+ppd", "--random-prompt-tokens", "2", *common,
                 "--compare-plain", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["identical_to_plain"] is True and doc["method"] == "dynamic"
    assert all(len(r["stats"]["dynamic"]["sizes"]) == r["steps"] for r in doc["results"])
    assert "corrections" in doc["results"][0]["stats"]["dynamic"] and "dynamic_sizes_mean" in doc["summary"]
    capsys.readouterr()
    assert main(["plan", "dynamic", "--accept", str(ppd), "--accept", f"draft={ppd}", "-o", str(tmp_path / "x.json")]) != 0
    err = capsys.readouterr().err
    assert "lookup and one drafter" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()
