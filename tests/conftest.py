"""Suite-wide settings. In CI (.ci/run) every engine is installed, so a missing one must fail the run
instead of skipping its tests quietly: TREE_PLANNER_REQUIRE_LLAMA_CPP=1 (as TREE_PLANNER_REQUIRE_VLLM=1
does for the vLLM environment in tests/test_vllm.py)."""
from __future__ import annotations

import importlib.util
import os
import signal
import sys

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel workers (-n 2 on two cores): one thread each, set before torch or llama.cpp start, and
    # inherited by the subprocesses tests run, so no two workers' spinning OpenMP threads share a core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # xdist's workers ignore SIGINT (the controller owns Ctrl-C), and an ignored signal stays ignored in
    # every child: the tests that interrupt a load or a benchmark need Python's own handler back
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The files that take minutes (vLLM server starts, distribution tests, llama.cpp's main job) go first,
# longest first (seconds measured with -n 2 on the 2-core machine, 2026-11-27; the vLLM plugin's file,
# 5 minutes of engines in one fixture, and test_vllm.py moved up on 2026-12-03, when the plugin's file,
# missing here, ran last and alone for about 5 minutes of a 17-minute suite): xdist's loadfile hands
# files out in this order, so no long file starts when the rest is done.
SLOW_FIRST = ("test_vllm_plugin.py", "test_vllm_server.py", "test_bench_smoke.py", "test_vllm.py", "test_llama_cli.py",
              "test_pearl.py", "test_smollm2.py", "test_draft_sampling.py", "test_coupled.py",
              "test_llama_sampling.py", "test_sampling_decode.py", "test_vllm_profile.py", "test_dynamic_sampling.py",
              "test_vllm_accept.py", "test_mtad.py", "test_bench_sampling.py", "test_sampling_rules.py",
              "test_architecture.py", "test_bad_inputs.py", "test_llama_engine.py", "test_kernels.py")


def pytest_configure(config):
    # xdist 3.7+ reorders loadfile's files by their number of tests, most first, unless told not to: a
    # two-test file of vLLM engines (the longest) then started last and left the other worker idle
    # for minutes (21 min measured, 3 of them on one worker)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def pytest_sessionstart(session):
    if os.environ.get("TREE_PLANNER_REQUIRE_LLAMA_CPP") == "1" and importlib.util.find_spec("llama_cpp") is None:
        pytest.exit("TREE_PLANNER_REQUIRE_LLAMA_CPP=1 but llama-cpp-python is not installed "
                    "(bash scripts/setup.sh --engine llama.cpp)", returncode=3)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that sets torch's thread count must not leak it into the next one: on a float32 toy,
    60 training steps on two threads end somewhere else than on one (other reduction order), and a
    later test's outcome then depends on which file its worker ran before it."""
    torch = sys.modules.get("torch")  # not imported here: the numpy-only tests never load it
    before = torch.get_num_threads() if torch is not None else None
    yield
    if before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)
