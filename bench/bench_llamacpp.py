"""llama.cpp on prompts no tuning step read: this project's plan in llama.cpp against llama.cpp's own decoding.

    python3 bench/bench_llamacpp.py --plan runs/<autotune --engine llama.cpp run>/chosen.json
    python3 bench/bench_llamacpp.py --plan A.json --plan B.json --repeats 5 --threads 2
    python3 bench/bench_llamacpp.py --smoke                      # 2 prompts x 16 tokens, seconds

Prompts: training.splits.bench_prompts("chat", n) (two-turn hand-written chats: the first turn, and the
second after llama.cpp's own greedy answer to the first) and bench_prompts("repeat", n) (requests that
repeat their input: rewrite, summarise, correct, extract). Prompt ids: the model's chat template.
Contenders, on the same ids, interleaved in a shuffled order per (repeat, prompt) after a warm-up,
medians over --repeats, every time the wall time of the call, from the call to its last token (prefill
included):
  llama.cpp plain       llama-cpp-python's Llama.generate, greedy (top-k 1), on a Llama of its own opened
                        as a user would (n_ctx 2048, the same threads): the baseline
  llama.cpp lookup K    the same with its LlamaPromptLookupDecoding(num_pred_tokens=K), K = 4, 10
  engine plain          this project's loop in llama.cpp with root-only steps (the loop's own cost)
  plan NAME             the plan as a user runs it: decoder.api.load_plan + api.generate (its recorded
                        guesser; a plain decision: the engine's fastest plain decoding, Llama.generate)
  transformers generate model.generate on the fp32 Hugging Face weights, greedy (--no-hf: skipped)
Reports per contender tokens/s, per-prompt speedup over llama.cpp plain (geometric mean, min, per group),
whether each output equals llama.cpp plain's, and beside every plan the oracle ceiling on the same prompts
(planner/ceiling.py, from the plan's profile and the real answers) and the share of its gain the plan
captured. Writes bench/results/llamacpp.{json,md} (--out) with the machine and its load. Ctrl-C writes
what is measured.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from common import Results, bench_main, load_avg, open_hf, sample_load  # noqa: E402
from common import machine as common_machine  # noqa: E402

from planner.errors import UserError  # noqa: E402

BASE = "llama.cpp plain"


def machine(threads: int) -> dict:
    """bench/common.py's machine record with the threads llama.cpp computes with."""
    return common_machine() | {"threads": threads, "load_avg_1m": load_avg()}


def build_prompts(stock, tokenizer, n_chat: int, n_repeat: int) -> list[tuple[str, str, torch.Tensor]]:
    """(id, group, prompt ids): chat first turns, chat second turns after llama.cpp's own greedy first
    answer (`stock`, a StockLlama), and repeat requests, through the model's chat template."""
    from training.splits import bench_prompts

    def ids(messages) -> torch.Tensor:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return torch.tensor(list(out["input_ids"] if hasattr(out, "keys") else out), dtype=torch.long)

    rows = []
    for bp in bench_prompts("chat", n_chat):
        first = [{"role": "user", "content": bp.turns[0]}]
        rows.append((f"{bp.id}/1", "chat", ids(first)))
        if len(bp.turns) > 1:
            answer, _ = stock.greedy(rows[-1][2], 96)
            text = tokenizer.decode(answer, skip_special_tokens=True)
            rows.append((f"{bp.id}/2", "chat", ids(first + [{"role": "assistant", "content": text},
                                                            {"role": "user", "content": bp.turns[1]}])))
    for bp in bench_prompts("repeat", n_repeat):
        rows.append((bp.id, "repeat", ids([{"role": "user", "content": bp.turns[0]}])))
    return rows


def contenders(s: "Sizes", engine, plans: dict, stocks: dict, hf) -> dict:
    """name -> fn(ids) -> tokens (measure() times the call)."""
    from decoder import api
    from decoder.guesser import PlainGuesser
    from decoder.loop import generate

    out = {BASE: lambda ids: stocks[None].greedy(ids, s.tokens)[0]}
    for k, stock in stocks.items():
        if k is not None:
            out[f"llama.cpp lookup {k}"] = (lambda st: lambda ids: st.greedy(ids, s.tokens)[0])(stock)
    out["engine plain"] = lambda ids: generate(engine, ids, plan=None, guesser=PlainGuesser(),
                                               max_new_tokens=s.tokens, phase_times=False).tokens.tolist()
    for name, plan in plans.items():
        out[f"plan {name}"] = (lambda p: lambda ids: api.generate(engine, ids, p, max_new_tokens=s.tokens,
                                                                  phase_times=False).tokens)(plan)
    if hf is not None:
        def transformers(ids):
            torch.set_num_threads(s.threads)  # the llama engine keeps torch on one thread
            try:
                return hf.stock_generate(ids, s.tokens)[0]
            finally:
                torch.set_num_threads(1)
        out["transformers generate"] = transformers
    return out


USER_CTX = 2048  # the baseline's context: a user's own Llama (its per-token cost follows the cells in use)


def _stock_baselines(engine, threads: int) -> dict:
    """llama-cpp-python's own decoding on the engine's file, each on a Llama of its own as a user opens it:
    None -> plain Llama.generate (the baseline), K -> its prompt lookup (LlamaPromptLookupDecoding)."""
    from decoder.engines.llama_cpp.stock import StockLlama

    gguf = engine.record()["model_file"]
    return {k: StockLlama(gguf, threads, n_ctx=USER_CTX, lookup=k) for k in (None, 4, 10)}


def measure(s: "Sizes", seed: int, prompts, fns: dict) -> tuple[dict, dict, bool]:
    """seconds[name][prompt id] -> [per repeat] (the call's wall time), tokens[name][prompt id]; interleaved,
    warm-up first."""
    rng = random.Random(seed)
    seconds = {n: {} for n in fns}
    tokens = {n: {} for n in fns}
    for fn in fns.values():  # warm-up: first calls at new shapes, thread pools
        fn(prompts[0][2][: max(8, prompts[0][2].numel() // 2)])
    interrupted = False
    try:
        for r in range(s.repeats):
            for pid, _, ids in prompts:
                order = list(fns)
                rng.shuffle(order)
                for n in order:
                    t0 = time.perf_counter()
                    toks = fns[n](ids)
                    sec = time.perf_counter() - t0
                    seconds[n].setdefault(pid, []).append(sec)
                    tokens[n][pid] = toks
                sample_load()
            print(f"repeat {r + 1}/{s.repeats} done (load {load_avg()})", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: writing what is measured", file=sys.stderr)
    return seconds, tokens, interrupted


def ceilings(prompts, answers: dict, profile, max_guesses: int = 15) -> dict:
    """Per prompt: the oracle ceiling of prompt lookup on llama.cpp plain's own answer (planner/ceiling.py)."""
    from decoder.guessers.lookup import available_lengths
    from planner.ceiling import oracle_ceiling, simulate_fixed
    from planner.cost import step_cost

    G = min(profile.max_input_length - 1, max_guesses)
    cost = [float(step_cost(profile, g + 1)) for g in range(G + 1)]
    out = {}
    for pid, _, ids in prompts:
        if pid not in answers:
            continue
        offered, avail = available_lengths(ids.tolist(), answers[pid], G)
        c = oracle_ceiling(avail, cost)
        stock4 = simulate_fixed([min(o, 4) for o in offered], avail, cost)
        out[pid] = {"ceiling": c.speedup, "oracle_s": c.oracle_s, "plain_s": c.plain_s,
                    "lookup4_predicted": c.plain_s / stock4}
    return out


def summarise(prompts, seconds, tokens, ceil: dict) -> dict:
    ids = [pid for pid, _, _ in prompts if all(pid in seconds[n] for n in seconds)]
    group = {pid: g for pid, g, _ in prompts}
    med = {n: {p: statistics.median(seconds[n][p]) for p in ids} for n in seconds}
    rows = {}
    for n in seconds:
        ratio = {p: med[BASE][p] / med[n][p] for p in ids}
        toks = sum(len(tokens[n][p]) for p in ids)
        row = {"tokens": toks, "seconds": sum(med[n].values()), "tokens_per_s": toks / sum(med[n].values()),
               "speedup_geomean": math.exp(statistics.fmean(math.log(r) for r in ratio.values())),
               "speedup_min": min(ratio.values()), "per_prompt": {p: round(r, 4) for p, r in ratio.items()},
               "identical_to_llama_plain": [p for p in ids if tokens[n][p] != tokens[BASE][p]] == [],
               "differs_on": [p for p in ids if tokens[n][p] != tokens[BASE][p]]}
        for g in ("chat", "repeat"):
            rs = [ratio[p] for p in ids if group[p] == g]
            if rs:
                row[f"speedup_{g}"] = math.exp(statistics.fmean(math.log(r) for r in rs))
        if n.startswith("plan "):
            row["speedup_overall"] = row["tokens_per_s"] / (sum(len(tokens[BASE][p]) for p in ids) / sum(med[BASE].values()))
        cs = [ceil[p] for p in ids if p in ceil] if n.startswith("plan ") and ceil else []
        if cs:
            ceiling = sum(c["plain_s"] for c in cs) / sum(c["oracle_s"] for c in cs)
            overall = row["speedup_overall"]
            row.update(ceiling=ceiling, ceiling_share=(overall - 1) / (ceiling - 1) if ceiling > 1 + 1e-9 else None)
        rows[n] = row
    lk = rows.get("llama.cpp lookup 4")
    for n, row in rows.items():
        if n.startswith("plan ") and lk:
            row["vs_llama_lookup4"] = row["tokens_per_s"] / lk["tokens_per_s"]
    return {"prompts": ids, "rows": rows}


def to_markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# llama.cpp benchmark ({doc['model']}, {doc['tokens']} greedy tokens, {len(doc['result']['prompts'])} "
             f"prompts, medians of {doc['repeats']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; load {doc['load_before']} before, "
             f"{doc['load_after']} after. llama.cpp build: llamafile {doc['llama_cpp']['llamafile']}.", "",
             "| contender | tokens/s | x llama.cpp plain (geomean) | min | chat | repeat | identical | ceiling | share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, r in doc["result"]["rows"].items():
        f = lambda k: f"{r[k]:.2f}" if r.get(k) is not None else ""  # noqa: E731
        lines.append(f"| {n} | {r['tokens_per_s']:.1f} | {r['speedup_geomean']:.3f} | {r['speedup_min']:.3f} | "
                     f"{f('speedup_chat')} | {f('speedup_repeat')} | {r['identical_to_llama_plain']} | {f('ceiling')} | "
                     f"{f('ceiling_share')} |")
    for n, r in doc["result"]["rows"].items():
        if "vs_llama_lookup4" in r:
            ceiling = f" against an oracle ceiling of {r['ceiling']:.3f}x" if r.get("ceiling") else " (no ceiling: plain plan)"
            lines.append(f"\n{n}: {r['vs_llama_lookup4']:.2f}x llama.cpp's 4-token prompt lookup; overall "
                         f"{r['speedup_overall']:.3f}x plain{ceiling}.")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", action="append", default=[], help="a llama.cpp plan (repeatable), e.g. RUN/chosen.json")
    p.add_argument("--profile", default=None, help="the L(n) for the ceiling (default: the first plan's profile)")
    p.add_argument("--chat", type=int, default=6, help="two-turn chats (each gives 2 prompts)")
    p.add_argument("--repeat", type=int, default=8, help="prompts that repeat their input")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp and torch threads (default: the cores)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    p.add_argument("--smoke", action="store_true",
                   help="2 prompts x 16 tokens, one repeat, no transformers; writes nothing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "llamacpp"))
    return p


def main(argv=None) -> int:
    return bench_main("bench_llamacpp", parser(), run, argv, writes=lambda a: not a.smoke)


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, or --smoke's seconds."""

    chat: int
    repeat: int
    tokens: int
    repeats: int
    no_hf: bool
    threads: int


def sizes(a) -> Sizes:
    from decoder.engines.llama_cpp.lib import check_threads

    s = Sizes(1, 0, 16, 1, True, 0) if a.smoke else Sizes(a.chat, a.repeat, a.tokens, a.repeats, a.no_hf, 0)
    if not (1 <= s.tokens <= 2048 and 1 <= s.repeats <= 100 and 0 <= s.chat <= 50 and 0 <= s.repeat <= 50):
        raise UserError("--tokens in 1..2048, --repeats in 1..100, --chat and --repeat in 0..50")
    return Sizes(s.chat, s.repeat, s.tokens, s.repeats, s.no_hf, check_threads(a.threads))


def run(args) -> Results:
    from decoder.engines.registry import EngineRequest, open_engine
    from planner.engines import DEFAULT
    from planner.profile import load_profile
    from planner.tree import load_tree

    from decoder import api

    s = sizes(args)
    trees = {Path(f).parent.name + "/" + Path(f).stem: load_tree(f) for f in args.plan}
    prof_path = args.profile or next((t.provenance.get("profile") for t in trees.values()
                                      if isinstance(t.provenance.get("profile"), str)), None)
    profile = load_profile(prof_path) if prof_path else None
    load_before = load_avg()
    engine = open_engine("llama.cpp", EngineRequest(model="smollm2-135m", threads=s.threads))  # as api.open_engine
    for f, t in zip(args.plan, trees.values()):
        if (t.engine or DEFAULT) != engine.caps.name:
            raise UserError(f"--plan {f}: made for the {t.engine or DEFAULT} engine, not {engine.caps.name}")
    plans = {name: api.load_plan(f, engine) for name, f in zip(trees, args.plan)}
    stocks = _stock_baselines(engine, s.threads)
    prompts = build_prompts(stocks[None], engine.tokenizer, s.chat, s.repeat)
    hf = None if s.no_hf else open_hf("smollm2-135m", "fp32")  # no threads: torch stays on the llama engine's one
    fns = contenders(s, engine, plans, stocks, hf)
    seconds, tokens, interrupted = measure(s, args.seed, prompts, fns)
    ceil = ceilings(prompts, tokens[BASE], profile) if profile is not None else {}
    result = summarise(prompts, seconds, tokens, ceil)
    record = engine.record()
    doc = {"model": engine.model_name, "model_file": record["model_file"], "tokens": s.tokens, "repeats": s.repeats,
           "machine": machine(s.threads), "load_before": load_before, "load_after": load_avg(),
           "llama_cpp": record["llama_cpp"], "plans": args.plan, "profile": prof_path,
           "prompts": [{"id": pid, "group": g, "length": int(ids.numel())} for pid, g, ids in prompts],
           "ceilings": ceil, "result": result, "seconds": seconds, "interrupted": interrupted,
           "command": "python3 bench/bench_llamacpp.py " + " ".join(sys.argv[1:])}
    md = to_markdown(doc)
    files = {} if args.smoke else {Path(args.out + ".json"): doc, Path(args.out + ".md"): md}
    return Results(files, md, 130 if interrupted else 0)


if __name__ == "__main__":
    sys.exit(main())
