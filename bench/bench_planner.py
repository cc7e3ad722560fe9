"""Planner benchmark: speed of the planners and quality of their trees on published acceptance data.

  python bench/bench_planner.py [--shared ../shared] [--repeats 7] [--out bench/results]

Writes bench/results/planner.json and planner.md. Speed: medians over repeats, each against a
baseline in the same run (a plain-Python version of the same DP; full path enumeration for
medusa). Quality: the model's tau (tokens per step) per method and size, PPD paper heuristic vs
the improved construction, and predicted speedups under synthetic latency profiles (flat up to a
knee, then linear), plus any profiles found under profiles/.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import Results, bench_main, machine, sample_load  # noqa: E402

from planner.accept import load_acceptance  # noqa: E402
from planner.candidate import best_paths, sequoia_table, sequoia_tree  # noqa: E402
from planner.plan import plan  # noqa: E402
from planner.ppd import paper_trees, ppd_tree  # noqa: E402
from planner.profile import LatencyProfile, load_profile  # noqa: E402


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sequoia_python_baseline(rows, max_size, max_depth):
    """The same DP (one depth limit) with Python loops, as reference implementations write it."""
    M = max_size + 1
    K = len(rows[0])
    NEG = float("-inf")
    F = [[NEG] * (M + 1) for _ in range(max_depth + 1)]
    F[max_depth][1] = 1.0
    for d in range(max_depth - 1, -1, -1):
        G = [0.0] + [NEG] * M
        best = list(G)
        for k in range(1, K + 1):
            w = rows[d][k - 1]
            new = [NEG] * (M + 1)
            for j in range(1, M + 1):
                for t in range(1, j + 1):
                    if G[j - t] == NEG or F[d + 1][t] == NEG:
                        continue
                    v = G[j - t] + w * F[d + 1][t]
                    if v > new[j]:
                        new[j] = v
            G = new
            best = [max(a, b) for a, b in zip(best, G)]
        F[d][1:] = [1.0 + b for b in best[:-1]]
    return F[0][max_size + 1]


def medusa_enumeration_baseline(rows, size, depth):
    """All K + K^2 + ... + K^D paths, sorted: what the PPD authors' script does."""
    probs = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(rows.shape[1]), repeat=d):
            probs.append(np.prod(rows[np.arange(d), path]))
    probs.sort(reverse=True)
    return 1 + sum(probs[:size])


def synthetic_profile(knee: int, slope: float, top: int = 512, base: float = 0.02) -> LatencyProfile:
    """Flat until `knee` tokens, then `slope` times L(1) per extra token."""
    n = np.array([1, knee, top])
    lat = base * np.array([1.0, 1.0, 1.0 + slope * (top - knee)])
    return LatencyProfile(n, lat, {"file": f"synthetic(knee={knee},slope={slope})"})


def bench_speed(repeats, rng):
    rows_dep = np.stack([np.sort(rng.dirichlet(np.ones(33))[:32])[::-1] * (0.9 ** d) for d in range(10)])
    rows_pos = np.tile(rows_dep[:1], (10, 1))
    out = {}
    out["sequoia_table_128x10x32_depth_dependent_s"] = median_time(lambda: sequoia_table(rows_dep, 128, 10), repeats)
    out["sequoia_table_128x10x32_positional_s"] = median_time(lambda: sequoia_table(rows_pos, 128, 10), repeats)
    out["sequoia_tree_128x10x32_s"] = median_time(lambda: sequoia_tree(rows_dep, 128, 10), repeats)
    t0 = time.perf_counter()
    base = sequoia_python_baseline(rows_dep.tolist(), 128, 10)
    out["sequoia_python_loops_one_depth_limit_s"] = time.perf_counter() - t0
    assert abs(base - sequoia_table(rows_dep, 128, 10)[10, 128]) < 1e-9, "baseline disagrees"
    out["medusa_best_paths_128x10x32_s"] = median_time(lambda: best_paths(rows_dep, 128, 10), repeats)
    rows10 = rows_dep[:4, :10]
    out["medusa_best_paths_128_depth4_10ranks_s"] = median_time(lambda: best_paths(rows10, 128, 4), repeats)
    t0 = time.perf_counter()
    base = medusa_enumeration_baseline(rows10, 128, 4)
    out["medusa_enumerate_all_11110_paths_s"] = time.perf_counter() - t0
    assert abs(base - 1 - best_paths(rows10, 128, 4)[1].sum()) < 1e-9
    return out


def bench_ppd_speed(ppd, repeats):
    return {
        "ppd_paper_N120_P3_10ranks_s": median_time(lambda: paper_trees(ppd, 120, 3), repeats),
        "ppd_improved_N120_P3_10ranks_s": median_time(lambda: ppd_tree(ppd, 120, 3), repeats),
        "ppd_improved_N256_P3_10ranks_s": median_time(lambda: ppd_tree(ppd, 256, 3), repeats),
    }


def tau_vs_size(ppd, medusa_acc):
    sizes = [4, 8, 16, 24, 32, 48, 64, 96, 120, 160, 256]
    rows = []
    for N in sizes:
        row = {"input_length": N}
        for name, acc in (("ppd-vicuna-7b", ppd), ("medusa-vicuna-7b", medusa_acc)):
            D = acc.max_depth
            row[f"medusa[{name}]"] = plan("medusa", acc, size=N - 1, max_depth=D).expected_tokens_per_step
            row[f"sequoia[{name}]"] = plan("sequoia", acc, size=N - 1, max_depth=D).expected_tokens_per_step
        row["ppd_paper[ppd-vicuna-7b]"] = paper_trees(ppd, N, 3).tau
        tree = ppd_tree(ppd, N, 3)
        row["ppd_improved[ppd-vicuna-7b]"] = tree.expected_tokens_per_step
        row["ppd_states"] = [
            {"state": st.state, "input_length": st.input_length, "candidates": len(st.nodes),
             "prompt_tokens": sum(st.prompt_tokens), "tau": st.expected_tokens, "pi": st.stationary_probability}
            for st in tree.states
        ]
        rows.append(row)
    return rows


PLAIN = {"predicted_speedup": 1.0, "tau": 1.0, "input_lengths": [1], "size": 0, "pi": [1.0]}  # no tree pays


def hardware_aware(ppd, medusa_acc, profiles):
    """Each planner's automatic size under each latency profile; where the planner predicts plain decoding
    fastest (a profile whose forward grows steeply with its input), the cell is plain decoding."""
    from planner.errors import PlainIsFastest

    out = []
    for prof in profiles:
        row = {"profile": prof.source.get("file")}
        for label, kw in (("ppd_paper", dict(improved=False)),
                          ("ppd_improved_shared_budget", dict(per_state_budgets=False)),
                          ("ppd_improved_per_state", dict())):
            try:
                t = plan("ppd", ppd, profile=prof, max_input_length=min(256, prof.max_input_length), **kw)
            except PlainIsFastest:
                row[label] = PLAIN
                continue
            row[label] = {"predicted_speedup": t.predicted_speedup, "tau": t.expected_tokens_per_step,
                          "input_lengths": [st.input_length for st in t.states],
                          "pi": [round(st.stationary_probability, 4) for st in t.states]}
        for method in ("medusa", "sequoia"):
            try:
                t = plan(method, medusa_acc, profile=prof, max_size=255)
            except PlainIsFastest:
                row[f"{method}[medusa-vicuna-7b]"] = PLAIN
                continue
            row[f"{method}[medusa-vicuna-7b]"] = {"predicted_speedup": t.predicted_speedup,
                                                  "tau": t.expected_tokens_per_step, "size": len(t.states[0].nodes)}
        out.append(row)
    return out


def to_markdown(res) -> str:
    s, q = res["speed"], res["tau_vs_size"]
    lines = [
        "# Planner benchmark", "",
        f"Machine: {_machine_line(res['machine'])}. Medians over {res['repeats']} repeats.", "",
        "## Speed", "",
        "| what | seconds |", "|---|---|",
    ]
    lines += [f"| {k[:-2]} | {v:.4f} |" for k, v in s.items()]
    lines += [
        "", "Baselines run in the same process: the same Sequoia DP with Python loops (one depth limit only; "
        "the vectorised table computes all 10 limits), and medusa by enumerating and sorting every path.", "",
        "## tau (tokens per step, model) vs input length, published acceptance", "",
        "Input length = 1 + candidates (+ prompt tokens for ppd). medusa/sequoia on the PPD matrix are "
        "depth <= 3 trees without prompt tokens.", "",
    ]
    cols = [c for c in q[0] if c not in ("input_length", "ppd_states")]
    lines += ["| N | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in q:
        lines.append(f"| {r['input_length']} | " + " | ".join(f"{r[c]:.4f}" for c in cols) + " |")
    gains = [(r["input_length"], r["ppd_improved[ppd-vicuna-7b]"] / r["ppd_paper[ppd-vicuna-7b]"] - 1) for r in q]
    lines += ["", "PPD improved over paper (amortised tau, same input length): "
              + ", ".join(f"N={n}: {100 * g:+.2f}%" for n, g in gains), "",
              "## PPD dynamic trees (improved) per state", "",
              "| N | state: input length / candidates / prompt tokens / tau / pi |", "|---|---|"]
    for r in q:
        if r["input_length"] in (16, 32, 64, 120, 256):
            cells = "; ".join(f"s{x['state']}: {x['input_length']}/{x['candidates']}/{x['prompt_tokens']}/"
                              f"{x['tau']:.3f}/{x['pi']:.3f}" for x in r["ppd_states"])
            lines.append(f"| {r['input_length']} | {cells} |")
    lines += ["", "## Predicted speedup with a latency profile (automatic size)", "",
              "| profile | ppd paper | ppd improved, shared N | ppd improved, per-state budgets | medusa | sequoia |",
              "|---|---|---|---|---|---|"]
    for r in res["hardware_aware"]:
        cell = lambda x: f"{x['predicted_speedup']:.4f} (tau {x['tau']:.3f}, n {x.get('input_lengths', x.get('size'))})"  # noqa: E731
        lines.append(f"| {r['profile']} | {cell(r['ppd_paper'])} | {cell(r['ppd_improved_shared_budget'])} | "
                     f"{cell(r['ppd_improved_per_state'])} | {cell(r['medusa[medusa-vicuna-7b]'])} | "
                     f"{cell(r['sequoia[medusa-vicuna-7b]'])} |")
    return "\n".join(lines) + "\n"


def _machine_line(m) -> str:
    """Older results files say the machine in one string; bench/common.py's record is an object."""
    if isinstance(m, str):
        return m
    return f"{m['cpu']} ({m['cores']} cores, {', '.join(m['vector_extensions']) or 'no vector extensions known'}), " \
           f"python {m['python']}, numpy {m['numpy']}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(ROOT / ".." / "shared"), help="the shared folder (data/ inside)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return ap


def main(argv=None) -> int:
    return bench_main("bench_planner", parser(), run, argv)


def run(args) -> Results:
    data = Path(args.shared) / "data" / "published_acceptance.json"
    ppd = load_acceptance(f"{data}:ppd-vicuna-7b")
    med = load_acceptance(f"{data}:medusa-vicuna-7b")
    rng = np.random.default_rng(0)
    profiles = [synthetic_profile(32, 0.01), synthetic_profile(64, 0.005), synthetic_profile(16, 0.03)]
    profiles += [load_profile(str(p)) for p in sorted((ROOT / "profiles").glob("*.json"))]
    speed = bench_speed(args.repeats, rng)
    sample_load()
    speed |= bench_ppd_speed(ppd, args.repeats)
    sample_load()
    res = {
        "machine": machine() | {"numpy": np.__version__},
        "repeats": args.repeats,
        "speed": speed,
        "tau_vs_size": tau_vs_size(ppd, med),
        "hardware_aware": hardware_aware(ppd, med, profiles),
    }
    out = Path(args.out)
    md = to_markdown(res)
    return Results({out / "planner.json": res, out / "planner.md": md}, md)


if __name__ == "__main__":
    sys.exit(main())
