"""profiler.load: the CPU other processes take while we time something (the race's load rule)."""
import subprocess
import sys
import time

import pytest

from profiler import load


@pytest.mark.skipif(not load.PROC_STAT.exists(), reason="Linux /proc/stat only")
def test_another_busy_process_is_counted_and_our_own_work_is_not():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start
        meter = load.OtherLoad()
        meter.start()
        t_end = time.perf_counter() + 0.8
        while time.perf_counter() < t_end:  # our own spinning is subtracted
            pass
        others = meter.stop()
    finally:
        busy.kill()
        busy.wait()
    assert others is not None and others >= 0.4  # the busy loop's share of a core, at least


def test_no_proc_stat_means_unknown(monkeypatch, tmp_path):
    monkeypatch.setattr(load, "PROC_STAT", tmp_path / "missing")
    meter = load.OtherLoad()
    meter.start()
    assert meter.stop() is None and load.other_cores(0.01) is None
