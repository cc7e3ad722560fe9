"""Batched decoding on this machine: EMS-SD (packed, no padding) against the vanilla padded layout,
predicted against measured, at b = 1, 2, 4, 8, in one run.

    python bench/bench_batch.py                     # SmolLM2-135M, its shipped PPD prompt tokens
    python bench/bench_batch.py --smoke             # a tiny random model, seconds (the test suite runs it)

Steps: profile L_b(n) for both layouts (planner profile's measurement); measure the prompt tokens'
acceptance on autotune's acceptance prompts (training.splits.accept_and_race); plan a tree per batch
size and layout (planner.batch.plan_schedule, the one cost model); then decode the benchmark prompts
(training.splits.bench_prompts, chats and requests that repeat their input alternating, so every
batch mixes the groups: a batch's time is shared, so no per-group figure) b at a time with plain
decoding and the planned tree, both layouts, in a shuffled order per round after a warm-up
(bench/common.py; median per configuration);
check every output against single-sequence greedy decoding; count padding against the model's
E[tau_max] - E[tau]. Writes bench/results/batch.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import ROOT, Results, bench_ids, bench_main, interleaved, machine, open_hf, tokenizer_or_builtin

from planner.errors import UserError

LAYOUTS = ("packed", "padded")


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, or --smoke's seconds on a tiny random model."""

    batch_sizes: list[int]
    tokens: int
    rounds: int
    profile_budget: float
    max_input_length: int
    fixed_input_length: int
    num_prompts: int
    accept_prompts: int


def sizes(a) -> Sizes:
    try:
        batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    except ValueError:
        raise UserError(f"--batch-sizes {a.batch_sizes}: expected integers separated by commas") from None
    s = Sizes(batch_sizes, a.tokens, a.rounds, a.profile_budget, a.max_input_length, a.fixed_input_length,
              a.num_prompts, a.accept_prompts)
    if a.smoke:
        s = Sizes(batch_sizes, 6, 1, 1.5, 8, min(a.fixed_input_length, 6), 4, 2)
    if not (max(s.batch_sizes) <= s.num_prompts <= 64 and 1 <= s.accept_prompts <= 8):
        raise UserError("--num-prompts: at least the largest batch size, at most 64; --accept-prompts 1..8")
    return s


def _setup(args, s: Sizes):
    """(engine, guesser, decode prompts [ids], acceptance prompts [ids]). The smoke's tiny random model has
    untrained prompt tokens and reads the prompts through the built-in model's tokenizer."""
    import torch

    from decoder.guessers.registry import LoadRequest, load_guesser
    from workflows.cli.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts, shipped

    engine = open_hf("tiny", threads=args.threads) if args.smoke else open_hf(args.model, "fp32", args.threads)
    if args.smoke:
        guesser = load_guesser("ppd", LoadRequest(engine, top_k=4, options={"random": 2}))
    else:
        guesser = load_guesser("ppd", LoadRequest(engine, str(shipped(engine.model_name, "prompt_tokens"))))
    tok = tokenizer_or_builtin(engine)
    half = s.num_prompts // 2
    with torch.inference_mode():
        chat, rep = (bench_ids(tok, {g: n}, engine, first_answer_tokens=8 if args.smoke else 64,
                               keep_last=24 if args.smoke else None)
                     for g, n in (("chat", s.num_prompts - half), ("repeat", half)))
    prompts = [p.ids for pair in zip(chat, rep + [None]) for p in pair if p is not None]  # the groups alternate
    accept_texts, _ = held_out_prompts(str(DEFAULT_QUESTIONS), s.accept_prompts, 0)
    return engine, guesser, prompts, encode_prompts(tok, accept_texts)


def _profiles(engine, args, s: Sizes) -> tuple[dict, dict]:
    """({layout: the profile JSON}, {layout: {batch size: LatencyProfile}}), measured now. The files are
    results too, written at the end with the rest (a run refused for the load writes none)."""
    from planner.jsonio import atomic_write_json
    from planner.profile import load_batch_profiles
    from profiler.measure import profile_model

    raw, loaded = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            prof = profile_model(engine, list(range(1, s.max_input_length + 1)), context_length=args.context,
                                 batch_sizes=s.batch_sizes, time_budget_s=s.profile_budget, layout=layout,
                                 progress=False, overhead=layout == "packed")
            if layout == "padded":  # one overhead line for both: the decoder's work per sequence is the same
                prof["decoder_overhead"] = raw["packed"]["decoder_overhead"]
            raw[layout] = prof
            loaded[layout] = load_batch_profiles(str(atomic_write_json(Path(tmp) / f"batch-profile-{layout}.json", prof)))
    return raw, loaded


def _decode(engine, prompts, tree, guesser, b, layout, n):
    """Decode the prompts b at a time; (tokens, steps, seconds, outputs, padded inputs, cache holes)."""
    from decoder import generate
    from decoder.guesser import PlainGuesser

    g = guesser if tree is not None else PlainGuesser()
    tokens = steps = 0
    pad_in = holes = 0
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), b):
        batch = prompts[i: i + b]
        res = generate(engine, batch, plan=tree, guesser=g, max_new_tokens=n, layout=layout)
        outs += [r.tokens.tolist() for r in res]
        tokens += sum(r.tokens.numel() for r in res)
        steps += sum(r.steps for r in res)
        st = res[0].batch.summary()
        pad_in += st["padded_input_tokens"]
        holes += st["cache_holes"]
    return {"tokens": tokens, "steps": steps, "seconds": time.perf_counter() - t0, "outputs": outs,
            "padded_inputs": pad_in, "cache_holes": holes}


def run(args) -> Results:
    from decoder import PlainGuesser, generate
    from planner.accept import from_entry
    from planner.batch import plan_schedule
    from planner.cost import Guessing
    from planner.plan import plan
    from profiler.acceptance import measure_accuracy
    from profiler.measure import warm_up_shapes

    s = sizes(args)
    out = Path(args.out)
    engine, guesser, prompts, accept_prompts = _setup(args, s)
    t_start = time.time()
    raw, profiles = _profiles(engine, args, s)
    accept = from_entry(measure_accuracy(engine, guesser, accept_prompts, max_new_tokens=s.tokens))
    guessing = Guessing(prompt_tokens=True, ensemble=guesser.ensemble)
    greedy = [generate(engine, p, None, PlainGuesser(), max_new_tokens=s.tokens).tokens.tolist() for p in prompts]
    # where the planner picks plain decoding everywhere (a CPU), the fixed tree still measures what
    # packing saves over padding: one PPD tree of --fixed-input-length at every batch size
    fixed = plan("ppd", accept, input_length=s.fixed_input_length, prompt_tokens=guesser.num_prompt_tokens,
                 guessing=guessing) if s.fixed_input_length else None
    rows = []
    for layout in LAYOUTS:
        sched = plan_schedule("ppd", accept, profiles[layout], s.batch_sizes, guessing, layout=layout,
                              prompt_tokens=guesser.num_prompt_tokens, max_input_length=s.max_input_length)
        for b, plan_kind in [(b, k) for b in s.batch_sizes for k in ("planned", "fixed")]:
            if plan_kind == "fixed" and fixed is None:
                continue
            tree = fixed if plan_kind == "fixed" else next(e.tree for e in sched
                                                           if e.batch_sizes[0] <= b <= e.batch_sizes[1])
            warm_up_shapes(engine, prompts, range(1, s.max_input_length + 1))
            for warm in (None, tree):  # batched shapes too: one untimed pass of the first batch each
                _decode(engine, prompts[:b], warm, guesser, b, layout, 4)
            runs = {"plain": [], "tree": []}
            fns = {k: (lambda _, k=k, tr=tr: runs[k].append(_decode(engine, prompts, tr, guesser, b, layout, s.tokens)))
                   for k, tr in (("plain", None), ("tree", tree))}
            interleaved(fns, [0], s.rounds, progress=False, warm=False)  # shuffled per round: a slow spell hits both alike
            rows.append({"plan": plan_kind, **_row(layout, b, tree, runs, greedy, accept, profiles[layout][b], guessing)})
            print(json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, dict)}), file=sys.stderr)
    result = {"machine": machine(), "model": engine.model_name, "batch_sizes": s.batch_sizes, "tokens": s.tokens,
              "prompts": len(prompts), "rounds": s.rounds, "context_profiled": args.context,
              "acceptance": accept.accuracy.tolist(), "rows": rows, "wall_s": round(time.time() - t_start, 1)}
    md = _markdown(result)
    files = {out / f"batch-profile-{layout}.json": raw[layout] for layout in LAYOUTS}
    return Results(files | {out / "batch.json": result, out / "batch.md": md}, md)


def _row(layout, b, tree, runs, greedy, accept, profile, guessing) -> dict:
    from planner.batch import predict_batch

    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    t, p = runs["tree"][0], runs["plain"][0]
    pred = predict_batch(tree, accept, profile, b, guessing, layout)
    return {
        "layout": layout, "batch_size": b,
        "tree": None if tree is None else {"method": tree.method, "max_input_length": tree.max_input_length},
        "plain_tokens_per_s": p["tokens"] / med["plain"], "tree_tokens_per_s": t["tokens"] / med["tree"],
        "measured_speedup": (t["tokens"] / med["tree"]) / (p["tokens"] / med["plain"]),
        "predicted_speedup": pred.speedup,
        "measured_tokens_per_step": t["tokens"] / max(t["steps"], 1), "predicted_tokens_per_step": pred.tokens_per_step,
        "predicted_padding_per_step": pred.padding_per_step, "predicted_padding_ratio": pred.padding_ratio,
        "measured_cache_holes": t["cache_holes"], "measured_padded_inputs": t["padded_inputs"],
        # cache slots padded per sequence and step: sum_i (tau_max - tau_i) over sequence-steps
        "measured_padding_per_step": t["cache_holes"] / max(t["steps"], 1),
        "identical_to_single_greedy": t["outputs"] == greedy and p["outputs"] == greedy,
    }


def _markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Batched decoding: EMS-SD (packed) vs the padded baseline", "",
             f"{result['model']}, CPU {m['cpu']} ({m['torch_threads']} threads, torch {m['torch']}, load {m['load_avg']}), "
             f"{result['prompts']} benchmark prompts (training.splits.bench_prompts, chats and repeat requests) x {result['tokens']} new tokens, medians of {result['rounds']} "
             f"interleaved rounds; the tree per batch size and layout is the planner's (planner.batch.plan_schedule on "
             f"profiles measured in the same run). Speedups are per sequence, over batched plain decoding in the same layout.", "",
             "Rows \"fixed\": one PPD tree of the same size at every batch size, whatever the planner prefers, "
             "to measure what packing saves over padding.", "",
             "| layout | b | plan | tree (max input) | plain tok/s | tree tok/s | speedup pred | meas | tokens/step pred | meas "
             "| padding/step pred | meas | identical |", "|" + "---|" * 13]
    for r in result["rows"]:
        tree = "plain" if r["tree"] is None else f"{r['tree']['method']} ({r['tree']['max_input_length']})"
        lines.append(f"| {r['layout']} | {r['batch_size']} | {r.get('plan', 'planned')} | {tree} | {r['plain_tokens_per_s']:.1f} | "
                     f"{r['tree_tokens_per_s']:.1f} | {r['predicted_speedup']:.2f} | {r['measured_speedup']:.2f} | "
                     f"{r['predicted_tokens_per_step']:.2f} | {r['measured_tokens_per_step']:.2f} | "
                     f"{r['predicted_padding_per_step'] if r['layout'] == 'padded' else 0:.2f} | "
                     f"{r['measured_padding_per_step']:.2f} | {'yes' if r['identical_to_single_greedy'] else 'NO'} |")
    lines.append("")
    lines.append(f"Wall time {result['wall_s']} s.")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--max-input-length", type=int, default=24)
    p.add_argument("--profile-budget", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fixed-input-length", type=int, default=12,
                   help="also decode one PPD tree of this input length at every batch size (0: only the planned ones)")
    p.add_argument("--num-prompts", type=int, default=8, help="benchmark prompts, half chats, half repeat requests")
    p.add_argument("--accept-prompts", type=int, default=4, help="acceptance prompts (autotune's acceptance split)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p


def main(argv=None) -> int:
    return bench_main("bench_batch", parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
