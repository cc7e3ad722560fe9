"""The time of one decode step in vLLM's worker at K = 0 with the project's plugin, against vLLM plain, each
config in several fresh processes, alternated: is the plain path the plugin takes as fast as plain's own?

    python bench/bench_k0_steps.py                          # 16 requests at once, 4 processes per config
    python bench/bench_k0_steps.py --requests 32 --processes 6

Served, K = 0 with the plugin measured 0.91-0.94x plain at 16 and 32 requests (bench/results/
serving-k0-plugin.md), and bench_k0_work.py counted the same calls per step in both. This times the step
itself: each process runs one engine as `vllm serve` runs it (the worker in its own process, fp32, eager, the
benchmark's chat and repeat prompts), a warm-up `generate`, then --rounds `generate` calls of every request at once,
and times vLLM's `execute_model` on every step that decodes all the requests (nothing prefilled in it: the
steps a served level at that batch is made of). Per process the median step; per config the median over its
processes, and the spread between its processes (one config's processes differ by more than the effect
looked for on this VM, which is why the processes are many and alternate: plain, K = 0, K = 0, plain, ...).
Timed, so it refuses a loaded machine (bench/common.py). Writes bench/results/vllm-k0-steps.{json,md} (--out).
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
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after vLLM's own packages in its environment (the --inside run)

from bench.bench_k0_work import K0, prompt_ids, run_inside  # noqa: E402  (K0: the served config)

CONFIGS = {"plain": (None, False), "k0_plugin": (K0, True)}


def _time_steps(worker, batch: int) -> None:
    """In vLLM's worker process: time every execute_model that decodes one token for each of `batch` requests."""
    runner = worker.model_runner
    execute = runner.execute_model
    runner.k0_step_s = []

    def timed(scheduler_output, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return execute(scheduler_output, *args, **kwargs)
        finally:
            if scheduler_output.total_num_scheduled_tokens == batch == len(scheduler_output.num_scheduled_tokens):
                runner.k0_step_s.append(time.perf_counter() - t0)

    runner.execute_model = timed


def _clear_steps(worker) -> None:
    worker.model_runner.k0_step_s.clear()


def _steps(worker) -> list[float]:
    return list(worker.model_runner.k0_step_s)


def inside(request: dict) -> dict:
    """vLLM's side: one engine as `vllm serve` runs it (the worker in its own process, one thread on its own
    core, the engine core beside it), the seconds of each step that decodes every request."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc ships the timer functions to the worker
    if request["plugin"]:
        os.environ["TREE_PLANNER_VLLM_PLUGIN"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=request["model"], dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              speculative_config=request["speculative_config"])
    llm.collective_rpc(_time_steps, args=(len(request["prompts"]),))
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    llm.generate(prompts, greedy, use_tqdm=False)  # warm-up: every shape once
    llm.collective_rpc(_clear_steps)
    tokens = None
    for _ in range(request["rounds"]):
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        tokens = tokens or [list(o.outputs[0].token_ids) for o in outs]
    return {"step_s": llm.collective_rpc(_steps)[0], "tokens": tokens}


def order(processes: int) -> list[str]:
    """plain, K = 0, K = 0, plain, plain, K = 0, ...: each config as often first as second in a pair."""
    pair = list(CONFIGS)
    return [name for i in range(processes) for name in (pair if i % 2 == 0 else pair[::-1])]


def summarise(runs: list[dict]) -> dict:
    """Per config: each process's median step (ms, in the order they ran), their median and their spread
    (the largest over the smallest); the ratio of K = 0's median over plain's."""
    out = {}
    for name in CONFIGS:
        medians = [1e3 * statistics.median(r["step_s"]) for r in runs if r["config"] == name and r["step_s"]]
        out[name] = {"process_median_ms": [round(m, 2) for m in medians],
                     "median_ms": statistics.median(medians) if medians else None,
                     "spread": max(medians) / min(medians) if medians else None,
                     "steps": sum(len(r["step_s"]) for r in runs if r["config"] == name)}
    p, k = out["plain"]["median_ms"], out["k0_plugin"]["median_ms"]
    out["k0_over_plain_time"] = k / p if p and k else None
    return out


def report(doc: dict) -> str:
    s = doc["summary"]
    p, k = s["plain"], s["k0_plugin"]
    lines = [f"# vLLM's decode step at K = 0 with the plugin against plain, in fresh processes ({doc['model']}, "
             f"{doc['vllm']}, {doc['machine']['cpu']}, {doc['machine']['cores']} cores)", "",
             f"{doc['requests']} requests at once, {doc['max_tokens']} new tokens each, greedy, {doc['rounds']} timed "
             f"`generate` calls per process after a warm-up; the worker in its own process as served, fp32, eager; "
             f"{doc['processes']} processes per config, alternated (`{' '.join(doc['order'])}`). The time of vLLM's "
             f"`execute_model` on each step that decodes all {doc['requests']} requests. K = 0 with the plugin: "
             f"`{json.dumps(K0)}`. Wall time {doc['wall_s']:.0f} s; 1-minute load average at the start "
             f"{doc['load_avg_start']}.", "",
             "| config | median step ms | each process's median step, ms (in order) | spread between processes | steps |",
             "|---|---|---|---|---|"]
    for name, label in (("plain", "vLLM plain"), ("k0_plugin", "K = 0 with the plugin")):
        c = s[name]
        lines.append(f"| {label} | {c['median_ms']:.1f} | {', '.join(f'{x:.1f}' for x in c['process_median_ms'])} | "
                     f"{c['spread']:.2f}x | {c['steps']} |")
    lines += ["", f"K = 0 with the plugin over plain, median step time: **{s['k0_over_plain_time']:.3f}x** "
              f"(below 1: faster). Answers identical to plain's: {doc['identical']}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--inside":
        Path(sys.argv[3]).write_text(json.dumps(inside(json.loads(Path(sys.argv[2]).read_text()))))
        return 0
    from bench.common import Results, bench_main, load_record, machine, sample_load
    from decoder.engines.shipped import model_dir
    from decoder.engines.vllm.env import installed_version, require_python
    from planner.errors import UserError

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16, help="requests at once: the batch timed (default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="timed generate calls per process (default 3)")
    p.add_argument("--processes", type=int, default=4, help="fresh processes per config (default 4)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm-k0-steps"))

    def run(a) -> Results:
        if not (1 <= a.requests <= 64 and 1 <= a.max_tokens <= 512 and 1 <= a.rounds <= 20
                and 1 <= a.processes <= 20):
            raise UserError("--requests 1..64, --max-tokens 1..512, --rounds 1..20, --processes 1..20")
        t0 = time.time()
        load_start = load_record()["load_avg_1m_start"]
        folder = model_dir("smollm2-135m")
        ids = prompt_ids(folder, a.requests)
        python = require_python()
        runs = []
        plan = order(a.processes)
        for i, name in enumerate(plan, 1):
            spec, plugin = CONFIGS[name]
            print(f"bench_k0_steps: process {i}/{len(plan)}: {name}", file=sys.stderr, flush=True)
            r = run_inside(python, {"model": str(folder), "prompts": ids, "max_tokens": a.max_tokens,
                                    "rounds": a.rounds, "speculative_config": spec, "plugin": plugin}, __file__)
            runs.append({"config": name, **r})
            sample_load()
        tokens = {name: [r["tokens"] for r in runs if r["config"] == name] for name in CONFIGS}
        identical = all(t == tokens["plain"][0] for ts in tokens.values() for t in ts)
        doc = {"bench": "vllm-k0-steps", "model": "smollm2-135m", "vllm": installed_version(), "machine": machine(),
               "requests": a.requests, "max_tokens": a.max_tokens, "rounds": a.rounds, "processes": a.processes,
               "order": plan, "identical": identical, "wall_s": time.time() - t0, "load_avg_start": load_start,
               "summary": summarise(runs),
               "runs": [{"config": r["config"], "step_ms": [round(1e3 * x, 3) for x in r["step_s"]]} for r in runs]}
        out = Path(a.out)
        return Results({out.with_suffix(".json"): doc, out.with_suffix(".md"): report(doc)}, report(doc),
                       0 if identical else 1)

    return bench_main("bench_k0_steps", p, run)


if __name__ == "__main__":
    sys.exit(main())
