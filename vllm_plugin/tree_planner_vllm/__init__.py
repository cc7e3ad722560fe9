"""tree-planner's vLLM plugin: where a speculative schedule drafts nothing, vLLM decodes plain.

vLLM calls `register` in each of its processes (the `vllm.general_plugins` entry point). It does
nothing at all unless TREE_PLANNER_VLLM_PLUGIN=1 is in the environment; then, on a vLLM version the
patches were written against (gate.TESTED_VLLM), it patches vLLM's classes (patches.py) and each engine
decides once whether the plugin acts on it (gate.refusal, one log line). On any other version it
patches nothing and logs one line. docs/vllm.md ("The tree-planner plugin") says what and why.
"""
from __future__ import annotations

import logging

from tree_planner_vllm.gate import SWITCH, TESTED_VLLM, switched_on, tested_version

__all__ = ["register", "SWITCH", "TESTED_VLLM"]
logger = logging.getLogger("vllm.tree_planner_vllm")  # under vLLM's logger: its handler and format


def register() -> None:
    """The entry point vLLM calls: patch vLLM when switched on and the version is a tested one."""
    if not switched_on():
        return
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not tested_version(version):
        logger.warning("tree-planner plugin: vLLM %s is not a version it was tested with (%s); nothing patched, "
                       "vLLM runs unchanged", version, ", ".join(TESTED_VLLM))
        return
    from tree_planner_vllm import patches

    if patches.install():
        logger.debug("tree-planner plugin: vLLM %s patched in this process", version)
