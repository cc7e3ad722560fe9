"""llama-server with the flags a plan exports, against llama-server without them, over its HTTP API.

    bash scripts/build_llama_server.sh                  # once: the server of the same llama.cpp build
    python3 bench/bench_llama_server.py --plan runs/<autotune --engine llama.cpp run>/chosen.json
    python3 bench/bench_llama_server.py --plan PLAN --chat 2 --repeat 2 --tokens 32 --repeats 1   # quick

Two servers run side by side on 127.0.0.1 (ports --port and --port + 1), one with the plan's
`planner export --engine llama-server` flags and one without (the same model, threads, context, flash
attention off, one slot): both idle when not asked, so requests alternate between them in a shuffled
order per (repeat, prompt), after a warm-up request each. Prompts are bench/bench_llamacpp.py's (chat
first and second turns, repeat requests), sent as the chat template's token ids to POST /completion
(greedy: temperature 0, top-k 1, no prompt cache, raw tokens returned). Reports per server tokens/s
from the wall time of each request (prefill included) and from the server's own decode timing, the
per-prompt speedup, and whether every output equals the plain server's. Writes
bench/results/llama_server.{json,md} with the machine and its load; Ctrl-C writes what is measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import Results, bench_main, load_avg  # noqa: E402

from planner.errors import UserError  # noqa: E402

DEFAULT_SERVER = Path(os.environ.get("TREE_PLANNER_CACHE") or Path.home() / ".cache" / "tree-planner") / "llama-server" / "bin" / "llama-server"


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise UserError(f"llama-server exited ({proc.returncode}) at start; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return proc
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    proc.terminate()
    raise UserError(f"llama-server on port {port} not ready in 120 s; see {log}")


def complete(port: int, ids: list[int], n: int) -> tuple[list[int], float, dict]:
    body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0,
                       "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True, "stream": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return list(out.get("tokens") or []), time.perf_counter() - t0, out.get("timings") or {}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help="a llama.cpp plan (RUN/chosen.json)")
    p.add_argument("--server", default=str(DEFAULT_SERVER), help="the llama-server binary")
    p.add_argument("--chat", type=int, default=6)
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "llama_server"))
    return p


def main(argv=None) -> int:
    return bench_main("bench_llama_server", parser(), run, argv)


def _prompts(threads: int, n_chat: int, n_repeat: int) -> tuple[list, str]:
    """bench_llamacpp's prompts (chat turns answered by llama.cpp's own greedy generation) and the GGUF
    file, from a llama.cpp engine closed before the servers start (they get the cores)."""
    from bench_llamacpp import build_prompts

    from decoder.engines.registry import EngineRequest, open_engine

    engine = open_engine("llama.cpp", EngineRequest(model="smollm2-135m", threads=threads, context=4096))
    try:
        return build_prompts(engine, n_chat, n_repeat), engine.record()["model_file"]
    finally:
        engine.close()


def run(args) -> Results:
    from bench_llamacpp import machine

    from decoder.engines.llama_cpp.lib import check_threads
    from planner.export_llama import llama_server_export
    from planner.tree import load_tree

    if not Path(args.server).is_file():
        raise UserError(f"{args.server}: no llama-server binary (build it: bash scripts/build_llama_server.sh)")
    if not (1 <= args.tokens <= 2048 and 1 <= args.repeats <= 100 and 1024 <= args.port <= 65534):
        raise UserError("--tokens in 1..2048, --repeats in 1..100, --port in 1024..65534")
    threads = check_threads(args.threads)
    plan = load_tree(args.plan)
    prompts, gguf = _prompts(threads, args.chat, args.repeat)
    exported = llama_server_export(plan, gguf, threads, port=args.port + 1)
    plain_cmd = llama_server_export(load_tree(args.plan), gguf, threads, port=args.port).command
    plain_cmd = plain_cmd[: plain_cmd.index("--spec-type")] if "--spec-type" in plain_cmd else plain_cmd
    cmds = {"plain": [args.server] + plain_cmd[1:], "exported": [args.server] + exported.command[1:]}
    ports = {"plain": args.port, "exported": args.port + 1}
    load_before = load_avg()
    logs = Path(args.out).parent
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    seconds = {k: {} for k in cmds}
    decode_s = {k: {} for k in cmds}
    tokens = {k: {} for k in cmds}
    interrupted = False
    try:
        for k, cmd in cmds.items():
            procs[k] = start(cmd, ports[k], Path(f"/tmp/llama_server_{k}.log"))
        for k in cmds:  # warm-up
            complete(ports[k], prompts[0][2].tolist(), 8)
        rng = random.Random(0)
        for r in range(args.repeats):
            for pid, _, ids in prompts:
                order = list(cmds)
                rng.shuffle(order)
                for k in order:
                    toks, sec, timings = complete(ports[k], ids.tolist(), args.tokens)
                    seconds[k].setdefault(pid, []).append(sec)
                    decode_s[k].setdefault(pid, []).append(timings.get("predicted_ms", float("nan")) / 1e3)
                    tokens[k][pid] = toks
            print(f"repeat {r + 1}/{args.repeats} done (load {load_avg()})", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(timeout=30)
    # the load is judged once, over the whole run, when the results are written: only then are the
    # servers' CPU seconds this process's own (a finished child's), not another process's
    ids_done = [pid for pid, _, _ in prompts if all(pid in seconds[k] for k in cmds)]
    group = {pid: g for pid, g, _ in prompts}
    rows = {}
    for k in cmds:
        med = {p: statistics.median(seconds[k][p]) for p in ids_done}
        dec = {p: statistics.median(decode_s[k][p]) for p in ids_done}
        n = sum(len(tokens[k][p]) for p in ids_done)
        rows[k] = {"tokens": n, "tokens_per_s": n / sum(med.values()), "decode_tokens_per_s": n / sum(dec.values()),
                   "command_line": " ".join(cmds[k])}
    ratio = {p: statistics.median(seconds["plain"][p]) / statistics.median(seconds["exported"][p]) for p in ids_done}
    geo = lambda rs: math.exp(statistics.fmean(math.log(x) for x in rs)) if rs else None  # noqa: E731
    doc = {"plan": args.plan, "machine": machine(threads), "load_before": load_before,
           "load_after": load_avg(), "tokens": args.tokens, "repeats": args.repeats, "rows": rows,
           "export_notes": exported.notes, "speedup_geomean": geo(list(ratio.values())),
           "speedup_chat": geo([r for p, r in ratio.items() if group[p] == "chat"]),
           "speedup_repeat": geo([r for p, r in ratio.items() if group[p] == "repeat"]),
           "per_prompt": ratio, "identical": [p for p in ids_done if tokens["plain"][p] != tokens["exported"][p]] == [],
           "differs_on": [p for p in ids_done if tokens["plain"][p] != tokens["exported"][p]],
           "interrupted": interrupted, "command": "python3 bench/bench_llama_server.py " + " ".join(sys.argv[1:])}
    md = [f"# llama-server: exported flags against none ({len(ids_done)} prompts x {args.tokens} tokens, medians of "
          f"{args.repeats})", "", f"Machine: {doc['machine']['cpu']}, {threads} threads; load {load_before} before, "
          f"{doc['load_after']} after.", "", "| server | tokens/s (wall) | tokens/s (server decode) | command |",
          "|---|---|---|---|"]
    md += [f"| {k} | {r['tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | `{r['command_line']}` |" for k, r in rows.items()]
    md += ["", f"Speedup (wall, geometric mean over prompts): {doc['speedup_geomean']:.3f}x (chat "
           f"{doc['speedup_chat'] or float('nan'):.3f}x, repeat {doc['speedup_repeat'] or float('nan'):.3f}x); outputs "
           f"identical: {doc['identical']}."] + [f"- note: {n}" for n in exported.notes]
    text = "\n".join(md) + "\n"
    return Results({Path(args.out + ".json"): doc, Path(args.out + ".md"): text}, text, 130 if interrupted else 0)


if __name__ == "__main__":
    sys.exit(main())
