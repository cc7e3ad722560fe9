"""The project's vLLM plugin as the rest of the project sees it: its switch, the proposers it acts for,
whether a speculative config needs it, and how to serve one that does. Nothing here imports vLLM or the
plugin (vllm_plugin/, installed into vLLM's own environment by scripts/setup_vllm.sh; docs/vllm.md).

    from planner.vllm_plugin import PLUGIN_ENV, needs_plugin, vllm_serving
    env, command_line, notes = vllm_serving(speculative_config)   # env: {PLUGIN_ENV: "1"} where needed

The plugin cannot import the project: its own copy of these names is vllm_plugin/tree_planner_vllm/gate.py,
and tests/test_vllm_plugin.py checks that the two agree.
"""
from __future__ import annotations

import json
import shlex

# In the environment of `vllm serve` (or of any vLLM process): "1" switches the plugin on. With it a step
# whose scheduled K is 0 for every running request is vLLM's plain path (no rejection sampler, no draft
# fetch), and suffix and medusa take a per-batch-size schedule.
PLUGIN_ENV = "TREE_PLANNER_VLLM_PLUGIN"
PLUGIN_SCHEDULES = ("suffix", "medusa")  # proposers that assert one draft length in vLLM 0.32: a schedule with the plugin
# The vLLM methods `planner export` writes (planner/export.py ENGINE_METHODS["vllm"]) that the plugin does not act
# for; it acts for every other one (tree_planner_vllm.gate.TESTED_METHODS, which the tests check against this).
PLUGIN_REFUSES = frozenset({"mtp"})
# The engine core's log line (then ": N") after a prefix cache reset made suffix decoding forget its N cached
# answers: a race that repeats a pass's prompts on one suffix server reads it (decoder/engines/vllm/server.py).
PLUGIN_FORGOT = "tree-planner plugin: prefix cache reset; suffix decoding forgot its cached answers"
PLUGIN_INSTALL = "pip install ./vllm_plugin"  # into vLLM's environment (bash scripts/setup_vllm.sh does it)
WITHOUT_PLUGIN_K0 = "0.82-0.97x vLLM plain"  # a schedule's K = 0 without it (bench/results/serving-k0.md)
SAMPLED_ON_CPU = (f"sampled requests (temperature > 0) on vLLM 0.32's CPU build: serve with {PLUGIN_ENV}=1 whatever the "
                  "schedule; without the plugin vLLM verifies sampled drafts at an uninitialised temperature and "
                  "top-p, so it accepts almost nothing and its answers are not the model's distribution "
                  "(docs/vllm.md); greedy requests are unaffected")


def _ks(cfg: dict) -> set[int]:
    return {int(k) for _, _, k in cfg.get("num_speculative_tokens_per_batch_size") or []}


def needs_plugin(cfg: dict | None) -> bool:
    """Whether vLLM serves `cfg` as planned only with the plugin: a K = 0 range (without it vLLM's speculative
    path runs there with nothing drafted), or a varying K for suffix or medusa (without it their proposer
    asserts one length and the worker dies)."""
    if not cfg or not cfg.get("method") or cfg["method"] in PLUGIN_REFUSES:
        return False  # (a method no export writes gets the switch: the plugin then logs why it stays out)
    ks = _ks(cfg)
    return 0 in ks or (cfg["method"] in PLUGIN_SCHEDULES and len(ks) > 1)


def vllm_serving(cfg: dict, plugin: bool = True) -> tuple[dict, str, list[str]]:
    """How to serve a vLLM speculative config: ("env" for vLLM's environment, the command line, notes). With
    the plugin where the config needs it, its switch and a note on installing it and on what happens without it;
    for any method the plugin acts for, a last note on sampled requests on vLLM's CPU build."""
    env, line, notes = _serving(cfg, plugin)
    if cfg.get("method") and cfg["method"] not in PLUGIN_REFUSES:
        notes.append(SAMPLED_ON_CPU)
    return env, line, notes


def _serving(cfg: dict, plugin: bool) -> tuple[dict, str, list[str]]:
    arg = "--speculative-config " + shlex.quote(json.dumps(cfg, separators=(",", ":")))
    off = 0 in _ks(cfg)
    if plugin and needs_plugin(cfg):
        without = [f"K = 0 ranges would run vLLM's speculative path with nothing drafted ({WITHOUT_PLUGIN_K0} "
                   "measured)"] if off else []
        if cfg["method"] in PLUGIN_SCHEDULES and len(_ks(cfg)) > 1:
            without.append(f"vLLM's {cfg['method']} proposer asserts one draft length, so its worker would die at the "
                           "first batch size whose K differs")
        note = (f"needs the project's vLLM plugin, switched on by {PLUGIN_ENV}=1 in the environment of `vllm serve` "
                f"(\"env\"): install it into vLLM's environment with `{PLUGIN_INSTALL}` (bash scripts/setup_vllm.sh "
                f"does); without it {'; '.join(without)}")
        return {PLUGIN_ENV: "1"}, f"{PLUGIN_ENV}=1 vllm serve MODEL {arg}", [note]
    if off:
        why = ("--plugin off" if not plugin and cfg.get("method") not in PLUGIN_REFUSES else
               f"the project's vLLM plugin does not act for {cfg.get('method')}")
        return {}, arg, [f"K = 0 ranges run vLLM's speculative path with nothing drafted ({WITHOUT_PLUGIN_K0} "
                         f"measured; {why}): expect them slower than serving without speculation"]
    return {}, arg, []
