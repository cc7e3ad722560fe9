"""Decoder benchmark: where a decoding step's time goes, against a plain forward pass of the same length.

  python bench/bench_decoder.py [--threads 2] [--tokens 48] [--repeats 7] [--out bench/results]

For each plan (ppd and medusa trees planned from the published acceptance data) a 125M-parameter
Llama (bench/data/llama-125m.json on the hf engine: random weights, fp32) decodes with random prompt
tokens; every step is split into prepare (input, positions, mask), forward, verify, cache (KV
compaction) and guess (top-k of the prompt-token logits). Baseline in the same run: the model's own forward pass over the same number
of tokens at the same context with the default causal mask (median over repeats). The overhead
outside the forward pass is reported as a fraction of it. An oracle guesser with the published
per-rank accuracy gives end-to-end tokens/s against plain decoding through the same cache path.
Writes bench/results/decoder.json and decoder.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, Results, bench_main, load_avg, machine, open_hf, sample_load

import torch  # noqa: E402

from decoder import (  # noqa: E402
    OracleGuesser,
    PlainGuesser,
    generate,
)
from planner.accept import load_acceptance  # noqa: E402
from planner.plan import plan  # noqa: E402

SHARED = ROOT / ".." / "shared"
PHASES = ("prepare", "forward", "verify", "cache", "guess")
LLAMA_125M = ROOT / "bench" / "data" / "llama-125m.json"  # 12 layers, hidden 768, 12 heads, vocab 32000


@torch.inference_mode()
def plain_forward_time(engine, context: torch.Tensor, n: int, repeats: int) -> float:
    """Median time of the torch model's own forward of n new tokens over a cache of len(context), its
    default causal mask (no mask given): the baseline a decoding step is set against. The engine's own
    forward functions (decoder/torch_ops/forward.py) on its torch model: a step's parts are what this
    benchmark measures."""
    from decoder.torch_ops.cache import crop_cache
    from decoder.torch_ops.forward import prefill, tree_forward

    model = engine.torch_model()
    cache = prefill(model, context[None]).cache
    C = context.numel()
    x = torch.randint(1, engine.vocab_size, (1, n))
    pos = torch.arange(C, C + n)[None]
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        tree_forward(model, x, pos, None, cache)
        dt = time.perf_counter() - t0
        crop_cache(cache, C)
        if i:  # first one is warm-up
            times.append(dt)
    return statistics.median(times)


def step_profile(out) -> dict:
    """Medians over the steps after the bootstrap, per phase, and the step's real input length."""
    idx = [i for i, s in enumerate(out.stats.states) if s >= 0]
    med = {p: statistics.median(out.stats.times[p][i] for i in idx) for p in PHASES}
    totals = [sum(out.stats.times[p][i] for p in PHASES) for i in idx]
    lengths = [out.stats.input_lengths[i] for i in idx]
    return {"median_s": med, "median_step_s": statistics.median(totals),
            "median_outside_forward_s": statistics.median(t - out.stats.times["forward"][i] for t, i in zip(totals, idx)),
            "median_forward_s": statistics.median(out.stats.times["forward"][i] for i in idx),
            "median_input_length": statistics.median(lengths), "steps": len(idx)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128, help="prompt length")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per run")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shared", default=str(SHARED))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return ap


def main(argv=None) -> int:
    return bench_main("bench_decoder", parser(), run, argv)


def _plain_row(engine, ids, args) -> tuple[dict, float, torch.Tensor, torch.Tensor]:
    """Plain decoding through the same loop: (its row, its tokens/s, the reference continuation, the
    context halfway through it, at which the plain forwards are timed)."""
    generate(engine, ids, None, PlainGuesser(), max_new_tokens=4)  # warm-up
    plain_runs = [generate(engine, ids, None, PlainGuesser(), max_new_tokens=args.tokens + 4) for _ in range(3)]
    ref = plain_runs[0].tokens
    plain_tps = statistics.median(r.tokens.numel() / r.stats.total_s for r in plain_runs)
    prof = step_profile(plain_runs[0])
    mid_context = torch.cat([ids, ref[: args.tokens // 2]])
    base1 = plain_forward_time(engine, mid_context, 1, args.repeats)
    row = {"plan": "plain (the loop's root-only steps)", "input_length": 1, "tokens_per_step": 1.0,
           **{f"{p}_ms": prof["median_s"][p] * 1e3 for p in PHASES},
           "step_ms": prof["median_step_s"] * 1e3, "plain_forward_ms": base1 * 1e3,
           "outside_forward_frac": prof["median_outside_forward_s"] / prof["median_forward_s"],
           "step_vs_plain_forward": prof["median_step_s"] / base1 - 1,
           "oracle_tokens_per_s": None, "oracle_speedup": None}
    return row, plain_tps, ref, mid_context


def _plan_row(engine, name, tree, ids, ref, mid_context, acc_row0, plain_tps, args) -> dict:
    """A plan's step split with random prompt tokens, and end to end with an oracle of the published
    per-rank accuracy (distance 1 row, ranks 0..9)."""
    from decoder.guessers.registry import LoadRequest, load_guesser

    P = tree.prompt_tokens_max or tree.depth
    pt = load_guesser("ppd", LoadRequest(engine, top_k=10, options={"random": P}))
    layouts = pt.layouts(tree, engine.dtype, engine.device)
    generate(engine, ids, plan=tree, guesser=pt, max_new_tokens=6)  # warm-up
    out = generate(engine, ids, plan=tree, guesser=pt, max_new_tokens=args.tokens)
    prof = step_profile(out)
    n = int(prof["median_input_length"])
    base = plain_forward_time(engine, mid_context, n, args.repeats)
    seq = torch.cat([ids, ref])
    oracle_tps = []
    for seed in range(3):
        oracle = OracleGuesser(seq, engine.vocab_size, P, top_k=10, accuracy=acc_row0 + [0.0] * (10 - len(acc_row0)),
                               seed=seed, prompt_tokens=pt)
        o = generate(engine, ids, plan=tree, guesser=oracle, max_new_tokens=args.tokens)
        assert torch.equal(o.tokens, ref[: args.tokens]), "tree decoding must equal plain greedy decoding"
        oracle_tps.append((o.tokens.numel() / o.stats.total_s, o.tokens.numel() / o.steps))
    tps = statistics.median(t for t, _ in oracle_tps)
    print(f"{name}: n={n} step {prof['median_step_s'] * 1e3:.1f} ms, plain forward {base * 1e3:.1f} ms, "
          f"outside forward {prof['median_outside_forward_s'] / prof['median_forward_s']:.1%} of the step's forward",
          file=sys.stderr, flush=True)
    return {"plan": name, "input_length": n,
            "planned_input_length": max(b.planned_input_length for b in layouts.states.values()),
            "tokens_per_step": statistics.median(s for _, s in oracle_tps),
            **{f"{p}_ms": prof["median_s"][p] * 1e3 for p in PHASES},
            "step_ms": prof["median_step_s"] * 1e3, "plain_forward_ms": base * 1e3,
            "outside_forward_frac": prof["median_outside_forward_s"] / prof["median_forward_s"],
            "step_vs_plain_forward": prof["median_step_s"] / base - 1,
            "oracle_tokens_per_s": tps, "oracle_speedup": tps / plain_tps}


def run(args) -> Results:
    load_start = load_avg()
    engine = open_hf(str(LLAMA_125M), "fp32", args.threads)
    n_params = sum(p.numel() for p in engine.torch_model().parameters())
    data = Path(args.shared) / "data" / "published_acceptance.json"
    acc_ppd = load_acceptance(f"{data}:ppd-vicuna-7b")
    acc_med = load_acceptance(f"{data}:medusa-vicuna-7b")
    plans = {
        "ppd-20": plan("ppd", acc_ppd, input_length=20, prompt_tokens=3),
        "ppd-40": plan("ppd", acc_ppd, input_length=40, prompt_tokens=3),
        "medusa-7-d2": plan("medusa", acc_med, size=7, max_depth=2),
        "medusa-15-d3": plan("medusa", acc_med, size=15, max_depth=3),
    }
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, engine.vocab_size, (args.context,), generator=g)
    row, plain_tps, ref, mid_context = _plain_row(engine, ids, args)
    rows = [row]
    for name, tree in plans.items():
        acc = acc_ppd if tree.method == "ppd" else acc_med
        rows.append(_plan_row(engine, name, tree, ids, ref, mid_context, acc.accuracy[0].tolist(), plain_tps, args))
        sample_load()
    result = {
        "machine": machine() | {"threads": args.threads, "load_average_start_end": [load_start, load_avg()]},
        "model": {"name": "llama-125m (random weights, fp32)", "parameters": n_params},
        "context": args.context, "tokens": args.tokens, "repeats": args.repeats,
        "plain_tokens_per_s": plain_tps, "rows": rows,
    }
    out_dir = Path(args.out)
    md = markdown(result)
    return Results({out_dir / "decoder.json": result, out_dir / "decoder.md": md}, md)


def markdown(r: dict) -> str:
    lines = [
        "# Decoder step breakdown",
        "",
        f"{r['model']['name']}, {r['model']['parameters'] / 1e6:.0f}M parameters, CPU ({r['machine']['threads']} threads, "
        f"torch {r['machine']['torch']}; {r['machine']['cores']} cores shared with other jobs, load average "
        f"{r['machine']['load_average_start_end'][0]:.1f} at start, {r['machine']['load_average_start_end'][1]:.1f} at end), prompt {r['context']} tokens, {r['tokens']} new tokens. Medians over steps; "
        f"plain forward = the model's own forward over the same number of tokens at the same context (median of {r['repeats']}).",
        "",
        "| plan | real input | prepare ms | forward ms | verify ms | cache ms | guess ms | step ms | plain forward ms | outside forward / step forward | step vs plain forward | oracle tokens/step | oracle speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        o = "-" if x["oracle_speedup"] is None else f"{x['oracle_speedup']:.2f}x"
        lines.append(
            f"| {x['plan']} | {x['input_length']} | {x['prepare_ms']:.2f} | {x['forward_ms']:.1f} | {x['verify_ms']:.2f} | "
            f"{x['cache_ms']:.2f} | {x['guess_ms']:.2f} | {x['step_ms']:.1f} | {x['plain_forward_ms']:.1f} | "
            f"{x['outside_forward_frac']:.1%} | {x['step_vs_plain_forward']:+.1%} | {x['tokens_per_step']:.2f} | {o} |")
    lines += ["", f"Plain decoding: {r['plain_tokens_per_s']:.1f} tokens/s. Oracle: the true token at rank r with the "
              "published distance-1 probability (so tokens/step is realistic, the guess cost is not); output checked "
              "equal to plain greedy decoding.", "",
              "The robust figure is `outside forward / step forward`: prepare + verify + cache + guess against the "
              "forward pass of the same steps. Absolute times, `step vs plain forward` and the oracle speedups compare "
              "measurements taken seconds apart and move with the load of the shared machine; rerun on a quiet machine "
              "before reading them as speedups.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
