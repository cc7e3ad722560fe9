"""CPU matmul paths (issue 21): what each path costs per weight shape and input length, what the
chosen paths do to the whole forward L(n), and this project's plain loop against transformers'
`model.generate` on the same prompt ids, with and without the paths.

    python bench/bench_cpu_paths.py                  # SmolLM2-135M, n = 1..16, 4 + 4 prompts x 64 tokens
    python bench/bench_cpu_paths.py --quick          # n = 1..8, 2 + 1 prompts x 32 tokens
    python bench/bench_cpu_paths.py --profile profiles/cpu-smollm2-135m.json   # the paths a profile chose
    python bench/bench_cpu_paths.py --plan trees/autotune-x.json --guesser ppd # + that plan vs generate
    python bench/bench_cpu_paths.py --smoke --out DIR                         # tiny random model, seconds

Prompts: training.splits.bench_prompts (two-turn chats, requests that repeat their input; no tuning
step reads them), reported per group. Decoding runs are interleaved (bench/common.py): per prompt
and round the variants in a shuffled order, after one untimed pass of every variant on every
prompt (the first forward at a new shape costs seconds on this CPU). Ratios are per (prompt,
round) against generate in the same round, then the median. Outputs: plain with paths must equal plain without
(identical tokens); against generate a difference may only be a near tie (profiler.compare).
Writes bench/results/cpu_paths.{json,md} (--out) with the machine and its load average.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import (
    ROOT,
    Results,
    bench_ids,
    bench_main,
    by_group,
    interleaved,
    library_generate,
    load,
    machine,
    open_hf,
    tokenizer_or_builtin,
)

import torch  # noqa: E402

from planner.errors import UserError  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, --quick's or --smoke's."""

    max_n: int
    chat_prompts: int
    repeat_prompts: int
    tokens: int
    rounds: int
    budget: float
    repeats: int
    context: int


def sizes(a) -> Sizes:
    s = Sizes(a.max_n, a.chat_prompts, a.repeat_prompts, a.tokens, a.rounds, a.budget, a.repeats, a.context)
    if a.smoke:
        s = Sizes(4, 1, 1, 6, 1, 2.0, 2, 16)
    elif a.quick:
        s = Sizes(8, 2, 1, 32, 2, 25.0, 5, a.context)
    for name, lo, hi in (("max_n", 1, 256), ("context", 1, 4096), ("repeats", 1, 100), ("chat_prompts", 0, 24),
                         ("repeat_prompts", 0, 64), ("tokens", 1, 1024), ("rounds", 1, 20)):
        if not lo <= getattr(s, name) <= hi:
            raise UserError(f"--{name.replace('_', '-')}: expected an integer in {lo}..{hi}")
    if not 1 <= a.threads <= 256:
        raise UserError("--threads: expected an integer in 1..256")
    if s.chat_prompts + s.repeat_prompts < 1:
        raise UserError("--chat-prompts, --repeat-prompts: one prompt at least")
    if not 0 < s.budget <= 3600:
        raise UserError("--budget: expected seconds in (0, 3600]")
    return s


def _machine() -> dict:
    return machine() | {"mkldnn": torch.backends.mkldnn.is_available(),
                        "capability": torch.backends.cpu.get_cpu_capability()}


def _setup(args, s: Sizes):
    """The engine and its benchmark prompts (a tiny random model: the built-in tokenizer's ids)."""
    engine = open_hf("tiny" if args.smoke else args.model, None if args.smoke else "fp32", args.threads)
    with torch.inference_mode():
        prompts = bench_ids(tokenizer_or_builtin(engine), {"chat": s.chat_prompts, "repeat": s.repeat_prompts}, engine,
                            first_answer_tokens=8 if args.smoke else 64, keep_last=24 if args.smoke else None)
    return engine, prompts


# This benchmark measures the hf engine's CPU matmul paths themselves, so it calls the engine's own
# functions on its torch model (decoder/engines/hf/cpu_paths.py, matmul_choice.py): the per-shape
# repeats, the whole-forward check and generate with the paths switched on are no engine method.


def _paths(engine, args, s: Sizes, rows: list[int]) -> dict:
    """The profile's matmul_paths (--profile), else chosen now (isolated per shape, then whole-forward check)."""
    from decoder.engines.hf.cpu_paths import use_profile_paths
    from decoder.engines.hf.matmul_choice import choose_matmul_paths
    from planner.jsonio import read_json

    model = engine.torch_model()
    if args.profile:
        obj = read_json(args.profile).get("matmul_paths")
        if obj is None or use_profile_paths(model, args.profile) is None:
            raise UserError(f"--profile {args.profile}: no usable 'matmul_paths' for this model (profile it again)")
        return obj
    return choose_matmul_paths(model, rows, s.context, s.budget, repeats=s.repeats, progress=not args.no_progress)


def _whole_model(engine, s: Sizes, rows: list[int]) -> dict:
    from decoder.engines.hf.matmul_choice import validate_whole_model

    w = validate_whole_model(engine.torch_model(), rows, s.context, time.time() + s.budget, s.repeats, seed=1)
    for key in ("default_s", "chosen_s"):
        base = w[key][0]
        w[key.replace("_s", "_over_L1")] = [x / base if x and base else None for x in w[key]]
    return w


def _variants(engine, plan_run) -> dict:
    """name -> fn(ids) -> token list; 'paths' switches the installed paths on for that run only."""
    from decoder.engines.hf.cpu_paths import set_paths_enabled
    from decoder.guesser import PlainGuesser
    from decoder.loop import generate

    model = engine.torch_model()

    def with_paths(on, fn):
        def run(ids, n):
            set_paths_enabled(model, on)
            try:
                return fn(ids, n)
            finally:
                set_paths_enabled(model, True)
        return run

    def plain(ids, n):
        return generate(engine, ids, None, PlainGuesser(), max_new_tokens=n).tokens.tolist()

    v = {"generate": lambda ids, n: engine.stock_generate(ids, n)[0],
         "plain": with_paths(False, plain),
         "plain + paths": with_paths(True, plain),
         "generate + paths": lambda ids, n: library_generate(engine, ids, n, paths=True)}
    if plan_run is not None:
        v["plan + paths"] = with_paths(True, plan_run)
    return v


def _plan_runner(engine, args):
    if not args.plan:
        return None, None
    from argparse import Namespace

    from decoder.loop import generate
    from planner.tree import load_tree
    from workflows.cli.inputs import make_guesser

    tree = load_tree(args.plan)
    kind = args.guesser or (tree.settings.get("guesser") if isinstance(tree.settings.get("guesser"), str) else "ppd")
    if kind == "pearl":
        raise UserError(f"--plan {args.plan}: a PEARL plan; decode it with `planner decode --pearl --profile`")
    ns = Namespace(guesser=kind, model=args.model, prompt_tokens=None, random_prompt_tokens=None, top_k_guesses=10,
                   ensemble=1)
    guesser = make_guesser(ns, engine)
    guesser.check(tree, args.plan)

    def run(ids, n):
        return generate(engine, ids, plan=tree, guesser=guesser, max_new_tokens=n).tokens.tolist()

    return run, {"plan": args.plan, "guesser": kind, "method": tree.method}


def _decode(engine, prompts, variants: dict, tokens: int, rounds: int, seed: int, progress: bool) -> dict:
    from profiler.compare import classify

    ids = [p.ids for p in prompts]
    for x in ids:  # warm-up: every variant at every prompt's shapes
        for fn in variants.values():
            fn(x, min(tokens, 4))
    runs = {k: (lambda x, fn=fn: fn(x, tokens)) for k, fn in variants.items()}
    tm = interleaved(runs, ids, rounds, seed=seed, progress=progress)
    outs = tm.outputs
    rows = {}
    for k in variants:
        ratios = [g / t for i in range(len(ids)) for g, t in zip(tm.wall["generate"][i], tm.wall[k][i])]
        per_prompt = [statistics.median(g / t for g, t in zip(tm.wall["generate"][i], tm.wall[k][i])) for i in range(len(ids))]
        n_tok = sum(len(o) for o in outs[k])
        rows[k] = {"speed_vs_generate_median": statistics.median(ratios), "speed_vs_generate_min": min(ratios),
                   "speed_vs_generate_max": max(ratios), "by_group": by_group(per_prompt, [p.group for p in prompts]),
                   "tokens_per_s": n_tok * rounds / sum(sum(t) for t in tm.wall[k]),
                   "seconds": [[round(x, 4) for x in t] for t in tm.wall[k]]}
        rows[k]["vs_generate"] = [classify(engine, ids[i], outs["generate"][i], outs[k][i])["status"] for i in range(len(ids))]
    rows["plain + paths"]["identical_to_plain"] = outs["plain + paths"] == outs["plain"]
    if "plan + paths" in rows:
        rows["plan + paths"]["identical_to_plain_with_paths"] = outs["plan + paths"] == outs["plain + paths"]
    return rows


def _f(x, scale: float = 1e3, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x * scale, fmt)


def _markdown(doc: dict) -> str:
    m, mp, w = doc["machine"], doc["matmul_paths"], doc["whole_model"]
    groups = list(next(iter(doc["decoding"].values()))["by_group"])
    lines = [f"# CPU matmul paths ({doc['model']})", "",
             f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch {m['torch']} ({m['capability']}); "
             f"load average (1/5/15 min) {doc['load_avg_start']} at start, {doc['load_avg_end']} at end "
             f"(the cores are shared with other jobs). fp32, context {doc['settings']['context']} tokens.", "",
             "## Per weight shape: fastest sample per call (ms), isolated, all the model's weights of that shape in turn", ""]
    rows = mp["rows"]
    for s in mp["shapes"]:
        lines += [f"**{s['out_features']} x {s['in_features']}** ({s.get('modules', '?')} modules)", "",
                  "| path | " + " | ".join(str(M) for M in rows) + " |", "|---|" + "---|" * len(rows)]
        for p, ts in (s.get("best_s") or {}).items():
            lines.append(f"| {p} | " + " | ".join(_f(t, 1e3, ".2f") for t in ts) + " |")
        lines += ["| **installed** | " + " | ".join(s["paths"]) + " |", ""]
    lines += [f"Extra weight layouts installed: {mp.get('extra_bytes', 0) / 2**20:.0f} MiB "
              f"(model weights {mp.get('weight_bytes', 0) / 2**20:.0f} MiB).", "",
              "## Whole forward L(n), n new tokens after the context (median ms, interleaved pairs)", "",
              "| n | " + " | ".join(str(n) for n in w["rows"]) + " |", "|---|" + "---|" * len(w["rows"]),
              "| F.linear | " + " | ".join(_f(x) for x in w["default_s"]) + " |",
              "| chosen paths | " + " | ".join(_f(x) for x in w["chosen_s"]) + " |",
              "| L(n)/L(1) F.linear | " + " | ".join(_f(x, 1, ".2f") for x in w["default_over_L1"]) + " |",
              "| L(n)/L(1) chosen | " + " | ".join(_f(x, 1, ".2f") for x in w["chosen_over_L1"]) + " |",
              "| chosen / F.linear | " + " | ".join(_f(x, 1, ".2f") for x in w["ratio"]) + " |", "",
              f"## Decoding: {doc['settings']['prompts']} benchmark prompts (training.splits.bench_prompts) x "
              f"{doc['settings']['tokens']} greedy tokens, "
              f"{doc['settings']['rounds']} rounds", "",
              "| variant | speed vs generate (median, min-max) | " + " | ".join(groups) +
              " | tokens/s | outputs vs generate |", "|---|---|" + "---|" * len(groups) + "---|---|"]
    for k, r in doc["decoding"].items():
        st = r["vs_generate"]
        lines.append(f"| {k} | {r['speed_vs_generate_median']:.2f}x ({r['speed_vs_generate_min']:.2f}-"
                     f"{r['speed_vs_generate_max']:.2f}) | " + "".join(f"{r['by_group'][g]:.2f}x | " for g in groups)
                     + f"{r['tokens_per_s']:.1f} | {st.count('identical')} identical, "
                     f"{st.count('near_tie')} near ties, {st.count('mismatch')} mismatches |")
    d = doc["decoding"]
    lines += ["", f"plain + paths identical to plain: {d['plain + paths']['identical_to_plain']}"]
    if "plan + paths" in d:
        lines.append(f"plan ({doc['plan']['plan']}, guesser {doc['plan']['guesser']}) identical to plain + paths: "
                     f"{d['plan + paths']['identical_to_plain_with_paths']}")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", default=None, help="use this profile's matmul_paths instead of choosing them now")
    p.add_argument("--plan", default=None, help="also decode this plan (with the paths) against generate")
    p.add_argument("--guesser", default=None, help="with --plan: KIND[:DIR] (default: the one the plan records, else ppd)")
    p.add_argument("--max-n", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--budget", type=float, default=60.0, help="seconds for choosing the paths, and again for L(n)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--chat-prompts", type=int, default=4, help="two-turn chats (training.splits.bench_prompts)")
    p.add_argument("--repeat-prompts", type=int, default=4, help="requests that repeat their input")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="n = 1..8, 2 + 1 prompts x 32 tokens, 2 rounds, 25 s budgets")
    p.add_argument("--smoke", action="store_true", help="a tiny random model; checks the whole path in seconds")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    return bench_main("bench_cpu_paths", parser(), run, argv)


def run(args) -> Results:
    s = sizes(args)
    load_start, t0 = load(), time.time()
    engine, prompts = _setup(args, s)
    rows = list(range(1, s.max_n + 1))
    print(f"choosing matmul paths for n = 1..{s.max_n} (load {load_start})", file=sys.stderr)
    mp = _paths(engine, args, s, rows)
    print("whole-model L(n), F.linear vs chosen paths", file=sys.stderr)
    whole = _whole_model(engine, s, rows)
    plan_run, plan_info = _plan_runner(engine, args)
    print("decoding: generate vs plain, with and without paths", file=sys.stderr)
    decoding = _decode(engine, prompts, _variants(engine, plan_run), s.tokens, s.rounds, args.seed, not args.no_progress)
    has_weights = engine.record()["has_weights"]
    doc = {"model": engine.model_name + ("" if has_weights else " (random weights)"), "machine": _machine(),
           "load_avg_start": load_start, "load_avg_end": load(),
           "settings": {"context": s.context, "max_n": s.max_n, "prompts": len(prompts), "tokens": s.tokens,
                        "rounds": s.rounds, "repeats": s.repeats, "budget_s": s.budget, "quick": args.quick,
                        "profile": args.profile},
           "matmul_paths": mp, "whole_model": whole, "decoding": decoding, "plan": plan_info,
           "wall_s": round(time.time() - t0, 1)}
    md = _markdown(doc)
    out = Path(args.out)
    return Results({out / "cpu_paths.json": doc, out / "cpu_paths.md": md}, md)


if __name__ == "__main__":
    sys.exit(main())
