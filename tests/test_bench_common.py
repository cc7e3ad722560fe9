"""bench/common.py, the benchmarks' shared pieces: the prompts (training.splits.bench_prompts,
a chat's first turn answered by the model), the interleaved timing loop, ratios per group."""
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
    m = common.machine()
    assert {"cpu", "cores", "torch_threads", "torch", "load_avg"} <= set(m)


def test_bench_ids_answer_a_chat_and_keep_the_groups():
    from decoder.engines.hf.load import load_model

    model = load_model("builtin", device="cpu").model
    tok = common.builtin_tokenizer()
    ids = common.bench_ids(tok, {"chat": 1, "repeat": 2}, model, first_answer_tokens=4)
    assert [(p.group, p.id) for p in ids] == [("chat", "c01"), ("repeat", "r00"), ("repeat", "r01")]
    text = tok.decode(ids[0].ids)
    assert text.count("USER:") == 2 and text.rstrip().endswith("ASSISTANT:")  # two turns, the answer between
    short = common.bench_ids(tok, {"repeat": 1}, keep_last=5)
    assert short[0].ids.numel() == 5 and short[0].ids.tolist() == ids[1].ids[-5:].tolist()
    with pytest.raises(Exception, match="needs the model"):
        common.bench_ids(tok, {"chat": 1})
    with pytest.raises(Exception, match="expected 0..64"):
        common.bench_ids(tok, {"repeat": 65})
