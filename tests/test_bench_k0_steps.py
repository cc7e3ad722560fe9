"""bench/bench_k0_steps.py's alternation and summary, without vLLM."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_k0_steps as ks  # noqa: E402


def test_processes_alternate_so_each_config_leads_a_pair_as_often():
    assert ks.order(4) == ["plain", "k0_plugin", "k0_plugin", "plain", "plain", "k0_plugin", "k0_plugin", "plain"]
    firsts = [ks.order(6)[i] for i in range(0, 12, 2)]
    assert firsts.count("plain") == firsts.count("k0_plugin") == 3


def test_summary_takes_each_process_median_then_the_median_over_processes():
    runs = [{"config": "plain", "step_s": [0.050, 0.060, 0.055]},   # median 55 ms
            {"config": "k0_plugin", "step_s": [0.044, 0.046]},        # 45
            {"config": "k0_plugin", "step_s": [0.066]},               # 66
            {"config": "plain", "step_s": [0.065, 0.065, 0.1]},       # 65
            {"config": "plain", "step_s": [0.060]}]                   # 60
    s = ks.summarise(runs)
    assert s["plain"]["process_median_ms"] == [55.0, 65.0, 60.0]
    assert s["plain"]["median_ms"] == pytest.approx(60.0)
    assert s["k0_plugin"]["median_ms"] == pytest.approx(55.5)
    assert s["plain"]["spread"] == pytest.approx(65 / 55)
    assert s["k0_over_plain_time"] == pytest.approx(55.5 / 60.0)
    assert s["plain"]["steps"] == 7


def test_a_config_without_timed_steps_has_no_ratio():
    s = ks.summarise([{"config": "plain", "step_s": [0.05]}, {"config": "k0_plugin", "step_s": []}])
    assert s["k0_plugin"]["median_ms"] is None and s["k0_over_plain_time"] is None
