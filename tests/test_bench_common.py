"""bench/common.py, the benchmarks' shared pieces: the prompts (training.splits.bench_prompts,
a chat's first turn answered by the engine), the interleaved timing loop, ratios per group, the machine
record, the load rule and the end of every benchmark's main."""
import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402


def test_interleaved_warms_up_shuffles_and_times_every_repeat():
    calls = []
    runs = {k: (lambda item, k=k: calls.append((k, item)) or f"{k}:{item}") for k in "abc"}
    t = common.interleaved(runs, ["x", "y"], repeats=3, seed=1, progress=False)
    assert calls[:3] == [("a", "x"), ("b", "x"), ("c", "x")]  # warm-up first, once each
    timed = calls[3:]
    assert len(timed) == 2 * 3 * 3 and [i for _, i in timed[:9]] == ["x"] * 9
    orders = {tuple(k for k, _ in timed[j: j + 3]) for j in range(0, 18, 3)}
    assert len(orders) > 1  # shuffled per round
    assert t.outputs["b"] == ["b:x", "b:y"] and all(len(r) == 3 for r in t.wall["a"]) and len(t.median("c")) == 2
    calls.clear()
    common.interleaved(runs, ["x"], repeats=1, warm=False, progress=False)
    assert len(calls) == 3


def test_geomean_and_groups():
    assert common.geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert common.by_group([2.0, 8.0, 1.0], ["a", "a", "b"]) == pytest.approx({"a": 4.0, "b": 1.0})



def test_the_machine_record_names_the_cpu_its_vector_extensions_and_cores(monkeypatch):
    import profiler.machine as pm

    monkeypatch.setattr(common, "cpu_name", lambda: "Test CPU 9000")
    monkeypatch.setattr(common, "vector_extensions", lambda: ["avx", "avx2", "fma"])
    m = common.machine()
    assert m["cpu"] == "Test CPU 9000" and m["vector_extensions"] == ["avx", "avx2", "fma"]
    assert {"cpu", "vector_extensions", "cores", "torch_threads", "torch", "python", "load_avg"} <= set(m)
    assert m["cores"] == pm.cores() and isinstance(m["load_avg"], list)
    real = pm.vector_extensions()  # profiler/machine.py is the one home: its order, its names
    assert real == [f for f in pm.VECTOR_FLAGS if f in real]


def _watched(tmp_path, monkeypatch, load_start: float, others: list, loaded_ok: bool = False):
    """bench_main over a run that samples the load once per prompt (two prompts), with the 1-minute
    load average and the other processes' cores per lap monkeypatched."""
    laps = iter(others)
    monkeypatch.setattr(common, "load_avg", lambda: load_start)
    monkeypatch.setattr(common.OthersMeter, "lap", lambda self: next(laps))
    monkeypatch.setattr(common.OthersMeter, "seconds", lambda self: 10.0)  # every sample is a full lap
    out = tmp_path / "r.json"

    def run(args):
        for _ in range(2):
            common.sample_load()
        return common.Results({out: {"x": 1}, tmp_path / "r.md": "table\n"}, "table")

    argv = ["--loaded-ok"] if loaded_ok else []
    return common.bench_main("bench_t", argparse.ArgumentParser(), run, argv), out


def test_a_quiet_run_writes_and_records_the_loads_seen(tmp_path, monkeypatch, capsys):
    code, out = _watched(tmp_path, monkeypatch, 0.1, [0.0, 0.2, 0.1])
    assert code == 0 and capsys.readouterr().out.strip() == "table"
    watch = json.loads(out.read_text())["load_watch"]
    assert watch["load_avg_1m_start"] == 0.1 and watch["other_cores"] == [0.0, 0.2, 0.1]
    assert watch["limit"] == common.LOAD_LIMIT and watch["loaded_ok"] is False
    assert (tmp_path / "r.md").read_text() == "table\n"


@pytest.mark.parametrize("load_start, others, seen", [(1.7, [0.0] * 3, "load average 1.7 above 0.5 at the start"),
                                                      (0.1, [0.1, 1.2, 0.0], "other processes used 1.2 cores")])
def test_a_loaded_run_is_refused_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, load_start, others,
                                                                 seen):
    code, out = _watched(tmp_path, monkeypatch, load_start, others)
    err = capsys.readouterr().err.strip()
    assert code == common.LOADED_EXIT and code != 0
    assert err.startswith("bench_t: error: refused: ") and seen in err and "--loaded-ok" in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []
    assert common.load_record()["loaded_ok"] is True  # the watch was the run's: library calls after it refuse nothing


def test_loaded_ok_writes_and_records_the_load(tmp_path, monkeypatch):
    code, out = _watched(tmp_path, monkeypatch, 1.7, [0.1, 1.2, 0.9], loaded_ok=True)
    watch = json.loads(out.read_text())["load_watch"]
    assert code == 0 and watch["loaded_ok"] is True
    assert watch["load_avg_1m_start"] == 1.7 and watch["other_cores"] == [0.1, 1.2, 0.9]


def test_a_run_that_writes_nothing_is_not_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "load_avg", lambda: 3.0)
    code = common.bench_main("bench_t", argparse.ArgumentParser(), lambda a: common.Results({}, "smoke: ok"), [],
                             writes=lambda a: False)
    assert code == 0 and "smoke: ok" in capsys.readouterr().out


def test_a_user_error_is_one_line_and_exit_code_2(monkeypatch, capsys):
    monkeypatch.setattr(common, "load_avg", lambda: 0.0)

    def run(args):
        raise common.UserError("--tokens: expected 1..10")

    assert common.bench_main("bench_t", argparse.ArgumentParser(), run, []) == 2
    assert capsys.readouterr().err.strip() == "bench_t: error: --tokens: expected 1..10"


def test_the_others_meter_takes_out_this_processs_finished_children(monkeypatch):
    """profiler/load.py's meter leaves out this process's own threads; a `planner decode` or vLLM engine the
    benchmark ran in a child is its own work too: 4 child CPU seconds over a 4-second lap are one core."""
    import profiler.load as pl

    children = iter([10.0, 14.0, 14.0, 14.0, 14.0, 14.0])  # at each (re)start of a meter and each lap
    monkeypatch.setattr(common, "_children_s", lambda: next(children))
    monkeypatch.setattr(pl.OtherLoad, "stop", lambda self: 1.5)  # busy less this process's own: 1.5 cores
    monkeypatch.setattr(common.OthersMeter, "seconds", lambda self: 4.0)
    assert common.OthersMeter().lap() == 0.5
    monkeypatch.setattr(pl.OtherLoad, "stop", lambda self: None)  # no /proc/stat: unknown, never refused
    assert common.OthersMeter().lap() is None


def test_bench_ids_answer_a_chat_and_keep_the_groups():
    engine = common.open_hf("builtin")
    tok = engine.tokenizer
    ids = common.bench_ids(tok, {"chat": 1, "repeat": 2}, engine, first_answer_tokens=4)
    assert [(p.group, p.id) for p in ids] == [("chat", "c01"), ("repeat", "r00"), ("repeat", "r01")]
    text = tok.decode(ids[0].ids)
    assert text.count("USER:") == 2 and text.rstrip().endswith("ASSISTANT:")  # two turns, the answer between
    short = common.bench_ids(tok, {"repeat": 1}, keep_last=5)
    assert short[0].ids.numel() == 5 and short[0].ids.tolist() == ids[1].ids[-5:].tolist()
    with pytest.raises(Exception, match="needs the model"):
        common.bench_ids(tok, {"chat": 1})
    with pytest.raises(Exception, match="expected 0..64"):
        common.bench_ids(tok, {"repeat": 65})
