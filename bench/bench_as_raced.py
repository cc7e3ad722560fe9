"""`planner decode --plan RUN/chosen.json` with no other flag against the same decode with every
raced-with setting given as a flag, on prompts no tuning step read.

    python3 bench/bench_as_raced.py --run runs/<autotune run>
    python3 bench/bench_as_raced.py --run reports/example-autotune-cpu-smollm2-135m --repeats 3

The plan records what it was raced with (planner/plan_settings.py: the profile whose matmul paths
ran, the threads, the guesser's files); decode applies it when no flag is given. Contenders, each a
fresh `python3 -m planner decode` process on the same prompts (training.splits.bench_prompts: chat
first turns and input-repeating requests, one prompt file), alternating in a shuffled order per
repeat:
  as raced      --plan RUN/chosen.json and nothing else
  configured    the same with --profile RUN/profile.json --threads N (the recorded values) given
  no paths      the same with --threads N and a profile without matmul paths (what decode did before
                the record: the docs' command ran without the run's matmul paths)
Reported: decode's own tokens/s per run (model loading excluded), the median over repeats, and the
ratio to "configured". Writes bench/results/as_raced.{json,md} (--out) with the machine and load.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, Results, bench_main, load, machine, sample_load

from planner.errors import UserError  # noqa: E402


def _prompt_file(directory: Path, chat: int, repeat: int) -> Path:
    from training.splits import bench_prompts

    rows = [{"id": p.id, "turns": [p.turns[0]]} for p in bench_prompts("chat", chat) + bench_prompts("repeat", repeat)]
    path = directory / "bench_prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _plain_profile(run: Path, directory: Path) -> Path:
    """The run's profile without its matmul paths: decode then runs stock F.linear."""
    doc = json.loads((run / "profile.json").read_text())
    doc.pop("matmul_paths", None)
    path = directory / "profile-no-paths.json"
    path.write_text(json.dumps(doc))
    return path


def _decode(plan: Path, prompts: Path, tokens: int, extra: list[str], out: Path) -> float:
    cmd = [sys.executable, "-m", "planner", "decode", "--plan", str(plan), "--prompts", str(prompts),
           "--max-new-tokens", str(tokens), "--no-progress", "-o", str(out), *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(out.read_text())["summary"]["tokens_per_s"])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="an autotune run folder (chosen.json, profile.json)")
    p.add_argument("--chat", type=int, default=6)
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "as_raced"))
    return p


def main(argv=None) -> int:
    return bench_main("bench_as_raced", parser(), run, argv)


def run(a) -> Results:
    from planner.tree import load_tree

    if not (1 <= a.tokens <= 2048 and 1 <= a.repeats <= 20 and a.chat + a.repeat >= 1):
        raise UserError("--tokens 1..2048, --repeats 1..20, one prompt at least")
    run_dir = Path(a.run)
    plan = run_dir / "chosen.json"
    raced = load_tree(str(plan)).settings.get("raced_with") or {}
    threads = raced.get("threads")
    if threads is None:
        raise UserError(f"{plan}: no settings.raced_with.threads (a plan autotune wrote records it)")
    mach = machine()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts = _prompt_file(tmp, a.chat, a.repeat)
        arms = {"as raced": [],
                "configured": ["--profile", str(run_dir / "profile.json"), "--threads", str(threads)],
                "no paths": ["--profile", str(_plain_profile(run_dir, tmp)), "--threads", str(threads)]}
        speeds = {k: [] for k in arms}
        _decode(plan, prompts, 8, [], tmp / "warm.json")  # warm-up: caches, the conversion
        for r in range(a.repeats):
            order = list(arms)
            rng.shuffle(order)
            for k in order:
                speeds[k].append(_decode(plan, prompts, a.tokens, arms[k], tmp / "out.json"))
                print(f"repeat {r + 1}/{a.repeats} {k}: {speeds[k][-1]:.1f} tokens/s", file=sys.stderr, flush=True)
            sample_load()
    med = {k: statistics.median(v) for k, v in speeds.items()}
    doc = {"run": str(run_dir), "machine": mach, "load_avg_after": load(), "tokens": a.tokens, "repeats": a.repeats,
           "prompts": a.chat + a.repeat, "threads": threads, "tokens_per_s": speeds, "median": med,
           "vs_configured": {k: med[k] / med["configured"] for k in med}}
    out = Path(a.out)
    md = _markdown(doc, list(arms))
    return Results({out.with_suffix(".json"): doc, out.with_suffix(".md"): md}, md)


def _markdown(doc: dict, arms: list[str]) -> str:
    m, med = doc["machine"], doc["median"]
    lines = [f"# planner decode --plan {doc['run']}/chosen.json: as raced vs configured ({m['cpu']}, {m['cores']} cores, "
             f"load {m['load_avg']} -> {doc['load_avg_after']})", "",
             f"{doc['prompts']} benchmark prompts no tuning step read, {doc['tokens']} new tokens, one decode process "
             f"per run, median of {doc['repeats']} interleaved repeats.", "", "| decode | tokens/s | vs configured |",
             "|---|---|---|"]
    for k in arms:
        lines.append(f"| {k} | {med[k]:.1f} | {doc['vs_configured'][k]:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
