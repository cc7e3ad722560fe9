"""`planner export` on every kind of plan the project writes, to every engine: a file or a
one-line error, never a traceback (issue 32: the main job's chosen.json crashed on its recorded
inputs), and the main job's decision exports to vLLM without --method."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.export import ENGINES
from planner.tree import load_tree, save_tree
from workflows.cli.main import main
from workflows.mainjob.write import plain_plan

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "reports" / "example-autotune-cpu-smollm2-135m"
OLD_RUN = ROOT / "reports" / "autotune-cpu-smollm2-135m"
PLANS = {  # every kind of plan file, as the project writes them
    "static medusa": ROOT / "trees" / "medusa-vicuna-7b-n63.json",
    "static sequoia": ROOT / "trees" / "sequoia-medusa-vicuna-7b-n63.json",
    "static ppd": ROOT / "trees" / "ppd-vicuna-7b-n32.json",
    "autotune ppd (per-state budgets)": RUN / "trees" / "ppd-ppd-6-auto.json",
    "autotune lookup chain": RUN / "trees" / "lookup-chain-5.json",
    "autotune drafter chain": RUN / "trees" / "chain-chain-1.json",
    "autotune draft LM chain": OLD_RUN / "trees" / "draft-chain-1.json",
    "autotune parallelspec medusa": RUN / "trees" / "parallelspec-medusa-5.json",
    "per-step lookup": RUN / "trees" / "lookup-dynamic-15.json",
    "per-step drafter": RUN / "trees" / "parallelspec-dynamic-15.json",
    "hybrid lookup+chain (the main job's decision)": RUN / "chosen.json",
    "hybrid lookup+draft": RUN / "trees" / "lookup+draft-dynamic-15.json",
    "pearl": OLD_RUN / "trees" / "pearl-pearl-2.json",
    "batch schedule": ROOT / "exports" / "smollm2-draft-medusa-batched.json",
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """The committed plans, plus the two the tests write: a plain decision and a `planner plan
    dynamic` hybrid (its provenance records KIND=PATH specs)."""
    d = tmp_path_factory.mktemp("plans")
    out = dict(PLANS)
    out["plain decision"] = d / "plain.json"
    save_tree(plain_plan("nothing beat plain decoding"), out["plain decision"])
    out["planner plan dynamic hybrid"] = d / "dynamic.json"
    assert main(["plan", "dynamic", "--accept", f"lookup={RUN / 'accept-lookup.json'}",
                 "--accept", f"chain={RUN / 'accept-chain.json'}", "--profile", str(RUN / "profile.json"),
                 "-q", "-o", str(out["planner plan dynamic hybrid"])]) == 0
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_every_plan_kind_exports_or_says_why_in_one_line(plans, engine, tmp_path, capsys):
    outcomes = {}
    for kind, plan in plans.items():
        out = tmp_path / f"{kind.replace(' ', '_')}.json"
        rc = main(["export", "--engine", engine, str(plan), "-q", "-o", str(out)])  # a traceback fails the test
        err = capsys.readouterr().err
        if rc == 0:
            data = json.loads(out.read_text())
            assert data["engine"] == engine and all("\n" not in n for n in data["notes"])
            outcomes[kind] = "written"
        else:
            assert rc == 2 and err.startswith("planner export: error: ") and err.count("\n") == 1, (kind, err)
            assert not out.exists()
            outcomes[kind] = err.strip()
    # what must be written without --method: every plan whose guesser an engine can run itself
    for kind in ("autotune lookup chain", "per-step lookup", "hybrid lookup+chain (the main job's decision)",
                 "hybrid lookup+draft", "planner plan dynamic hybrid"):
        assert outcomes[kind] == "written", (kind, outcomes[kind])
    assert "plain decoding" in outcomes["plain decision"]
    assert "this project's chain drafter" in outcomes["autotune drafter chain"]


def test_the_main_jobs_decision_exports_to_vllm_as_suffix_decoding(tmp_path, capsys):
    out = tmp_path / "vllm.json"
    assert main(["export", "--engine", "vllm", str(RUN / "chosen.json"), "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    cfg = data["speculative_config"]
    assert cfg["method"] == "suffix" and 5 <= cfg["num_speculative_tokens"] <= 24
    # the break-even path probability from the profile: L(n + 1) - L(n) against the chain's tokens/s
    from planner.profile import load_profile

    prof = load_profile(str(RUN / "profile.json"))
    slopes = [prof.latency(n + 1) - prof.latency(n) for n in range(1, 24)]
    assert min(slopes) * 20 < cfg["suffix_decoding_min_token_prob"] < max(slopes) * 50  # 20..50 tokens/s
    assert cfg["suffix_decoding_max_tree_depth"] == 2 * cfg["num_speculative_tokens"]
    assert data["basis"]["acceptance"]["field"] == "dynamic.guessers.lookup.prior"
    assert data["basis"]["draft_lengths"].startswith("chains planned")
    notes = " | ".join(data["notes"])
    assert "chain drafter of the lookup+chain plan dropped" in notes and "per-step trees dropped" in notes
    # a static lookup chain maps to ngram with the n-gram sizes the acceptance was measured with
    assert main(["export", "--engine", "vllm", str(RUN / "trees" / "lookup-chain-5.json"), "-q", "-o", str(out)]) == 0
    cfg = json.loads(out.read_text())["speculative_config"]
    assert cfg["method"] == "ngram" and (cfg["prompt_lookup_min"], cfg["prompt_lookup_max"]) == (1, 3)


def test_per_batch_size_draft_lengths_from_a_batched_profile(tmp_path):
    """A plan without a schedule gets a draft length per batch size the profile measured."""
    out = tmp_path / "vllm.json"
    profile = ROOT / "bench" / "results" / "batch-profile-packed.json"
    assert main(["export", "--engine", "vllm", str(RUN / "chosen.json"), "--profile", str(profile), "-q",
                 "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["basis"]["profile_batch_sizes"]) > 1
    ranges = data["speculative_config"].get("num_speculative_tokens_per_batch_size")
    ks = [k for _, _, k in ranges] if ranges else [data["speculative_config"]["num_speculative_tokens"]]
    assert ranges is None or (ranges[0][0] == 1 and ranges[-1][1] == 4096)
    assert max(ks) == data["speculative_config"]["num_speculative_tokens"]


def test_the_plan_records_its_inputs_in_three_forms(tmp_path):
    """A dict with a hash, a bare path, a KIND=PATH list: each is read; a changed file is not used."""
    plan = load_tree(RUN / "trees" / "lookup-chain-5.json")
    assert isinstance(plan.provenance["accept"], str)
    for form in ("dict", "list"):
        data = json.loads((RUN / "trees" / "lookup-chain-5.json").read_text())
        path = data["provenance"]["accept"]
        data["provenance"].pop("accept")
        data["provenance"]["acceptance"] = {"file": path, "sha256": "0" * 16} if form == "dict" else [f"lookup={path}"]
        f = tmp_path / f"{form}.json"
        f.write_text(json.dumps(data))
        out = tmp_path / f"{form}-out.json"
        assert main(["export", "--engine", "vllm", str(f), "-q", "-o", str(out)]) == 0
        doc = json.loads(out.read_text())
        if form == "dict":  # the hash differs: the file changed since planning, so the depths are written
            assert any("changed since planning" in n for n in doc["notes"])
            assert doc["basis"]["draft_lengths"].startswith("the plan's tree depths")
        else:
            assert doc["basis"]["draft_lengths"].startswith("chains planned")


def test_prompt_lookup_min_is_the_shortest_match_whose_calibrated_acceptance_pays():
    """With a lookup calibration (acceptance per matched n-gram length), prompt_lookup_min leaves out
    the match lengths whose drafts cost more than they bring on the profile."""
    import numpy as np

    from planner.dynamic import DEPTH_BINS, LOOKUP_COUNTS, Calibration, num_bins
    from planner.export import lookup_settings
    from planner.profile import profile_from_json

    C = len(LOOKUP_COUNTS)
    p = np.zeros((DEPTH_BINS, num_bins("lookup")))
    p[:, 0:C], p[:, C:2 * C], p[:, 2 * C:] = 0.05, 0.6, 0.9  # 1-gram matches rarely right, 2- and 3-grams often
    cal = Calibration("lookup", p, np.ones_like(p), np.ones_like(p))
    profile = profile_from_json({"input_lengths": [1, 8], "latency_s": [0.05, 0.06]})
    cfg, notes = lookup_settings("ngram", 4, None, profile, cal)
    assert (cfg["prompt_lookup_min"], cfg["prompt_lookup_max"]) == (2, 3) and "shortest matched n-gram" in notes[0]
    steep = profile_from_json({"input_lengths": [1, 8], "latency_s": [0.05, 0.5]})  # no draft pays: longest only
    assert lookup_settings("ngram", 4, None, steep, cal)[0]["prompt_lookup_min"] == 3
