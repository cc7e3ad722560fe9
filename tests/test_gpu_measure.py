"""scripts/gpu_measure.sh without a CUDA device: every stage, the smoke stage included, refuses with
exit 2 and one line before it writes anything; an unknown stage is refused the same way. The
device is hidden (CUDA_VISIBLE_DEVICES=""), so this runs the same on a GPU machine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_measure.sh"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_smoke_without_cuda_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = _run("smoke", str(out), cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["gpu_measure.sh: no CUDA device here"], r.stderr
    assert r.stdout == ""
    assert list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_unknown_stage_exits_2_with_one_line(tmp_path):
    r = _run("warp-speed", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_measure.sh: unknown stage 'warp-speed' ("), r.stderr
    assert "smoke" in lines[0]
    assert list(tmp_path.iterdir()) == []
    r = _run(cwd=tmp_path)  # no stage at all
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("usage: gpu_measure.sh")
