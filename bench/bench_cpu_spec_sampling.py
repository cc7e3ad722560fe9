"""vLLM 0.32's CPU build under sampled speculative decoding: does the rejection sampler verify drafts at the
request's own temperature and top-p? Without the project's plugin it does not (docs/vllm.md, "Sampled
speculative decoding on vLLM 0.32's CPU build is not lossless without the plugin"); this measures it.

    python bench/bench_cpu_spec_sampling.py                   # 40 requests one at a time, 32 tokens, T 0.7, top-p 0.9
    python bench/bench_cpu_spec_sampling.py --requests 8 --max-tokens 16

Each engine runs in its own process in vLLM's environment (scripts/setup_vllm.sh), engine core and worker in
that process, fp32, eager, on the benchmark's chat and repeat prompts (bench_k0_work.prompt_ids), request i
with seed i, one request at a time (so steps without drafts exist and the plugin's plain path runs too):
- ngram K = 8 (lookup 1-3) as vLLM ships it (the switch off);
- the same with the plugin switched on but its CPU expand fix undone (what the plugin did before 2026-12-03);
- the same with the plugin.
Per engine: every call of the rejection sampler's `expand_batch_to_tokens` compared with the expansion computed
here from the request's own values (the count that differ, and the temperatures it returned), drafted and
accepted tokens, and the first answers decoded. Counts do not depend on load; the wall time is one run each,
not a benchmark. Writes bench/results/vllm-cpu-spec-sampling.{json,md} (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ARMS = {  # name -> (plugin switch, undo the plugin's expand fix)
    "vLLM as shipped": (False, False),
    "plugin, expand fix undone": (True, True),
    "plugin": (True, False),
}


def inside(request: dict) -> dict:
    """vLLM's side: one engine, the requests one at a time, the expansions and acceptance counted."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["TREE_PLANNER_VLLM_PLUGIN"] = "1" if request["plugin"] else "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample import rejection_sampler as rs

    llm = LLM(model=request["model"], dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              speculative_config=NGRAM)
    if request["undo_fix"]:  # the plugin patched at engine start: put vLLM's own function back
        rs.expand_batch_to_tokens = getattr(rs.expand_batch_to_tokens, "__wrapped__", rs.expand_batch_to_tokens)
    llm.generate([TokensPrompt(prompt_token_ids=request["prompts"][0])], SamplingParams(max_tokens=4), use_tqdm=False)
    count = {"expansions": 0, "wrong": 0, "drafted": 0, "accepted": 0, "verify_steps": 0, "temperatures": []}
    expand = rs.expand_batch_to_tokens

    def checked(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        out = expand(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        ends = cu_num_tokens.to(torch.int64)
        want = torch.where(x == replace_from, torch.full_like(x, replace_to), x).repeat_interleave(
            torch.diff(ends, prepend=ends.new_zeros(1)), output_size=num_tokens)
        if num_tokens:
            count["expansions"] += 1
            count["wrong"] += int(not torch.equal(out, want))
            if replace_to == 1 and len(count["temperatures"]) < 8:  # the temperature's expansion
                count["temperatures"].append(float(out[0]))
        return out

    rs.expand_batch_to_tokens = checked
    forward = rs.RejectionSampler.forward

    def counted(self, metadata, *a, **k):
        out = forward(self, metadata, *a, **k)
        count["verify_steps"] += 1
        count["drafted"] += int(sum(metadata.num_draft_tokens))
        count["accepted"] += int(((out.sampled_token_ids >= 0).sum(dim=1) - 1).sum())
        return out

    rs.RejectionSampler.forward = counted  # counted from here on: the warm-up above is not
    answers, t0 = [], time.perf_counter()
    for i, ids in enumerate(request["prompts"]):
        params = SamplingParams(temperature=request["temperature"], top_p=request["top_p"], seed=i,
                                max_tokens=request["max_tokens"])
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        answers.append(list(out[0].outputs[0].token_ids))
    return {**count, "wall_s": time.perf_counter() - t0, "answers": answers}


def report(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# Sampled speculative decoding in vLLM's CPU build ({doc['model']}, {doc['vllm']}, {m['cpu']}, "
             f"{m['cores']} cores)", "",
             f"{doc['requests']} benchmark requests one at a time (seed i for request i), {doc['max_tokens']} new tokens, "
             f"T {doc['temperature']}, top-p {doc['top_p']}, `{json.dumps(NGRAM)}`; engine core and worker in one process, "
             "fp32, eager. An expansion is wrong when `expand_batch_to_tokens` returned other values than the "
             "requests' own temperature, top-p or top-k repeated over their drafted positions. Wall time: one run "
             "each, not a benchmark.", "",
             "| engine | expansions wrong | temperatures it returned (first) | accepted / drafted | tokens per verify step "
             "| wall s |", "|---|---|---|---|---|---|"]
    for name, r in doc["arms"].items():
        temps = ", ".join(f"{t:.3g}" for t in r["temperatures"][:4])
        per_step = 1 + r["accepted"] / r["verify_steps"] if r["verify_steps"] else float("nan")
        lines.append(f"| {name} | {r['wrong']} of {r['expansions']} | {temps} | {r['accepted']} / {r['drafted']} | "
                     f"{per_step:.2f} | {r['wall_s']:.0f} |")
    lines += ["", "First answers:", ""]
    for name, r in doc["arms"].items():
        lines += [f"- {name}:"] + [f"  - {json.dumps(t)}" for t in r["texts"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.bench_k0_work import prompt_ids, run_inside, serve_inside, write_results

    if serve_inside(inside):
        return
    from bench.common import machine
    from decoder.engines.hf.tokenizer import load_tokenizer
    from decoder.engines.shipped import model_dir
    from decoder.engines.vllm.env import installed_version, require_python

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40, help="requests, one at a time (default 40)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm-cpu-spec-sampling"))
    a = p.parse_args()
    if not (2 <= a.requests <= 200 and 1 <= a.max_tokens <= 512):
        raise SystemExit("bench_cpu_spec_sampling: --requests 2..200, --max-tokens 1..512")
    folder = model_dir("smollm2-135m")
    python = require_python()
    base = {"model": str(folder), "prompts": prompt_ids(folder, a.requests), "max_tokens": a.max_tokens,
            "temperature": 0.7, "top_p": 0.9}
    tok = load_tokenizer(folder, local_only=True)
    arms = {}
    for name, (plugin, undo) in ARMS.items():
        print(f"bench_cpu_spec_sampling: {name}", file=sys.stderr, flush=True)
        r = run_inside(python, {**base, "plugin": plugin, "undo_fix": undo}, script=__file__)
        arms[name] = {**r, "texts": [tok.decode(t) for t in r["answers"][a.requests // 2:a.requests // 2 + 3]]}
    doc = {"bench": "vllm-cpu-spec-sampling", "model": "smollm2-135m", "vllm": installed_version(), "machine": machine(),
           "requests": a.requests, "max_tokens": a.max_tokens, "temperature": 0.7, "top_p": 0.9, "arms": arms}
    out = Path(a.out)
    slim = {**doc, "arms": {n: {k: v for k, v in r.items() if k != "answers"} for n, r in arms.items()}}
    write_results(out, slim, report(doc))


if __name__ == "__main__":
    main()
