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
from pathlib import Path

from common import ROOT, bench_ids, builtin_tokenizer, interleaved, load, machine

import torch  # noqa: E402

from planner.errors import UserError  # noqa: E402


def _guessers(target, smoke: bool) -> dict:
    """name -> a guesser factory (each decode gets a fresh guesser object where it keeps state)."""
    from decoder import DraftModelGuesser, ParallelDrafter, PromptLookupGuesser
    from decoder.guessers.draft import build_draft_lm, load_draft_model
    from decoder.guessers.parallel import arch_of

    if smoke:
        ps = ParallelDrafter(arch_of(target.config), num_masks=2, top_k=4,
                             head_ids=torch.arange(0, target.config.vocab_size, 2))
        draft = build_draft_lm(target, 1)
    else:
        from workflows.cli.inputs import shipped

        ps = ParallelDrafter.load(str(shipped("smollm2-135m", "parallelspec")))
        draft = load_draft_model(str(shipped("smollm2-135m", "draft_lm")), target)
    full = ParallelDrafter(ps.arch, ps.num_masks, None, ps.top_k, "parallel", ps.meta)
    full.load_state_dict(ps.state_dict())
    chain = ParallelDrafter(ps.arch, ps.num_masks, ps.head_ids, ps.top_k, "chain", ps.meta)
    chain.load_state_dict(ps.state_dict())
    return {"parallelspec": lambda: ps, "parallelspec (full head)": lambda: full, "chain": lambda: chain,
            "draft LM": lambda: DraftModelGuesser(draft, top_k=1, depth=4), "lookup": lambda: PromptLookupGuesser()}


def _setup(args):
    """(target, prompts [BenchIds], label); a tiny random model reads them with the built-in tokenizer."""
    from decoder.engines.hf.load import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model("tiny", device="cpu") if args.smoke else load_model(args.model, device="cpu", dtype="fp32")
    if loaded.tokenizer_dir:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    else:
        tok = builtin_tokenizer()
    with torch.inference_mode():
        prompts = bench_ids(tok, {"chat": args.chat_prompts, "repeat": args.repeat_prompts}, loaded.model,
                            first_answer_tokens=8 if args.smoke else 64,
                            keep_last=24 if args.smoke else None)
    return loaded.model, prompts, "tiny (random)" if args.smoke else loaded.name


def _decode(target, ids, name: str, make, tokens: int):
    from decoder import generate, generate_plain

    if name == "plain":
        return generate_plain(target, ids, max_new_tokens=tokens)
    return generate(target, ids, None, make(), max_new_tokens=tokens)


def _row(out, plain_tokens) -> dict:
    t = out.stats.times
    return {"tokens": len(out.tokens), "steps": out.steps, "total_s": out.stats.summary()["total_s"],
            "forward_ms": 1e3 * statistics.median(t["forward"]),
            # the session's propose (timed with the step's input preparation) and its commit
            "guess_ms": 1e3 * statistics.median(a + b for a, b in zip(t["prepare"], t["guess"])),
            "identical": torch.equal(out.tokens, plain_tokens)}


def run(args) -> dict:
    from planner.jsonio import atomic_write_bytes, atomic_write_json

    t0 = time.time()
    target, prompts, label = _setup(args)
    mach = machine()
    makers = _guessers(target, args.smoke)
    names = ["plain", *makers]
    plain = [_decode(target, p.ids, "plain", None, args.tokens).tokens for p in prompts]
    runs = {n: [] for n in names}

    def job(n):
        def fn(item):
            k, ids = item
            out = _decode(target, ids, n, makers.get(n), min(args.tokens, 16) if k < 0 else args.tokens)
            if k >= 0:  # not the warm-up
                runs[n].append(_row(out, plain[k]) | {"group": prompts[k].group})
        return fn

    interleaved({n: job(n) for n in names}, list(enumerate(p.ids for p in prompts)), args.rounds,
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
           "tokens": args.tokens, "rounds": args.rounds, "rows": rows, "load_avg_end": load(), "wall_s": time.time() - t0}
    if args.out:
        out = Path(args.out)
        atomic_write_json(out / "drafters.json", doc)
        atomic_write_bytes(out / "drafters.md", markdown(doc).encode())
    print(markdown(doc))
    return doc


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--chat-prompts", type=int, default=2, help="two-turn chats (training.splits.bench_prompts)")
    p.add_argument("--repeat-prompts", type=int, default=2, help="requests that repeat their input")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="a tiny random model, seconds; writes only with --out")
    p.add_argument("--out", default=None, help="default bench/results (not with --smoke)")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.rounds, args.threads, args.chat_prompts, args.repeat_prompts = 12, 1, 1, 1, 1
    if args.chat_prompts + args.repeat_prompts < 1:
        p.error("--chat-prompts, --repeat-prompts: one prompt at least")
    if not args.smoke and args.out is None:
        args.out = str(ROOT / "bench" / "results")
    try:
        doc = run(args)
    except UserError as e:
        print(f"bench_drafters: error: {e}", file=sys.stderr)
        return 2
    if args.smoke:
        ok = all(r["identical"] for r in doc["rows"])
        print("smoke: ok" if ok else "smoke: FAILED (an output differed from plain greedy decoding)")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
