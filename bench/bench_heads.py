"""An EAGLE head where users run it: its planned settings against transformers' `generate`, the project's plain
loop, the settings engines ship for heads (vLLM's K = 3 chain, SGLang's default tree of 5 steps, top 4, 8
draft tokens), the fastest EAGLE-2 budget and chain planned from its acceptance and a profile, and any plans
given (the main job's decisions, the project's other drafters), on the hf engine.

    python bench/bench_heads.py --profile runs/latest/profile.json --plan runs/latest/chosen.json
    python bench/bench_heads.py --smoke                 # a tiny random model and a head made for it, seconds

Prompts: training.splits.bench_prompts (single-turn chats, follow-ups, requests that repeat their input; no
tuning step read them, no head trained on them). Contenders run interleaved in a shuffled order per prompt and
round after a warm-up (bench/common.py); per prompt the median over rounds; speedups are per-prompt ratios
against `generate` in the same run, summarised by their geometric mean, and per group. Every output is checked
against `generate`'s. Writes bench/results/heads.{json,md} (--out) with the machine and the load.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, Results, bench_ids, bench_main, by_group, geomean, interleaved, load, machine, open_hf, \
    tokenizer_or_builtin

import torch  # noqa: E402

from planner.errors import UserError  # noqa: E402

SHIPPED_HEAD = ROOT / "models" / "smollm2-135m" / "eagle3"
STOCK = {"vLLM default (chain K = 3)": ("chain", 3), "SGLang default (5 steps, top 4, 8 tokens)": ("grow", (5, 4, 8))}


def _head_guesser(engine, folder: str, depth: int = 3, grow=None):
    from decoder.guessers.draft import DraftModelGuesser, Grow
    from decoder.guessers.heads import open_eagle

    return DraftModelGuesser(open_eagle(folder, engine), top_k=8, depth=depth, label=folder,
                             grow=None if grow is None else Grow(*grow))


def _planned(args, engine, head: str) -> dict:
    """The fastest EAGLE-2 budget and chain under the head's acceptance and --profile (planner/export_heads.py)."""
    if args.profile is None:
        return {}
    from planner.accept import load_acceptance
    from planner.export_heads import best_budget
    from planner.profile import load_profile

    accept = load_acceptance(args.accept or str(Path(head) / "accept_heldout.json"))
    profile = load_profile(args.profile)
    tree, chain = best_budget(accept, profile, args.draft_ms / 1e3), best_budget(accept, profile, args.draft_ms / 1e3, True)
    return {f"planned tree ({tree.steps} steps, top {tree.topk}, {tree.draft_tokens} tokens)":
            ("grow", (tree.steps, tree.topk, tree.draft_tokens)), f"planned chain (K = {chain.steps})": ("chain", chain.steps)}


def contenders(args, engine, head: str) -> dict:
    """name -> run(ids) -> GenerateOutput-like (tokens, steps, total_s)."""
    from decoder import api
    from decoder.guesser import PlainGuesser
    from decoder.loop import generate

    n = args.tokens

    def stock(ids):
        tokens, seconds = engine.stock_generate(ids, n)
        return {"tokens": tokens, "steps": len(tokens), "total_s": seconds}

    def run(guesser, plan=None):
        def go(ids):
            out = generate(engine, ids, plan, guesser, max_new_tokens=n, phase_times=False)
            return {"tokens": out.tokens.tolist(), "steps": out.steps, "total_s": out.stats.total_s}
        return go

    out = {"transformers generate": stock, "plain (this project's loop)": run(PlainGuesser())}
    for name, (how, size) in {**STOCK, **_planned(args, engine, head)}.items():
        g = _head_guesser(engine, head, depth=size) if how == "chain" else _head_guesser(engine, head, grow=size)
        out[f"head: {name}"] = run(g)
    for path in args.plan:
        plan = api.load_plan(path, engine)

        def go(ids, plan=plan):
            c = api.generate(engine, ids, plan, max_new_tokens=n, phase_times=False)
            return {"tokens": c.tokens, "steps": c.output.steps, "total_s": c.output.stats.total_s}
        out[f"plan: {plan.label} ({path})"] = go
    return out


def run(args) -> Results:
    t0 = time.time()
    smoke = _smoke_head() if args.smoke else None
    engine = open_hf("tiny", threads=args.threads) if args.smoke else open_hf(args.model, "fp32", args.threads)
    head = smoke(engine) if smoke else (args.head or str(SHIPPED_HEAD))
    with torch.inference_mode():
        prompts = bench_ids(tokenizer_or_builtin(engine), {"single": args.single_prompts, "chat": args.chat_prompts,
                                                           "repeat": args.repeat_prompts}, engine,
                            first_answer_tokens=8 if args.smoke else 64, keep_last=24 if args.smoke else None)
    mach = machine()
    runs = contenders(args, engine, head)
    timings = interleaved(runs, [p.ids for p in prompts], args.rounds, warm_up=prompts[0].ids[-16:])
    doc = summarise(args, runs, timings, prompts, mach, head, time.time() - t0)
    md = markdown(doc)
    out = Path(args.out or ROOT / "bench" / "results")
    files = {} if args.smoke and not args.out else {out / "heads.json": doc, out / "heads.md": md}
    ok = all(r["identical"] for r in doc["rows"])
    return Results(files, md if ok else md + "\nFAILED: an output differed from generate's", 0 if ok else 1)


def summarise(args, runs: dict, t, prompts, mach: dict, head: str, wall_s: float) -> dict:
    base = "transformers generate"
    groups = [p.group for p in prompts]
    rows = []
    for name in runs:
        secs = t.median(name)
        outs = t.outputs[name]
        speed = [b / s for b, s in zip(t.median(base), secs)]
        tokens = sum(len(o["tokens"]) for o in outs)
        rows.append({"contender": name, "tokens_per_step": tokens / max(1, sum(o["steps"] for o in outs)),
                     "tokens_per_s": tokens / sum(secs), "speedup": geomean(speed), "by_group": by_group(speed, groups),
                     "worst": min(speed), "identical": all(o["tokens"] == b["tokens"] for o, b in zip(outs, t.outputs[base]))})
    return {"machine": mach, "model": "tiny (random), smoke" if args.smoke else args.model, "head": head,
            "prompts": len(prompts), "groups": sorted(set(groups)), "tokens": args.tokens, "rounds": args.rounds,
            "profile": args.profile, "accept": args.accept, "rows": rows, "load_avg_end": load(), "wall_s": round(wall_s, 1)}


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# An EAGLE head where users run it: {doc['model']} on {m['cpu']} ({m['cores']} cores, "
             f"{m['torch_threads']} torch threads; load average {m['load_avg']} at start, {doc['load_avg_end']} at end)",
             "", f"Head {doc['head']}; {doc['prompts']} benchmark prompts x {doc['tokens']} new tokens, greedy, "
             f"{doc['rounds']} rounds interleaved; speedups against transformers' `generate` per prompt, geometric mean.",
             "", "| contender | tokens/step | tokens/s | speedup | " + "".join(f"{g} | " for g in doc["groups"]) +
             "worst prompt | identical to generate |", "|---|---|---|---|" + "---|" * len(doc["groups"]) + "---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['contender']} | {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     + "".join(f"{r['by_group'].get(g, float('nan')):.2f}x | " for g in doc["groups"])
                     + f"{r['worst']:.2f}x | {'yes' if r['identical'] else 'NO'} |")
    lines += ["", f"Wall time {doc['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def _smoke_head():
    """A head for the tiny random model, started from it (untrained) and written in the released layout."""
    def make(engine) -> str:
        from decoder.torch_ops.heads import save_eagle3

        passes = engine.training()
        L = passes.num_layers()
        head = passes.eagle3_head(tuple(range(min(3, L))), torch.arange(0, engine.vocab_size, 2))
        folder = tempfile.mkdtemp(prefix="bench-heads-")
        save_eagle3(head, folder)
        return folder
    return make


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--head", default=None, help=f"the head's folder (default {SHIPPED_HEAD.relative_to(ROOT)})")
    p.add_argument("--accept", default=None, help="its acceptance (default HEAD/accept_heldout.json)")
    p.add_argument("--profile", default=None, help="a latency profile: adds the planned tree and chain")
    p.add_argument("--draft-ms", type=float, default=3.0, help="a head pass's cost in the planning (ms)")
    p.add_argument("--plan", action="append", default=[], help="a plan file raced beside (repeatable)")
    p.add_argument("--single-prompts", type=int, default=4)
    p.add_argument("--chat-prompts", type=int, default=2)
    p.add_argument("--repeat-prompts", type=int, default=2)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny random model and a head started from it; seconds")
    p.add_argument("--out", default=None, help="default bench/results (not with --smoke)")
    return p


def main(argv=None) -> int:
    return bench_main("bench_heads", parser(), run, argv, writes=lambda a: not a.smoke or a.out is not None)


if __name__ == "__main__":
    sys.exit(main())
