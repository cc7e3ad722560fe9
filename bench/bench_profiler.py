"""Profiler benchmark: cheap random-weight model build against transformers' own init, and the
wall time of `planner profile` with no arguments.

  python bench/bench_profiler.py [--preset qwen2-0.5b] [--repeats 3] [--threads 1] [--out bench/results]

Build: opening the hf engine on the preset (its loader, decoder/engines/hf/load.py: allocate with init
skipped, fill uniform noise of the same std) against the baseline `AutoModelForCausalLM.from_config`
(the library's full random init), same preset, dtype and device, in the same run; medians over repeats. The default run is timed
end to end as a user sees it (process start to exit). Writes profiler.json and profiler.md.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from common import Results, bench_main, load_avg, machine, open_hf, sample_load  # noqa: E402

from decoder.engines.models import PRESET_DIR  # noqa: E402


def build_cheap(preset: str) -> float:
    """Seconds to open the hf engine on a preset: its loader allocates with init skipped and fills noise."""
    t0 = time.perf_counter()
    engine = open_hf(preset, "fp32")
    dt = time.perf_counter() - t0
    assert torch.isfinite(engine.teacher_forced(torch.arange(8)).logits).all()
    return dt


def build_stock(preset: str) -> float:
    """The baseline: transformers' own full random init of the same config (the hf engine's stock
    machinery, decoder/engines/hf/stock.py)."""
    from decoder.engines.hf.stock import stock_init_seconds

    return stock_init_seconds(PRESET_DIR / f"{preset}.json")


def default_run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.json"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "planner", "profile", "--no-progress", "-o", str(out)],
                              cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        import json

        prof = json.loads(out.read_text()) if proc.returncode == 0 else {}
    return {"rc": proc.returncode, "wall_s": round(wall, 2), "model": prof.get("model"), "threads": prof.get("threads"),
            "points": len(prof.get("input_lengths", [])), "samples": sum(prof.get("repeats", [])),
            "L1_ms": round(prof["latency_s"][0] * 1e3, 3) if prof else None,
            "L256_ms": round(prof["latency_s"][-1] * 1e3, 3) if prof else None,
            "load_avg_1m": prof.get("settings", {}).get("load_avg_1m")}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-0.5b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return ap


def main(argv=None) -> int:
    return bench_main("bench_profiler", parser(), run, argv)


def run(args) -> Results:
    torch.set_num_threads(args.threads)
    # shapes only (no memory): the parameter count, and every module the builds import, imported untimed
    params = sum(p.numel() for p in open_hf(args.preset, device="meta").torch_model().parameters())
    cheap, stock = [], []
    for _ in range(args.repeats):  # alternate so drift on the shared machine hits both alike
        cheap.append(build_cheap(args.preset))
        stock.append(build_stock(args.preset))
        sample_load()
    result = {
        "machine": machine() | {"threads": args.threads, "load_avg_1m": load_avg()},
        "build": {"preset": args.preset, "params": params, "dtype": "fp32", "device": "cpu", "repeats": args.repeats,
                  "cheap_s": [round(x, 3) for x in cheap], "stock_init_s": [round(x, 3) for x in stock],
                  "cheap_median_s": round(statistics.median(cheap), 3),
                  "stock_init_median_s": round(statistics.median(stock), 3),
                  "speedup": round(statistics.median(stock) / statistics.median(cheap), 2)},
        "default_run": default_run(),
    }
    out = Path(args.out)
    b, d, m = result["build"], result["default_run"], result["machine"]
    md = (
        "# Profiler benchmark\n\n"
        f"Machine: {m['cores']}-core CPU ({m['cpu']}) shared with other jobs (load {m['load_avg_1m']}), "
        f"torch {torch.__version__}, {args.threads} thread(s) for the build.\n\n"
        f"| build {b['preset']} ({b['params'] / 1e9:.2f} B params, fp32, CPU) | median of {b['repeats']} |\n|---|---|\n"
        f"| transformers init (baseline) | {b['stock_init_median_s']:.2f} s |\n"
        f"| profiler cheap fill | {b['cheap_median_s']:.2f} s |\n"
        f"| speedup | {b['speedup']:.1f}x |\n\n"
        f"`planner profile` with no arguments ({d['model']}, {d['threads']} threads): {d['wall_s']:.1f} s wall from "
        f"process start, {d['points']} lengths, {d['samples']} samples, L(1) = {d['L1_ms']} ms, "
        f"L(256) = {d['L256_ms']} ms (exit code {d['rc']}).\n"
    )
    return Results({out / "profiler.json": result, out / "profiler.md": md}, md)


if __name__ == "__main__":
    sys.exit(main())
