"""The top-p of a sampled verify step's drafted positions in vLLM 0.32's CPU build: vLLM's sort against the
plugin's partial selection (vllm_plugin/tree_planner_vllm/nucleus.py), on the rows the rejection sampler filters.

    python bench/bench_cpu_top_p.py                   # 40 requests one at a time, 32 new tokens, T 0.7, top-p 0.9
    python bench/bench_cpu_top_p.py --requests 8 --max-tokens 16

One engine with the plugin in vLLM's environment (scripts/setup_vllm.sh), engine core and worker in one process,
fp32, eager, ngram K = 8 (lookup 1-3), on the benchmark's chat and repeat prompts (bench_k0_work.prompt_ids), request
i with seed i. Every call of the rejection sampler's `apply_top_k_top_p` ([drafted positions, vocab], temperature
applied) runs both functions on copies of its input, in alternating order, timed; the verification goes on with the
plugin's result. Per call: the rows, both times, whether the two kept the same tokens, whether the plugin left the
call to vLLM's sort (a nucleus wider than its candidates); per row the tokens kept. Times are medians over the calls
of one run on one machine, not a served benchmark (bench_serving.py measures what they do to throughput). Writes
bench/results/vllm-cpu-top-p.{json,md} (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def inside(request: dict) -> dict:
    """vLLM's side: one engine with the plugin, every top-p call of the rejection sampler run both ways."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["TREE_PLANNER_VLLM_PLUGIN"] = "1"
    import torch
    from tree_planner_vllm import nucleus
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample import rejection_sampler as rs

    llm = LLM(model=request["model"], dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              speculative_config=NGRAM)
    plugin = rs.apply_top_k_top_p
    vllm_own = getattr(plugin, "__wrapped__", None)
    if vllm_own is None:
        raise SystemExit("bench_cpu_top_p: the plugin did not patch the rejection sampler's top-p")
    calls: list[dict] = []

    def both(logits, k, p):
        order = (vllm_own, plugin) if len(calls) % 2 == 0 else (plugin, vllm_own)
        out, ms = {}, {}
        for fn in order:
            x = logits.clone()
            t0 = time.perf_counter()
            out[fn] = fn(x, k, p)
            ms[fn] = (time.perf_counter() - t0) * 1e3
        refused = k is not None or p is None or nucleus.top_p_filter(logits.clone(), p) is None
        kept = (~torch.isinf(out[plugin])).sum(dim=-1)
        differ = torch.isinf(out[vllm_own]) != torch.isinf(out[plugin])  # [rows, vocab]
        calls.append({"rows": int(logits.shape[0]), "vllm_ms": ms[vllm_own], "plugin_ms": ms[plugin],
                      "same": not bool(differ.any()), "refused": bool(refused), "kept": kept.tolist(),
                      "differ": _differences(logits, p, differ) if differ.any() else []})
        return logits.copy_(out[plugin])

    llm.generate([TokensPrompt(prompt_token_ids=request["prompts"][0])], SamplingParams(max_tokens=4), use_tqdm=False)
    rs.apply_top_k_top_p = both  # from here on: the warm-up above is not counted
    for i, ids in enumerate(request["prompts"]):
        params = SamplingParams(temperature=request["temperature"], top_p=request["top_p"], seed=i,
                                max_tokens=request["max_tokens"])
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return {"calls": calls}


def _differences(logits, p, differ) -> list[dict]:
    """Each token one function kept and the other did not: its probability and how far the mass of the tokens
    likelier than it lies from p (exact arithmetic keeps it when that mass is below p), in float64."""
    import torch

    out = []
    for row, token in differ.nonzero().tolist():
        probs = logits[row].double().softmax(-1)
        above = float(probs[probs > probs[token]].sum())
        out.append({"prob": float(probs[token]), "above_minus_p": above - float(p[row])})
    return out


def summary(calls: list[dict]) -> dict:
    rows = [c["rows"] for c in calls]
    kept = sorted(n for c in calls for n in c["kept"])
    return {"calls": len(calls), "rows": sum(rows), "same": sum(c["same"] for c in calls),
            "refused": sum(c["refused"] for c in calls),
            "vllm_ms_per_row": statistics.median(c["vllm_ms"] / c["rows"] for c in calls),
            "plugin_ms_per_row": statistics.median(c["plugin_ms"] / c["rows"] for c in calls),
            "vllm_ms_per_call": statistics.median(c["vllm_ms"] for c in calls),
            "plugin_ms_per_call": statistics.median(c["plugin_ms"] for c in calls),
            "rows_per_call": statistics.median(rows),
            "kept_median": kept[len(kept) // 2], "kept_p99": kept[min(len(kept) - 1, int(len(kept) * 0.99))],
            "kept_max": kept[-1], "differences": [d for c in calls for d in c["differ"]]}


def report(doc: dict) -> str:
    m, s = doc["machine"], doc["summary"]
    return "\n".join([
        f"# Top-p of the drafted positions in vLLM's CPU build ({doc['model']}, {doc['vllm']}, {m['cpu']}, "
        f"{m['cores']} cores)", "",
        f"{doc['requests']} benchmark requests one at a time (seed i for request i), {doc['max_tokens']} new tokens, "
        f"T {doc['temperature']}, top-p {doc['top_p']}, `{json.dumps(doc['config'])}` with the plugin; engine core and worker in "
        "one process, fp32, eager. Every call of the rejection sampler's `apply_top_k_top_p` ran vLLM's sort and the "
        "plugin's partial selection on copies of its input, in alternating order; medians over the calls of one run, "
        f"1-minute load average {doc['load_before']:.2f} at the start.", "",
        "| calls | drafted rows | rows per call (median) | vLLM sort ms per row | plugin ms per row | vLLM ms per call "
        "| plugin ms per call | calls with the same tokens kept | calls left to vLLM's sort | tokens kept per row "
        "(median / p99 / max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {s['calls']} | {s['rows']} | {s['rows_per_call']:g} | {s['vllm_ms_per_row']:.2f} | "
        f"{s['plugin_ms_per_row']:.2f} | {s['vllm_ms_per_call']:.2f} | {s['plugin_ms_per_call']:.2f} | "
        f"{s['same']} of {s['calls']} | {s['refused']} | {s['kept_median']} / {s['kept_p99']} / {s['kept_max']} |",
        "", "Tokens one function kept and the other did not (a nucleus is the tokens whose likelier tokens hold less "
        "than p; both sum in floating point, vLLM in float32 over the whole vocabulary, the plugin in float64 over "
        "its candidates): " + ("none." if not s["differences"] else "; ".join(
            f"probability {d['prob']:.3g}, the mass above it p {d['above_minus_p']:+.2g}" for d in s["differences"])
            + "."), ""])


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.bench_k0_work import prompt_ids, run_inside, serve_inside, write_results

    if serve_inside(inside):
        return
    from bench.common import machine
    from decoder.engines.shipped import model_dir
    from decoder.engines.vllm.env import installed_version, require_python

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40, help="requests, one at a time (default 40)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default 32)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm-cpu-top-p"))
    a = p.parse_args()
    if not (2 <= a.requests <= 200 and 1 <= a.max_tokens <= 512):
        raise SystemExit("bench_cpu_top_p: --requests 2..200, --max-tokens 1..512")
    folder = model_dir("smollm2-135m")
    python = require_python()
    load_before = os.getloadavg()[0]
    request = {"model": str(folder), "prompts": prompt_ids(folder, a.requests), "max_tokens": a.max_tokens,
               "temperature": 0.7, "top_p": 0.9}
    print("bench_cpu_top_p: one engine, every top-p call both ways", file=sys.stderr, flush=True)
    calls = run_inside(python, request, script=__file__)["calls"]
    if not calls:
        raise SystemExit("bench_cpu_top_p: no verify step sampled drafted positions (nothing drafted)")
    doc = {"bench": "vllm-cpu-top-p", "model": "smollm2-135m", "vllm": installed_version(), "machine": machine(),
           "requests": a.requests, "max_tokens": a.max_tokens, "temperature": 0.7, "top_p": 0.9,
           "config": NGRAM, "load_before": load_before, "summary": summary(calls)}
    write_results(Path(a.out), doc, report(doc))


if __name__ == "__main__":
    main()
