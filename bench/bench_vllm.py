"""vLLM with this project's export against vLLM plain, vLLM's own ngram and suffix defaults, this
project's plan on its own engine and transformers' `generate`, on prompts no tuning step reads.

    python bench/bench_vllm.py                  # 8 chat + 8 repeat prompts, 96 tokens, 3 rounds
    python bench/bench_vllm.py --quick          # 4 + 4 prompts, 64 tokens, 1 round (a loaded machine)
    python bench/bench_vllm.py --export FILE    # another `planner export --engine vllm` file

Prompts: training.splits.bench_prompts, "chat" (the first user turn of each hand-written two-turn
chat; the second turn would need the model's own first answer, which every contender would have to
share) and "repeat" (requests that repeat their input), each through the model's chat template
(workflows.cli.inputs.encode_prompts), the same token ids for every contender.

Contenders, one engine per process for vLLM (scripts/setup_vllm.sh's environment; fp32, eager,
greedy, one request at a time after a warm-up request on a prompt outside the set), the others in
this process (fp32, this project's loop with the plan profile's matmul paths, transformers stock):
  vLLM plain, vLLM export (default: `planner export --engine vllm` of the main job's decision),
  vLLM ngram (vLLM's documented example: k = 5, prompt_lookup_max 4), vLLM suffix (every default,
  the cross-request cache on: each prompt is decoded once per engine, so it holds only the other
  prompts' answers), this project's plan (its chosen.json on decoder.generate), transformers
  generate, and EXTRA_CONTENDERS (a slot for another engine, e.g. llama.cpp).
Rounds are interleaved (every contender once per round, in a shuffled order); per prompt the median
over rounds. Reports tokens/s, speedup over vLLM plain and over generate (geometric mean over
prompts, per group), accepted/drafted, and whether each output equals vLLM plain's and generate's.
vLLM's contenders also run the whole set as one batch (tokens/s of the batch). Writes
bench/results/vllm.{json,md} (--out) with the machine and the load average.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/common.py: the machine, shared by every benchmark

from common import Results, bench_main, load_avg, sample_load  # noqa: E402

from planner.errors import UserError  # noqa: E402

RUN = ROOT / "reports" / "autotune-quiet-cpu-smollm2-135m"  # the main job docs/vllm.md's race was measured with
from workflows.export.vllm import RACE_DEFAULTS as VLLM_DEFAULTS  # noqa: E402  vLLM's own settings, as the race uses them

# Another engine's contender: name -> fn(prompts: list[list[int]], max_new_tokens, eos) -> (tokens, seconds)
# lists per prompt (and optionally a third: {"drafted", "accepted"}); run in this process, interleaved.
EXTRA_CONTENDERS: dict = {}


# ---------------------------------------------------------------------------------------------- inputs


def prompts(tokenizer, n_chat: int, n_repeat: int) -> tuple[list[tuple[str, str, list[int]]], list[int]]:
    """(group, id, token ids) per prompt, and a warm-up prompt outside the set."""
    from training.splits import bench_prompts
    from workflows.cli.inputs import encode_prompts

    rows = bench_prompts("chat", n_chat + 1) + bench_prompts("repeat", n_repeat)
    ids = encode_prompts(tokenizer, [p.turns[0] for p in rows])
    out = [(p.group, p.id, t.tolist()) for p, t in zip(rows, ids)]
    warm = out.pop(n_chat)  # the chat prompt after the set: warm-up only
    return out, warm[2]


def exported_configs(exports: list[str]) -> dict[str, dict]:
    """name -> {"config", "file", "notes"}: each export file's vLLM config, else the main job's
    decision exported now (`planner export --engine vllm`, no race)."""
    from workflows.cli.main import main

    if not exports:
        tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "vllm.json"
        if main(["export", "--engine", "vllm", str(RUN / "chosen.json"), "-q", "-o", str(tmp)]) != 0:
            raise UserError("planner export of the main job's decision failed")
        exports = [str(tmp)]
    out = {}
    for f in exports:
        data = json.loads(Path(f).read_text())
        raced = (data.get("basis") or {}).get("race")
        name = "vLLM export, raced" if raced else "vLLM export"
        name = name if name not in out else f"{name} ({Path(f).stem})"
        out[name] = {"config": data["speculative_config"], "file": f, "notes": data.get("notes", [])}
    return out


# ---------------------------------------------------------------------------------------------- contenders


def vllm_contender(model_dir: str, config: dict | None, warmup: list[int], batched: bool):
    from workflows.export.vllm import decode_request, run_engine

    def run(ids, n, eos):
        r = run_engine("decode", decode_request(model_dir, config, ids, warmup, n, batched=batched))
        extra = {k: r[k] for k in ("drafted", "accepted", "drafts", "start_s")}
        if batched:
            extra["batched_tokens_per_s"] = sum(len(t) for t in r["batched_tokens"]) / r["batched_seconds"]
            extra["batched_identical"] = r["batched_tokens"] == r["tokens"]
        return r["tokens"], r["seconds"], extra
    return run


def local_contenders(engine, plan, guesser, profile: str | None) -> dict:
    """This project's plan on its own loop (matmul paths of the plan's profile) and transformers'
    generate (the engine's stock generation: stock Linears), in this process."""
    import torch

    from decoder import generate

    if profile:
        engine.use_matmul_paths(profile)

    def ours(ids, n, eos):
        toks, secs, drafted, accepted = [], [], 0, 0
        for p in ids:
            t = time.perf_counter()
            out = generate(engine, torch.tensor(p), plan=plan, guesser=guesser, max_new_tokens=n, eos_token_id=eos,
                           phase_times=False)
            secs.append(time.perf_counter() - t)
            toks.append(out.tokens.tolist())
            drafted += sum(x - 1 for x in out.stats.input_lengths)
            accepted += sum(out.stats.accepted)
        return toks, secs, {"drafted": drafted, "accepted": accepted}

    def hf(ids, n, eos):
        toks, secs = [], []
        for p in ids:
            t = time.perf_counter()
            toks.append(engine.stock_generate(torch.tensor(p), n)[0])
            secs.append(time.perf_counter() - t)
        return toks, secs, {}

    return {"this project's plan (own engine)": ours, "transformers generate": hf}


# ---------------------------------------------------------------------------------------------- the race


def race(runs: dict, ids: list[list[int]], n: int, eos, rounds: int, seed: int = 0) -> dict:
    """name -> {"seconds": per-prompt medians, "tokens": first round's, "extra": per round}."""
    rng = random.Random(seed)
    out = {k: {"seconds": [[] for _ in ids], "tokens": None, "extra": []} for k in runs}
    for r in range(rounds):
        order = list(runs)
        rng.shuffle(order)
        for name in order:
            t = time.perf_counter()
            toks, secs, extra = runs[name](ids, n, eos)
            for i, s in enumerate(secs):
                out[name]["seconds"][i].append(s)
            out[name]["tokens"] = out[name]["tokens"] or toks
            out[name]["extra"].append(dict(extra, load_avg_1m=load_avg()))
            print(f"  round {r + 1}/{rounds}: {name}: {sum(map(len, toks)) / sum(secs):.1f} tokens/s "
                  f"({time.perf_counter() - t:.0f} s, load {load_avg()})", file=sys.stderr, flush=True)
            sample_load()  # a vLLM contender's engine process has finished: its CPU is this run's own
    for v in out.values():
        v["seconds"] = [statistics.median(s) for s in v["seconds"]]
    return out


def geo(xs) -> float:
    xs = list(xs)
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def summarise(results: dict, groups: list[str]) -> dict:
    plain, gen = results["vLLM plain"], results["transformers generate"]
    rows = {}
    for name, r in results.items():
        n_tok = sum(len(t) for t in r["tokens"])
        row = {"tokens_per_s": n_tok / sum(r["seconds"]), "tokens": n_tok, "seconds": sum(r["seconds"]),
               "vs_vllm_plain": geo(p / s for p, s in zip(plain["seconds"], r["seconds"])),
               "vs_generate": geo(g / s for g, s in zip(gen["seconds"], r["seconds"])),
               "same_as_vllm_plain": sum(a == b for a, b in zip(r["tokens"], plain["tokens"])),
               "same_as_generate": sum(a == b for a, b in zip(r["tokens"], gen["tokens"])),
               "by_group_vs_vllm_plain": {g: geo(p / s for p, s, gg in zip(plain["seconds"], r["seconds"], groups)
                                                 if gg == g) for g in sorted(set(groups))}}
        extra = r["extra"][0] if r["extra"] else {}
        if extra.get("drafted"):
            row["accepted_per_drafted"] = extra["accepted"] / extra["drafted"]
            row["drafted"], row["accepted"] = extra["drafted"], extra["accepted"]
        batched = [e["batched_tokens_per_s"] for e in r["extra"] if "batched_tokens_per_s" in e]
        if batched:
            row["batched_tokens_per_s"] = statistics.median(batched)
            row["batched_identical"] = all(e["batched_identical"] for e in r["extra"])
        row["load_avg_1m"] = [e.get("load_avg_1m") for e in r["extra"]]
        if any("start_s" in e for e in r["extra"]):
            row["engine_start_s"] = statistics.median(e["start_s"] for e in r["extra"])
        rows[name] = row
    return rows


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# vLLM: this project's export against vLLM's own speculation ({doc['model']}, {m['cpu']}, "
             f"{m['cores']} cores, load {doc['load_avg_before']} -> {doc['load_avg_after']})", "",
             f"{len(doc['prompts'])} prompts no tuning step reads ({doc['counts']}), {doc['max_new_tokens']} new tokens, "
             f"greedy fp32, one request at a time, median of {doc['rounds']} interleaved round(s); {doc['vllm']} "
             f"(CPU build, eager). Configs: " + "; ".join(
                 f"{k} `{json.dumps(c, separators=(',', ':'))}`" for k, c in doc["configs"].items()) + ".", "",
             "| contender | tokens/s | vs vLLM plain | " + " | ".join(f"{g} vs plain" for g in doc["groups"]) +
             " | vs generate | accepted / drafted | batch of all: tokens/s | same as vLLM plain | same as generate "
             "| load after |", "|---|---|---|" + "---|" * len(doc["groups"]) + "---|---|---|---|---|---|"]
    n = len(doc["prompts"])
    for name, r in doc["results"].items():
        acc = f"{r['accepted']} / {r['drafted']} ({r['accepted_per_drafted']:.2f})" if "drafted" in r else ""
        batch = f"{r['batched_tokens_per_s']:.1f}" if "batched_tokens_per_s" in r else ""
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['vs_vllm_plain']:.2f}x | "
                     + " | ".join(f"{r['by_group_vs_vllm_plain'][g]:.2f}x" for g in doc["groups"])
                     + f" | {r['vs_generate']:.2f}x | {acc} | {batch} | {r['same_as_vllm_plain']} / {n} | "
                       f"{r['same_as_generate']} / {n} | {', '.join(str(x) for x in r.get('load_avg_1m', []))} |")
    for name, e in doc["exports"].items():
        lines += ["", f"{name} ({e['file']}) notes: " + " ".join(f"({i + 1}) {t}" for i, t in enumerate(e["notes"]))]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chat", type=int, default=8, help="chat prompts (first turns)")
    p.add_argument("--repeat", type=int, default=8, help="input-repeating requests")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="4 + 4 prompts, 64 tokens, 1 round")
    p.add_argument("--export", action="append", default=[],
                   help="a `planner export --engine vllm` file, repeatable (default: the main job's decision, exported now)")
    p.add_argument("--plan", default=str(RUN / "chosen.json"), help="this project's plan for its own engine")
    p.add_argument("--profile", default=str(RUN / "profile.json"), help="its matmul paths")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of this process's contenders (default 1: vLLM's CPU worker computes on one "
                        "thread here, the other core serving its front end)")
    p.add_argument("--skip", default="", help="comma-separated contenders to leave out")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm"), help="writes OUT.json and OUT.md")
    return p


def main(argv=None) -> int:
    return bench_main("bench_vllm", parser(), run, argv)


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, or --quick's."""

    chat: int
    repeat: int
    max_new_tokens: int
    rounds: int


def sizes(a) -> Sizes:
    s = Sizes(4, 4, 64, 1) if a.quick else Sizes(a.chat, a.repeat, a.max_new_tokens, a.rounds)
    if not (0 <= s.chat <= 15 and 0 <= s.repeat <= 64 and s.chat + s.repeat >= 1 and 1 <= s.max_new_tokens <= 1024
            and 1 <= s.rounds <= 20):
        raise UserError("--chat 0..15, --repeat 0..64 (one prompt at least), --max-new-tokens 1..1024, --rounds 1..20")
    if not 1 <= a.threads <= 256:
        raise UserError("--threads must be in 1..256")
    return s


def run(a) -> Results:
    import torch

    from bench_main_job import load_plan
    from common import machine, open_hf

    from decoder.engines.shipped import model_dir as shipped_dir
    from decoder.engines.vllm.env import SETUP, STAMP, venv_python

    s = sizes(a)
    python = venv_python()
    if python is None:
        raise UserError(f"no vLLM environment: run bash {SETUP}")
    load0 = load_avg()
    engine = open_hf("smollm2-135m", threads=a.threads)
    model_dir = str(shipped_dir(engine.model_name))  # vLLM loads the same converted Hugging Face folder
    rows, warmup = prompts(engine.tokenizer, s.chat, s.repeat)
    ids = [r[2] for r in rows]
    eos = sorted(engine.eos_ids())
    exports = exported_configs(a.export)
    tree, guesser = load_plan(a.plan, engine)
    runs = {"vLLM plain": vllm_contender(model_dir, None, warmup, True),
            **{k: vllm_contender(model_dir, e["config"], warmup, True) for k, e in exports.items()},
            **{k: vllm_contender(model_dir, c, warmup, True) for k, c in VLLM_DEFAULTS.items()},
            **local_contenders(engine, tree, guesser, a.profile), **EXTRA_CONTENDERS}
    skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    runs = {k: v for k, v in runs.items() if k not in skip or k in ("vLLM plain", "transformers generate")}
    with torch.inference_mode():
        for name, fn in runs.items():
            if not name.startswith("vLLM"):
                fn([warmup], 16, eos)  # this process's contenders: every shape once (vLLM's warm up in their engine)
        results = race(runs, ids, s.max_new_tokens, eos, s.rounds)
    groups = [r[0] for r in rows]
    doc = {"model": engine.model_name, "machine": machine(),
           "vllm": (python.parent.parent / STAMP).read_text().split()[0], "load_avg_before": load0,
           "load_avg_after": load_avg(), "max_new_tokens": s.max_new_tokens, "rounds": s.rounds,
           "groups": sorted(set(groups)), "counts": f"{s.chat} chat, {s.repeat} repeat",
           "prompts": [{"group": g, "id": i, "length": len(t)} for g, i, t in rows],
           "exports": exports, "plan": a.plan,
           "configs": {k: e["config"] for k, e in exports.items()} | VLLM_DEFAULTS, "results": summarise(results, groups)}
    out = Path(a.out)
    md = markdown(doc)
    return Results({out.with_suffix(".json"): doc, out.with_suffix(".md"): md}, md)


if __name__ == "__main__":
    sys.exit(main())
