"""Where a served vLLM's time goes, server by server: the engine core's loop and the API server's output
work, from the timers bench/serving_probe/sitecustomize.py records inside the servers.

    TREE_PLANNER_PROBE=/tmp/probe PYTHONPATH=bench/serving_probe python bench/bench_serving.py ...
    python bench/serving_probe.py /tmp/probe --out bench/results/serving-probe

Per server, over its whole run (a race sends every level to one server): the engine core's loop turns
that ran a step, the time in steps (schedule, the worker's forward and sampling, update_from_output, the
output put, post_step), the time between steps (waiting for requests or taking them in), and the API
server's time in OutputProcessor (detokenizing, building responses) and in taking requests in; and, per
batch size B, the median decode-only step with exactly B requests and how many of those steps drafted
nothing (with the plugin, vLLM's plain path). Per contender the medians over its servers and each as a
ratio to vLLM plain's. Equal step times with unequal served tokens/s would put a served difference
outside the engine's steps; the reverse puts it in them. (A race moves from level to level without the
engine idling, so the loop cannot be cut into levels by its pauses; the batch size names the level.)
Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_dir(folder: Path) -> dict[int, dict]:
    """{process group: {"label": str, "engine": [loop rows], "api": [rows]}} from the probe's files."""
    servers: dict[int, dict] = defaultdict(lambda: {"label": None, "engine": [], "api": []})
    for path in sorted(folder.glob("*.jsonl")):
        lines = path.read_text().splitlines()
        if not lines:
            continue
        head = json.loads(lines[0])
        server = servers[head["pgid"]]
        server["label"] = server["label"] or label(head["leader"], head.get("plugin", ""))
        rows = [json.loads(line) for line in lines[1:] if line.strip()]
        server["engine" if head["role"] == "engine" else "api"].extend(rows)
    return dict(servers)


def label(leader: list[str], plugin: str) -> str:
    """The contender a server ran: vLLM plain, or its speculative config (and whether the plugin was on)."""
    if "--speculative-config" not in leader:
        return "vLLM plain"
    config = json.loads(leader[leader.index("--speculative-config") + 1])
    on = plugin.strip().lower() in ("1", "true", "yes", "on")
    return json.dumps(config, sort_keys=True, separators=(",", ":")) + (" +plugin" if on else "")


def server_stats(server: dict, batches: list[int]) -> dict:
    """One server's totals over its run (every level) and its decode-only steps by batch size."""
    loop, api = server["engine"], server["api"]
    ran = [r for r in loop if r[7]]
    out = {"steps": len(ran), "step_s": sum(r[3] for r in loop), "wait_s": sum(r[2] for r in loop[1:]),
           "update_s": sum(r[5] for r in loop), "post_s": sum(r[6] for r in loop),
           "api_out_s": sum(r[2] for r in api if r[0] == "out"), "api_in_s": sum(r[2] for r in api if r[0] == "in")}
    for b in batches:
        # one token per request plus its drafts: no prefill in the step
        decode = [r[3] for r in ran if r[7] == b and r[8] == r[7] + r[9]]
        out[f"decode_{b}_n"] = len(decode)
        out[f"decode_{b}_ms"] = 1000 * statistics.median(decode) if decode else None
        out[f"plain_{b}_n"] = sum(1 for r in ran if r[7] == b and r[8] == b)  # no request drafted: the plain path
    return out


def summarise(servers: dict[int, dict], batches: list[int]) -> dict:
    """{label: {metric: median over that contender's servers, "servers": n}}."""
    per: dict[str, list[dict]] = defaultdict(list)
    for server in servers.values():
        if server["engine"]:
            per[server["label"]].append(server_stats(server, batches))
    return {name: {k: _median([r[k] for r in rows]) for k in rows[0]} | {"servers": len(rows)}
            for name, rows in per.items()}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


TOTALS = [("steps", "steps", "{:.0f}"), ("step_s", "in steps s", "{:.1f}"), ("wait_s", "waiting / intake s", "{:.2f}"),
          ("update_s", "update_from_output s", "{:.2f}"), ("post_s", "post_step s", "{:.2f}"),
          ("api_out_s", "API output work s", "{:.2f}"), ("api_in_s", "API intake s", "{:.3f}")]


def _cell(value, base, fmt: str, ratio: bool) -> str:
    if value is None:
        return "-"
    return fmt.format(value) + (f" ({value / base:.2f})" if ratio and base else "")


def markdown(summary: dict, folder: Path, batches: list[int]) -> str:
    plain = summary.get("vLLM plain", {})
    names = sorted(summary, key=lambda n: (n != "vLLM plain", n))
    lines = [f"# Where served time goes, per contender (probe files: {folder})", "",
             "Medians over each contender's servers, each server's whole run (every level); (ratio to vLLM "
             "plain's median).", "",
             "| contender | servers | " + " | ".join(t for _, t, _ in TOTALS) + " |", "|---|---|" + "---|" * len(TOTALS)]
    for name in names:
        row = summary[name]
        cells = [_cell(row[k], plain.get(k), fmt, name != "vLLM plain") for k, _, fmt in TOTALS]
        lines.append(f"| {name} | {row['servers']} | " + " | ".join(cells) + " |")
    lines += ["", "Decode-only steps with exactly B requests: median ms (steps; of them without any draft: with the "
              "plugin, vLLM's plain path).", "", "| contender | " + " | ".join(f"B = {b}" for b in batches) + " |",
              "|---|" + "---|" * len(batches)]
    for name in names:
        row = summary[name]
        cells = [_cell(row[f"decode_{b}_ms"], plain.get(f"decode_{b}_ms"), "{:.1f}", name != "vLLM plain")
                 + f" ({row[f'decode_{b}_n']:.0f}; {row[f'plain_{b}_n']:.0f})" for b in batches]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="the TREE_PLANNER_PROBE folder the servers wrote")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="batch sizes whose decode steps are compared")
    p.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default: print the table)")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"{folder}: not a folder of probe files", file=sys.stderr)
        return 2
    servers = read_dir(folder)
    if not servers:
        print(f"{folder}: no probe files (*.jsonl); were the servers started with TREE_PLANNER_PROBE set?", file=sys.stderr)
        return 2
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        print(f"--batches {args.batches}: expected batch sizes, comma-separated", file=sys.stderr)
        return 2
    summary = summarise(servers, batches)
    text = markdown(summary, folder, batches)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"folder": str(folder), "batches": batches, "summary": summary}, indent=1) + "\n")
        Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
