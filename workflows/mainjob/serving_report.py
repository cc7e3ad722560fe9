"""The serving main job's report, its prediction checks and its exports (workflows/mainjob/serving.py
writes them): what each contender measured against vLLM plain per level, how far each prediction was off
and why, and the decision in each engine's own settings.

    from workflows.mainjob.serving_report import report, prediction_error, prediction_parts, exports
    text = report(summary, contenders)   # report.md
"""
from __future__ import annotations

import json
from pathlib import Path

from planner.errors import UserError
from planner.jsonio import atomic_write_json
from planner.serving import MAX_CONCURRENCY, PLUGIN_ENV
from workflows.mainjob.serving_race import PLAIN, Contender, beats_plain, by_level


def prediction_error(contenders: list[Contender], levels_out: list[dict]) -> dict:
    """Per planned contender and level: predicted / measured output tokens/s - 1."""
    out = {}
    for c in contenders:
        for lv in levels_out:
            row = lv["contenders"].get(c.name)
            if c.predicted and row and not row.get("plain_path") and row["output_tokens_per_s"] > 0:
                out.setdefault(c.name, {})[lv["level"]] = c.predicted[lv["level"]] / row["output_tokens_per_s"] - 1
    return out


def prediction_parts(contenders: list[Contender], levels_out: list[dict]) -> dict:
    """Per planned contender and level, what a prediction rested on beside what the race measured: tokens a
    request gained per decoding step (the acceptance) and the served step (the cost), so a miss shows which
    of the two it came from."""
    out = {}
    for c in contenders:
        for lv in levels_out:
            row, priced = lv["contenders"].get(c.name), c.priced.get(lv["level"])
            if not (row and priced and row.get("requests")):
                continue
            decoded = row["output_tokens"] - row["requests"]  # each request's first token comes with its prefill
            # counted as the acceptance records count steps (profiler/vllm_accept.py decode_steps): decoded -
            # accepted alone undercounts where a last step's accepted drafts ran past max_tokens (vLLM counts,
            # then cuts them)
            steps = row["steps"]
            out.setdefault(c.name, {})[lv["level"]] = {
                "tokens_per_step": [priced["tokens_per_step"], decoded / steps if steps > 0 else None],
                "step_s": [priced["step_s"], row.get("step_p50_s")]}
    return out


def report(summary: dict, contenders: list[Contender]) -> str:
    levels = summary["concurrency"]
    lines = [f"# Serving autotune: {summary['model']} on {summary['engine']}", "",
             f"Decision: **{summary['decision']['winner']}**"
             + (f", draft length by level {summary['decision'].get('draft_length_by_level')}"
                if summary['decision'].get('draft_length_by_level') else "")
             + (" (with the plugin: K = 0 is vLLM's plain path)" if summary['decision'].get('plugin') else ""), ""]
    measured = summary["decision"].get("vs_plain_by_level") or {}
    if measured:
        lines += [f"The decision as written, measured against plain (row {summary['decision']['measured_as']!r}): "
                  + ", ".join(f"{lv}: {v:.2f}x" if v is not None else f"{lv}: -"
                              for lv, v in by_level(measured)), ""]
    if summary["decision"].get("confirm"):
        lines += [f"Confirmation: {summary['decision']['confirm']}", ""]
    lines += ["Output tokens/s (x vLLM plain at the same level; * = ahead of plain beyond the noise, paired per request; "
              "the level's winner in bold)", "",
              "| contender | " + " | ".join(str(c) for c in levels) + " |", "|---" * (len(levels) + 1) + "|"]
    at_level = {lv["level"]: lv for lv in summary["levels"]}
    for c in contenders:
        cells = []
        for lv in levels:
            row = at_level.get(lv, {}).get("contenders", {}).get(c.name)
            if row is None:
                cells.append("-")
                continue
            if row.get("plain_path"):
                cells.append("plain path")
                continue
            cell = f"{row['output_tokens_per_s']:.1f} ({row['vs_plain']:.2f}x)" + ("*" if beats_plain(row) else "")
            cells.append(f"**{cell}**" if at_level[lv]["winner"] == c.name != PLAIN else cell)
        lines.append(f"| {c.name} | " + " | ".join(cells) + " |")
    drift = {lv: at_level[lv]["contenders"].get(PLAIN, {}).get("drift") for lv in levels if lv in at_level}
    if any(d is not None for d in drift.values()):
        lines += ["", "vLLM plain ran on a server before the contenders and on another after them; each ratio is to "
                  "the median of the two. Plain's drift over the race (the second server's tokens/s over the "
                  "first's): " + ", ".join(f"{lv}: {d:.2f}" if d is not None else f"{lv}: -"
                                           for lv, d in drift.items())]
    sizes = (summary.get("race_requests") or {}).get("by_level") or {}
    full = (summary.get("race_requests") or {}).get("requests")
    cut = [(lv, n) for lv, n in by_level(sizes) if n < full]
    if cut:
        lines += ["", f"Cut to fit the budget: every contender raced the first {', '.join(f'{n} at {lv}' for lv, n in cut)}"
                  f" of the {full} requests (the levels where a request takes longest)"]
    if any(row.get("plain_path") for lv in summary["levels"] for row in lv["contenders"].values()):
        lines += ["", "plain path: not raced there, its K = 0 with the plugin is vLLM's plain path (decided as plain)"]
    unresolved = summary.get("unresolved") or {}
    if unresolved:
        lines += ["", "Unresolved after every pass the budget held (the paired interval, widened by the spread between "
                  "servers, still holds 1; with the plugin such a level runs plain): "
                  + "; ".join(f"{n} at {', '.join(map(str, lvs))}" for n, lvs in unresolved.items())]
    skipped = summary.get("skipped") or {}
    if skipped:
        lines += ["", "Not raced:", ""] + [f"- {name}: {why}" for name, why in skipped.items()]
    return "\n".join(lines + _details(summary, contenders, at_level)) + "\n"


def _details(summary: dict, contenders: list[Contender], at_level: dict) -> list[str]:
    """The report after the race table: time per token, the predictions' errors and parts, time, the split."""
    levels = summary["concurrency"]
    lines = ["", "Time per output token p50 / p99 (ms)", "", "| contender | " + " | ".join(map(str, levels)) + " |",
             "|---" * (len(levels) + 1) + "|"]
    for c in contenders:
        cells = []
        for lv in levels:
            row = at_level.get(lv, {}).get("contenders", {}).get(c.name)
            ok = row and row["tpot_p50_s"] is not None and row["tpot_p99_s"] is not None
            cells.append(f"{row['tpot_p50_s'] * 1e3:.0f} / {row['tpot_p99_s'] * 1e3:.0f}" if ok else "-")
        lines.append(f"| {c.name} | " + " | ".join(cells) + " |")
    err = summary.get("prediction_error") or {}
    if err:
        lines += ["", "Predicted / measured output tokens/s - 1:", ""]
        lines += [f"- {name}: " + ", ".join(f"{lv}: {e:+.0%}" for lv, e in by_level(v))
                  for name, v in err.items()]
    parts = summary.get("prediction_parts") or {}
    if parts:
        lines += ["", "What each prediction rested on, predicted / raced: tokens per decoding step (acceptance) and "
                  "the served step in ms (cost; the median gap between a request's chunks):", ""]
        for name, v in parts.items():
            cells = []
            for lv, p in by_level(v):
                (tp, tm), (sp, sm) = p["tokens_per_step"], p["step_s"]
                cells.append(f"{lv}: {tp:.2f} / " + (f"{tm:.2f}" if tm else "-") + f", {sp * 1e3:.0f} / "
                             + (f"{sm * 1e3:.0f}" if sm else "-"))
            lines.append(f"- {name}: " + "; ".join(cells))
    budget = summary.get("budget") or {}
    if budget:
        lines += ["", f"Time: {budget['used_minutes']:.1f} min of a {budget['minutes']:g}-minute budget; per contender "
                  "(server starts and every level): " + ", ".join(f"{n} {v:.0f} s" for n, v in
                                                                   budget["seconds_by_contender"].items())]
    served = summary.get("served") or {}
    overhead = summary.get("server_overhead_s") or {}
    if served:
        lines += ["", "vLLM plain's pass, split (ms): the served step / each request's time outside its decoding "
                  "steps (prefill, first token, ramp and tail; speculation does not shorten it): "
                  + ", ".join(f"{lv}: {v['decode_step_s'] * 1e3:.0f} / {v['request_s'] * 1e3:.0f}"
                              for lv, v in by_level(served))]
    elif overhead:
        lines += ["", "The server's own cost per step beyond the profiled forward, from vLLM plain's pass (ms; "
                  "added to every priced step): " + ", ".join(f"{lv}: {v * 1e3:.0f}" for lv, v in
                                                            by_level(overhead))]
    return lines


def exports(chosen: Contender | None, out: Path, models: dict[str, str]) -> None:
    """The decision for each engine that takes a per-batch-size schedule: vLLM's config as it was raced (and
    the plugin's switch where its K = 0 ranges need it); TensorRT-LLM's draft_len_schedule (max_concurrency
    where the last range is off) and SGLang's flags from the same ranges where they express them."""
    from planner.export import DraftRange

    d = out / "exports"
    d.mkdir(exist_ok=True)
    if chosen is None:
        atomic_write_json(d / "vllm.json", {"speculative_config": None, "notes": ["plain decoding: no speculation"]})
        return
    cfg = chosen.speculative
    doc = {"speculative_config": cfg, "command_line": "--speculative-config " + json.dumps(cfg, separators=(",", ":"))}
    if chosen.plugin:
        doc.update({"env": {PLUGIN_ENV: "1"}, "notes": [
            f"serve with {PLUGIN_ENV}=1 and the project's vLLM plugin installed (bash scripts/setup_vllm.sh): a "
            "batch size scheduled at K = 0 then runs vLLM's plain path; without it vLLM keeps its speculative path "
            "there (0.81-1.07x plain measured), and suffix or medusa with a schedule stop at the first batch size "
            "whose K differs"]})
    atomic_write_json(d / "vllm.json", doc)
    ranges = cfg.get("num_speculative_tokens_per_batch_size") or [[1, MAX_CONCURRENCY, cfg.get("num_speculative_tokens")]]
    notes = []
    for engine in ("trtllm", "sglang"):  # planner/export.py's builders: each engine's own constraints and notes
        try:
            export = _export_for(engine, cfg["method"], [DraftRange(*r) for r in ranges], models.get(cfg["method"]), d)
        except UserError as e:
            notes.append(f"{engine}: {e}")
            continue
        atomic_write_json(d / f"{engine}.json", export.to_json())
    atomic_write_json(d / "notes.json", {"notes": notes})


def _export_for(engine: str, method: str, ranges: list, folder: str | None, d: Path):
    """The same ranges as another engine's settings (a chain plan as deep as the longest draft)."""
    from planner.export import ENGINE_METHODS, ExportOptions, build
    from planner.tree import Tree, TreeState

    if method not in ENGINE_METHODS[engine]:
        raise UserError(f"no {method} proposer (it has {', '.join(ENGINE_METHODS[engine])})")
    depth = max(r.k for r in ranges) or 1
    chain = Tree("medusa", [TreeState(0, [(0,) * i for i in range(1, depth + 1)], 1.0, depth + 1)], 1.0)
    opts = ExportOptions(engine, method, folder,
                         adaptive_config_path=str(d / f"{engine}.adaptive.json"))
    return build(chain, ranges, opts, {"source": "planner autotune --engine vllm, the raced schedule"}, [])
