"""Why one per-step plan takes fewer steps than another under coupled sampling: swap their parts.

    python bench/bench_sampling_steps.py      # the greedy rerun's and the T 0.7 run's lookup + ParallelSpec plans
    python bench/bench_sampling_steps.py --a G.json --b S.json --slopes 0.01,0.03,0.1 --prompts bench

No timing: under coupled sampling (decoder/noise.py) every plan emits plain sampling's text with the same
seed, so the steps a plan takes on a prompt are exact, and two plans compare on one text. Two dynamic
plans of one family (by default lookup + ParallelSpec per-step trees, one from the greedy main job rerun
with the race's tie rule, one from the T 0.7 / top-p 0.9 autotune) and hybrids of them decode the
autotune's held-out prompts (acceptance and race prompts, each as its first turn and its follow-up),
coupled, at the sampling settings: the step-cost curve (`dynamic.step_cost_s`, the profile each was planned
against) taken from one plan and the guessers' priors and calibrations from the other. Writes
bench/results/sampling_steps.{json,md} (--out).

With --slopes the question is where a plan calibrated under sampling (b) would beat one calibrated
greedily (a): both decode the text on their own step costs and on synthetic curves L(n) = L(1) (1 + s (n - 1))
(a forward that grows with its input, as on a compute-bound device), b at a's price of a drafter pass, and
each run is priced by its curve: modeled seconds = the sum over its steps of the curve at the step's input
length, plus the drafter passes it paid for. Steps, input lengths and passes are exact (one text); only the
price is a model, the same one the per-step planner decides with. --prompts bench
takes bench_sampling's benchmark prompts, which no tuning step read.

With --frozen both plans also decode with their online correction off (dynamic.prior_strength 1e6: the
priors and calibrations each was tuned with, never corrected by what the prompt's own steps accept), on
their own step costs: how much of the difference between a greedy and a sampled calibration the per-step
correction recovers while it decodes.
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


def sloped(doc: dict, slope: float) -> dict:
    """The plan with step costs L(n) = L(1) (1 + slope (n - 1)) over its own lengths, L(1) its own."""
    t = copy.deepcopy(doc)
    cost = t["dynamic"]["step_cost_s"]
    t["dynamic"]["step_cost_s"] = [float(cost[0]) * (1.0 + slope * n) for n in range(len(cost))]
    return t


def drafting_from(doc: dict, like: dict) -> dict:
    """The plan with `like`'s price of a drafter pass per guesser (draft_s: this machine's, measured
    by each run with its own noise), so that two plans differ only by their priors and calibrations."""
    t = copy.deepcopy(doc)
    for kind, g in t["dynamic"]["guessers"].items():
        g["draft_s"] = like["dynamic"]["guessers"][kind]["draft_s"]
    return t


def frozen(doc: dict) -> dict:
    """The plan without its online correction: the tuned priors and calibrations, as they are, every step."""
    from planner.dynamic import MAX_PRIOR_STRENGTH

    t = copy.deepcopy(doc)
    t["dynamic"]["prior_strength"] = MAX_PRIOR_STRENGTH
    return t


def modeled_seconds(input_lengths: list[int], cost: list[float], drafting_s: list[float]) -> float:
    """A run's price on a step-cost curve: the curve at each step's input length (clamped to its end)
    plus the drafter passes each step paid for (the session's own record, at the plan's draft_s)."""
    return float(sum(cost[min(int(n), len(cost)) - 1] for n in input_lengths) + sum(drafting_s))


def _slopes(text: str | None) -> list[float]:
    from planner.errors import UserError

    if text is None:
        return []
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--slopes: expected comma-separated numbers, got {text!r}") from None
    if not out or any(not 0.0 <= x <= 1.0 for x in out):
        raise UserError(f"--slopes: expected slopes in [0, 1] (a fraction of L(1) per token), got {text!r}")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default=str(A_PLAN), help="a dynamic plan (default: the greedy rerun's)")
    p.add_argument("--b", default=str(B_PLAN), help="another of the same guessers (default: the T 0.7 run's)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--slopes", default=None, help="comma-separated s: a and b on their own step costs and on "
                                                  "L(n) = L(1) (1 + s (n - 1)), priced by the curve (no hybrids)")
    p.add_argument("--frozen", action="store_true", help="also a and b without their online correction, priced "
                                                          "on their own step costs (implies the priced table)")
    p.add_argument("--prompts", choices=["held-out", "bench"], default="held-out",
                   help="the autotune's held-out prompts (default) or bench_sampling's benchmark prompts")
    p.add_argument("--bench-prompts", type=int, default=8, help="--prompts bench: this many chats and rewrites each")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sampling_steps"))
    return p


def main(argv=None) -> int:
    from common import bench_main

    # no timing (steps on one coupled text, priced by a model): no load is judged
    return bench_main("bench_sampling_steps", parser(), run, argv, writes=lambda a: False)


def run(a):
    import torch
    from bench_main_job import load_plan
    from common import Results, machine, open_hf

    from decoder import generate
    from planner.errors import UserError
    from planner.tree import tree_from_json
    from workflows.cli.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts

    if not (1 <= a.tokens <= 512 and 0 < a.temperature <= 5 and 0 < a.top_p <= 1 and 0 <= a.top_k <= 1000
            and 1 <= a.bench_prompts <= 32):
        raise UserError("--tokens 1..512, --temperature in (0, 5], --top-p in (0, 1], --top-k 0..1000, --bench-prompts 1..32")
    slopes = _slopes(a.slopes)
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
    engine = open_hf("smollm2-135m")
    engine.use_matmul_paths(str(PATHS_PROFILE))
    _, guesser = load_plan(a.a, engine)
    A, B = docs["a"], docs["b"]
    priced = [f", slope {x:g}" for x in slopes] + ([", frozen"] if a.frozen else [])
    if priced:
        B = drafting_from(B, A)
        plans = {"a": A, "b": B}
        for x in slopes:
            plans[f"a, slope {x:g}"], plans[f"b, slope {x:g}"] = sloped(A, x), sloped(B, x)
        if a.frozen:
            plans["a, frozen"], plans["b, frozen"] = frozen(A), frozen(B)
    else:
        plans = {"a": A, "b": B, "a's step costs, b's guessers": hybrid(A, B), "b's step costs, a's guessers": hybrid(B, A)}
    tok = engine.tokenizer
    if a.prompts == "bench":
        from bench_sampling import build_prompts

        prompts = [ids for _, ids in build_prompts(engine, tok, a.bench_prompts, a.bench_prompts, 64)]
    else:
        accept, race = held_out_prompts(str(DEFAULT_QUESTIONS), 8, 16, 2)
        prompts = encode_prompts(tok, accept + race)
    rows = {}
    with torch.inference_mode():
        for name, doc in plans.items():
            tree = tree_from_json(doc, name)
            cost = doc["dynamic"]["step_cost_s"]
            steps = tokens = 0
            lengths: list[int] = []
            drafting: list[float] = []
            for i, ids in enumerate(prompts):
                out = generate(engine, ids, plan=tree, guesser=guesser, max_new_tokens=a.tokens, phase_times=False,
                               seed=i, verify_rule="coupled", temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
                steps, tokens = steps + int(out.steps), tokens + len(out.tokens)
                lengths += out.stats.input_lengths
                drafting += out.stats.dynamic["predicted_draft_s"]
            modeled = modeled_seconds(lengths, cost, drafting)
            rows[name] = {"steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps,
                          "mean_input_length": sum(lengths) / len(lengths), "drafting_s": sum(drafting),
                          "modeled_s": modeled,
                          "modeled_speedup": tokens * float(cost[0]) / modeled}  # plain: one token a step at L(1)
            print(f"bench_sampling_steps: {name}: {tokens} tokens in {steps} steps", file=sys.stderr, flush=True)
    doc = {"a": str(a.a), "b": str(a.b), "prompts": len(prompts), "prompt_set": a.prompts, "tokens": a.tokens,
           "machine": machine(), "sampling": {"temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}, "slopes": slopes,
           "frozen": bool(a.frozen),
           "rows": rows, "step_cost_s": {k: plans[k]["dynamic"]["step_cost_s"][:8] for k in ("a", "b")}}
    if priced:
        doc["b_over_a"] = {c: rows[f"a{c}"]["modeled_s"] / rows[f"b{c}"]["modeled_s"] for c in [""] + priced}
    out = Path(a.out)
    md = _markdown(doc, a)
    return Results({out.with_suffix(".json"): doc, out.with_suffix(".md"): md + "\n"}, md)


def _markdown(doc: dict, a) -> str:
    which = "held-out" if doc["prompt_set"] == "held-out" else "benchmark (no tuning step read them)"
    priced = "b_over_a" in doc
    head = ("# Steps of per-step plans on one coupled text, priced on step-cost curves" if priced else
            "# Steps of per-step plans on one coupled text, their parts swapped")
    cost = doc["step_cost_s"]
    lines = [head, "",
             (f"{doc['prompts']} {which} prompts x {a.tokens} tokens, coupled sampling at temperature {a.temperature}, "
              f"top-k {a.top_k or 'off'}, top-p {a.top_p} (seed = prompt index); a = `{a.a}`, b = `{a.b}`. Step costs (s) for input lengths "
              f"1..8: a {[round(x, 4) for x in cost['a']]}, b {[round(x, 4) for x in cost['b']]}."), ""]
    if not priced:
        lines += ["| plan | tokens | steps | tokens per step |", "|---|---|---|---|"]
        lines += [f"| {k} | {r['tokens']} | {r['steps']} | {r['tokens_per_step']:.3f} |" for k, r in doc["rows"].items()]
        return "\n".join(lines)
    lines += ["b drafts at a's price of a drafter pass (draft_s), so the two differ only by their priors and "
              "calibrations. Slope s: both plans' step costs replaced by L(n) = L(1) (1 + s (n - 1)). Modeled seconds: "
              "the sum over the run's steps of its curve at the step's input length, plus the drafter passes each "
              "step paid for at draft_s; speedup: plain decoding's price (one token a step at L(1)) over it."
              + (" Frozen: the plan's own step costs, its online correction off (prior_strength 1e6): the tuned "
                 "priors and calibrations used as they are on every step." if doc["frozen"] else ""), "",
              "| curve | plan | steps | tokens per step | mean input length | drafting s | modeled s | modeled speedup "
              "| b's speedup over a |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c, ratio in doc["b_over_a"].items():
        for k in ("a", "b"):
            r = doc["rows"][f"{k}{c}"]
            lines.append(f"| {c.lstrip(', ') or 'own'} | {k} | {r['steps']} | {r['tokens_per_step']:.3f} | "
                         f"{r['mean_input_length']:.2f} | {r['drafting_s']:.2f} | {r['modeled_s']:.2f} | "
                         f"{r['modeled_speedup']:.3f}x | "
                         + (f"{ratio:.3f}x |" if k == "b" else " |"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
