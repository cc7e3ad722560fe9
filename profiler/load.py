"""What else the machine is doing while we time something: the CPU other processes take.

    meter = OtherLoad()
    meter.start(); work(); cores = meter.stop()     # cores other processes used meanwhile (None: unknown)

The machine's busy time (/proc/stat: every state but idle and iowait, steal included: a
hypervisor's other guests take cores too) less this process's own CPU time (all its threads),
over the wall time. A timing of a 2-thread torch op is only what a free machine gives when this is
near 0: another process on one of two cores stalls every op's slower thread, and a plan that runs
two jobs on their own cores (PEARL) is slowed differently from one that runs on both. Linux only;
elsewhere stop() returns None and nothing counts as loaded.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def _busy_s() -> float | None:
    """Seconds all CPUs have spent busy since boot, or None where /proc/stat cannot be read."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()[1:9]
        v = [int(x) for x in fields]
    except (OSError, ValueError):
        return None
    if len(v) < 5:
        return None
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()
    return t.user + t.system


class OtherLoad:
    """Cores other processes used between start() and stop()."""

    def __init__(self) -> None:
        self._t0 = self._busy0 = self._own0 = None

    def start(self) -> None:
        self._t0, self._busy0, self._own0 = time.perf_counter(), _busy_s(), _own_s()

    def stop(self) -> float | None:
        busy, own, wall = _busy_s(), _own_s(), time.perf_counter() - self._t0
        if busy is None or self._busy0 is None or wall <= 0:
            return None
        return max(0.0, (busy - self._busy0 - (own - self._own0)) / wall)


def other_cores(seconds: float = 0.5) -> float | None:
    """Cores other processes use now, sampled over `seconds`."""
    m = OtherLoad()
    m.start()
    time.sleep(seconds)
    return m.stop()


FREE_CORE = 0.5  # other processes' cores from which one core counts as taken


def free_threads(threads: int, seconds: float = 1.0) -> tuple[int, float | None]:
    """(threads to compute with, cores other processes used over `seconds`): `threads` less the
    cores others keep busy, at least 1. A 2-thread op on two cores where another process holds one
    waits on its preempted thread every step (L(1) 2.6x slower here), so a run that shares the
    machine measures, and decodes, on the cores it has free."""
    others = other_cores(seconds)
    if others is None or others < FREE_CORE:
        return threads, others
    return max(1, min(threads, round(threads - others))), others
