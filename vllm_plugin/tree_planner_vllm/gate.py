"""When the plugin acts: the switch, the vLLM versions it was tested with, and the settings it refuses.

Nothing here imports vLLM, so the rules can be read (and tested) without it. `refusal` takes vLLM's
own VllmConfig and answers None (the plugin acts) or the one-line reason it stays out.
"""
from __future__ import annotations

import os

SWITCH = "TREE_PLANNER_VLLM_PLUGIN"  # the same name as the project's planner/vllm_plugin.py SWITCH
TESTED_VLLM = ("0.32.0",)  # the patches read these versions' source; any other: nothing is patched
# The proposers whose K = 0 steps and per-step K the tests check token for token against plain vLLM.
TESTED_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "medusa")
# Proposers that assert one fixed draft length in vLLM 0.32: the plugin hands them the step's K.
STEP_K_METHODS = ("suffix", "medusa")
# Proposers whose drafting is skipped outright at K = 0 (no state to feed: ngram reads the token
# history, Medusa's heads read only the last hidden state). Suffix decoding is fed but not asked;
# draft_model and EAGLE run their first forward (vLLM's own K = 0 path) to keep their KV cache whole.
SKIP_AT_K0 = ("ngram", "medusa")
# Logged by the engine core, then ": N", after a prefix cache reset made suffix decoding forget its N cached
# answers (the project's planner/vllm_plugin.py PLUGIN_FORGOT: a race reads it in the server's log).
FORGOT = "tree-planner plugin: prefix cache reset; suffix decoding forgot its cached answers"


def switched_on(environ=None) -> bool:
    """TREE_PLANNER_VLLM_PLUGIN=1 (or true/yes/on); unset, empty or 0: off."""
    value = (os.environ if environ is None else environ).get(SWITCH, "").strip().lower()
    return value in ("1", "true", "yes", "on")


def tested_version(version: str) -> bool:
    """vLLM's version without a local build tag (`0.32.0+cpu` is 0.32.0) is one the patches were read from."""
    return version.split("+", 1)[0] in TESTED_VLLM


def refusal(vllm_config, platform_is_cpu: bool) -> str | None:
    """None when the plugin acts on this engine; otherwise why not, one line (the plugin then leaves
    every step to vLLM)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return "no speculative config: nothing to do"
    if spec.method not in TESTED_METHODS:
        return f"method {spec.method!r} is not one it was tested with ({', '.join(TESTED_METHODS)})"
    model = vllm_config.model_config
    if model.is_hybrid or model.has_inner_state or model.is_attention_free:
        return ("the target keeps recurrent state (Mamba / linear attention): vLLM routes every step of such a "
                "model through the speculative path on purpose, a plain step would read its state at the wrong offset")
    return _untested_setting(vllm_config, spec, platform_is_cpu)


def _untested_setting(vllm_config, spec, platform_is_cpu: bool) -> str | None:
    parallel = vllm_config.parallel_config
    checks = (
        (not platform_is_cpu, "a platform other than vLLM's CPU backend (untested: CUDA graphs, async scheduling)"),
        (vllm_config.use_v2_model_runner, "vLLM's Model Runner V2 (the plugin patches the V1 runner)"),
        (bool(vllm_config.scheduler_config.async_scheduling), "async scheduling (untested; --no-async-scheduling)"),
        (parallel.pipeline_parallel_size > 1, "pipeline parallelism"),
        (parallel.tensor_parallel_size > 1, "tensor parallelism"),
        (parallel.data_parallel_size > 1, "data parallelism"),
        ((spec.draft_tensor_parallel_size or 1) > 1, "a tensor-parallel drafter"),
        (spec.disable_padded_drafter_batch, "disable_padded_drafter_batch"),
        (spec.parallel_drafting, "parallel_drafting"),
        (spec.rejection_sample_method != "standard", f"rejection_sample_method {spec.rejection_sample_method!r}"),
        (vllm_config.kv_transfer_config is not None, "a KV transfer connector"),
    )
    for untested, what in checks:
        if untested:
            return f"{what} is not a setting it was tested with"
    return None


def describe(method: str) -> str:
    """What the plugin does for one proposer, for its log line."""
    k0 = ("drafting skipped" if method in SKIP_AT_K0 else
          "suffix tree fed, nothing drafted" if method == "suffix" else "the drafter's first forward only")
    step_k = "; the step's K from the schedule" if method in STEP_K_METHODS else ""
    return (f"a step without drafts runs vLLM's plain sampler, no draft fetch at K = 0, {k0} at K = 0{step_k}; "
            "sampled drafts verified at the requests' temperature and top-p (vLLM 0.32's CPU expand fixed)")
