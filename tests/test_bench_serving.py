"""bench/bench_serving.py without vLLM: its --smoke mode runs the whole path (the race module's servers per
contender, warm-up, levels, rounds, /metrics, plain before and after, the paired rows, the identity check,
the report) on a fake streaming server in its own process, and its faults: a config the server refuses, a
request that times out, a response that differs from plain's, Ctrl-C. The prompts are checked to be distinct
per server; the race's own rules are tests/test_serving_autotune.py's. The real servers run in
tests/test_vllm_server.py; the benchmark itself is run by hand (docs/vllm.md)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_serving as bs  # noqa: E402

from planner.errors import UserError  # noqa: E402
from planner.serving import PLUGIN_ENV  # noqa: E402

SCRIPT = str(ROOT / "bench" / "bench_serving.py")


def _run(tmp_path, *args, timeout=120):
    r = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path / "serving"), *args],
                       check=False, capture_output=True, text=True, timeout=timeout)
    doc = json.loads((tmp_path / "serving.json").read_text()) if (tmp_path / "serving.json").is_file() else None
    return r, doc


def test_smoke_races_every_contender_and_level_on_prompts_no_server_sees_twice(tmp_path):
    r, doc = _run(tmp_path, "--sampling", "greedy,sampled")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {(x["contender"], x["mode"], x["level"]): x for x in doc["rows"]}
    names = ["vLLM plain", "vLLM suffix (defaults)", "vLLM ngram (k=4, lookup 1-3)"]
    assert set(rows) == {(n, m, c) for n in names for m in ("greedy", "sampled") for c in (1, 2, 4)}
    for (name, _, _), x in rows.items():
        plain = name == "vLLM plain"
        assert x["completed"] == x["requests"] == (24 if plain else 12)  # 6 requests x 2 rounds x its servers
        assert x["servers"] == (2 if plain else 1)  # plain before and after the contenders
        assert x["tokens_per_s"] > 0 and x["tpot_p50_ms"] is not None and x["ttft_p50_ms"] is not None
        assert (x["drafted"] == 0) == plain and (x["paired"] is None) == plain
    ngram = rows[("vLLM ngram (k=4, lookup 1-3)", "greedy", 1)]
    # the fake's speed difference is small beside a loaded machine's noise: the paired row, not who is ahead
    assert ngram["mean_acceptance_length"] > 1 and ngram["paired"]["prompts"] == 12 and ngram["ahead"] is not None
    assert rows[("vLLM plain", "greedy", 4)]["vs_plain"] == 1.0
    assert doc["mismatches"] == [] and doc["greedy_compared"] == 2 * 3 * 12 and not doc["interrupted"]
    assert set(doc["modes"]) == {"greedy", "sampled"} and set(doc["modes"]["greedy"]["drift"]) == {"1", "2", "4"}
    assert doc["load_watch"]["loaded_ok"] is True and "vector_extensions" in doc["machine"]
    # every round of every level has its own prompts, none of them the warm-up's
    seen = [p for ids in doc["prompts"]["slots"].values() for p in ids]
    assert len(seen) == len(set(seen)) == 3 * 2 * 6 and not set(seen) & set(doc["prompts"]["warmup"])
    md = (tmp_path / "serving.md").read_text()
    assert "| vLLM ngram (k=4, lookup 1-3) | 1 |" in md and "## sampled" in md and "72 of 72 compared" in md


def test_a_refused_config_a_timeout_and_a_mismatch_are_reported(tmp_path):
    t0 = time.monotonic()
    r, doc = _run(tmp_path, "--skip", "suffix", "--concurrency", "1,3", "--timeout", "0.5",
                  "--config", 'bad={"method": "ngram", "bogus": 1}',
                  "--config", 'hang={"method": "fake-hang"}', "--config", 'wrong={"method": "fake-wrong"}')
    assert time.monotonic() - t0 < 60  # a hung request costs its timeout, not a hang
    assert r.returncode == 1, r.stderr[-3000:]
    refusal = [ln for ln in r.stderr.splitlines() if ln.startswith("bench_serving: bad:")]
    assert len(refusal) == 1 and "bogus: Extra inputs are not permitted" in refusal[0]
    assert "Extra inputs" in doc["contenders"]["bad"]["error"] and "bad" not in {x["contender"] for x in doc["rows"]}
    hang = [x for x in doc["rows"] if x["contender"] == "hang"]
    assert sum(x["timed_out"] for x in hang) >= 1 and all(x["completed"] + x["failed"] == x["requests"] for x in hang)
    assert {x["contender"] for x in doc["mismatches"]} == {"wrong"}
    assert all(x["first_difference"] == 3 for x in doc["mismatches"])
    assert all(x["behind"] for x in doc["rows"] if x["contender"] == "wrong")  # a changed token: behind plain
    md = (tmp_path / "serving.md").read_text()
    assert "timed out" in md and "differ:" in md and "Extra inputs are not permitted" in md


def test_ctrl_c_writes_the_finished_levels(tmp_path):
    """SIGINT while a request hangs: plain's levels are written, the cut level is not, exit 130."""
    proc = subprocess.Popen([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path / "serving"), "--skip",
                             "suffix,ngram", "--timeout", "60", "--config", 'hang={"method": "fake-hang"}'],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "hang: ready" in line:
                break
        time.sleep(1.0)  # the 5th request it receives hangs (in the first round at concurrency 1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    doc = json.loads((tmp_path / "serving.json").read_text())
    assert doc["interrupted"] and {x["contender"] for x in doc["rows"]} == {"vLLM plain"}
    assert "Interrupted" in (tmp_path / "serving.md").read_text()


def test_the_budget_runs_more_passes_until_the_levels_resolve_and_names_the_rest(tmp_path):
    """A contender at plain's pace (drafts never accepted) ties plain: with --budget, a level it leaves neither
    ahead nor behind races again (a fresh server for it and for plain each time) until the budget ends, and the
    report names the levels still open. Whether a tie's interval holds 1 is chance, so the test checks that
    every level ends resolved or named, and that a level raced again has the extra servers
    (tests/test_serving_autotune.py drives the same loop on a clock)."""
    t0 = time.monotonic()
    r, doc = _run(tmp_path, "--skip", "suffix,ngram", "--concurrency", "1,2", "--budget", "0.15",
                  "--config", 'same={"method": "fake-same", "num_speculative_tokens": 2}')
    assert r.returncode == 0, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60  # the budget (9 s) ends the passes
    info = doc["modes"]["greedy"]
    rows = {x["level"]: x for x in doc["rows"] if x["contender"] == "same"}
    for level, row in rows.items():
        assert row["resolved"] or level in info["unresolved"].get("same", [])
        assert row["servers"] >= (2 if "another pass" in r.stderr and level in _passed(r.stderr) else 1)
    if info["unresolved"]:
        assert "Unresolved" in (tmp_path / "serving.md").read_text()


def _passed(err: str) -> set[int]:
    """The levels the log says another pass raced."""
    out = set()
    for line in err.splitlines():
        if line.strip().startswith("another pass") and "same at " in line:
            out |= {int(x) for x in line.split("same at ")[1].split(" (")[0].split(";")[0].split(", ")}
    return out


def test_the_main_jobs_decision_races_with_the_plugin_and_without(tmp_path):
    chosen = tmp_path / "chosen.json"
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 3, 4],
                                                                                                     [4, 256, 0]]}
    chosen.write_text(json.dumps({"format": "tree-planner/serving-decision", "speculative_config": cfg, "plugin": True}))
    a, b = bs.decision_contenders(str(chosen))
    assert (a.plugin, b.plugin) == (True, False) and a.speculative == b.speculative == cfg
    export = tmp_path / "vllm.json"
    export.write_text(json.dumps({"speculative_config": cfg, "env": {PLUGIN_ENV: "1"}}))
    assert [c.plugin for c in bs.decision_contenders(str(export))] == [True, False]
    chosen.write_text(json.dumps({"speculative_config": cfg, "plugin": False}))
    assert [c.name for c in bs.decision_contenders(str(chosen))] == ["main job's decision"]
    chosen.write_text(json.dumps({"speculative_config": None}))
    with pytest.raises(UserError, match="plain decision"):
        bs.decision_contenders(str(chosen))
    chosen.write_text(json.dumps({"speculative_config": cfg, "plugin": True}))
    r, doc = _run(tmp_path, "--skip", "suffix,ngram", "--concurrency", "1", "--decision", str(chosen))
    assert r.returncode == 0, r.stderr[-3000:]
    assert doc["contenders"]["main job's decision (plugin)"]["plugin"] is True
    assert {x["contender"] for x in doc["rows"]} == {"vLLM plain", "main job's decision (plugin)",
                                                     "main job's decision (no plugin)"}
    assert "with the plugin" in (tmp_path / "serving.md").read_text()


def test_configs(tmp_path):
    export = tmp_path / "vllm.json"
    export.write_text(json.dumps({"speculative_config": {"method": "suffix", "num_speculative_tokens_per_batch_size":
                                                         [[1, 4, 8], [5, 4096, 0]]}, "notes": ["planned"],
                                  "env": {PLUGIN_ENV: "1"}}))
    c = bs.parse_config(f"planned={export}")
    assert c.speculative["num_speculative_tokens_per_batch_size"] == [[1, 4, 8], [5, 4096, 0]]
    assert c.notes == ["planned"] and c.plugin
    assert bs.parse_config('k3={"method": "ngram", "num_speculative_tokens": 3}').speculative["num_speculative_tokens"] == 3
    for bad in ("noequals", "x={not json", f"x={tmp_path / 'missing.json'}", "vLLM plain={}", "x=[]"):
        with pytest.raises(UserError):
            bs.parse_config(bad)
    with pytest.raises(UserError, match="NAME may not contain '='"):
        bs.parse_config(f"K = 0={export}")
    with pytest.raises(UserError, match="not a built-in contender"):
        bs.contenders([], "nope")


def test_request_slots_are_distinct_and_a_run_that_needs_a_prompt_twice_is_refused():
    s = bs.Settings((1, 4), ("greedy",), 5, 8, 2, 1.0, None, True)
    w = bs.workload(s, bs.FakeBackend.encode)
    assert list(w.slots) == [(c, r) for c in (1, 4) for r in range(2)]
    ids = [p.id for ps in w.slots.values() for p in ps]
    assert len(ids) == len(set(ids)) == 20 and len(w.warmup) == 4 and not set(ids) & {p.id for p in w.warmup}
    assert [p.group for p in w.slots[(1, 0)]] == ["chat", "repeat", "chat", "repeat", "chat"]
    # the benchmark: 1..32, 16 requests a round (32 at 32), every prompt new
    full = bs.workload(bs.Settings(bs.LEVELS, ("greedy", "sampled"), 16, 32, 1, 300.0, None, True), bs.FakeBackend.encode)
    sent = [p.id for ps in full.slots.values() for p in ps]
    assert len(sent) == len(set(sent)) == 5 * 16 + 32 and len(full.slots[(32, 0)]) == 32
    with pytest.raises(UserError, match="distinct ones exist"):
        bs.workload(bs.Settings(bs.LEVELS, ("greedy",), 16, 32, 3, 300.0, None, True), bs.FakeBackend.encode)


def test_settings_are_checked():
    p = bs.parser()
    for bad in (["--concurrency", "0"], ["--concurrency", "1,x"], ["--concurrency", "2,2"], ["--sampling", "beam"],
                ["--requests", "4"], ["--budget", "0"]):
        with pytest.raises(UserError):
            bs.settings(p.parse_args(bad + ["--smoke"]))
    s = bs.settings(p.parse_args([]))
    assert s.levels == (1, 2, 4, 8, 16, 32) and s.modes == ("greedy", "sampled")
    assert (s.requests, s.max_tokens, s.rounds, s.budget_s) == (16, 32, 1, None) and s.sent(32) == 32


def test_sampled_requests_carry_a_seed_each_unless_unseeded():
    p = bs.parser()
    for args, seeded in (([], True), (["--unseeded"], False)):
        s = bs.settings(p.parse_args(["--smoke", "--sampling", "greedy,sampled"] + args))
        w = bs.workload(s, bs.FakeBackend.encode)
        sampled = [r for reqs in bs.traffic(w, s, "sampled").requests.values() for r in reqs]
        greedy = [r for reqs in bs.traffic(w, s, "greedy").requests.values() for r in reqs]
        assert all(("seed" in r.extras) == seeded and r.extras["temperature"] == 0.7 for r in sampled)
        assert not any("seed" in r.extras for r in greedy)


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX")
def test_the_fake_server_leaves_no_thread():
    server = bs.FakeServer({"method": "ngram"}).start()
    assert server.alive() and server.url.startswith("http://127.0.0.1:")
    server.stop()
    assert not server.alive()


def test_a_process_groups_cpu_is_read():
    """The load watch is credited with the server group's CPU (its processes may never be reaped into ours)."""
    assert bs.group_cpu_s(None) == 0.0 and bs.group_cpu_s(os.getpgrp()) > 0
