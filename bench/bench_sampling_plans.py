"""Where a tree planned for the sampled acceptance beats the one planned for greedy acceptance.

    python bench/bench_sampling_plans.py          # the committed runs: quiet greedy main job, T 0.7 / top-p 0.9

No timing: the planning model, exact given its inputs. Per guesser with both acceptance files (the greedy
main job's and the sampled autotune's, measured on the same held-out prompts) and per static method, two
trees are planned against one latency curve, one from the greedy acceptance and one from the sampled
acceptance (the same guessing record: drafter cost and passes, from the sampled file), and both are
valued under the sampled acceptance, the one a sampling user meets: tau (planner.candidate.tree_tau) x
plain step / the tree's step latency (planner.cost). The latency curves: this machine's measured profile, and
synthetic curves L(n) = L(1) (1 + a (n - 1)) for slopes `a` (a forward that grows with its input, as a
compute-bound device's does; L(1) the profile's). The ratio sampled-planned / greedy-planned is what
re-planning for sampling buys where the guesser and method stay the same; it is >= 1 by construction (each
planner is optimal for the acceptance it is given), and how far above 1 says where tuning for sampling
would pay. Writes bench/results/sampling_plans.{json,md} (--out).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import Results, bench_main

from planner.accept import Acceptance, load_acceptance
from planner.candidate import tree_tau
from planner.cost import Guessing, default_guessing, plain_step, step_latency
from planner.errors import PlainIsFastest, UserError
from planner.plan import plan
from planner.profile import LatencyProfile, load_profile, profile_from_json
from planner.tree import Tree

GREEDY_RUN = ROOT / "reports" / "autotune-quiet-cpu-smollm2-135m"
SAMPLED_RUN = ROOT / "reports" / "sampling-autotune-cpu-smollm2-135m-t0.7-p0.9"
GUESSERS = ("lookup", "chain", "parallelspec", "draft", "ppd")
METHODS = ("medusa", "sequoia")
MAX_N = 64  # synthetic curves' input lengths 1..MAX_N


def synthetic(profile: LatencyProfile, slope: float) -> LatencyProfile:
    """L(n) = L(1) (1 + slope (n - 1)) for n = 1..MAX_N, L(1) the measured profile's."""
    l1 = plain_step(profile)
    n = list(range(1, MAX_N + 1))
    return profile_from_json({"input_lengths": n, "latency_s": [l1 * (1 + slope * (k - 1)) for k in n]},
                             f"synthetic slope {slope}")


def value(tree: Tree | None, sampled: Acceptance, profile: LatencyProfile, guessing: Guessing) -> tuple[float, int]:
    """(predicted speedup over plain under the sampled acceptance, candidates) of a one-state tree; None: plain.
    Nodes deeper than the sampled acceptance covers count as never accepted (their cost still counts)."""
    if tree is None:
        return 1.0, 0
    depth = sampled.accuracy.shape[0]
    nodes = tree.states[0].nodes
    tau = tree_tau(sampled.rows(depth), [p for p in nodes if len(p) <= depth])
    return tau * plain_step(profile) / step_latency(tree, profile, guessing), len(nodes)


def _plan(method: str, accept: Acceptance, profile: LatencyProfile, guessing: Guessing) -> Tree | None:
    try:
        return plan(method, accept, profile=profile, guessing=guessing)
    except PlainIsFastest:
        return None


def compare(greedy: Acceptance, sampled: Acceptance, method: str, profile: LatencyProfile) -> dict:
    guessing = default_guessing(method, sampled)
    g = value(_plan(method, greedy, profile, guessing), sampled, profile, guessing)
    s = value(_plan(method, sampled, profile, guessing), sampled, profile, guessing)
    return {"greedy_planned": {"speedup": g[0], "candidates": g[1]},
            "sampled_planned": {"speedup": s[0], "candidates": s[1]}, "ratio": s[0] / g[0]}


def run(greedy_dir: Path, sampled_dir: Path, profile_path: Path, slopes: list[float]) -> dict:
    measured = load_profile(str(profile_path))
    curves = {"measured": measured} | {f"slope {a:g}": synthetic(measured, a) for a in slopes}
    rows, sampling = [], None
    for g in GUESSERS:
        paths = greedy_dir / f"accept-{g}.json", sampled_dir / f"accept-{g}.json"
        if not all(p.is_file() for p in paths):
            continue
        ga, sa = (load_acceptance(str(p)) for p in paths)
        sampling = sampling or sa.source.get("sampling")
        for method in METHODS if g != "ppd" else ("medusa",):
            for name, prof in curves.items():
                rows.append({"guesser": g, "method": method, "curve": name, **compare(ga, sa, method, prof)})
    if not rows:
        raise UserError(f"{greedy_dir}, {sampled_dir}: no guesser has an accept-*.json in both")
    return {"greedy_run": str(greedy_dir), "sampled_run": str(sampled_dir), "profile": str(profile_path),
            "sampling": sampling, "slopes": slopes, "rows": rows}


def markdown(doc: dict) -> str:
    lines = ["# Trees planned for sampled acceptance against trees planned for greedy acceptance", "",
             (f"Planning model, no timing. Acceptance: `{doc['greedy_run']}` (greedy) and `{doc['sampled_run']}` "
              f"(sampled: {doc['sampling']}); both trees valued under the sampled acceptance. Curves: the measured "
              f"profile `{doc['profile']}` and L(n) = L(1) (1 + a (n - 1)) for a in {doc['slopes']}."), "",
             "| guesser | method | latency curve | greedy-planned: candidates | speedup | sampled-planned: candidates "
             "| speedup | sampled / greedy |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        g, s = r["greedy_planned"], r["sampled_planned"]
        lines.append(f"| {r['guesser']} | {r['method']} | {r['curve']} | {g['candidates']} | {g['speedup']:.3f}x | "
                     f"{s['candidates']} | {s['speedup']:.3f}x | {r['ratio']:.3f} |")
    best = max(doc["rows"], key=lambda r: r["ratio"])
    lines += ["", f"Largest gain: {best['ratio']:.3f}x ({best['guesser']}, {best['method']}, {best['curve']})."]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--greedy-run", default=str(GREEDY_RUN), help="a greedy `planner autotune` run folder (accept-*.json)")
    p.add_argument("--sampled-run", default=str(SAMPLED_RUN), help="a sampled run folder on the same prompts")
    p.add_argument("--profile", default=None, help="the latency profile (default: the greedy run's profile.json)")
    p.add_argument("--slopes", default="0,0.01,0.03,0.1", help="synthetic curves' slopes per input token, comma-separated")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sampling_plans"), help="writes OUT.json and OUT.md")
    return p


def main(argv=None) -> int:
    # no timing: the planning model's answer does not depend on the machine's load, so none is judged
    return bench_main("bench_sampling_plans", parser(), main_run, argv, writes=lambda a: False)


def main_run(a) -> Results:
    try:
        slopes = [float(x) for x in a.slopes.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--slopes {a.slopes}: expected numbers separated by commas") from None
    if not slopes or any(not 0 <= x <= 10 for x in slopes):
        raise UserError(f"--slopes {a.slopes}: expected slopes in 0..10")
    greedy, sampled = Path(a.greedy_run), Path(a.sampled_run)
    profile = Path(a.profile) if a.profile else greedy / "profile.json"
    if not profile.is_file():
        raise UserError(f"{profile}: no such profile (give --profile FILE)")
    doc = run(greedy, sampled, profile, slopes)
    out = Path(a.out)
    md = markdown(doc)
    return Results({out.with_suffix(".json"): doc, out.with_suffix(".md"): md}, md)


if __name__ == "__main__":
    sys.exit(main())
