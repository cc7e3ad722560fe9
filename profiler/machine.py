"""What machine a measurement ran on: the CPU (name, vector extensions, cores), the load average.

    cpu_name()              # "AMD EPYC 7B13"
    vector_extensions()     # ["avx", "avx2", "fma"]: what a CPU's matmuls and llama.cpp's kernels can use
    load_avg()              # the 1-minute load average, None where unknown

Profiles, benchmarks and run records all name the machine the same way from here. Linux reads
/proc/cpuinfo; elsewhere the platform module's answer stands in.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# the SIMD extensions that decide which kernels run (x86: AVX family, AMX; Arm: NEON/ASIMD, SVE), in this order
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
                "avx512_bf16", "amx_bf16", "amx_int8", "asimd", "asimddp", "sve", "sve2")


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def vector_extensions() -> list[str]:
    """The CPU's vector extensions among VECTOR_FLAGS, in that order (empty where unknown)."""
    flags = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
    return [f for f in VECTOR_FLAGS if f in flags]


def load_avg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def load_avgs() -> list[float]:
    """The 1, 5 and 15-minute load averages (empty where unknown)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return []


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
