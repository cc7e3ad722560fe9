"""The main job's decision against the engine's own generation, on prompts the autotuner never saw.

    python bench/bench_main_job.py --run runs/<autotune run>          # its chosen.json, in the engine it names
    python bench/bench_main_job.py --plan trees/x.json                 # any plan with a recorded guesser
    python bench/bench_main_job.py --smoke                             # the toy model, seconds
    python bench/bench_main_job.py --run runs/quiet --also loaded=runs/loaded   # two decisions, one race

Prompts: training.splits.bench_prompts, which no tuning step reads (bench/common.py): single-turn
chats, the follow-up turn of two-turn chats (the model's own greedy first answer, then the second
turn), and requests that repeat their input (rewrite, summarise, edit, extract), reported per group.
On the same prompt ids, interleaved in a shuffled order per repeat after a warm-up, medians over
`--repeats`:
  generate          the engine's own generation (transformers' generate, llama.cpp's Llama.generate),
                    greedy: the baseline a user compares with
  generate+lookup   transformers' generate with prompt_lookup_num_tokens=10 (its own speculation;
                    engines that lend their torch modules)
  plain loop        this project's plain decoding loop (decoder.generate with PlainGuesser)
  chosen            the decision as a user runs it: decoder.api.load_plan + generate (its guesser and
                    files as raced, the profile's matmul paths; a plain decision the engine's fastest
                    plain decoding; PEARL its own loop)
  chosen (NAME)     --also NAME=RUN: another run's decision (e.g. one made while a core was busy), on
                    its own engine with its own run's matmul paths
Reports tokens/s per contender, per-prompt speedup over the engine's own generation (geometric mean,
min, max, per group) and whether every output equals it (a difference may only be a near tie,
profiler.compare). Writes bench/results/main_job.{json,md} (--out) with the machine.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch  # noqa: E402
from common import (  # noqa: F401 (machine: the sampling benchmarks import it from here)
    ROOT,
    Results,
    bench_ids,
    bench_main,
    by_group,
    geomean,
    interleaved,
    library_generate,
    load,
    machine,
    tokenizer_or_builtin,
)

from planner.errors import UserError  # noqa: E402

# ---------------------------------------------------------------------------------------------- contenders


def recorded_guesser(tree, path: str) -> str:
    """KIND[:DIR] the plan records (autotune writes it): the files it was raced with (checked against
    their checksum), else the recorded directory; as `planner decode --plan` resolves it."""
    from planner.guessers import kind as guesser_kind
    from planner.plan_settings import plan_settings

    kind = tree.settings["guesser"]
    raced = plan_settings(tree.settings, path).raced_with
    where = None
    if raced is not None and raced.guesser is not None:
        where = str(raced.guesser.check(Path(path).parent, path, "the guesser's files"))
    where = where or tree.provenance.get("guesser_dir")
    return f"{kind}:{where}" if isinstance(where, str) and guesser_kind(kind).files is not None else kind


def load_plan(path: str, engine):
    """The plan and the guesser it records (autotune writes both), built against the engine (None: plain
    decoding)."""
    from planner.tree import load_tree
    from workflows.cli.inputs import make_guesser

    tree = load_tree(path)
    kind = tree.settings.get("guesser")
    if kind is None:
        raise UserError(f"{path}: the plan records no guesser (settings.guesser); autotune's plans do")
    if kind == "plain":
        return tree, None
    if kind == "pearl":
        where = tree.provenance.get("guesser_dir")
        spec = f"draft:{where}" if isinstance(where, str) else "draft"
    else:
        spec = recorded_guesser(tree, path)
    args = SimpleNamespace(guesser=spec, model=engine.model_name, prompt_tokens=None, random_prompt_tokens=None,
                           ensemble=1, top_k_guesses=10)
    return tree, make_guesser(args, engine)


def contenders(engine, plan, n: int) -> dict:
    """name -> fn(ids [T]) -> list of new token ids. The engine's own generation runs stock (transformers:
    F.linear in every Linear); this project's loops run the matmul paths the plan's profile chose."""
    from decoder import PlainGuesser, generate

    def plain(ids):
        return generate(engine, ids, None, PlainGuesser(), max_new_tokens=n, phase_times=False).tokens.tolist()

    out = {"generate": lambda ids: engine.stock_generate(ids, n)[0]}
    if engine.caps.torch_modules:  # transformers' own speculation runs on its torch model
        out["generate+lookup"] = lambda ids: library_generate(engine, ids, n, prompt_lookup_num_tokens=10)
    out["plain loop"] = plain
    if plan is not None:
        out["chosen"] = chosen_runner(engine, plan, n)
    return out


def chosen_runner(engine, plan, n: int):
    """The decision as `planner decode --plan` runs it, through the library (decoder/api.py)."""
    from decoder import api

    def chosen(ids):
        return api.generate(engine, ids, plan, max_new_tokens=n, phase_times=False).tokens

    return chosen


def summarise(engine, prompts, timings) -> dict:
    """Per contender: tokens/s, per-prompt speedup over generate (geometric mean, min, max, per
    group) and how many outputs equal generate's."""
    from profiler.compare import classify

    secs = {k: timings.median(k) for k in timings.wall}
    tokens = timings.outputs
    base = secs["generate"]
    groups = [p.group for p in prompts]
    out = {}
    for name in secs:
        ups = [b / s for b, s in zip(base, secs[name])]
        status = [classify(engine, p.ids, tokens["generate"][k], tokens[name][k])["status"] for k, p in enumerate(prompts)]
        n_tok = sum(len(t) for t in tokens[name])
        out[name] = {"tokens_per_s": n_tok / sum(secs[name]), "tokens": n_tok, "seconds": sum(secs[name]),
                     "speedup_vs_generate": geomean(ups), "min_speedup": min(ups), "max_speedup": max(ups),
                     "per_prompt_speedup": ups, "by_kind": by_group(ups, groups),
                     "identical": status.count("identical"), "near_ties": status.count("near_tie"),
                     "mismatches": status.count("mismatch")}
    return out


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# The main job's decision vs {doc.get('baseline', 'the engine')} ({doc['model']}, {doc.get('engine', 'hf')} "
             f"engine, {m['cpu']} ({', '.join(m.get('vector_extensions') or []) or 'vector extensions unknown'}), "
             f"{m['cores']} cores, torch {m['torch']}, load {m['load_avg']} -> {doc['load_avg_after']})", "",
             f"`generate` is {doc.get('baseline', 'the engine')}, the baseline of every speedup.", "",
             f"Plan: `{doc['plan']}` ({doc['plan_label']}); {len(doc['prompts'])} benchmark prompts no tuning step "
             f"read (training.splits.bench_prompts: {', '.join(f'{n} {k}' for k, n in doc['counts'].items())}), "
             f"{doc['max_new_tokens']} new tokens, median of {doc['repeats']} interleaved repeats."
             + "".join(f" Also raced: `{x}`." for x in doc.get("also", [])), "",
             "| contender | tokens/s | speedup vs generate (geo-mean) | min | max | " + " | ".join(doc["kinds"]) +
             " | same as generate |", "|---|---|---|---|---|" + "---|" * len(doc["kinds"]) + "---|"]
    for name, r in doc["results"].items():
        same = f"{r['identical']} + {r['near_ties']} near ties" if r["near_ties"] else f"{r['identical']}"
        same += f", {r['mismatches']} DIFFER" if r["mismatches"] else ""
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_generate']:.2f}x | {r['min_speedup']:.2f} | "
                     f"{r['max_speedup']:.2f} | " + " | ".join(f"{r['by_kind'].get(k, float('nan')):.2f}x" for k in doc["kinds"])
                     + f" | {same} / {len(doc['prompts'])} |")
    return "\n".join(lines) + "\n"


def _also(specs: list[str]) -> list[tuple[str, Path]]:
    out = []
    for spec in specs:
        name, sep, run = spec.partition("=")
        if not sep or not name or not (Path(run) / "chosen.json").is_file():
            raise UserError(f"--also {spec}: expected NAME=RUN with RUN/chosen.json")
        out.append((name, Path(run)))
    return out


def _other_decision(model_name: str, run: Path, n: int, threads: int | None):
    """Another run's chosen plan on its own engine (its own model copy), with that run's matmul paths."""
    engine, plan = open_plan(str(run / "chosen.json"), model_name, threads)
    return chosen_runner(engine, plan, n)


def open_plan(path: str | None, model: str, threads: int | None):
    """(the engine the plan names, opened on `model`, and the plan made ready for it by decoder.api);
    without a plan, the default engine and None."""
    from decoder import api
    from planner.tree import load_tree

    tree = load_tree(path) if path else None
    engine = api.open_engine(tree.engine if tree is not None else None, model=model, threads=threads)
    return engine, (api.load_plan(path, engine) if path else None)


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, or --smoke's toy-model seconds."""

    model: str
    single_prompts: int
    chat_prompts: int
    repeat_prompts: int
    max_new_tokens: int
    repeats: int
    first_answer_tokens: int


def sizes(a) -> Sizes:
    s = Sizes(a.model, a.single_prompts, a.chat_prompts, a.repeat_prompts, a.max_new_tokens, a.repeats, 64)
    if a.smoke:
        s = Sizes("builtin", 1, 1, 1, 12, 1, 16)
    if not (1 <= s.max_new_tokens <= 2048 and 1 <= s.repeats <= 50
            and s.single_prompts + s.chat_prompts + s.repeat_prompts >= 1):
        raise UserError("--max-new-tokens 1..2048, --repeats 1..50, and one prompt at least")
    return s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", help="an autotune run folder (its chosen.json)")
    src.add_argument("--plan", help="a plan file with a recorded guesser")
    p.add_argument("--also", action="append", default=[], metavar="NAME=RUN",
                   help="another autotune run whose chosen.json races beside (repeatable)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", default=None,
                   help="the profile whose matmul paths this project's loops run (default: the run's profile.json)")
    p.add_argument("--single-prompts", type=int, default=8, help="single-turn chats (bench/data/bench_chat.jsonl)")
    p.add_argument("--chat-prompts", type=int, default=8,
                   help="follow-up turns of two-turn chats (bench/data/bench_chat.jsonl)")
    p.add_argument("--repeat-prompts", type=int, default=8, help="requests that repeat their input")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="the toy model, 1 + 1 prompts, 12 tokens, 1 repeat")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "main_job"), help="writes OUT.json and OUT.md")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    return bench_main("bench_main_job", parser(), run, argv)


def run(a) -> Results:
    s = sizes(a)
    path = a.plan or (str(Path(a.run) / "chosen.json") if a.run else None)
    engine, plan = open_plan(path, s.model, a.threads)
    tok = tokenizer_or_builtin(engine)
    if a.profile:  # else the plan's own (load_plan installed the paths it was raced with)
        engine.use_matmul_paths(a.profile)
        print(f"matmul paths from {a.profile}", file=sys.stderr)
    label = _label(plan)
    mach = machine()
    counts = {"single": s.single_prompts, "chat": s.chat_prompts, "repeat": s.repeat_prompts}
    with torch.inference_mode():
        prompts = bench_ids(tok, counts, engine, first_answer_tokens=s.first_answer_tokens)
        runs = contenders(engine, plan, s.max_new_tokens)
        for name, other in _also(a.also):
            runs[f"chosen ({name})"] = _other_decision(s.model, other, s.max_new_tokens, a.threads)
        timings = interleaved(runs, [p.ids for p in prompts], s.repeats, progress=not a.no_progress)
        results = summarise(engine, prompts, timings)
    from decoder.engines.registry import kind_of

    doc = {"model": engine.model_name, "engine": engine.caps.name, "baseline": kind_of(engine).stock, "plan": path,
           "plan_label": label, "also": a.also, "profile": a.profile, "machine": mach, "load_avg_after": load(),
           "max_new_tokens": s.max_new_tokens, "repeats": s.repeats, "counts": counts,
           "kinds": [g for g in counts if counts[g]],
           "prompts": [{"id": p.id, "kind": p.group, "length": int(p.ids.numel())} for p in prompts],
           "results": results}
    out = Path(a.out)
    return Results({out.with_suffix(".json"): doc, out.with_suffix(".md"): markdown(doc)}, markdown(doc))


def _label(plan) -> str:
    return "no plan" if plan is None else plan.label


if __name__ == "__main__":
    sys.exit(main())
