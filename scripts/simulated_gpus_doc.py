"""Generate the tables of docs/simulated-gpus.md from the code (no number is typed by hand):

1. validation: every published point of planner/published_latency.json against the simulator;
2. hardware awareness: the plan the planner picks for the same acceptance statistics on this CPU
   (measured profiles) and on simulated GPUs (predicted), per batch size;
3. the vLLM / SGLang / TensorRT-LLM exports of the simulated-H100 plan (files in exports/sim-h100-vicuna-7b/).

    python scripts/simulated_gpus_doc.py            # rewrites the marked blocks of docs/simulated-gpus.md

Also writes bench/results/simulated_gpus.json (every row, machine-readable). Takes about a minute:
the planner runs for 6 acceptance sets x 5 platforms x 4 batch sizes.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.accept import load_acceptance  # noqa: E402
from planner.batch import chain_acceptance, plan_schedule  # noqa: E402
from planner.cost import Guessing, default_guessing  # noqa: E402
from planner.errors import PlainIsFastest, UserError  # noqa: E402
from planner.jsonio import atomic_write_bytes, atomic_write_json  # noqa: E402
from planner.profile import load_batch_profiles, profile_from_json  # noqa: E402
from planner.simulate import architecture_from_config, get_gpu, latency, load_gpu_table, simulate_profile  # noqa: E402

DOC = ROOT / "docs" / "simulated-gpus.md"
RESULTS = ROOT / "bench" / "results" / "simulated_gpus.json"
EXPORT_DIR = ROOT / "exports" / "sim-h100-vicuna-7b"
PRESETS = ROOT / "decoder" / "engines" / "presets"
PUBLISHED_ACCEPT = ROOT.parent / "shared" / "data" / "published_acceptance.json"
HELDOUT = ROOT / "reports" / "accept-smollm2-135m-heldout"
CPU_PROFILES = {1: ROOT / "reports" / "autotune-cpu-smollm2-135m" / "profile.json",
                4: ROOT / "bench" / "results" / "batch-profile-packed.json"}
BATCH_SIZES = (1, 4, 16, 64)
CONTEXT = 256
PLATFORMS = (  # (key, label, gpu, engine); the CPU is measured, the rest simulated
    ("cpu", "this CPU (measured)", None, None),
    ("a100-40gb-eager", "A100-40GB, HF eager (simulated: PPD's testbed)", "a100-40gb", "eager"),
    ("a100-80gb", "A100-80GB, graphs engine (simulated)", "a100-80gb", "graphs"),
    ("h100-sxm", "H100 SXM, graphs engine (simulated)", "h100-sxm", "graphs"),
    ("rtx-4090", "RTX 4090, graphs engine (simulated)", "rtx-4090", "graphs"),
)
# acceptance set -> (file spec, model, methods tried, guesser kind)
SETS = {
    "SmolLM2-135M, PPD prompt tokens": (str(HELDOUT / "accept-ppd.json"), "smollm2-135m", ("ppd", "medusa", "sequoia"), "ppd"),
    "SmolLM2-135M, draft LM (2 layers)": (str(HELDOUT / "accept-draft.json"), "smollm2-135m", ("medusa", "sequoia"), "draft"),
    "SmolLM2-135M, ParallelSpec drafter": (str(HELDOUT / "accept-parallelspec.json"), "smollm2-135m", ("medusa",), "parallelspec"),
    "SmolLM2-135M, drafter as a chain": (str(HELDOUT / "accept-chain.json"), "smollm2-135m", ("chain",), "chain"),
    "SmolLM2-135M, prompt lookup": (str(HELDOUT / "accept-lookup.json"), "smollm2-135m", ("chain",), "lookup"),
    "Vicuna-7B, published PPD matrix": (f"{PUBLISHED_ACCEPT}:ppd-vicuna-7b", "vicuna-7b", ("ppd", "medusa", "sequoia"), "ppd"),
}
DRAFTER_LAYERS = {"draft": 2, "parallelspec": 1, "chain": 1}  # models/smollm2-135m/{draft_lm,parallelspec}
DRAFTER_TOKENS = {"draft": 1, "parallelspec": 5, "chain": 1}  # tokens per drafter pass (ParallelSpec: root + 4 masks)
PLAN_KW = dict(max_size=64, time_budget_s=3.0)


def config(name: str) -> dict:
    return json.loads((PRESETS / f"{name}.json").read_text())


# ---------------------------------------------------------------------------------------------
# 1. validation


def validation_rows() -> list[dict]:
    spec = __import__("importlib.util").util.spec_from_file_location("fit", ROOT / "scripts" / "fit_simulated_gpus.py")
    fit = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    gpus, eager = load_gpu_table()
    rows = []
    for p in fit.load_points():
        pred = fit.predict_ms(p, gpus, eager)
        rows.append(dict(p, simulated_ms=round(pred, 3), error=pred / p["measured_ms"] - 1))
    return rows


def validation_table(rows: list[dict]) -> str:
    lines = ["| point | GPU | model | engine | n x b, context | published (ms) | simulated (ms) | error | used for |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        used = "fit" if r["role"] == "fit" else ("out of sample" if r["target"] else "out of sample, not a target")
        lines.append(f"| `{r['id']}` | {r['gpu']} | {r['model']} | {r['engine']} | {r['input_length']} x "
                     f"{r['batch_size']}, {r['context_length']} | {r['measured_ms']:g} | {r['simulated_ms']:.2f} | "
                     f"{100 * r['error']:+.1f} % | {used} |")
    lines.append("")
    for engine, aim in (("graphs", 15), ("eager", 25)):
        for role in ("fit", "out-of-sample"):
            sel = [r for r in rows if r["engine"] == engine and r["role"] == role and r["target"]]
            if sel:
                worst = max(sel, key=lambda r: abs(r["error"]))
                lines.append(f"- {engine}, {role.replace('-', ' ')}: {len(sel)} points, largest error "
                             f"{100 * worst['error']:+.1f} % (`{worst['id']}`; aim {aim} %)")
    off = [r for r in rows if not r["target"]]
    for r in off:
        lines.append(f"- not a target: `{r['id']}` {100 * r['error']:+.1f} %: {r.get('note', '')}")
    lines.append("")
    lines.append("Sources, one per point (planner/published_latency.json):")
    lines.append("")
    for src in dict.fromkeys(r["source"] for r in rows):
        ids = ", ".join(f"`{r['id']}`" for r in rows if r["source"] == src)
        lines.append(f"- {ids}: {src}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 2. hardware awareness


def platform_profiles(key: str, gpu_name: str | None, engine: str | None, model: str) -> dict:
    """batch size -> LatencyProfile (the CPU: measured files; a GPU: simulated in memory)."""
    if gpu_name is None:
        if model != "smollm2-135m":
            return {}
        out = {}
        for b, path in CPU_PROFILES.items():
            out[b] = load_batch_profiles(str(path))[b]
        return out
    arch = architecture_from_config(config(model), model)
    dtype = "fp16" if model == "vicuna-7b" else "bf16"
    out = {}
    for b in BATCH_SIZES:
        try:
            data = simulate_profile(arch, get_gpu(gpu_name), dtype, engine, list(range(1, 257)), CONTEXT, [b])
        except UserError as e:
            if "allows" not in str(e):
                raise
            out[b] = None  # weights + KV cache do not fit in the GPU's memory
            continue
        label = f"(simulated {key}, {model})"
        out[b] = profile_from_json(dict(data["series"][0], simulated=data["simulated"]), label=label)
    return out


def guessing_for(kind: str, accept, gpu_name: str | None, engine: str | None, batch: int) -> Guessing:
    """The acceptance file's guesser; on a simulated GPU, the drafter's pass simulated there too
    (the same SmolLM2 layers, the target's LM head) instead of the pass time measured on this CPU."""
    g = default_guessing("medusa", accept)
    if gpu_name is None or kind not in DRAFTER_LAYERS:
        return g
    cfg = dict(config("smollm2-135m"), num_hidden_layers=DRAFTER_LAYERS[kind])
    drafter = architecture_from_config(cfg, f"smollm2-135m {kind} drafter")
    draft_s = latency(drafter, get_gpu(gpu_name), "bf16", DRAFTER_TOKENS[kind], batch, CONTEXT, engine)
    return replace(g, draft_s=float(draft_s))


def best_at(methods, accept, profiles, batch: int, guessing: Guessing) -> dict:
    """The best of `methods` at this batch size by predicted speedup (plain decoding when none wins)."""
    best = {"method": "plain", "candidates": 0, "input_length": 1, "tokens_per_step": 1.0, "speedup": 1.0}
    for method in methods:
        acc, g, m = (chain_acceptance(accept), replace(guessing, prompt_tokens=False), "medusa") if method == "chain" \
            else (accept, guessing, method)
        kw = dict(PLAN_KW, max_depth=acc.max_depth or 8) if method == "chain" else dict(PLAN_KW)
        if method == "chain":
            kw["max_size"] = kw["max_depth"]
        try:
            entry = plan_schedule(m, acc, {batch: profiles[batch]}, [batch], g, "packed", **kw)[0]
        except PlainIsFastest:
            continue
        point = entry.points[0]
        if entry.tree is not None and point["speedup"] > best["speedup"]:
            t = entry.tree
            best = {"method": method, "candidates": max(len(st.nodes) for st in t.states), "depth": t.depth,
                    "input_length": t.max_input_length, "tokens_per_step": point["tokens_per_step"],
                    "speedup": point["speedup"]}
    return best


def awareness_rows(progress=print) -> list[dict]:
    rows = []
    for set_name, (spec, model, methods, kind) in SETS.items():
        accept = load_acceptance(spec)
        for key, label, gpu_name, engine in PLATFORMS:
            t0 = time.time()
            profiles = platform_profiles(key, gpu_name, engine, model)
            for b in BATCH_SIZES:
                row = {"acceptance": set_name, "platform": key, "platform_label": label, "model": model,
                       "batch_size": b, "kind": "measured" if gpu_name is None else "predicted (simulated)"}
                if b not in profiles:
                    rows.append(dict(row, method=None))
                    continue
                if profiles[b] is None:
                    rows.append(dict(row, method="does not fit"))
                    continue
                row.update(best_at(methods, accept, profiles, b, guessing_for(kind, accept, gpu_name, engine, b)))
                row["L1_ms"] = 1e3 * profiles[b].latency(1)
                rows.append(row)
            progress(f"  {set_name} on {key}: {time.time() - t0:.1f} s")
    return rows


def _cell(r: dict) -> str:
    if r.get("method") is None:
        return "not measured"
    if r["method"] == "does not fit":
        return "does not fit in memory"
    if r["method"] == "plain":
        return "plain (no speculation)"
    return (f"{r['method']} {r['candidates']} cand., n={r['input_length']}: "
            f"{r['tokens_per_step']:.2f} tok/step, **{r['speedup']:.2f}x**")


def awareness_table(rows: list[dict]) -> str:
    out = []
    for set_name in SETS:
        out += [f"**{set_name}** (model {rows[[r['acceptance'] for r in rows].index(set_name)]['model']})", "",
                "| platform | " + " | ".join(f"batch {b}" for b in BATCH_SIZES) + " |",
                "|---|" + "---|" * len(BATCH_SIZES)]
        for key, label, _, _ in PLATFORMS:
            cells = [next(r for r in rows if r["acceptance"] == set_name and r["platform"] == key and r["batch_size"] == b)
                     for b in BATCH_SIZES]
            if all(c.get("method") is None for c in cells):
                continue
            l1 = next((c["L1_ms"] for c in cells if c.get("L1_ms")), None)
            out.append(f"| {label}, L(1) = {l1:.2f} ms | " + " | ".join(_cell(c) for c in cells) + " |")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# 3. exports of the H100 plan


def h100_exports(progress=print) -> str:
    from workflows.cli.main import main

    EXPORT_DIR.mkdir(parents=True, exist_ok=True)
    prof = EXPORT_DIR / "profile-h100-sxm-vicuna-7b.json"
    plan = EXPORT_DIR / "plan-ppd.json"
    sizes = ",".join(map(str, BATCH_SIZES))
    rel = lambda p: str(Path(p).relative_to(ROOT))  # noqa: E731
    accept = "../shared/data/published_acceptance.json:ppd-vicuna-7b"
    commands = [
        ["profile", "--simulate", "h100-sxm", "--model", "vicuna-7b", "--dtype", "fp16", "--batch-sizes", sizes,
         "-o", rel(prof)],
        ["plan", "ppd", "--accept", accept, "--profile", rel(prof), "--batch-sizes", sizes, "-o", rel(plan), "-q"],
    ]
    engines = {"vllm": "vllm.json", "sglang": "sglang.json", "trtllm": "trtllm.yaml"}
    for engine, name in engines.items():
        commands.append(["export", "--engine", engine, rel(plan), "--method", "eagle", "--draft-model",
                         "yuhuili/EAGLE-Vicuna-7B-v1.3", "-o", rel(EXPORT_DIR / name), "-q"])
    lines = ["```bash"]
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for argv in commands:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main(argv)
            if code != 0:
                raise SystemExit(f"planner {' '.join(argv)} failed: {err.getvalue()}")
            lines.append("planner " + " ".join(argv))
            progress("  planner " + " ".join(argv))
    finally:
        os.chdir(cwd)
    lines.append("```")
    lines.append("")
    for engine, name in engines.items():
        path = EXPORT_DIR / name
        if engine == "trtllm":
            body = path.read_text()
            lines += [f"`{rel(path)}`:", "", "```yaml", body.rstrip(), "```", ""]
        else:
            data = json.loads(path.read_text())
            keep = {k: data[k] for k in ("speculative_config", "server_args", "adaptive_config") if k in data}
            lines += [f"`{rel(path)}` (settings and notes; the basis is in the file):", "", "```json",
                      json.dumps(dict(keep, command_line=data["command_line"], notes=data["notes"]), indent=1), "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{DOC}: no '<!-- BEGIN {name} -->' block")
    return pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text)


def main() -> int:
    t0 = time.time()
    val = validation_rows()
    print("validation: done")
    aware = awareness_rows()
    exports = h100_exports()
    text = DOC.read_text()
    text = replace_block(text, "validation", validation_table(val))
    text = replace_block(text, "awareness", awareness_table(aware))
    text = replace_block(text, "exports", exports)
    atomic_write_bytes(DOC, text.encode())
    atomic_write_json(RESULTS, {"validation": val, "awareness": aware, "batch_sizes": list(BATCH_SIZES),
                                "context_length": CONTEXT, "wall_s": round(time.time() - t0, 1),
                                "generated_by": "scripts/simulated_gpus_doc.py"})
    print(f"wrote {DOC} and {RESULTS} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
