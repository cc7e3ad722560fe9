"""Profiler benchmark: cheap random-weight model build against transformers' own init, and the
wall time of `planner profile` with no arguments.

  python bench/bench_profiler.py [--preset qwen2-0.5b] [--repeats 3] [--threads 1] [--out bench/results]

Build: `decoder.engines.hf.load.load_model` (allocate with init skipped, fill uniform noise of the same
std) against the baseline `AutoModelForCausalLM.from_config` (the library's full random init),
same preset, dtype and device, in the same run; medians over repeats. The default run is timed
end to end as a user sees it (process start to exit). Writes profiler.json and profiler.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from planner.jsonio import atomic_write_bytes, atomic_write_json  # noqa: E402
from decoder.engines.hf.load import _load_config, load_model  # noqa: E402
from decoder.engines.models import PRESET_DIR  # noqa: E402


def build_cheap(preset: str) -> float:
    t0 = time.perf_counter()
    lm = load_model(preset, device="cpu", dtype="fp32")
    dt = time.perf_counter() - t0
    with torch.inference_mode():
        assert torch.isfinite(lm.model(torch.arange(8)[None]).logits).all()
    return dt


def build_stock(preset: str) -> float:
    from transformers import AutoModelForCausalLM

    config = _load_config(PRESET_DIR / f"{preset}.json")
    t0 = time.perf_counter()
    AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return time.perf_counter() - t0


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-0.5b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cheap, stock = [], []
    for _ in range(args.repeats):  # alternate so drift on the shared machine hits both alike
        cheap.append(build_cheap(args.preset))
        stock.append(build_stock(args.preset))
    params = sum(p.numel() for p in load_model(args.preset, device="meta").model.parameters())
    result = {
        "machine": {"cpu_count": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
        "build": {"preset": args.preset, "params": params, "dtype": "fp32", "device": "cpu", "repeats": args.repeats,
                  "cheap_s": [round(x, 3) for x in cheap], "stock_init_s": [round(x, 3) for x in stock],
                  "cheap_median_s": round(statistics.median(cheap), 3),
                  "stock_init_median_s": round(statistics.median(stock), 3),
                  "speedup": round(statistics.median(stock) / statistics.median(cheap), 2)},
        "default_run": default_run(),
    }
    out = Path(args.out)
    atomic_write_json(out / "profiler.json", result)
    b, d = result["build"], result["default_run"]
    md = (
        "# Profiler benchmark\n\n"
        f"Machine: {os.cpu_count()}-core CPU shared with other jobs (load {result['machine']['load_avg_1m']}), "
        f"torch {torch.__version__}, {args.threads} thread(s) for the build.\n\n"
        f"| build {b['preset']} ({b['params'] / 1e9:.2f} B params, fp32, CPU) | median of {b['repeats']} |\n|---|---|\n"
        f"| transformers init (baseline) | {b['stock_init_median_s']:.2f} s |\n"
        f"| profiler cheap fill | {b['cheap_median_s']:.2f} s |\n"
        f"| speedup | {b['speedup']:.1f}x |\n\n"
        f"`planner profile` with no arguments ({d['model']}, {d['threads']} threads): {d['wall_s']:.1f} s wall from "
        f"process start, {d['points']} lengths, {d['samples']} samples, L(1) = {d['L1_ms']} ms, "
        f"L(256) = {d['L256_ms']} ms (exit code {d['rc']}).\n"
    )
    atomic_write_bytes(out / "profiler.md", md.encode())
    print(md)


if __name__ == "__main__":
    main()
