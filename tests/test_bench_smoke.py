"""The GPU benchmark must not rot while no GPU is around: its --smoke mode runs every section
(tree attention, KV compaction, verification floor, decoder step dense vs kernels) on the CPU
under the Triton interpreter and fails when a kernel or the kernel step disagrees with its
reference. The other benchmarks' smoke modes run end to end on tiny models; those that write results
pass --loaded-ok (the test machine is shared: bench/common.py would refuse to write otherwise) and one
torch thread where the benchmark's default is two: beside the other test worker on two cores a second
spinning OpenMP thread slowed the batch smoke from 25 s to 132 s."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_kernels_smoke(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_kernels.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "smoke: ok" in r.stdout
    assert "## Decoder step" in r.stdout
    assert list(tmp_path.iterdir()) == []  # smoke writes nothing


def test_bench_batch_smoke(tmp_path):
    """The batch benchmark runs end to end on a tiny model and every output equals single greedy decoding."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_batch.py"), "--smoke", "--batch-sizes", "1,2",
                        "--threads", "1", "--out", str(tmp_path), "--loaded-ok"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "batch.json").read_text())
    assert {(row["layout"], row["batch_size"], row["plan"]) for row in result["rows"]} == {
        (lay, b, k) for lay in ("packed", "padded") for b in (1, 2) for k in ("planned", "fixed")}
    assert all(row["tree"] is not None for row in result["rows"] if row["plan"] == "fixed")
    assert all(row["identical_to_single_greedy"] for row in result["rows"])
    assert (tmp_path / "batch.md").is_file() and (tmp_path / "batch-profile-packed.json").is_file()
    assert result["load_watch"]["loaded_ok"] is True and "other_cores" in result["load_watch"]
    assert "vector_extensions" in result["machine"]


def test_bench_drafters_smoke(tmp_path):
    """Every drafter decodes through the benchmark on a tiny model, identical to plain greedy decoding."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_drafters.py"), "--smoke", "--out", str(tmp_path),
                        "--threads", "1", "--loaded-ok"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads((tmp_path / "drafters.json").read_text())
    assert [row["guesser"] for row in result["rows"]] == ["plain", "parallelspec", "parallelspec (full head)",
                                                          "chain", "draft LM", "lookup"]
    assert all(row["identical"] for row in result["rows"])


@pytest.mark.parametrize("kind", ["pearl", "mtad"])
def test_gpu_riders_smoke(tmp_path, kind):
    """The GPU riders' script runs its whole path on a tiny model on the CPU, so it works when a GPU comes."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_riders.py"), kind, "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads((tmp_path / f"gpu-riders-{kind}.json").read_text())
    assert result["rows"] and result["weights"].startswith("random")
    if kind == "pearl":
        assert {"sd", "pearl", "pearl_serial", "eta"} <= set(result["rows"][0])


def test_bench_main_job_smoke(tmp_path):
    """The main job's benchmark runs end to end on the toy model with a plain decision and a lookup
    chain, and every contender's output equals transformers' generate."""
    from planner.tree import Tree, TreeState, save_tree

    chain = Tree("medusa", [TreeState(0, [(0,), (0, 0)], 1.5, 3)], 1.5, settings={"guesser": "lookup"})
    plain = Tree("medusa", [TreeState(0, [(0,)], 1.0, 2)], 1.0, settings={"guesser": "plain"})
    for name, tree in (("plain", plain), ("lookup", chain)):
        out, plan = tmp_path / name, save_tree(tree, tmp_path / f"{name}.json")
        cmd = [sys.executable, str(ROOT / "bench" / "bench_main_job.py"), "--smoke", "--out", str(out), "--no-progress",
               "--plan", str(plan)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        doc = json.loads(out.with_suffix(".json").read_text())
        assert set(doc["results"]) == {"generate", "generate+lookup", "plain loop", "chosen"}
        assert doc["plan_label"].startswith("plain") == (name == "plain")
        assert all(res["mismatches"] == 0 for res in doc["results"].values())
        assert doc["results"]["generate"]["speedup_vs_generate"] == 1.0


def test_bench_cpu_paths_smoke(tmp_path):
    """The CPU matmul-paths benchmark runs end to end on a tiny model: paths chosen and checked on the
    whole forward, plain decoding with them identical to plain decoding without, results written."""
    from planner.tree import Tree, TreeState, save_tree

    plan = save_tree(Tree("medusa", [TreeState(0, [(0,), (0, 0), (0, 0, 0)], 1.0, 4)], 1.0), tmp_path / "chain.json")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_cpu_paths.py"), "--smoke", "--no-progress",
                        "--plan", str(plan), "--guesser", "lookup", "--threads", "1", "--out", str(tmp_path),
                        "--loaded-ok"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads((tmp_path / "cpu_paths.json").read_text())
    assert doc["matmul_paths"]["rows"] == [1, 2, 3, 4] and doc["whole_model"]["rows"] == [1, 2, 3, 4]
    assert set(doc["decoding"]) == {"generate", "plain", "plain + paths", "generate + paths", "plan + paths"}
    assert doc["decoding"]["plain + paths"]["identical_to_plain"] is True
    assert doc["decoding"]["plan + paths"]["identical_to_plain_with_paths"] is True
    assert doc["plan"]["guesser"] == "lookup"
    assert all(s != "mismatch" for row in doc["decoding"].values() for s in row["vs_generate"])
    assert "load_avg_start" in doc and (tmp_path / "cpu_paths.md").is_file()


def test_bench_dynamic_smoke(tmp_path):
    """Dynamic plans (lookup, draft LM, their hybrid) run through the benchmark beside transformers'
    generate, prompt lookup and assisted generation on tiny models; ours equal generate."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_dynamic.py"), "--smoke", "--out", str(tmp_path),
                        "--loaded-ok"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "smoke: ok" in r.stdout
    result = json.loads((tmp_path / "dynamic.json").read_text())
    rows = {row["method"]: row for row in result["summary"]}
    assert {"hf_generate", "hf_lookup", "hf_assisted", "plain", "dynamic/lookup", "dynamic/draft",
            "dynamic/lookup+draft"} == set(rows)
    assert all(rows[m]["identical_to_generate"] for m in rows if m.startswith(("dynamic", "plain")))
    assert all(rows[m]["mean_size"] is not None for m in rows if m.startswith("dynamic"))
