"""The GPU benchmark must not rot while no GPU is around: its --smoke mode runs every section
(tree attention, KV compaction, verification floor, decoder step dense vs kernels) on the CPU
under the Triton interpreter and fails when a kernel or the kernel step disagrees with its
reference."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_kernels_smoke(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_kernels.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "smoke: ok" in r.stdout
    assert "## Decoder step" in r.stdout
    assert list(tmp_path.iterdir()) == []  # smoke writes nothing
