"""Why one per-step plan takes fewer steps than another under coupled sampling: swap their parts.

    python bench/bench_sampling_steps.py      # the greedy rerun's and the T 0.7 run's lookup + ParallelSpec plans

No timing: under coupled sampling (decoder/noise.py) every plan emits plain sampling's text with the same
seed, so the steps a plan takes on a prompt are exact, and two plans compare on one text. Two dynamic
plans of one family (by default lookup + ParallelSpec per-step trees, one from the greedy main job rerun
with the race's tie rule, one from the T 0.7 / top-p 0.9 autotune) and hybrids of them decode the
autotune's held-out prompts (acceptance and race prompts, each as its first turn and its follow-up),
coupled, at the sampling settings: the step-cost curve (`dynamic.step_cost_s`, the profile each was planned
against) taken from one plan and the guessers' priors and calibrations from the other. Writes
bench/results/sampling_steps.{json,md} (--out).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

A_PLAN = ROOT / "reports" / "autotune-tierule-cpu-smollm2-135m" / "chosen.json"
B_PLAN = ROOT / "reports" / "sampling-autotune-cpu-smollm2-135m-t0.7-p0.9" / "trees" / "lookup+parallelspec-dynamic-15.json"
PATHS_PROFILE = ROOT / "reports" / "autotune-quiet-cpu-smollm2-135m" / "profile.json"  # the benchmarks' matmul paths


def hybrid(costs_from: dict, guessers_from: dict) -> dict:
    """A dynamic plan: the step costs of one, the guessers' priors and calibrations of the other."""
    t = copy.deepcopy(guessers_from)
    t["dynamic"]["step_cost_s"] = copy.deepcopy(costs_from["dynamic"]["step_cost_s"])
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default=str(A_PLAN), help="a dynamic plan (default: the greedy rerun's)")
    p.add_argument("--b", default=str(B_PLAN), help="another of the same guessers (default: the T 0.7 run's)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sampling_steps"))
    a = p.parse_args(argv)
    from planner.errors import UserError

    try:
        return _run(a)
    except UserError as e:
        print(f"bench_sampling_steps: error: {e}", file=sys.stderr)
        return 2


def _run(a) -> int:
    import torch
    from bench_main_job import load_plan, machine
    from transformers import AutoTokenizer

    from decoder import generate
    from decoder.cpu_paths import use_profile_paths
    from planner.errors import UserError
    from planner.jsonio import atomic_write_json
    from planner.tree import tree_from_json
    from profiler.models import load_model
    from workflows.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts

    if not (1 <= a.tokens <= 512 and 0 < a.temperature <= 5 and 0 < a.top_p <= 1):
        raise UserError("--tokens 1..512, --temperature in (0, 5], --top-p in (0, 1]")
    docs = {}
    for name, path in (("a", a.a), ("b", a.b)):
        try:
            docs[name] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: cannot read a plan ({e})") from None
        if "dynamic" not in docs[name]:
            raise UserError(f"{path}: field dynamic: expected a per-step (dynamic) plan")
    if set(docs["a"]["dynamic"]["guessers"]) != set(docs["b"]["dynamic"]["guessers"]):
        raise UserError(f"{a.a}, {a.b}: field dynamic.guessers: expected the same guessers in both")
    loaded = load_model("smollm2-135m", device="cpu")
    model = loaded.model
    use_profile_paths(model, str(PATHS_PROFILE))
    _, guesser = load_plan(a.a, loaded)
    A, B = docs["a"], docs["b"]
    plans = {"a": A, "b": B, "a's step costs, b's guessers": hybrid(A, B), "b's step costs, a's guessers": hybrid(B, A)}
    accept, race = held_out_prompts(str(DEFAULT_QUESTIONS), 8, 16, 2)
    prompts = encode_prompts(AutoTokenizer.from_pretrained(loaded.tokenizer_dir), accept + race)
    rows = {}
    with torch.inference_mode():
        for name, doc in plans.items():
            tree = tree_from_json(doc, name)
            steps = tokens = 0
            for i, ids in enumerate(prompts):
                out = generate(model, ids, plan=tree, guesser=guesser, max_new_tokens=a.tokens, phase_times=False,
                               seed=i, verify_rule="coupled", temperature=a.temperature, top_k=0, top_p=a.top_p)
                steps, tokens = steps + int(out.steps), tokens + len(out.tokens)
            rows[name] = {"steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps}
            print(f"bench_sampling_steps: {name}: {tokens} tokens in {steps} steps", file=sys.stderr, flush=True)
    doc = {"a": str(a.a), "b": str(a.b), "prompts": len(prompts), "tokens": a.tokens, "machine": machine(),
           "sampling": {"temperature": a.temperature, "top_p": a.top_p}, "rows": rows,
           "step_cost_s": {k: plans[k]["dynamic"]["step_cost_s"][:8] for k in ("a", "b")}}
    out = Path(a.out)
    atomic_write_json(out.with_suffix(".json"), doc)
    lines = ["# Steps of per-step plans on one coupled text, their parts swapped", "",
             (f"{doc['prompts']} held-out prompts x {a.tokens} tokens, coupled sampling at temperature {a.temperature}, "
              f"top-p {a.top_p} (seed = prompt index); a = `{a.a}`, b = `{a.b}`. Step costs (s) for input lengths "
              f"1..8: a {[round(x, 4) for x in doc['step_cost_s']['a']]}, b {[round(x, 4) for x in doc['step_cost_s']['b']]}."),
             "", "| plan | tokens | steps | tokens per step |", "|---|---|---|---|"]
    lines += [f"| {k} | {r['tokens']} | {r['steps']} | {r['tokens_per_step']:.3f} |" for k, r in rows.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
