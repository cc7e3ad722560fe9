"""vLLM's OpenAI server under concurrent load: vLLM plain against its own speculation and planned
configs, at several concurrency levels, on requests no tuning step reads.

    python bench/bench_serving.py                                   # levels 1,2,4,8,16, greedy
    python bench/bench_serving.py --concurrency 1,4,16 --requests 12 --max-tokens 32 --repeats 1
    python bench/bench_serving.py --config planned=vllm.json        # a `planner export --engine vllm` file
    python bench/bench_serving.py --sampling greedy,sampled
    python bench/bench_serving.py --skip suffix,ngram --draft-lengths 1,2,4   # the project draft LM in vLLM
    python bench/bench_serving.py --smoke                           # a fake server in this process, seconds

Requests: training.splits.bench_prompts' "chat" (first turns of the hand-written chats) and
"repeat" (input-repeating requests) groups, alternating, through the model's chat template, sent as
token ids to /v1/completions (profiler/load_generator.py: streamed, every token timed). Every round
of every level gets its own slice of the pool, the same slice for every contender, so no server sees
a prompt twice (suffix decoding's cross-request cache would otherwise hold the answer: an oracle);
when the 24 chat prompts run out they are reused, and the result says how often. A warm-up wave of
`level` requests on prompts outside the measured slices comes first at every level.

Contenders: vLLM plain (no speculative config: the baseline), vLLM's suffix defaults
`{"method": "suffix"}`, ngram k=4 with lookup 1-3, and every `--config NAME=JSON_OR_FILE` (a file
holding {"speculative_config": {...}}, as `planner export --engine vllm` writes, or the config itself).

Schedule, contender by contender: one vLLM server holds about 4-6 GB (the API server, the engine
core, a 2 GiB KV cache) and wants a core of the two while it decodes, so the servers are not kept up
side by side; restarting a server per round would cost 30-60 s each. So each contender gets one
server, started once and run through every sampling mode, level and round, then stopped. vLLM plain
runs first and last (with --plain-between also between every two contenders); a contender's speedup
per round is its tokens/s over the geometric mean of the nearest plain runs before and after it on
the same requests, the median over rounds; the plain runs' last/first ratio is reported as drift.

Per contender and level: output tokens/s (median over rounds), its ratio to plain, time per output
token p50/p99 and time to first token p50 (over every completed request of the level's rounds),
accepted/drafted and mean acceptance length (vLLM's /metrics, profiler/serving_metrics.py, read
before and after the level's measured rounds). Greedy (temperature 0) and sampled (temperature 0.7,
top-p 0.9, a seed per request) modes. In greedy mode every response's token ids are compared with
the first plain run's on the same request; any mismatch makes the exit code 1.

Faults: a config vLLM rejects is one line with vLLM's reason on stderr and a row saying so; the
other contenders are still measured and the exit code is 1. A request that times out (--timeout) is
counted and reported (exit code 1), never waited on past its limit. A server that dies mid-run ends
that contender. Ctrl-C stops the running server and writes the finished levels (exit code 130).
Progress goes to stderr; writes OUT.json and OUT.md (default bench/results/serving).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/common.py: the machine, the load watch, bench_main

from common import Results, bench_main, machine, sample_load  # noqa: E402

from planner.errors import UserError  # noqa: E402
from profiler import serving_level  # noqa: E402
from profiler.load_generator import LoadInterrupted, TokenRequest, percentile  # noqa: E402
from profiler.serving_metrics import SpecDecodeCounters  # noqa: E402

PLAIN = "vLLM plain"
DEFAULT_CONTENDERS = {  # --skip key -> (name, vLLM's speculative config)
    "suffix": ("vLLM suffix (defaults)", {"method": "suffix"}),
    "ngram": ("vLLM ngram (k=4, lookup 1-3)", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                               "prompt_lookup_min": 1}),
}
PROJECT_DRAFT = "<the project's draft LM>"  # resolved to its vLLM folder when a server starts
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
WARMUP_TOKENS = 16


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    levels: tuple[int, ...]
    modes: tuple[str, ...]
    requests: int
    max_tokens: int
    repeats: int
    timeout_s: float
    plain_between: bool
    smoke: bool


def settings(a) -> Settings:
    small = a.smoke  # a smoke run's defaults: a few short requests on the fake server
    pick = (lambda v, full, smoke: v if v is not None else (smoke if small else full))
    try:
        levels = tuple(int(x) for x in pick(a.concurrency, "1,2,4,8,16", "1,2,4").split(",") if x.strip())
    except ValueError:
        raise UserError(f"--concurrency {a.concurrency}: expected positive integers separated by commas") from None
    modes = tuple(x.strip() for x in a.sampling.split(",") if x.strip())
    s = Settings(levels, modes, pick(a.requests, 16, 6), pick(a.max_tokens, 64, 8), pick(a.repeats, 3, 2),
                 pick(a.timeout, 300.0, 2.0), a.plain_between, a.smoke)
    if not levels or any(c < 1 or c > 256 for c in levels) or len(set(levels)) != len(levels):
        raise UserError(f"--concurrency {a.concurrency}: expected distinct levels in 1..256")
    if not modes or any(m not in MODES for m in modes):
        raise UserError(f"--sampling {a.sampling}: expected one or both of {', '.join(MODES)}")
    if not (1 <= s.requests <= 256 and 1 <= s.max_tokens <= 2048 and 1 <= s.repeats <= 20 and s.timeout_s > 0):
        raise UserError("--requests 1..256, --max-tokens 1..2048, --repeats 1..20, --timeout above 0")
    return s


@dataclass
class Contender:
    name: str
    spec: dict | None  # vLLM's speculative config; None: plain
    source: str = "built in"
    notes: list = field(default_factory=list)


def parse_config(spec: str) -> Contender:
    """NAME=JSON or NAME=FILE; a file's {"speculative_config": ...} (planner export) or the config itself."""
    name, sep, value = spec.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not name or not value:
        raise UserError(f"--config {spec!r}: expected NAME=JSON or NAME=FILE")
    if name == PLAIN or name in {n for n, _ in DEFAULT_CONTENDERS.values()}:
        raise UserError(f"--config {name}: that name is a built-in contender's; choose another")
    source, notes = "command line", []
    if value.startswith("{"):
        text = value
    else:
        try:
            text, source = Path(value).read_text(), value
        except OSError as e:
            raise UserError(f"--config {name}: cannot read {value} ({e.strerror})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--config {name}: {source} is not JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(doc, dict) and isinstance(doc.get("speculative_config"), dict):
        notes = list(doc.get("notes") or [])
        doc = doc["speculative_config"]
    if not isinstance(doc, dict) or not doc:
        raise UserError(f"--config {name}: expected a JSON object (vLLM's speculative config) in {source}")
    return Contender(name, doc, source, notes)


def draft_contenders(lengths: str | None) -> list[Contender]:
    """--draft-lengths 1,2,4: vLLM's draft_model method on the project's draft LM, one fixed length each."""
    if not lengths:
        return []
    try:
        ks = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--draft-lengths {lengths}: expected positive integers separated by commas") from None
    if not ks or any(k < 1 or k > 16 for k in ks) or len(set(ks)) != len(ks):
        raise UserError(f"--draft-lengths {lengths}: expected distinct lengths in 1..16")
    return [Contender(f"vLLM draft_model (k={k})", {"method": "draft_model", "num_speculative_tokens": k,
                                                     "model": PROJECT_DRAFT}) for k in ks]


def contenders(specs: list[str], skip: str, draft_lengths: str | None = None) -> list[Contender]:
    left_out = {x.strip() for x in skip.split(",") if x.strip()}
    unknown = left_out - set(DEFAULT_CONTENDERS)
    if unknown:
        raise UserError(f"--skip {', '.join(sorted(unknown))}: not a built-in contender ({', '.join(DEFAULT_CONTENDERS)})")
    out = [Contender(*v) for k, v in DEFAULT_CONTENDERS.items() if k not in left_out]
    out += draft_contenders(draft_lengths) + [parse_config(s) for s in specs]
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise UserError(f"--config: two contenders named the same ({names})")
    return out


def schedule(others: list[Contender], plain_between: bool) -> list[Contender]:
    """Plain first and last (and between every two contenders with plain_between)."""
    plain = Contender(PLAIN, None)
    if not others:
        return [plain]
    out = [plain]
    for i, c in enumerate(others):
        out.append(c)
        if plain_between or i == len(others) - 1:
            out.append(plain)
    return out


# ---------------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Prompt:
    id: str
    group: str
    ids: tuple[int, ...]


@dataclass
class Workload:
    """The requests of every (mode, level, round) slot, the same for every contender, and the warm-up's."""

    slots: dict  # (mode, level, round) -> [Prompt]
    warmup: list
    reused: dict = field(default_factory=dict)  # group -> prompt sends beyond the pool (the pool has too few)


def repeat_pool(n: int) -> list:
    """The first n input-repeating prompts, or all there are when fewer."""
    from training.splits import bench_prompts

    try:
        return bench_prompts("repeat", n)
    except UserError as e:
        m = re.search(r"(\d+) repeat prompts available", str(e))
        if m is None or int(m[1]) < 1:
            raise
        return bench_prompts("repeat", int(m[1]))


def workload(s: Settings, encode) -> Workload:
    """Disjoint slices of the chat and repeat pools per slot (wrapping round when a pool runs out),
    alternating chat and repeat; the warm-up's prompts are the repeat pool's first, never measured.
    `encode` turns [text] into [token ids]."""
    from training.splits import bench_prompts

    n_slots = len(s.modes) * len(s.levels) * s.repeats
    n_chat = (s.requests + 1) // 2
    n_rep = s.requests - n_chat
    n_warm = max(s.levels)
    chat = bench_prompts("chat", 24)
    rep = repeat_pool(n_warm + n_slots * n_rep)
    if len(rep) <= n_warm and n_rep:
        raise UserError(f"{len(rep)} input-repeating prompts: too few for a warm-up of {n_warm} and measured ones")
    ids = encode([p.turns[0] for p in chat] + [p.turns[0] for p in rep])
    pool_chat = [Prompt(p.id, "chat", tuple(t)) for p, t in zip(chat, ids[:len(chat)])]
    pool_all = [Prompt(p.id, "repeat", tuple(t)) for p, t in zip(rep, ids[len(chat):])]
    warm, pool_rep = pool_all[:n_warm], pool_all[n_warm:] or pool_all
    slots, k = {}, 0
    for mode in s.modes:
        for level in s.levels:
            for r in range(s.repeats):
                cs = [pool_chat[(k * n_chat + j) % len(pool_chat)] for j in range(n_chat)]
                rs = [pool_rep[(k * n_rep + j) % len(pool_rep)] for j in range(n_rep)]
                slots[(mode, level, r)] = [x for pair in zip(cs, rs) for x in pair] + cs[len(rs):]
                k += 1
    reused = {"chat": max(0, n_slots * n_chat - len(pool_chat)), "repeat": max(0, n_slots * n_rep - len(pool_rep))}
    return Workload(slots, (warm * n_warm)[:n_warm], {g: n for g, n in reused.items() if n})


def token_requests(prompts: list[Prompt], mode: str, max_tokens: int, seed0: int) -> list[TokenRequest]:
    extras = dict(MODES[mode])
    return [TokenRequest(list(p.ids), max_tokens, extras | ({"seed": seed0 + j} if mode != "greedy" else {}))
            for j, p in enumerate(prompts)]


# ---------------------------------------------------------------------------------------------- one contender's run


@dataclass
class Cell:
    """One contender run's measurements at one (mode, level)."""

    contender: str
    run: int  # position in the schedule
    mode: str
    level: int
    rounds: list = field(default_factory=list)  # LoadResult per round
    spec: SpecDecodeCounters | None = None


@dataclass
class State:
    """Everything measured so far: a Ctrl-C writes it."""

    cells: list = field(default_factory=list)
    errors: dict = field(default_factory=dict)  # contender name -> one line
    warnings: list = field(default_factory=list)
    interrupted: bool = False


def run_contender(c: Contender, run: int, backend, s: Settings, w: Workload, state: State) -> None:
    """Start c's server, measure every mode and level on it, stop it. A refused config is recorded
    (plain's is fatal: no baseline); Ctrl-C propagates after the server is stopped."""
    progress(f"[{run + 1}] {c.name}: starting the server ...")
    t0, children0 = time.perf_counter(), children_s()
    server = backend.server(c.spec)
    try:
        server.start()
    except UserError as e:
        if c.spec is None:
            raise
        state.errors[c.name] = f"refused: {e}"
        progress(f"bench_serving: {c.name}: {e}")
        return
    try:
        progress(f"[{run + 1}] {c.name}: up in {time.perf_counter() - t0:.0f} s")
        for mode in s.modes:
            for level in s.levels:
                cell = measure_level(c, run, server, s, w, mode, level, state)
                state.cells.append(cell)
                if not server.alive():
                    raise UserError(f"the server stopped during {mode} at concurrency {level}")
    except UserError as e:
        if c.spec is None and run == 0:
            raise
        state.errors[c.name] = str(e)
        progress(f"bench_serving: {c.name}: {e}")
    finally:
        used = group_cpu_s(getattr(server, "pgid", None))
        server.stop()
        credit_own_cpu(used - (children_s() - children0))
        sample_load()  # the server's CPU counts as this run's own, not as another process's


def children_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def group_cpu_s(pgid: int | None) -> float:
    """CPU seconds the server's live processes have used (their reaped children's included)."""
    if pgid is None:
        return 0.0
    from decoder.engines.vllm.server import group_members

    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in group_members(pgid):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # utime stime cutime cstime: fields 14-17 of stat
        total += sum(int(x) for x in fields[11:15]) / tick
    return total


def credit_own_cpu(seconds: float) -> None:
    """Count `seconds` of CPU as this run's own in the load watch. Stopping the server signals its whole
    group at once, so its engine core and worker may end after their parent and are then never reaped
    into this process's children's time (about 40 % of a server's CPU, measured): without this credit
    the watch would count a quiet machine's vLLM as another process. (bench/common.py has no public
    call for it yet: this moves the watch's children mark.)"""
    import common

    meter = getattr(common._WATCH[0], "meter", None)
    if seconds > 0 and meter is not None and hasattr(meter, "children0"):
        meter.children0 -= seconds


def measure_level(c: Contender, run: int, server, s: Settings, w: Workload, mode: str, level: int,
                  state: State) -> Cell:
    def said(r: int, res) -> None:
        bad = [x for x in res.records if not x.ok]
        note = f", {len(bad)} failed ({bad[0].error})" if bad else ""
        progress(f"  {c.name} {mode} c={level} round {r + 1}/{s.repeats}: {res.output_tokens_per_s:.1f} tokens/s, "
                 f"{res.output_tokens} tokens in {res.wall_s:.1f} s{note}")

    warm = token_requests(w.warmup[:level], mode, WARMUP_TOKENS, 10_000)
    rounds = [token_requests(w.slots[(mode, level, r)], mode, s.max_tokens, 1000 * r) for r in range(s.repeats)]
    lv = serving_level.measure_level(server.url, server.served_model_name, warm, rounds, level, s.timeout_s, said)
    if len(lv.warmup.completed) < len(lv.warmup.records):
        state.warnings.append(f"{c.name}: {len(lv.warmup.records) - len(lv.warmup.completed)} warm-up request(s) "
                              f"failed at {mode} concurrency {level}: "
                              f"{next(r.error for r in lv.warmup.records if not r.ok)}")
    return Cell(c.name, run, mode, level, rounds=lv.rounds, spec=lv.spec)


# ---------------------------------------------------------------------------------------------- summary


def geo(xs) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def neighbours(cells: list[Cell], run: int, mode: str, level: int) -> list[Cell]:
    """The nearest plain runs before and after schedule position `run` at (mode, level)."""
    plain = [c for c in cells if c.contender == PLAIN and c.mode == mode and c.level == level]
    before = [c for c in plain if c.run < run]
    after = [c for c in plain if c.run > run]
    return ([max(before, key=lambda c: c.run)] if before else []) + ([min(after, key=lambda c: c.run)] if after else [])


def ratios(cell: Cell, cells: list[Cell]) -> list[float]:
    """Per round: tokens/s over the geometric mean of the neighbouring plain runs' on the same requests."""
    if cell.contender == PLAIN:
        return [1.0] * len(cell.rounds)
    base = neighbours(cells, cell.run, cell.mode, cell.level)
    out = []
    for r, res in enumerate(cell.rounds):
        b = geo(p.rounds[r].output_tokens_per_s for p in base if r < len(p.rounds))
        if not math.isnan(b) and res.output_tokens_per_s > 0:
            out.append(res.output_tokens_per_s / b)
    return out


def row(name: str, mode: str, level: int, cells: list[Cell], all_cells: list[Cell]) -> dict:
    """One contender at one (mode, level), over its runs (plain: every run)."""
    rounds = [res for c in cells for res in c.rounds]
    done = [rec for res in rounds for rec in res.completed]
    rs = [x for c in cells for x in ratios(c, all_cells)]
    spec = [c.spec for c in cells if c.spec is not None]
    acc = None
    if spec and any(x.speculating for x in spec):
        total = spec[0]
        for x in spec[1:]:
            total = SpecDecodeCounters(total.drafts + x.drafts, total.draft_tokens + x.draft_tokens,
                                       total.accepted_tokens + x.accepted_tokens, (), True)
        acc = {"drafts": total.drafts, "drafted": total.draft_tokens, "accepted": total.accepted_tokens,
               "acceptance_rate": total.acceptance_rate, "mean_acceptance_length": total.mean_acceptance_length,
               "acceptance_per_position": list(spec[0].acceptance_per_position) if len(spec) == 1 else None}
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    return {"contender": name, "mode": mode, "level": level, "runs": [c.run for c in cells],
            "rounds": len(rounds), "requests": sum(len(r.records) for r in rounds), "completed": len(done),
            "timed_out": sum(r.timed_out for r in rounds),
            "failed": sum(len(r.records) - len(r.completed) for r in rounds),
            "tokens_per_s": statistics.median(r.output_tokens_per_s for r in rounds) if rounds else None,
            "tokens_per_s_rounds": [round(r.output_tokens_per_s, 3) for r in rounds],
            "vs_plain": statistics.median(rs) if rs else None, "vs_plain_rounds": [round(x, 4) for x in rs],
            "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
            "ttft_p50_ms": _ms(percentile([r.ttft_s for r in done if r.ttft_s is not None], 50)),
            "acceptance": acc}


def identity(cells: list[Cell], w: Workload) -> tuple[list[dict], list[dict], int]:
    """Greedy token ids against the first plain run's on the same request: (contender mismatches,
    later plain runs' mismatches with the first, responses compared)."""
    ref = {}
    first_plain = min((c.run for c in cells if c.contender == PLAIN), default=None)
    for c in cells:
        if c.contender == PLAIN and c.run == first_plain and c.mode == "greedy":
            for r, res in enumerate(c.rounds):
                for rec in res.records:
                    if rec.ok and rec.token_ids is not None:
                        ref[(c.level, r, rec.index)] = rec.token_ids
    mism, plain_mism, compared = [], [], 0
    for c in cells:
        if c.mode != "greedy" or (c.contender == PLAIN and c.run == first_plain):
            continue
        for r, res in enumerate(c.rounds):
            for rec in res.records:
                want = ref.get((c.level, r, rec.index))
                if want is None or not rec.ok or rec.token_ids is None:
                    continue
                compared += c.contender != PLAIN
                if rec.token_ids != want:
                    at = next((i for i, (a, b) in enumerate(zip(rec.token_ids, want)) if a != b),
                              min(len(want), len(rec.token_ids)))
                    (plain_mism if c.contender == PLAIN else mism).append(
                        {"contender": c.contender, "run": c.run, "level": c.level, "round": r,
                         "prompt": w.slots[("greedy", c.level, r)][rec.index].id, "first_difference": at,
                         "plain_tokens": len(want), "tokens": len(rec.token_ids)})
    return mism, plain_mism, compared


def drift(cells: list[Cell], s: Settings) -> dict:
    """Per mode and level: the last plain run's median tokens/s over the first's."""
    out = {}
    for mode in s.modes:
        for level in s.levels:
            plain = sorted((c for c in cells if c.contender == PLAIN and c.mode == mode and c.level == level),
                           key=lambda c: c.run)
            if len(plain) >= 2 and plain[0].rounds and plain[-1].rounds:
                a = statistics.median(r.output_tokens_per_s for r in plain[0].rounds)
                b = statistics.median(r.output_tokens_per_s for r in plain[-1].rounds)
                out.setdefault(mode, {})[str(level)] = round(b / a, 4) if a > 0 else None
    return out


def summarise(state: State, s: Settings, w: Workload, order: list[Contender]) -> dict:
    names = list(dict.fromkeys(c.name for c in order))
    rows = []
    for mode in s.modes:
        for name in names:
            for level in s.levels:
                cells = [c for c in state.cells if c.contender == name and c.mode == mode and c.level == level]
                if cells:
                    rows.append(row(name, mode, level, cells, state.cells))
    mism, plain_mism, compared = identity(state.cells, w)
    return {"rows": rows, "mismatches": mism, "plain_self_mismatches": plain_mism, "greedy_compared": compared,
            "drift": drift(state.cells, s)}


# ---------------------------------------------------------------------------------------------- the report


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def markdown(doc: dict) -> str:
    m, st = doc["machine"], doc["settings"]
    lines = [f"# vLLM serving under load ({doc['model']}, {doc['vllm']}, {m['cpu']}, {m['cores']} cores)", "",
             f"{st['requests']} requests per round (chat and input-repeating, alternating; prompts no tuning step "
             f"reads), {st['max_tokens']} new tokens, median of {st['repeats']} round(s) per level after a warm-up "
             f"wave; one server per contender, run contender by contender with vLLM plain "
             f"{'between every two contenders and ' if st['plain_between'] else ''}at both ends; speedups are per "
             f"round against the neighbouring plain runs on the same requests. Wall time {doc['wall_s']:.0f} s."
             + (" **Interrupted: finished levels only.**" if doc["interrupted"] else ""), ""]
    if doc["prompts"]["reused"]:
        lines += [(f"Prompts sent again in a later round (the pools ran out): {doc['prompts']['reused']}; a stateful "
                   "proposer (suffix decoding's cross-request cache) may have seen their answers."), ""]
    small = [c for c in st["levels"] if c > st["requests"]]
    if small:
        lines += [f"At concurrency {', '.join(map(str, small))} only {st['requests']} requests are in flight.", ""]
    levels = st["levels"]
    for mode in st["modes"]:
        rows = [r for r in doc["rows"] if r["mode"] == mode]
        lines += [f"## {mode}", "", "Output tokens/s (ratio to vLLM plain):", "",
                  "| contender | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
        for name in dict.fromkeys(r["contender"] for r in rows):
            by = {r["level"]: r for r in rows if r["contender"] == name}
            lines.append(f"| {name} | " + " | ".join(
                f"{by[c]['tokens_per_s']:.1f} ({_f(by[c]['vs_plain'], '.2f')}x)" if c in by and by[c]["tokens_per_s"]
                is not None else "-" for c in levels) + " |")
        lines += ["", ("| contender | c | tokens/s | vs plain | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | accepted / "
                       "drafted | mean acceptance length | completed |"), "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            a = r["acceptance"]
            acc = f"{a['accepted']:.0f} / {a['drafted']:.0f} ({_f(a['acceptance_rate'], '.2f')})" if a else "-"
            mal = _f(a["mean_acceptance_length"], ".2f") if a else "-"
            lines.append(f"| {r['contender']} | {r['level']} | {_f(r['tokens_per_s'], '.1f')} | "
                         f"{_f(r['vs_plain'], '.2f')}x | {_f(r['tpot_p50_ms'], '.1f')} | {_f(r['tpot_p99_ms'], '.1f')} | "
                         f"{_f(r['ttft_p50_ms'], '.0f')} | {acc} | {mal} | {r['completed']} / {r['requests']}"
                         + (f", {r['timed_out']} timed out" if r["timed_out"] else "") + " |")
        if doc["drift"].get(mode):
            lines += ["", "vLLM plain drift (last plain run's tokens/s over the first's): " + ", ".join(
                f"c={k} {v:.2f}" for k, v in doc["drift"][mode].items() if v is not None) + "."]
        lines.append("")
    n_mism = len(doc["mismatches"])
    if "greedy" in st["modes"]:
        lines.append(f"Greedy responses identical to vLLM plain's: {doc['greedy_compared'] - n_mism} of "
                     f"{doc['greedy_compared']} compared." + (f" **{n_mism} differ:** " + "; ".join(
                         f"{x['contender']} c={x['level']} {x['prompt']} at token {x['first_difference']}"
                         for x in doc["mismatches"][:10]) if n_mism else ""))
        if doc["plain_self_mismatches"]:
            lines.append(f"vLLM plain's own later runs differ from its first on {len(doc['plain_self_mismatches'])} "
                         "response(s): the engine is not deterministic here.")
        lines.append("")
    configs = [f"{k}: `{json.dumps(v['config'], separators=(',', ':'))}`" + (f" ({v['error']})" if v.get("error") else "")
               for k, v in doc["contenders"].items() if v["config"] is not None or v.get("error")]
    lines += ["Configs: " + "; ".join(configs) + "." if configs else ""]
    lines += [f"Warning: {x}" for x in doc["warnings"]]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- backends


class VllmBackend:
    """Real servers: VllmServer through the vllm engine (decoder/engines/vllm/open.py)."""

    def __init__(self, model: str, startup_timeout_s: float):
        from decoder.engines.registry import EngineRequest, open_engine
        from decoder.engines.vllm.env import STAMP, venv_dir

        self.engine = open_engine("vllm", EngineRequest(model=model))
        self.startup_timeout_s = startup_timeout_s
        stamp = venv_dir() / STAMP
        self.version = stamp.read_text().split()[0] if stamp.is_file() and stamp.read_text().split() else "vLLM"
        self.model_name = self.engine.model_name

    def server(self, config: dict | None):
        if config and config.get("model") == PROJECT_DRAFT:
            config = {**config, "model": self.draft_dir()}
        return self.engine.server(speculative_config=config, startup_timeout_s=self.startup_timeout_s)

    def draft_dir(self) -> str:
        from decoder.engines.vllm.draft_folder import draft_for

        folder = draft_for(self.engine.model_name, self.engine.model_dir)
        if folder is None:
            raise UserError(f"--draft-lengths: no draft LM ships for {self.engine.model_name}")
        return str(folder)

    def encode(self, texts: list[str]) -> list[list[int]]:
        from decoder.engines.hf.tokenizer import load_tokenizer
        from workflows.cli.inputs import encode_prompts

        return [t.tolist() for t in encode_prompts(load_tokenizer(self.engine.model_dir, local_only=True), texts)]


class FakeBackend:
    """--smoke: an OpenAI-style streaming server in this process (no vLLM, no model)."""

    version, model_name = "fake vLLM (smoke)", "fake"

    def server(self, config: dict | None):
        return FakeServer(config)

    @staticmethod
    def encode(texts: list[str]) -> list[list[int]]:
        return [[10 + (ord(ch) % 200) for ch in t[:24]] for t in texts]


FAKE_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "num_speculative_tokens_per_batch_size", "suffix_decoding_max_cached_requests"}


class FakeServer:
    """Streams deterministic tokens per prompt (and seed), one per step for plain, chunks of several
    for a speculative config (the same tokens), with vLLM-style /metrics counters. Faults for the
    tests: an unknown config key is refused at start like vLLM's validation; method "fake-hang"
    never answers every 5th request; "fake-wrong" changes a token of some responses."""

    served_model_name = "m"
    STEP_S = 0.001

    def __init__(self, config: dict | None):
        self.spec = config or {}
        self.counts = [0.0, 0.0, 0.0]  # drafts, drafted, accepted
        self.received = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> FakeServer:
        bad = sorted(set(self.spec) - FAKE_KEYS)
        if bad:
            raise UserError(f"vLLM server on fake exited with code 1 while starting: ValidationError: 1 validation "
                            f"error for SpeculativeConfig: {bad[0]}: Extra inputs are not permitted (log: none)")
        ready = threading.Event()

        def serve():
            self._loop = asyncio.new_event_loop()
            srv = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
            ready.set()
            self._loop.run_forever()
            srv.close()
            for t in asyncio.all_tasks(self._loop):
                t.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._thread = None

    def metrics(self) -> str:
        if not self.spec:
            return "vllm:num_requests_running 0\n"
        d, t, a = self.counts
        return "".join(f'vllm:spec_decode_{k}_total{{engine="0",model_name="m"}} {v}\n'
                       for k, v in (("num_drafts", d), ("num_draft_tokens", t), ("num_accepted_tokens", a)))

    async def _handle(self, reader, writer):
        try:
            line = await reader.readline()
            headers = {}
            while (h := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = h.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            path = line.split()[1].decode()
            if not path.endswith("/completions"):
                body = "ok" if path == "/health" else self.metrics()
                writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
                await writer.drain()
                return
            req = json.loads(await reader.readexactly(int(headers["content-length"])))
            self.received += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            if self.spec.get("method") == "fake-hang" and self.received % 5 == 0:
                await reader.read()  # until the client gives up
                return
            await self._stream(writer, req)
        finally:
            writer.close()

    async def _stream(self, writer, req):
        base = sum(req["prompt"]) + 31 * int(req.get("seed", 0)) * (req.get("temperature", 0) > 0)
        toks = [10 + (base * 7 + i * 13) % 4000 for i in range(req["max_tokens"])]
        if self.spec.get("method") == "fake-wrong" and base % 2 == 0 and len(toks) > 3:
            toks[3] += 1
        k = int(self.spec.get("num_speculative_tokens", 3))
        i = step = 0
        while i < len(toks):
            n = 1 if not self.spec else 1 + step % (k + 1)
            if self.spec:
                self.counts = [self.counts[0] + 1, self.counts[1] + k, self.counts[2] + n - 1]
            await asyncio.sleep(self.STEP_S)
            chunk = {"choices": [{"index": 0, "text": "x" * len(toks[i:i + n]), "token_ids": toks[i:i + n]}]}
            await self._send(writer, chunk)
            i, step = i + n, step + 1
        await self._send(writer, {"choices": [], "usage": {"completion_tokens": len(toks)}})
        await self._send(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    @staticmethod
    async def _send(writer, event):
        data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()


# ---------------------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default=None, help="levels, comma-separated (default 1,2,4,8,16)")
    p.add_argument("--sampling", default="greedy", help="greedy, sampled or both, comma-separated (default greedy)")
    p.add_argument("--requests", type=int, default=None, help="requests per round (default 16), half chat, half repeat")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=None, help="measured rounds per level (default 3)")
    p.add_argument("--timeout", type=float, default=None, help="seconds one request may take (default 300)")
    p.add_argument("--config", dest="configs", action="append", default=[], metavar="NAME=JSON_OR_FILE",
                   help="another contender: a speculative config as JSON, or a file (planner export --engine vllm); "
                        "repeatable")
    p.add_argument("--draft-lengths", default=None, metavar="K,K,...",
                   help="also race vLLM's draft_model method on the project's draft LM at these fixed lengths")
    p.add_argument("--skip", default="", help="built-in contenders to leave out: suffix, ngram (comma-separated)")
    p.add_argument("--plain-between", action="store_true", help="run vLLM plain between every two contenders too")
    p.add_argument("--model", default="smollm2-135m", help="registry model or Hugging Face folder vLLM serves")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving"), help="writes OUT.json and OUT.md")
    p.add_argument("--smoke", action="store_true", help="a fake server in this process: checks the code paths in seconds")
    return p


def run(a) -> Results:
    s = settings(a)
    order = schedule(contenders(a.configs, a.skip, a.draft_lengths), s.plain_between)
    backend = FakeBackend() if s.smoke else VllmBackend(a.model, a.startup_timeout)
    w = workload(s, backend.encode)
    if w.reused:
        progress(f"bench_serving: the prompt pools are too small for every round to get new prompts; sends of a "
                 f"prompt seen before: {w.reused}")
    state, t0 = State(), time.perf_counter()
    try:
        for i, c in enumerate(order):
            if c.name in state.errors:
                continue
            run_contender(c, i, backend, s, w, state)
    except LoadInterrupted as e:  # a level cut short: the finished ones are kept
        state.interrupted = True
        progress(f"bench_serving: interrupted ({e}); writing the finished levels")
    except KeyboardInterrupt:
        state.interrupted = True
        progress("bench_serving: interrupted; writing the finished levels")
    doc = report(state, s, w, order, backend, time.perf_counter() - t0)
    out = Path(a.out)
    md = markdown(doc)
    failed = doc["mismatches"] or state.errors or any(r["failed"] for r in doc["rows"])
    return Results({out.with_suffix(".json"): doc, out.with_suffix(".md"): md} if state.cells else {}, md,
                   130 if state.interrupted else 1 if failed else 0)


def report(state: State, s: Settings, w: Workload, order: list[Contender], backend, wall_s: float) -> dict:
    summary = summarise(state, s, w, order)
    listed = {c.name: c for c in order}
    return {"bench": "serving", "model": backend.model_name, "vllm": backend.version, "machine": machine(),
            "settings": {"levels": list(s.levels), "modes": list(s.modes), "requests": s.requests,
                         "max_tokens": s.max_tokens, "repeats": s.repeats, "timeout_s": s.timeout_s,
                         "plain_between": s.plain_between, "smoke": s.smoke, "sampled": MODES["sampled"]},
            "schedule": [c.name for c in order],
            "contenders": {k: {"config": c.spec, "source": c.source, "notes": c.notes,
                               "error": state.errors.get(k)} for k, c in listed.items()},
            "prompts": {"reused": w.reused, "warmup": [p.id for p in w.warmup],
                        "slots": {f"{m}/c={c}/round {r + 1}": [p.id for p in ps] for (m, c, r), ps in w.slots.items()}},
            "wall_s": wall_s, "interrupted": state.interrupted, "warnings": state.warnings, **summary}


def main(argv=None) -> int:
    return bench_main("bench_serving", parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
