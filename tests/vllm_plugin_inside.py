"""The vLLM side of tests/test_vllm_plugin.py: runs INSIDE the vLLM environment (scripts/setup_vllm.sh)
as `python tests/vllm_plugin_inside.py MODE REQUEST.json RESULT.json`, with the repository's
vllm_plugin/ first on PYTHONPATH (so the plugin tested is the working tree's; vLLM finds it through the
entry point setup_vllm.sh installed). Standard library, vLLM and torch only.

  register  {"cases": [{"switch": "0" | "1", "version": "0.31.0" (optional)}, ...]}: vLLM's own plugin
            loader, once per case in order (the switch set, vLLM's version replaced when given); RESULT
            {"cases": [{"patched": [vLLM methods no longer vLLM's own], "lines": [the plugin's log lines]}]}.
  engine    {"model", "config", "greedy": {"levels", "prompts", "max_tokens"}, "sampled": {"prompt",
            "seeds": {name: [seed, ...]}, "max_tokens", "temperature", "top_p", "wrong": [names]},
            "register": a register request, run first (a process loads vLLM once), "forget": {"prompts",
            "max_tokens"}}:
            one engine in this process (vLLM's engine core and worker in-process, so a probe can
            count what each step ran). RESULT {"patched", "greedy": {level: [[ids]]}, "sampled": {name:
            [[ids]]}, "steps": [one record per step], "register": its result or null} (the plugin's log lines: the caller reads them from vLLM's
            output, as vLLM reconfigures its loggers while the engine starts). A step record: the batch, the step's K
            (`num_spec_tokens_to_schedule`), scheduled drafts, which sampler ran ("plain" or "spec"),
            rejection-sampler calls, proposer calls, suffix speculate calls and draft fetches by the
            engine core after it. Sample sets named in "wrong" run under a deliberately wrong rule, which
            the distribution test must catch, on the path "wrong_path" names: "plain" (the default), the
            plain sampler's temperature dropped (T = 1); "spec", the rejection sampler's verification and
            resampling of drafted positions against the raw distribution (T = 1, top-p 1).
            "forget", last: vLLM's reset_prefix_cache, the prompts one at a time ("forget first"), the same
            again without a reset ("forget repeated"), a reset, and once more ("forget after reset");
            RESULT["forget"] {"resets": [what each reset answered], phase: [[ids] per prompt]}.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process: the probe sees them
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "seed": 0}


class Lines(logging.Handler):
    """The plugin's log lines (its logger sits under vLLM's)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        if "tree-planner plugin" in record.getMessage():
            self.lines.append(f"{record.levelname}: {record.getMessage()}")


def _targets() -> dict:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.spec_decode.medusa import MedusaProposer
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    names = {GPUModelRunner: ("__init__", "_prepare_inputs", "propose_draft_token_ids", "_sample", "execute_model"),
             Scheduler: ("__init__", "schedule"),
             EngineCore: ("__init__", "post_step", "step", "reset_prefix_cache"),
             SuffixDecodingProposer: ("propose",), MedusaProposer: ("propose",),
             rejection_sampler: ("expand_batch_to_tokens", "apply_top_k_top_p")}  # module functions: the CPU fixes
    return {f"{cls.__name__.rsplit('.', 1)[-1]}.{n}": (cls, n, cls.__dict__[n]) for cls, ns in names.items() for n in ns}


def _patched(before: dict) -> list[str]:
    return sorted(k for k, (cls, n, fn) in before.items() if cls.__dict__[n] is not fn)


def _watch_logs() -> Lines:
    handler = Lines()
    log = logging.getLogger("vllm.tree_planner_vllm")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    return handler


def register(request: dict) -> dict:
    """Each case in order, in this one process: the switch and vLLM's version set, then vLLM's own plugin
    loader run again (its once-per-process flag reset); what each left patched and logged."""
    import vllm
    import vllm.plugins

    real_version, switch = vllm.__version__, os.environ.get("TREE_PLANNER_VLLM_PLUGIN")
    out = []
    for case in request["cases"]:
        handler = _watch_logs()
        before = _targets()
        os.environ["TREE_PLANNER_VLLM_PLUGIN"] = case["switch"]
        vllm.__version__ = case.get("version") or real_version  # what the plugin reads: a vLLM it was not tested with
        vllm.plugins.plugins_loaded = False
        vllm.plugins.load_general_plugins()  # the entry point scripts/setup_vllm.sh installed
        out.append({"patched": _patched(before), "lines": handler.lines})
        logging.getLogger("vllm.tree_planner_vllm").removeHandler(handler)
    vllm.__version__ = real_version
    os.environ["TREE_PLANNER_VLLM_PLUGIN"] = switch or ""
    vllm.plugins.plugins_loaded = False  # an engine started next loads the plugins as its own environment says
    return {"cases": out}


# ---------------------------------------------------------------------------------------------- the probe

class Probe:
    """Counts, per engine step, what vLLM ran: wrappers around vLLM's (or the plugin's) methods."""

    def __init__(self):
        self.steps: list[dict] = []
        self.wrong = None  # the deliberately wrong rule: "plain" or "spec", that path samples at temperature 1

    def install(self) -> None:
        import torch
        from vllm.v1.sample import rejection_sampler
        from vllm.v1.sample.rejection_sampler import RejectionSampler
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
        from vllm.v1.spec_decode.medusa import MedusaProposer
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        probe = self
        self._around(GPUModelRunner, "execute_model", lambda self_, out, *a, **k: probe.steps.append({
            "batch": len(out.num_scheduled_tokens), "k": out.num_spec_tokens_to_schedule,
            "drafts": sum(len(v) for v in out.scheduled_spec_decode_tokens.values()),
            "longest_draft": max(map(len, out.scheduled_spec_decode_tokens.values()), default=0), "path": None,
            "rejection": 0, "proposer": 0, "speculate": 0, "fetch": 0}))
        original_sample = GPUModelRunner.__dict__["_sample"]

        def _sample(self_, logits, spec_decode_metadata):
            probe.steps[-1]["path"] = "plain" if spec_decode_metadata is None else "spec"
            if probe.wrong == "plain" and spec_decode_metadata is None:
                sm = self_.input_batch.sampling_metadata
                self_.input_batch.sampling_metadata = dataclasses.replace(sm, temperature=sm.temperature * 0 + 1)
                try:
                    return original_sample(self_, logits, spec_decode_metadata)
                finally:
                    self_.input_batch.sampling_metadata = sm
            return original_sample(self_, logits, spec_decode_metadata)

        GPUModelRunner._sample = _sample
        expand = rejection_sampler.expand_batch_to_tokens  # the plugin's, where it patched

        def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
            out = expand(x, cu_num_tokens, num_tokens, replace_from, replace_to)
            if probe.wrong == "spec" and out.is_floating_point():  # temperature and top-p: the raw distribution
                return torch.ones_like(out)
            return out

        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        self._count(RejectionSampler, "forward", "rejection")
        for cls in (NgramProposer, SuffixDecodingProposer, SpecDecodeBaseProposer, MedusaProposer):  # draft_model, EAGLE
            self._count(cls, "propose", "proposer")
        self._count(GPUModelRunner, "take_draft_token_ids", "fetch")
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache

            self._count(SuffixDecodingCache, "speculate", "speculate")
        except ImportError:
            pass

    def _around(self, cls, name, before):
        original = getattr(cls, name)

        def wrapper(self_, *a, **k):
            before(self_, *a, **k)
            return original(self_, *a, **k)

        setattr(cls, name, wrapper)

    def _count(self, cls, name, key):
        def bump(*a, **k):
            if self.steps:
                self.steps[-1][key] += 1

        self._around(cls, name, bump)


# ---------------------------------------------------------------------------------------------- the engine

def engine(request: dict) -> dict:
    from vllm import LLM, SamplingParams

    loader = register(request["register"]) if request.get("register") else None  # before any plugin is loaded
    before = _targets()
    llm = LLM(model=request["model"], speculative_config=request.get("config"), **ENGINE)
    out = {"patched": _patched(before), "greedy": {}, "sampled": {}, "steps": [], "register": loader}
    probe = Probe()
    probe.install()

    def run(prompts, params, phase):
        first = len(probe.steps)
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        for step in probe.steps[first:]:
            step["phase"] = phase
        return [list(o.outputs[0].token_ids) for o in outs]

    greedy = request.get("greedy")
    if greedy:
        params = SamplingParams(temperature=0.0, max_tokens=int(greedy["max_tokens"]))
        for level in greedy["levels"]:  # `level` requests at once: the batch the schedule keys on
            out["greedy"][str(level)] = run(greedy["prompts"][:level], params, f"greedy c={level}")
    sampled = request.get("sampled")
    if sampled:
        for name, seeds in sampled["seeds"].items():
            probe.wrong = sampled.get("wrong_path", "plain") if name in sampled.get("wrong", ()) else None
            params = [SamplingParams(temperature=sampled["temperature"], top_p=sampled["top_p"], seed=int(s),
                                     max_tokens=int(sampled["max_tokens"])) for s in seeds]
            wave = int(sampled.get("wave", 64))  # every prompt prefilled whole in one step: a seeded request whose
            out["sampled"][name] = []  # prefill is split has its sample discarded, which CPU generators cannot rewind
            for i in range(0, len(params), wave):
                out["sampled"][name] += run([sampled["prompt"]] * len(params[i:i + wave]), params[i:i + wave],
                                            f"sampled {name}")
        probe.wrong = None
    forget = request.get("forget")
    if forget:  # what a reset leaves of earlier answers: the same prompts before and after it
        params = SamplingParams(temperature=0.0, max_tokens=int(forget["max_tokens"]))
        out["forget"] = {"resets": [llm.reset_prefix_cache()]}
        for phase in ("forget first", "forget repeated", "forget after reset"):
            if phase == "forget after reset":
                out["forget"]["resets"].append(llm.reset_prefix_cache())
            out["forget"][phase] = [run([p], params, phase)[0] for p in forget["prompts"]]
    out["steps"] = probe.steps
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("register", "engine"):
        print("usage: python tests/vllm_plugin_inside.py register|engine REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        request = json.load(f)
    result = register(request) if argv[0] == "register" else engine(request)
    with open(argv[2] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(argv[2] + ".tmp", argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
