"""bench/bench_k0_work.py's comparison, without vLLM: calls per step, and what counts as the model's work."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_k0_work as kw  # noqa: E402


def test_calls_are_compared_per_step_and_only_differences_are_listed():
    plain = {"steps": 10, "calls": {"a": 20, "b": 10, "vllm/model_executor/models/llama.py:1:forward": 300}}
    k0 = {"steps": 20, "calls": {"a": 40, "b": 30, "c": 20, "vllm/model_executor/models/llama.py:1:forward": 600}}
    diffs = kw.compare(plain, k0)
    assert [d["function"] for d in diffs] == ["c", "b"]  # a and the forward: as often per step
    assert diffs[0] == {"function": "c", "plain_per_step": 0.0, "k0_per_step": 1.0}
    assert kw.model_calls_equal(diffs)
    k0["calls"]["vllm/model_executor/models/llama.py:1:forward"] = 620
    assert not kw.model_calls_equal(kw.compare(plain, k0))
    assert not kw.model_calls_equal([{"function": "~:0:<built-in method torch._ops._C.onednn_mm>",
                                      "plain_per_step": 1.0, "k0_per_step": 2.0}])
