"""vLLM's side of the checks, the race and the benchmark: runs INSIDE the vLLM environment
(scripts/setup_vllm.sh), as `python -m workflows.export.vllm_inside MODE REQUEST.json RESULT.json`, with
the repository on PYTHONPATH. It imports the standard library and vLLM only (vLLM pins its own
transformers; the project's environment never imports vLLM): the caller, workflows/export/vllm.py, writes
the request and reads the result.

  check   REQUEST {"model", "configs": {name: speculative_config}, optional "targets": {name: a
          config-only target folder for that config}}: build vLLM's own engine config
          (EngineArgs(...).create_engine_config(): ModelConfig, SpeculativeConfig and their checks,
          no weights loaded) from each config; RESULT {name: null | "the error, one line"}.
  decode  REQUEST {"model", "config": speculative_config | null, "prompts": [[token ids]],
          "warmup": [token ids], "max_tokens", "batched": bool}: one engine (fp32, eager, greedy,
          one request at a time after a warm-up request), RESULT {"start_s", "tokens": [[ids]],
          "seconds": [per prompt], "drafted", "accepted", "drafts", and with "batched" the same
          prompts submitted together: "batched_seconds", "batched_tokens"}.

One engine per process: vLLM's CPU engine keeps global state, and a process per contender keeps
the measurements independent (the caller interleaves the processes).
"""
from __future__ import annotations

import json
import os
import sys
import time

ENGINE_DEFAULTS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048, "seed": 0}
KV_CACHE_GB = "2"  # VLLM_CPU_KVCACHE_SPACE: a 135M model's cache at max_model_len needs far less


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"


def check(request: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    out = {}
    targets = request.get("targets") or {}
    for name, cfg in request["configs"].items():
        model = targets.get(name, request["model"])  # a config-only target folder: no tokenizer to read
        try:
            vcfg = EngineArgs(model=model, speculative_config=cfg, skip_tokenizer_init=model != request["model"],
                              **ENGINE_DEFAULTS).create_engine_config()
            spec = vcfg.speculative_config
            out[name] = None if spec is not None else "vLLM built no speculative config"
        except Exception as e:  # noqa: BLE001  every rejection is the answer, one line each
            out[name] = _one_line(e)
    return out


def _spec_counts(llm) -> dict:
    counts = {"drafts": 0, "drafted": 0, "accepted": 0}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "drafted",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        key = names.get(m.name)
        if key is not None:
            counts[key] += int(getattr(m, "value", 0))
    return counts


def decode(request: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=request["model"], speculative_config=request.get("config"), disable_log_stats=False,
              **ENGINE_DEFAULTS)
    start_s = time.perf_counter() - t0
    n = int(request["max_tokens"])
    greedy = SamplingParams(temperature=0.0, max_tokens=n)

    def run(prompts):
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    run([request["warmup"]])  # every shape's first use, the proposer's set-up
    before = _spec_counts(llm)
    tokens, seconds = [], []
    for p in request["prompts"]:
        t = time.perf_counter()
        tokens.append(run([p])[0])
        seconds.append(time.perf_counter() - t)
    after = _spec_counts(llm)
    result = {"start_s": start_s, "tokens": tokens, "seconds": seconds, **{k: after[k] - before[k] for k in after}}
    if request.get("batched"):
        t = time.perf_counter()
        result["batched_tokens"] = run(request["prompts"])
        result["batched_seconds"] = time.perf_counter() - t
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("check", "decode"):
        print("usage: python -m workflows.export.vllm_inside check|decode REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GB)
    with open(argv[1]) as f:
        request = json.load(f)
    result = check(request) if argv[0] == "check" else decode(request)
    tmp = argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
