"""Suite-wide settings. In CI (.ci/run) every engine is installed, so a missing one must fail the run
instead of skipping its tests quietly: TREE_PLANNER_REQUIRE_LLAMA_CPP=1 (as TREE_PLANNER_REQUIRE_VLLM=1
does for the vLLM environment in tests/test_vllm.py)."""
from __future__ import annotations

import importlib.util
import os

import pytest


def pytest_sessionstart(session):
    if os.environ.get("TREE_PLANNER_REQUIRE_LLAMA_CPP") == "1" and importlib.util.find_spec("llama_cpp") is None:
        pytest.exit("TREE_PLANNER_REQUIRE_LLAMA_CPP=1 but llama-cpp-python is not installed "
                    "(bash scripts/setup.sh --engine llama.cpp)", returncode=3)
