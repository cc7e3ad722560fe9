"""What a guess costs: every drafter shipped for SmolLM2, decoding benchmark prompts as a chain, with the
per-step split into the target's forward pass and the guesser's work, against plain decoding in the
same run. The ParallelSpec drafter runs twice, with its restricted LM head (the shipped one) and
with the full 49,152-token head, to measure what the restriction saves.

    python bench/bench_drafters.py                    # SmolLM2-135M and its shipped drafters
    python bench/bench_drafters.py --smoke            # a tiny random model, seconds

Prompts: training.splits.bench_prompts (two-turn chats, requests that repeat their input; no tuning
step reads them), speedups reported per group. Runs are interleaved in a shuffled order per prompt
and round after a warm-up (bench/common.py); medians per guesser over prompts and rounds. Every
output is checked against plain greedy decoding.
Writes bench/results/drafters.{json,md} (--out) with the machine.
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
    drafter,
    interleaved,
    load,
    machine,
    open_hf,
    tokenizer_or_builtin,
)

import torch  # noqa: E402

from planner.errors import UserError  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, or --smoke's seconds on a tiny random model."""

    tokens: int
    rounds: int
    threads: int
    chat_prompts: int
    repeat_prompts: int
    out: str | None


def sizes(a) -> Sizes:
    if a.smoke:
        return Sizes(12, 1, 1, 1, 1, a.out)  # writes only with --out
    if a.chat_prompts + a.repeat_prompts < 1:
        raise UserError("--chat-prompts, --repeat-prompts: one prompt at least")
    out = a.out or str(ROOT / "bench" / "results")
    return Sizes(a.tokens, a.rounds, a.threads, a.chat_prompts, a.repeat_prompts, out)


def _smoke_arch() -> dict:
    """The tiny preset's architecture (the smoke's target): an untrained ParallelSpec drafter is built for it."""
    from decoder.engines.hf.load import _load_config
    from decoder.engines.models import resolve_spec
    from decoder.guessers.parallel import arch_of

    return arch_of(_load_config(resolve_spec("tiny", weights=False)[2]))


def _guessers(engine, smoke: bool, draft_dir: str | None) -> dict:
    """name -> a guesser factory (each decode gets a fresh guesser object where it keeps state)."""
    from decoder import DraftModelGuesser, ParallelDrafter, PromptLookupGuesser

    if smoke:
        ps = ParallelDrafter(_smoke_arch(), num_masks=2, top_k=4, head_ids=torch.arange(0, engine.vocab_size, 2))
        draft = drafter("first-layers:1", engine)
    else:
        from workflows.cli.inputs import shipped

        ps = ParallelDrafter.load(str(shipped("smollm2-135m", "parallelspec")))
        draft = drafter(draft_dir, engine) if draft_dir else None  # none ships: measured when --draft names one
    full = ParallelDrafter(ps.arch, ps.num_masks, None, ps.top_k, "parallel", ps.meta)
    full.load_state_dict(ps.state_dict())
    chain = ParallelDrafter(ps.arch, ps.num_masks, ps.head_ids, ps.top_k, "chain", ps.meta)
    chain.load_state_dict(ps.state_dict())
    out = {"parallelspec": lambda: ps, "parallelspec (full head)": lambda: full, "chain": lambda: chain,
           "draft LM": lambda: DraftModelGuesser(draft, top_k=1, depth=4), "lookup": lambda: PromptLookupGuesser()}
    return out if draft is not None else {k: v for k, v in out.items() if k != "draft LM"}


def _setup(args, s: Sizes):
    """(engine, prompts [BenchIds], label); a tiny random model reads them with the built-in tokenizer."""
    engine = open_hf("tiny", threads=s.threads) if args.smoke else open_hf(args.model, "fp32", s.threads)
    with torch.inference_mode():
        prompts = bench_ids(tokenizer_or_builtin(engine), {"chat": s.chat_prompts, "repeat": s.repeat_prompts}, engine,
                            first_answer_tokens=8 if args.smoke else 64, keep_last=24 if args.smoke else None)
    return engine, prompts, "tiny (random)" if args.smoke else engine.model_name


def _decode(engine, ids, name: str, make, tokens: int):
    from decoder import PlainGuesser, generate

    if name == "plain":
        return generate(engine, ids, None, PlainGuesser(), max_new_tokens=tokens)
    return generate(engine, ids, None, make(), max_new_tokens=tokens)


def _row(out, plain_tokens) -> dict:
    t = out.stats.times
    return {"tokens": len(out.tokens), "steps": out.steps, "total_s": out.stats.summary()["total_s"],
            "forward_ms": 1e3 * statistics.median(t["forward"]),
            # the session's propose (timed with the step's input preparation) and its commit
            "guess_ms": 1e3 * statistics.median(a + b for a, b in zip(t["prepare"], t["guess"])),
            "identical": torch.equal(out.tokens, plain_tokens)}


def run(args) -> Results:
    s = sizes(args)
    t0 = time.time()
    engine, prompts, label = _setup(args, s)
    mach = machine()
    makers = _guessers(engine, args.smoke, args.draft)
    names = ["plain", *makers]
    plain = [_decode(engine, p.ids, "plain", None, s.tokens).tokens for p in prompts]
    runs = {n: [] for n in names}

    def job(n):
        def fn(item):
            k, ids = item
            out = _decode(engine, ids, n, makers.get(n), min(s.tokens, 16) if k < 0 else s.tokens)
            if k >= 0:  # not the warm-up
                runs[n].append(_row(out, plain[k]) | {"group": prompts[k].group})
        return fn

    interleaved({n: job(n) for n in names}, list(enumerate(p.ids for p in prompts)), s.rounds,
                warm_up=(-1, prompts[0].ids))
    rows = []
    groups = sorted({p.group for p in prompts})

    def tps(xs):
        return sum(x["tokens"] for x in xs) / sum(x["total_s"] for x in xs)

    for n in names:
        xs = runs[n]
        fwd, guess = statistics.median(x["forward_ms"] for x in xs), statistics.median(x["guess_ms"] for x in xs)
        rows.append({"guesser": n, "tokens_per_step": sum(x["tokens"] for x in xs) / sum(x["steps"] for x in xs),
                     "forward_ms": fwd, "guess_ms": guess, "guess_over_forward": guess / fwd,
                     "tokens_per_s": tps(xs), "speedup": tps(xs) / tps(runs["plain"]),
                     "speedup_by_group": {g: tps([x for x in xs if x["group"] == g]) /
                                          tps([x for x in runs["plain"] if x["group"] == g]) for g in groups},
                     "identical": all(x["identical"] for x in xs)})
    doc = {"machine": mach, "model": label, "prompts": len(prompts), "groups": groups,
           "prompt_groups": ", ".join(f"{sum(p.group == g for p in prompts)} {g}" for g in groups),
           "tokens": s.tokens, "rounds": s.rounds, "rows": rows, "load_avg_end": load(), "wall_s": time.time() - t0}
    md = markdown(doc)
    files = {Path(s.out) / "drafters.json": doc, Path(s.out) / "drafters.md": md} if s.out else {}
    if not args.smoke:
        return Results(files, md)
    ok = all(r["identical"] for r in doc["rows"])
    return Results(files, md + ("smoke: ok" if ok else "smoke: FAILED (an output differed from plain greedy decoding)"),
                   0 if ok else 1)


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# What a guess costs: {doc['model']} on {m['cpu']} ({m['cores']} cores, {m['torch_threads']} torch "
             f"threads; load average {m['load_avg']} at start, {doc['load_avg_end']} at end)", "",
             f"{doc['prompts']} benchmark prompts ({doc['prompt_groups']}; training.splits.bench_prompts) x "
             f"{doc['tokens']} new tokens, greedy, chains (no tree), {doc['rounds']} rounds interleaved; medians per step.", "",
             "| guesser | tokens/step | target forward (ms) | propose + commit (ms) | guess / forward | tokens/s | speedup | "
             + "".join(f"{g} | " for g in doc["groups"]) + "identical |", "|---|---|---|---|---|---|---|" +
             "---|" * len(doc["groups"]) + "---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['guesser']} | {r['tokens_per_step']:.2f} | {r['forward_ms']:.1f} | {r['guess_ms']:.2f} | "
                     f"{100 * r['guess_over_forward']:.1f} % | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     + "".join(f"{r['speedup_by_group'][g]:.2f}x | " for g in doc["groups"]) +
                     f"{'yes' if r['identical'] else 'NO'} |")
    lines += ["", f"Wall time {doc['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--chat-prompts", type=int, default=2, help="two-turn chats (training.splits.bench_prompts)")
    p.add_argument("--repeat-prompts", type=int, default=2, help="requests that repeat their input")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny random model, seconds; writes only with --out")
    p.add_argument("--draft", default=None, help="a draft LM directory (planner train-drafter --kind draft-lm): none ships")
    p.add_argument("--out", default=None, help="default bench/results (not with --smoke)")
    return p


def main(argv=None) -> int:
    return bench_main("bench_drafters", parser(), run, argv, writes=lambda a: not a.smoke or a.out is not None)


if __name__ == "__main__":
    sys.exit(main())
