"""Fit the simulator's constants once to the published points marked "fit", and print the error
of every point (python scripts/fit_simulated_gpus.py [--write]).

One joint least-squares fit of relative errors over the graphs points: t_layer_s shared by all
GPUs, eta_m per GPU that owns constants (a100-80gb for both A100s, h100-sxm), eta_c where a point
weighs FLOPs (the A100's; the H100 borrows it); t0_s is held at 0.1 ms (n = 1 points cannot tell a
fixed cost from a per-layer one). Eager: per_layer_s by least squares with floor_s held at 2 ms.
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
PRESETS = ROOT / "decoder" / "engines" / "presets"
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
    """{"eager": {...}, owner: {eta_m, eta_c, t0_s, t_layer_s}} from the "fit" points.

    One joint least-squares fit of relative errors: t_layer_s is shared by every GPU (the gaps
    between a graph's kernels, a property of the engine more than of the chip; the H100's 16- and
    32-layer points are what pins it), eta_m is per GPU that owns constants, eta_c per GPU with a
    point that weighs FLOPs, borrowed from ETA_C_FROM by the others.
    """
    points = points or load_points()
    gpus, eager = load_gpu_table()
    eager_pts = [p for p in points if p["role"] == "fit" and p["engine"] == "eager"]
    layers = np.array([point_architecture(p).layers for p in eager_pts], dtype=float)
    y = np.array([p["measured_ms"] / 1e3 - eager.floor_s for p in eager_pts])
    eager = Eager(eager.floor_s, float(layers @ y / (layers @ layers)))
    graph_pts = [p for p in points if p["role"] == "fit" and p["engine"] == "graphs"]
    owners = sorted({_owner(gpus, p["gpu"]) for p in graph_pts})
    flops_owners = sorted({_owner(gpus, p["gpu"]) for p in graph_pts if p["input_length"] * p["batch_size"] > 16})
    names = ["t_layer_s"] + [f"eta_m:{o}" for o in owners] + [f"eta_c:{o}" for o in flops_owners]

    def constants(x) -> dict:
        v = dict(zip(names, x))
        return {o: {"eta_m": v[f"eta_m:{o}"], "eta_c": v.get(f"eta_c:{o}", v.get(f"eta_c:{ETA_C_FROM}")),
                    "t0_s": T0_S, "t_layer_s": v["t_layer_s"]} for o in owners}

    def residuals(x):
        c = constants(x)
        table = {k: replace(g, **c[g.constants_from]) if g.constants_from in c else g for k, g in gpus.items()}
        return [predict_ms(p, table, eager) / p["measured_ms"] - 1 for p in graph_pts]

    bounds = [BOUNDS[n.split(":")[0]] for n in names]
    x0 = [3e-5] + [0.8] * (len(names) - 1)
    res = least_squares(residuals, x0, bounds=tuple(zip(*bounds)), x_scale=[1e-5] + [0.1] * (len(names) - 1),
                        xtol=1e-12, ftol=1e-12)
    out: dict = {"eager": {"floor_s": eager.floor_s, "per_layer_s": round(eager.per_layer_s, 7)}}
    for owner, c in constants(res.x).items():
        out[owner] = {k: round(float(c[k]), 4 if k.startswith("eta") else 7) for k in ("eta_m", "eta_c", "t0_s", "t_layer_s")}
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
