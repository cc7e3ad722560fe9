"""bench/bench_serving.py without vLLM: its --smoke mode runs the whole path (servers started once per
contender, warm-up, levels, rounds, /metrics, the identity check, the report) on a fake streaming
server in its own process, and its faults: a config the server refuses, a request that times out, a
response that differs from plain's, Ctrl-C. The bookkeeping (speedups against the neighbouring plain
runs, drift, the request slots) is checked on made-up numbers. The real servers run in
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
from profiler.load_generator import LoadResult, RequestRecord  # noqa: E402

SCRIPT = str(ROOT / "bench" / "bench_serving.py")


def _run(tmp_path, *args, timeout=120):
    r = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path / "serving"), *args],
                       check=False, capture_output=True, text=True, timeout=timeout)
    doc = json.loads((tmp_path / "serving.json").read_text()) if (tmp_path / "serving.json").is_file() else None
    return r, doc


def test_smoke_measures_every_contender_and_level(tmp_path):
    r, doc = _run(tmp_path, "--sampling", "greedy,sampled")
    assert r.returncode == 0, r.stderr[-3000:]
    assert doc["schedule"] == ["vLLM plain", "vLLM suffix (defaults)", "vLLM ngram (k=4, lookup 1-3)", "vLLM plain"]
    rows = {(x["contender"], x["mode"], x["level"]): x for x in doc["rows"]}
    assert set(rows) == {(n, m, c) for n in doc["schedule"] for m in ("greedy", "sampled") for c in (1, 2, 4)}
    for (name, _, _), x in rows.items():
        assert x["completed"] == x["requests"] == (24 if name == "vLLM plain" else 12)  # 6 requests x 2 rounds x runs
        assert x["tokens_per_s"] > 0 and x["tpot_p50_ms"] is not None and x["ttft_p50_ms"] is not None
        assert (x["acceptance"] is None) == (name == "vLLM plain")
    ngram = rows[("vLLM ngram (k=4, lookup 1-3)", "greedy", 1)]
    assert ngram["acceptance"]["drafted"] > 0 and ngram["acceptance"]["mean_acceptance_length"] > 1
    assert rows[("vLLM plain", "greedy", 4)]["vs_plain"] == 1.0 and ngram["vs_plain"] > 0
    assert doc["mismatches"] == [] and doc["greedy_compared"] == 2 * 3 * 12 and not doc["interrupted"]
    assert set(doc["drift"]) == {"greedy", "sampled"} and set(doc["drift"]["greedy"]) == {"1", "2", "4"}
    assert doc["load_watch"]["loaded_ok"] is True and "vector_extensions" in doc["machine"]
    # every round of every level had new prompts (but for the 24 chat prompts' 36 sends), none of them the warm-up's
    seen = [p for ids in doc["prompts"]["slots"].values() for p in ids]
    assert len(seen) == 72 and len(set(seen)) == 72 - 12 and doc["prompts"]["reused"] == {"chat": 12}
    assert not set(seen) & set(doc["prompts"]["warmup"])
    md = (tmp_path / "serving.md").read_text()
    assert "| vLLM ngram (k=4, lookup 1-3) | 1 |" in md and "## sampled" in md and "72 of 72 compared" in md


def test_a_refused_config_a_timeout_and_a_mismatch_are_reported(tmp_path):
    t0 = time.monotonic()
    r, doc = _run(tmp_path, "--skip", "suffix", "--concurrency", "1,3", "--timeout", "0.5",
                  "--config", 'bad={"method": "ngram", "bogus": 1}',
                  "--config", 'hang={"method": "fake-hang"}', "--config", 'wrong={"method": "fake-wrong"}')
    assert time.monotonic() - t0 < 60  # a hung request costs its timeout, not a hang
    assert r.returncode == 1, r.stderr[-3000:]
    # vLLM's reason, in one line, and the others measured anyway
    refusal = [ln for ln in r.stderr.splitlines() if ln.startswith("bench_serving: bad:")]
    assert len(refusal) == 1 and "bogus: Extra inputs are not permitted" in refusal[0]
    assert doc["contenders"]["bad"]["error"].startswith("refused: ") and "bad" not in {x["contender"] for x in doc["rows"]}
    hang = [x for x in doc["rows"] if x["contender"] == "hang"]
    assert sum(x["timed_out"] for x in hang) >= 1 and all(x["completed"] + x["failed"] == x["requests"] for x in hang)
    assert {x["contender"] for x in doc["mismatches"]} == {"wrong"}
    assert all(x["first_difference"] == 3 for x in doc["mismatches"])
    md = (tmp_path / "serving.md").read_text()
    assert "timed out" in md and "differ:" in md and "Extra inputs are not permitted" in md


def test_ctrl_c_writes_the_finished_levels(tmp_path):
    """SIGINT while a request hangs: the plain run's levels are written, the cut level is not, exit 130."""
    proc = subprocess.Popen([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path / "serving"), "--skip",
                             "suffix,ngram", "--timeout", "60",
                             "--config", 'hang={"method": "fake-hang"}'],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if line.startswith("[2] hang: up"):
                break
        time.sleep(1.0)  # the 5th request it receives hangs (in round 1 at concurrency 1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    doc = json.loads((tmp_path / "serving.json").read_text())
    assert doc["interrupted"] and {x["contender"] for x in doc["rows"]} == {"vLLM plain"}
    assert "Interrupted" in (tmp_path / "serving.md").read_text()


# ---------------------------------------------------------------------------------------------- bookkeeping


def _result(tps: float, ids=None) -> LoadResult:
    rec = RequestRecord(index=0, start_s=0.0, ttft_s=0.1, token_times_s=[0.1, 0.2], latency_s=0.2, output_tokens=2,
                        token_ids=ids)
    return LoadResult(1, 2 / tps, [rec])


def test_speedups_against_the_neighbouring_plain_runs_and_drift():
    s = bs.Settings((1,), ("greedy",), 1, 2, 2, 1.0, False, True)
    cells = [bs.Cell("vLLM plain", 0, "greedy", 1, [_result(10), _result(20)]),
             bs.Cell("a", 1, "greedy", 1, [_result(20), _result(20)]),
             bs.Cell("vLLM plain", 2, "greedy", 1, [_result(40), _result(20)]),
             bs.Cell("b", 3, "greedy", 1, [_result(20), _result(30)]),
             bs.Cell("vLLM plain", 4, "greedy", 1, [_result(10), _result(20)])]
    # a: round 1 against sqrt(10 * 40) = 20, round 2 against 20; b: against 20 and 20
    assert bs.ratios(cells[1], cells) == pytest.approx([1.0, 1.0])
    assert bs.ratios(cells[3], cells) == pytest.approx([1.0, 1.5])
    assert [c.run for c in bs.neighbours(cells, 3, "greedy", 1)] == [2, 4]
    assert bs.row("b", "greedy", 1, [cells[3]], cells)["vs_plain"] == pytest.approx(1.25)
    assert bs.drift(cells, s) == {"greedy": {"1": pytest.approx(15 / 15)}}


def test_identity_compares_with_the_first_plain_run():
    w = bs.Workload({("greedy", 1, 0): [bs.Prompt("p0", "chat", (1, 2))]}, [])
    cells = [bs.Cell("vLLM plain", 0, "greedy", 1, [_result(10, [5, 6, 7])]),
             bs.Cell("x", 1, "greedy", 1, [_result(10, [5, 9, 7])]),
             bs.Cell("vLLM plain", 2, "greedy", 1, [_result(10, [5, 6, 7])])]
    mism, plain_mism, compared = bs.identity(cells, w)
    assert compared == 1 and plain_mism == []
    assert mism == [{"contender": "x", "run": 1, "level": 1, "round": 0, "prompt": "p0", "first_difference": 1,
                     "plain_tokens": 3, "tokens": 3}]


def test_schedule_and_configs(tmp_path):
    a, b = bs.Contender("a", {"method": "ngram"}), bs.Contender("b", {"method": "suffix"})
    assert [c.name for c in bs.schedule([a, b], False)] == ["vLLM plain", "a", "b", "vLLM plain"]
    assert [c.name for c in bs.schedule([a, b], True)] == ["vLLM plain", "a", "vLLM plain", "b", "vLLM plain"]
    export = tmp_path / "vllm.json"
    export.write_text(json.dumps({"speculative_config": {"method": "suffix", "num_speculative_tokens_per_batch_size":
                                                         [[1, 4, 8], [5, 4096, 0]]}, "notes": ["planned"]}))
    c = bs.parse_config(f"planned={export}")
    assert c.spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 8], [5, 4096, 0]] and c.notes == ["planned"]
    assert bs.parse_config('k3={"method": "ngram", "num_speculative_tokens": 3}').spec["num_speculative_tokens"] == 3
    for bad in ("noequals", "x={not json", f"x={tmp_path / 'missing.json'}", "vLLM plain={}", "x=[]"):
        with pytest.raises(UserError):
            bs.parse_config(bad)
    with pytest.raises(UserError, match="not a built-in contender"):
        bs.contenders([], "nope")


def test_request_slots_are_disjoint_and_shared(monkeypatch):
    s = bs.Settings((1, 4), ("greedy",), 5, 8, 2, 1.0, False, True)
    w = bs.workload(s, bs.FakeBackend.encode)
    assert list(w.slots) == [("greedy", c, r) for c in (1, 4) for r in range(2)]
    ids = [p.id for ps in w.slots.values() for p in ps]
    assert len(ids) == len(set(ids)) == 20 and w.reused == {} and len(w.warmup) == 4
    assert [p.group for p in w.slots[("greedy", 1, 0)]] == ["chat", "repeat", "chat", "repeat", "chat"]
    many = bs.workload(bs.Settings((1, 2, 4, 8, 16), ("greedy",), 16, 8, 3, 1.0, False, True), bs.FakeBackend.encode)
    assert many.reused == {"chat": 15 * 8 - 24}  # 24 chat prompts, 120 sends


def test_settings_are_checked():
    p = bs.parser()
    for bad in (["--concurrency", "0"], ["--concurrency", "1,x"], ["--concurrency", "2,2"], ["--sampling", "beam"],
                ["--requests", "0"]):
        with pytest.raises(UserError):
            bs.settings(p.parse_args(bad + ["--smoke"]))
    s = bs.settings(p.parse_args([]))
    assert s.levels == (1, 2, 4, 8, 16) and s.modes == ("greedy",) and (s.requests, s.max_tokens, s.repeats) == (16, 64, 3)


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX")
def test_the_fake_server_leaves_no_thread():
    server = bs.FakeServer({"method": "ngram"}).start()
    assert server.alive() and server.url.startswith("http://127.0.0.1:")
    server.stop()
    assert not server.alive()


def test_a_process_groups_cpu_is_read():
    """The load watch is credited with the server group's CPU (its processes may never be reaped into ours)."""
    assert bs.group_cpu_s(None) == 0.0 and bs.group_cpu_s(os.getpgrp()) > 0
