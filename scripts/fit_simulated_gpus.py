"""Fit the simulator's constants once to the published points marked "fit", and print the error
of every point (python scripts/fit_simulated_gpus.py [--write]).

Per GPU that owns constants (a100-80gb for both A100s, h100-sxm): eta_m, t_layer_s and, where a
point weighs FLOPs, eta_c, by least squares on relative errors; t0_s is held at 0.1 ms (two n = 1
points cannot tell a fixed cost from a per-layer one). A GPU with no point that weighs FLOPs takes
eta_c from the A100 fit. Eager: per_layer_s by least squares with floor_s held at 2 ms.
--write stores the constants in planner/simulated_gpus.json; tests/test_simulate.py checks that
the stored constants are what this fit returns.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.simulate import GPUS_PATH, Eager, architecture_from_config, latency, load_gpu_table  # noqa: E402

POINTS_PATH = ROOT / "planner" / "published_latency.json"
PRESETS = ROOT / "profiler" / "presets"
T0_S = 1e-4
ETA_C_FROM = "a100-80gb"  # the GPU whose eta_c a GPU without a FLOP-weighing point borrows
BOUNDS = {"eta_m": (0.3, 1.0), "eta_c": (0.2, 1.0), "t_layer_s": (0.0, 2e-4)}


def load_points() -> list[dict]:
    return json.loads(POINTS_PATH.read_text())["points"]


def point_architecture(p: dict):
    config = p.get("config") or json.loads((PRESETS / f"{p['model']}.json").read_text())
    return architecture_from_config(config, p["model"], p["id"])


def predict_ms(p: dict, gpus, eager: Eager) -> float:
    return 1e3 * latency(point_architecture(p), gpus[p["gpu"]], "fp16", p["input_length"], p["batch_size"],
                         p["context_length"], p["engine"], eager)


def _owner(gpus, name: str) -> str:
    return gpus[name].constants_from


def fit(points: list[dict] | None = None) -> dict:
    """{"eager": {...}, owner: {eta_m, eta_c, t0_s, t_layer_s}} from the "fit" points."""
    points = points or load_points()
    gpus, eager = load_gpu_table()
    eager_pts = [p for p in points if p["role"] == "fit" and p["engine"] == "eager"]
    layers = np.array([point_architecture(p).layers for p in eager_pts], dtype=float)
    y = np.array([p["measured_ms"] / 1e3 - eager.floor_s for p in eager_pts])
    eager = Eager(eager.floor_s, float(layers @ y / (layers @ layers)))
    out: dict = {"eager": {"floor_s": eager.floor_s, "per_layer_s": eager.per_layer_s}}
    graph_pts = [p for p in points if p["role"] == "fit" and p["engine"] == "graphs"]
    owners = sorted({_owner(gpus, p["gpu"]) for p in graph_pts}, key=lambda o: o != ETA_C_FROM)
    for owner in owners:
        mine = [p for p in graph_pts if _owner(gpus, p["gpu"]) == owner]
        weighs_flops = any(p["input_length"] * p["batch_size"] > 16 for p in mine)
        names = ["eta_m", "t_layer_s"] + (["eta_c"] if weighs_flops else [])
        fixed = {"t0_s": T0_S, "eta_c": out[ETA_C_FROM]["eta_c"] if not weighs_flops else 0.8}

        def residuals(x, mine=mine, names=names, fixed=fixed):
            c = dict(fixed, **dict(zip(names, x)))
            table = {k: replace(g, **c) for k, g in gpus.items()}
            return [predict_ms(p, table, eager) / p["measured_ms"] - 1 for p in mine]

        x0 = [0.8, 3e-5] + ([0.8] if weighs_flops else [])
        lo, hi = zip(*(BOUNDS[n] for n in names))
        res = least_squares(residuals, x0, bounds=(lo, hi), x_scale=[0.1, 1e-5] + ([0.1] if weighs_flops else []),
                            xtol=1e-12, ftol=1e-12)
        c = dict(fixed, **dict(zip(names, (float(v) for v in res.x))))
        out[owner] = {k: round(c[k], 4 if k.startswith("eta") else 7) for k in ("eta_m", "eta_c", "t0_s", "t_layer_s")}
    out["eager"] = {k: round(v, 7) for k, v in out["eager"].items()}
    return out


def write(constants: dict, path: Path = GPUS_PATH) -> None:
    data = json.loads(path.read_text())
    data["eager"].update(constants["eager"])
    for owner, c in constants.items():
        if owner != "eager":
            data["gpus"][owner].update(c)
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="store the fitted constants in planner/simulated_gpus.json")
    args = ap.parse_args()
    constants = fit()
    print(json.dumps(constants, indent=1))
    if args.write:
        write(constants)
        print(f"wrote {GPUS_PATH}")
    gpus, eager = load_gpu_table()
    for p in load_points():
        pred = predict_ms(p, gpus, eager)
        print(f"{p['id']:<34} {p['role']:<14} measured {p['measured_ms']:7.2f} ms  simulated {pred:7.2f} ms  "
              f"error {100 * (pred / p['measured_ms'] - 1):+6.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
