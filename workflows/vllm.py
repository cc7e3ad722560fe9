"""The project's side of vLLM: find the vLLM environment (scripts/setup_vllm.sh), run
workflows/vllm_engine.py inside it on a request, read the result. Used by `planner export --race`,
tests/test_vllm.py and bench/bench_vllm.py; nothing here imports vLLM.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from planner.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SETUP = "scripts/setup_vllm.sh"
STAMP = "tree-planner-vllm.stamp"  # written last by scripts/setup_vllm.sh: the environment is complete


def venv_dir() -> Path:
    cache = os.environ.get("TREE_PLANNER_CACHE") or str(Path.home() / ".cache" / "tree-planner")
    return Path(os.environ.get("TREE_PLANNER_VLLM_VENV") or Path(cache) / "vllm-venv")


def venv_python() -> Path | None:
    """The vLLM environment's interpreter, or None when scripts/setup_vllm.sh has not completed."""
    d = venv_dir()
    py = d / "bin" / "python"
    return py if (d / STAMP).is_file() and py.is_file() else None


def suffix_available(python: Path) -> bool:
    """Whether suffix decoding's index (arctic-inference) is installed beside vLLM."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('arctic_inference') is None)"
    return subprocess.run([str(python), "-c", code], capture_output=True).returncode == 0


def run_engine(mode: str, request: dict, timeout_s: float = 900, log=None) -> dict:
    """One process of workflows/vllm_engine.py in the vLLM environment; its result. A failure is a
    UserError carrying the last line vLLM printed. `log`: a file object for vLLM's own output
    (default: kept only to report a failure)."""
    python = venv_python()
    if python is None:
        raise UserError(f"the vLLM environment {venv_dir()} is not set up: run bash {SETUP}")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    with tempfile.TemporaryDirectory(prefix="tree-planner-vllm-") as d:
        req, res = Path(d) / "request.json", Path(d) / "result.json"
        req.write_text(json.dumps(request))
        try:
            proc = subprocess.run([str(python), "-m", "workflows.vllm_engine", mode, str(req), str(res)], env=env,
                                  cwd=str(ROOT), stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT if log is None
                                  else log, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise UserError(f"vLLM ({mode}) did not finish within {timeout_s:.0f} s") from None
        if proc.returncode != 0 or not res.is_file():
            tail = [ln for ln in (proc.stdout or "").splitlines() if ln.strip()][-1:] or ["(see the log)"]
            raise UserError(f"vLLM ({mode}) failed with exit code {proc.returncode}: {tail[0].strip()[:300]}")
        return json.loads(res.read_text())


def decode_request(model_dir: str, config: dict | None, prompts: list[list[int]], warmup: list[int],
                   max_tokens: int, batched: bool = False) -> dict:
    return {"model": str(model_dir), "config": config, "prompts": [list(map(int, p)) for p in prompts],
            "warmup": list(map(int, warmup)), "max_tokens": int(max_tokens), "batched": batched}


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
