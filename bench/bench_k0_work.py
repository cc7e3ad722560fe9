"""What a step costs vLLM with a speculative config at K = 0 and the project's plugin, against vLLM plain:
the work, counted, not timed. Timing on this VM cannot separate a few percent (two servers of one config
differ 11-28 %); the calls every step makes can be compared exactly.

    python bench/bench_k0_work.py                      # 32 requests at once, 48 tokens, greedy
    python bench/bench_k0_work.py --requests 16 --max-tokens 32

Each engine runs in its own process in vLLM's environment (scripts/setup_vllm.sh), its engine core and
worker in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0), fp32, eager, on the benchmark's prompts
(training.splits.bench_prompts, the chat and repeat groups, as bench/bench_serving.py sends them): one
warm-up call, then one `generate` of every request at once under cProfile. Per engine: the steps, and per
Python function its calls per step. The report lists every function whose calls differ. Counts do not
depend on the machine's load, so this can run beside other work; no time is reported.
Writes bench/results/vllm-k0-work.{json,md} (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K0 = json.loads((ROOT / "bench" / "data" / "serving-k0-plugin.json").read_text())["speculative_config"]  # as served
KERNELS = ("onednn_mm", "cpu_attention_with_kv_cache", "silu", "fused_add_rms_norm")


def inside(request: dict) -> dict:
    """vLLM's side: one engine, its calls per function over one generate of every request."""
    import cProfile
    import pstats

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if request["plugin"]:
        os.environ["TREE_PLANNER_VLLM_PLUGIN"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.core import EngineCore

    steps = [0]
    step = EngineCore.step

    def counted(self, *a, **k):
        out = step(self, *a, **k)
        steps[0] += bool(out and out[1])  # a step that ran the model
        return out

    EngineCore.step = counted
    llm = LLM(model=request["model"], dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              speculative_config=request["speculative_config"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    steps[0] = 0
    prof = cProfile.Profile()
    prof.enable()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    prof.disable()
    calls: dict[str, int] = {}
    for (path, line, name), (_, ncalls, _, _, _) in pstats.Stats(prof).stats.items():
        key = re.sub(r" at 0x[0-9a-f]+", "", f"{path.split('site-packages/')[-1]}:{line}:{name}")  # one key per run
        calls[key] = calls.get(key, 0) + ncalls
    return {"steps": steps[0], "calls": calls,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def run_inside(python: Path, request: dict, script: str = __file__) -> dict:
    """`script --inside REQUEST RESULT` in vLLM's environment, the working tree's plugin first on its path."""
    with tempfile.TemporaryDirectory() as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        env = {**os.environ, "PYTHONPATH": str(ROOT / "vllm_plugin")}
        r = subprocess.run([str(python), script, "--inside", str(req), str(res)], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{Path(script).stem}: the vLLM engine failed:\n{r.stderr[-3000:]}")
        return json.loads(res.read_text())


def serve_inside(inside) -> bool:
    """`SCRIPT --inside REQUEST RESULT` (run_inside's call, in vLLM's environment): `inside` on the request, its
    result written; True if that was this call."""
    if len(sys.argv) == 4 and sys.argv[1] == "--inside":
        Path(sys.argv[3]).write_text(json.dumps(inside(json.loads(Path(sys.argv[2]).read_text()))))
        return True
    return False


def write_results(out: Path, slim: dict, markdown: str) -> None:
    """OUT.json (the slim document) and OUT.md, the report printed too."""
    out.with_suffix(".json").write_text(json.dumps(slim, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown)
    print(markdown)


def prompt_ids(folder: Path, requests: int) -> list[list[int]]:
    """The benchmark's chat and repeat requests, half each, as bench_serving sends them: token ids."""
    from decoder.engines.hf.tokenizer import load_tokenizer
    from training.splits import bench_prompts
    from workflows.cli.inputs import encode_prompts

    half = requests // 2
    texts = [b.turns[0] for b in bench_prompts("chat", requests - half) + bench_prompts("repeat", half)]
    return [t.tolist() for t in encode_prompts(load_tokenizer(folder, local_only=True), texts)]


def compare(plain: dict, k0: dict) -> list[dict]:
    """Functions whose calls per step differ, most first."""
    rows = []
    for key in sorted(set(plain["calls"]) | set(k0["calls"])):
        a, b = plain["calls"].get(key, 0) / plain["steps"], k0["calls"].get(key, 0) / k0["steps"]
        if abs(a - b) > 1e-9:
            rows.append({"function": key, "plain_per_step": a, "k0_per_step": b})
    return sorted(rows, key=lambda r: -abs(r["k0_per_step"] - r["plain_per_step"]))


def model_calls_equal(differences: list[dict]) -> bool:
    """No function of the model's forward (vLLM's model_executor) or of its kernels among the differences."""
    return not any("model_executor" in d["function"] or any(k in d["function"] for k in KERNELS)
                   for d in differences)


def report(doc: dict) -> str:
    p, k = doc["plain"], doc["k0_plugin"]
    lines = [f"# vLLM's work per step at K = 0 with the plugin, against plain ({doc['model']}, {doc['vllm']}, "
             f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores)", "",
             f"{doc['requests']} requests at once, {doc['max_tokens']} new tokens each, greedy; engine core and worker "
             "in one process, fp32, eager; one `generate` under cProfile per engine. K = 0 with the plugin: "
             f"`{json.dumps(K0)}`.", "",
             f"- steps that ran the model: plain {p['steps']}, K = 0 with the plugin {k['steps']}",
             f"- answers identical: {doc['identical']}",
             "- the model's forward and kernels: every function of the model, attention and kernels is called as "
             "often per step in both" if doc["kernels_equal"] else "- the model's forward: calls differ (below)", "",
             "Functions whose calls per step differ:", "", "| function | plain per step | K = 0 + plugin per step |",
             "|---|---|---|"]
    lines += [f"| `{r['function']}` | {r['plain_per_step']:.2f} | {r['k0_per_step']:.2f} |" for r in doc["differences"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    if serve_inside(inside):
        return
    sys.path.insert(0, str(ROOT))
    from bench.common import machine
    from decoder.engines.vllm.env import installed_version, require_python
    from decoder.engines.shipped import model_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32, help="requests at once (default 32)")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per request (default 48)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm-k0-work"))
    a = p.parse_args()
    if not (1 <= a.requests <= 64 and 1 <= a.max_tokens <= 512):
        raise SystemExit("bench_k0_work: --requests 1..64, --max-tokens 1..512")
    folder = model_dir("smollm2-135m")
    ids = prompt_ids(folder, a.requests)
    python = require_python()
    base = {"model": str(folder), "prompts": ids, "max_tokens": a.max_tokens}
    print("bench_k0_work: vLLM plain", file=sys.stderr, flush=True)
    plain = run_inside(python, {**base, "speculative_config": None, "plugin": False})
    print("bench_k0_work: K = 0 with the plugin", file=sys.stderr, flush=True)
    k0 = run_inside(python, {**base, "speculative_config": K0, "plugin": True})
    diffs = compare(plain, k0)
    doc = {"bench": "vllm-k0-work", "model": "smollm2-135m", "vllm": installed_version(), "machine": machine(),
           "requests": a.requests, "max_tokens": a.max_tokens, "identical": plain["tokens"] == k0["tokens"],
           "kernels_equal": model_calls_equal(diffs),
           "differences": diffs, "plain": plain, "k0_plugin": k0}
    out = Path(a.out)
    slim = {**doc, "plain": {"steps": plain["steps"]}, "k0_plugin": {"steps": k0["steps"]}}
    write_results(out, slim, report(doc))


if __name__ == "__main__":
    main()
