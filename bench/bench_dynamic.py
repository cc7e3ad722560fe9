"""Per-step (dynamic) trees against transformers' own speculation, on the same prompts, one run.

    python bench/bench_dynamic.py            # SmolLM2-135M: benchmark chats + requests that repeat their input
    python bench/bench_dynamic.py --quick    # 2 + 2 prompts, 32 tokens, every method once after a warm-up
    python bench/bench_dynamic.py --smoke    # tiny random models, seconds; checks identity only

Methods (greedy, fp32):
  hf_generate      model.generate (the speed baseline: speedups are over it, per prompt)
  hf_lookup        model.generate(prompt_lookup_num_tokens=10)
  hf_assisted      model.generate(assistant_model=<the shipped draft LM>), transformers' defaults
  plain            this project's plain loop (decoder.generate with PlainGuesser)
  static/<g>       the best static plan of guesser g measured by the committed autotune run
                   (reports/autotune-cpu-smollm2-135m/trees)
  dynamic/<g>      a dynamic plan (planner plan dynamic) from the calibrated acceptance in
                   reports/dynamic-smollm2-135m/ and the committed profile; hybrids lookup+<g>
Prompts: training.splits.bench_prompts (no tuning step reads them; bench/common.py), per group.
Runs are interleaved per prompt in a shuffled order each repeat after a warm-up of every method
(bench/common.py); per prompt the median over repeats; every output is compared with hf_generate's.
Writes bench/results/dynamic.{json,md} (--out) with the machine and its load average.
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
    drafter,
    interleaved,
    library_generate,
    load,
    machine,
    open_hf,
    write_results,
)

import torch  # noqa: E402

from planner.errors import UserError  # noqa: E402

SHIPPED = ROOT / "models" / "smollm2-135m"
CAL_DIR = ROOT / "reports" / "dynamic-smollm2-135m"
AUTOTUNE = ROOT / "reports" / "autotune-cpu-smollm2-135m"
STATIC = {"lookup": "lookup-chain-6.json", "parallelspec": "parallelspec-medusa-7.json", "draft": "draft-chain-1.json"}
DYNAMIC_FULL = ("lookup", "parallelspec", "draft", "lookup+parallelspec", "lookup+draft")
DYNAMIC_QUICK = ("lookup", "parallelspec", "lookup+parallelspec")
# --clock cpu: time a method by the process's CPU time (with --threads 1 that is its own work), for a
# machine shared with other jobs, where wall time measures the neighbours as much as the method
CLOCK = {"cpu": False}


def _guesser(kind: str, engine, smoke_draft=None):
    from decoder import DraftModelGuesser, ParallelDrafter, PromptLookupGuesser
    from decoder.guessers.dynamic import HybridGuesser

    if "+" in kind:
        _, drafter = kind.split("+")
        return HybridGuesser(PromptLookupGuesser(), _guesser(drafter, engine, smoke_draft), drafter)
    if kind == "lookup":
        return PromptLookupGuesser()
    if kind == "draft":
        return DraftModelGuesser(smoke_draft if smoke_draft is not None else draft_lm(engine), top_k=4)  # refuses: none ships
    if kind == "parallelspec":
        return ParallelDrafter.load(SHIPPED / "parallelspec")
    raise UserError(f"bench_dynamic: unknown guesser {kind}")


def draft_lm(engine, spec: str | None = None):
    """A draft LM on the engine's model (bench.common.drafter: none ships any more)."""
    return drafter(spec, engine)


def _dynamic_plan(kind: str, profile, accepts: dict):
    from planner.dynamic_plan import plan_dynamic

    return plan_dynamic([(k, accepts[k]) for k in kind.split("+")], profile, max_size=16, max_depth=8)


def _time(fn) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    toks = fn()
    return toks, time.perf_counter() - t0


def runners(engine, methods, plans, guessers, draft_hf, n_new: int) -> dict:
    """method -> fn(ids) -> (tokens, GenerateOutput or None). transformers' own speculation options
    (prompt lookup, an assistant model) are no engine option: common.library_generate runs them."""
    from decoder import PlainGuesser, generate

    def hf(**kw):
        def run(ids):
            toks = library_generate(engine, ids, n_new, **kw) if kw else engine.stock_generate(ids, n_new)[0]
            return toks, None
        return run

    def ours(plan, g):
        def run(ids):
            out = generate(engine, ids, plan=plan, guesser=g, max_new_tokens=n_new)
            return out.tokens.tolist(), out
        return run

    table = {"hf_generate": hf(), "hf_lookup": hf(prompt_lookup_num_tokens=10),
             "plain": lambda ids: _tokens_and(generate(engine, ids, None, PlainGuesser(), max_new_tokens=n_new))}
    if draft_hf is not None:
        table["hf_assisted"] = hf(assistant_model=draft_hf)
    for m in methods:
        if m.startswith(("static/", "dynamic/")):
            table[m] = ours(plans[m], guessers[m])
    return {m: table[m] for m in ["hf_generate", "hf_lookup", "hf_assisted", "plain"] + list(methods) if m in table}


def _tokens_and(out):
    return out.tokens.tolist(), out


def run_bench(engine, prompts: list[tuple[str, str, torch.Tensor]], run: dict, repeats: int, progress: bool = True,
              on_prompt=None) -> dict:
    """{method: [per prompt {tokens, seconds (median), report}]} over (id, group, ids) prompts,
    timed by bench/common.py's interleaved loop. on_prompt(rows) after every prompt (results are
    written as they come; Ctrl-C keeps them)."""
    names = list(run)
    rows = {m: [] for m in names}

    def done(t, k):
        pid, group, _ = prompts[k]
        for m in names:
            toks, o = t.outputs[m][k]
            rep = o.stats.dynamic if o is not None and o.stats.dynamic is not None else None
            wall, cpu = statistics.median(t.wall[m][k]), statistics.median(t.cpu[m][k])
            rows[m].append({"prompt": pid, "group": group, "tokens": toks, "seconds": cpu if CLOCK["cpu"] else wall,
                            "wall_s": wall, "cpu_s": cpu,
                            "steps": o.steps if o is not None else None,
                            "forward_s": sum(o.stats.times["forward"]) if o is not None else None,
                            "decode_s": o.stats.total_s - o.stats.prefill_s if o is not None else None,
                            "dynamic": None if rep is None else {key: rep[key] for key in (
                                "sizes", "predicted_speedup", "predicted_tokens_per_step", "decide_s_mean",
                                "corrections")}})
        if progress:
            sp = {m: rows["hf_generate"][-1]["seconds"] / rows[m][-1]["seconds"] for m in names}
            print(f"[{k + 1}/{len(prompts)}] {group} {pid}: " + ", ".join(f"{m} {v:.2f}x" for m, v in sp.items()),
                  file=sys.stderr, flush=True)
        if on_prompt is not None:
            on_prompt(rows)

    interleaved(run, [ids for _, _, ids in prompts], repeats, warm_up=prompts[0][2][:32], on_item=done, progress=False)
    return rows


def summarise(rows: dict) -> list[dict]:
    base = rows["hf_generate"]
    plain = rows["plain"]
    out = []
    for m, rs in rows.items():
        tokens = sum(len(r["tokens"]) for r in rs)
        secs = sum(r["seconds"] for r in rs)
        per = [b["seconds"] / r["seconds"] for r, b in zip(rs, base)]
        per_plain = [p["seconds"] / r["seconds"] for r, p in zip(rs, plain)]
        row = {"method": m, "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
               "speedup_vs_generate": (tokens / secs) / (sum(len(r["tokens"]) for r in base) / sum(r["seconds"] for r in base)),
               "per_prompt_vs_generate": per, "min_prompt_vs_plain": min(per_plain),
               "median_prompt_vs_generate": statistics.median(per),
               "by_group_vs_generate": by_group(per, [r["group"] for r in rs]),
               "identical_to_generate": all(r["tokens"] == b["tokens"] for r, b in zip(rs, base))}
        if rs[0]["steps"] is not None:
            steps = sum(r["steps"] for r in rs)
            row["tokens_per_step"] = tokens / steps
            fwd = sum(r["forward_s"] for r in rs)
        if rs[0]["dynamic"] is not None:
            d = [r["dynamic"] for r in rs]
            sizes = [s for x in d for s in x["sizes"]]
            row["mean_size"] = statistics.fmean(sizes)
            row["plain_step_share"] = sum(s == 0 for s in sizes) / len(sizes)
            row["decide_vs_forward"] = sum(x["decide_s_mean"] * len(x["sizes"]) for x in d) / fwd
            preds = [x["predicted_speedup"] for x in d if x["predicted_speedup"] is not None]
            if preds:  # the session's forecast is over our plain step: compare with the measured speedup over plain
                # aggregate as the measurement does: plain's decode time over the forecast decode time, summed
                row["predicted_vs_plain"] = sum(p["decode_s"] for p in plain) / sum(
                    p["decode_s"] / x["predicted_speedup"] for p, x in zip(plain, d))
                row["predicted_vs_plain_per_prompt"] = preds
                # decode only (prefill excluded, as in the forecast): tokens per decode second against plain's
                row["measured_vs_plain"] = (tokens / sum(r["decode_s"] for r in rs)) / (
                    sum(len(r["tokens"]) for r in plain) / sum(r["decode_s"] for r in plain))
                row["prediction_error"] = row["predicted_vs_plain"] / row["measured_vs_plain"] - 1
        out.append(row)
    return out


def markdown(doc: dict) -> str:
    groups = list(doc["summary"][0]["by_group_vs_generate"]) if doc["summary"] else []
    lines = [f"# bench_dynamic ({doc['mode']})", "",
             f"Machine: {doc['machine']['cpu']}, {doc['machine']['cores']} cores, torch {doc['machine']['torch']} "
             f"({doc['machine']['torch_threads']} threads); load average before {doc['machine']['load_avg']}, "
             f"after {doc['load_after']}. Model {doc['model']}, greedy, {doc['max_new_tokens']} new tokens, "
             f"{doc['repeats']} repeat(s) per prompt after a warm-up, medians; clock: {doc.get('clock', 'wall')}"
             f"{' (process CPU time, 1 thread: the machine is shared)' if doc.get('clock') == 'cpu' else ''}.",
             f"Prompts: {doc['prompt_sets']}.", "",
             "| method | tokens/s | vs generate | " + " | ".join(f"{g} vs generate" for g in groups) + " | "
             "median prompt vs generate | worst prompt vs plain | tokens/step | "
             "mean size | plain steps | decide / forward | predicted vs plain (decode) | measured vs plain (decode) | identical |",
             "|---|---|---|" + "---|" * len(groups) + "---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    for r in doc["summary"]:
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_generate']:.2f}x | "
                     + "".join(f"{r['by_group_vs_generate'][g]:.2f}x | " for g in groups) +
                     f"{r['median_prompt_vs_generate']:.2f}x | {r['min_prompt_vs_plain']:.2f}x | "
                     f"{f(r.get('tokens_per_step'))} | {f(r.get('mean_size'), '{:.1f}')} | "
                     f"{f(r.get('plain_step_share'), '{:.0%}')} | {f(r.get('decide_vs_forward'), '{:.2%}')} | "
                     f"{f(r.get('predicted_vs_plain'))} | {f(r.get('measured_vs_plain'))} | "
                     f"{'yes' if r['identical_to_generate'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def smoke(out_dir: Path | None) -> Results:
    """Tiny random target and draft: every method decodes, ours equal generate."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_decoder_utils import tiny_model

    from decoder.engines.registry import as_engine
    from planner.accept import from_entry
    from planner.dynamic_plan import plan_dynamic

    torch.manual_seed(0)
    engine, draft = as_engine(tiny_model("llama", seed=1)), tiny_model("llama", seed=2)
    acc = {"lookup": from_entry({"accuracy": [[0.4], [0.8], [0.85]], "guesser": {"kind": "PromptLookupGuesser"}}, "l"),
           "draft": from_entry({"accuracy": [[0.5, 0.2]] * 3, "guesser": {"kind": "DraftModelGuesser", "draft_s": 0.001}}, "d")}
    methods = ("dynamic/lookup", "dynamic/draft", "dynamic/lookup+draft")
    plans = {m: plan_dynamic([(k, acc[k]) for k in m.split("/")[1].split("+")], None, 8, 4) for m in methods}
    guessers = {m: _guesser(m.split("/")[1], engine, draft) for m in methods}
    g = torch.Generator().manual_seed(0)
    rep = torch.randint(1, 100, (8,), generator=g)
    # a random model without a tokenizer: random ids (the full run reads training.splits.bench_prompts)
    prompts = [("s0", "random", torch.randint(1, 100, (12,), generator=g)), ("s1", "repeats", torch.cat([rep, rep, rep[:4]]))]
    rows = run_bench(engine, prompts, runners(engine, methods, plans, guessers, draft, 16), 1, progress=False)
    summary = summarise(rows)
    bad = [r["method"] for r in summary if not r["identical_to_generate"] and r["method"] not in ("hf_lookup", "hf_assisted")]
    doc = {"mode": "smoke", "machine": machine(), "load_after": load(), "model": "tiny random llama",
           "max_new_tokens": 16, "repeats": 1, "prompt_sets": "2 random", "summary": summary}
    files = {out_dir / "dynamic.json": doc} if out_dir is not None else {}
    said = f"smoke: NOT identical: {bad}" if bad else "smoke: ok"
    return Results(files, markdown(doc) + said, 1 if bad else 0)


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, or --quick's."""

    chat_prompts: int
    repeat_prompts: int
    max_new_tokens: int
    repeats: int


def sizes(a) -> Sizes:
    s = Sizes(2, 2, 32, a.repeats) if a.quick else Sizes(a.chat_prompts, a.repeat_prompts, a.max_new_tokens, a.repeats)
    for name in ("chat_prompts", "repeat_prompts", "max_new_tokens", "repeats"):
        if not 0 <= getattr(s, name) <= 1024:
            raise UserError(f"--{name.replace('_', '-')}: expected 0..1024")
    return s


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny random models, seconds; writes only with --out")
    ap.add_argument("--draft", default=None, help="a draft LM directory (planner train-drafter --kind draft-lm): none ships")
    ap.add_argument("--chat-prompts", type=int, default=4, help="two-turn chats (training.splits.bench_prompts)")
    ap.add_argument("--repeat-prompts", type=int, default=4, help="requests that repeat their input")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall (default) or cpu: process CPU time, for a shared machine (use with --threads 1)")
    ap.add_argument("--out", default=None, help="default bench/results (not with --smoke)")
    ap.add_argument("--profile", default=str(AUTOTUNE / "profile.json"),
                    help="latency profile the dynamic plans are costed with (measure it at the bench's --threads)")
    return ap


def main(argv=None) -> int:
    return bench_main("bench_dynamic", parser(), run, argv, writes=lambda a: not a.smoke or a.out is not None)


def run(args) -> Results:
    from planner.accept import load_acceptance
    from planner.profile import load_profile
    from planner.tree import load_tree

    if args.smoke:
        return smoke(Path(args.out) if args.out else None)
    s = sizes(args)
    engine = open_hf("smollm2-135m", "fp32", args.threads)
    CLOCK["cpu"] = args.clock == "cpu"
    if CLOCK["cpu"] and torch.get_num_threads() != 1:
        raise UserError("--clock cpu: give --threads 1 (CPU time of several threads counts their spinning too)")
    mach = machine()
    prompts = [(p.id, p.group, p.ids)
               for p in bench_ids(engine.tokenizer, {"chat": s.chat_prompts, "repeat": s.repeat_prompts}, engine)]
    profile = load_profile(args.profile)
    dyn = DYNAMIC_QUICK if args.quick else DYNAMIC_FULL
    accepts = {k: load_acceptance(str(CAL_DIR / f"accept-{k}.json")) for k in {p for d in dyn for p in d.split("+")}}
    methods = [f"static/{k}" for k in STATIC] + [f"dynamic/{k}" for k in dyn]
    plans, guessers = {}, {}
    for m in methods:
        kind = m.split("/")[1]
        plans[m] = load_tree(AUTOTUNE / "trees" / STATIC[kind]) if m.startswith("static/") else _dynamic_plan(kind, profile, accepts)
        guessers[m] = _guesser(kind, engine, draft_lm(engine, args.draft) if "draft" in kind else None)
    draft_hf = draft_lm(engine, args.draft)
    t0 = time.time()
    out = Path(args.out or ROOT / "bench" / "results")
    name = "dynamic-quick" if args.quick else "dynamic"
    state = {}

    def write(rows):
        """The prompts done so far (the load was sampled after the last one: a loaded run stops before this)."""
        done = len(rows["hf_generate"])
        doc = {"mode": "quick" if args.quick else "full", "machine": mach,
               "load_after": load(), "model": "smollm2-135m (fp32)",
               "max_new_tokens": s.max_new_tokens, "repeats": s.repeats, "prompts_done": done,
               "clock": args.clock,
               "prompt_sets": f"{s.chat_prompts} two-turn chats + {s.repeat_prompts} requests that repeat "
                              f"their input (training.splits.bench_prompts, read by no tuning step); "
                              f"{done} of {len(prompts)} done",
               "profile": args.profile, "calibration": str(CAL_DIR), "wall_s": time.time() - t0,
               "summary": summarise(rows), "rows": rows,
               "plans": {m: {"method": p.method, "settings": p.settings, "predicted_speedup": p.predicted_speedup}
                         for m, p in plans.items()}}
        write_results(Results({out / f"{name}.json": doc, out / f"{name}.md": markdown(doc)}))
        state["doc"] = doc

    try:
        run_bench(engine, prompts, runners(engine, methods, plans, guessers, draft_hf, s.max_new_tokens), s.repeats,
                  on_prompt=write)
    except KeyboardInterrupt:
        print("bench_dynamic: interrupted; the prompts finished so far are written", file=sys.stderr)
    return Results({}, markdown(state["doc"]) if "doc" in state else "")


if __name__ == "__main__":
    sys.exit(main())
