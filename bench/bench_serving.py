"""vLLM's OpenAI server under concurrent load: vLLM plain against its own speculation and the main job's
decision, at several concurrency levels, greedy and sampled, on prompts no tuning step reads and none of
which a server is sent twice. The race is the main job's (workflows/mainjob/serving_race.py).

    python bench/bench_serving.py --decision runs/RUN/chosen.json --sampling greedy,sampled --budget 120
    python bench/bench_serving.py --concurrency 1,4,16 --requests 12 --max-tokens 32
    python bench/bench_serving.py --config planned=vllm.json        # a `planner export --engine vllm` file
    python bench/bench_serving.py --skip suffix,ngram --draft-lengths 1,2,4   # the project draft LM in vLLM
    python bench/bench_serving.py --smoke                           # a fake server in this process, seconds

Requests: training.splits.bench_prompts' "chat" (the hand-written chats' first turns) and "repeat"
(input-repeating requests) groups, alternating while both last, through the model's chat template, sent as
token ids to /v1/completions (profiler/load_generator.py: streamed, every token timed). Each level sends
max(--requests, level) requests a round, every (level, round) its own prompts, the same for every
contender; a run that would need a prompt twice on one server is refused before anything starts (suffix
decoding's cross-request cache would hold its answer: an oracle). A warm-up wave of `level` short requests
on prompts outside the measured ones comes first at every level.

Contenders: vLLM plain (the baseline), vLLM's suffix defaults `{"method": "suffix"}`, ngram k=4 with lookup
1-3, --decision FILE (the main job's chosen.json, or its exports/vllm.json: with the project's plugin and,
where it uses it, without), and every --config NAME=JSON_OR_FILE (a file holding {"speculative_config":
{...}}, as `planner export --engine vllm` writes, with "env" naming the plugin's switch where it needs it,
or the config itself).

The race per sampling mode, as the main job runs it: one server per contender through every level and
round; plain first and again last on a fresh server (each level's plain is the median over its servers;
their drift is reported); per level the paired interval of log(plain / contender) seconds per output token
over the requests (sign-flip, 90 %) beside output tokens/s, TPOT p50/p99, TTFT p50, accepted/drafted and mean
acceptance length. With --budget MINUTES, further passes (each contender and plain on fresh servers) run at
the levels where a contender is neither ahead of plain nor behind it, until each resolves or the budget
ends; the report says which stayed unresolved. In greedy mode every response's token ids are compared with
plain's first answer to the same request; a mismatch makes the exit code 1.

Faults: a config vLLM rejects is one line with vLLM's reason on stderr and a row saying so; the other
contenders are still measured and the exit code is 1. A request past --timeout is counted (exit code 1). A
server that dies mid-run ends that contender. Ctrl-C stops the running server and writes the finished
levels (exit code 130). Progress goes to stderr; writes OUT.json and OUT.md (default bench/results/serving),
with the machine and the load.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/common.py: the machine, the load watch, bench_main

from common import Results, bench_main, load_record, machine, sample_load  # noqa: E402

from planner.errors import UserError  # noqa: E402
from planner.serving import PLUGIN_ENV  # noqa: E402
from profiler.load_generator import LoadInterrupted, TokenRequest  # noqa: E402
from workflows.mainjob import serving_race as sr  # noqa: E402

PLAIN_LABEL = "vLLM plain"  # the race's sr.PLAIN, as the report names it
STOCK = {  # --skip key -> (name, vLLM's speculative config)
    "suffix": ("vLLM suffix (defaults)", {"method": "suffix"}),
    "ngram": ("vLLM ngram (k=4, lookup 1-3)", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                               "prompt_lookup_min": 1}),
}
PROJECT_DRAFT = "<the project's draft LM>"  # resolved to its vLLM folder when a server starts
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
LEVELS = (1, 2, 4, 8, 16, 32)


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def label(name: str) -> str:
    return PLAIN_LABEL if name == sr.PLAIN else name


# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    levels: tuple[int, ...]
    modes: tuple[str, ...]
    requests: int  # per round at a level: max(requests, level)
    max_tokens: int
    rounds: int  # rounds per level on one server, each with its own prompts
    timeout_s: float
    budget_s: float | None  # further passes at unresolved levels while this holds them (None: one pass)
    smoke: bool
    seeded: bool = True  # sampled requests carry a seed each (vLLM 0.32's CPU engine dies on them at 32: --unseeded)

    def sent(self, level: int) -> int:
        return max(self.requests, level)


def settings(a) -> Settings:
    small = a.smoke  # a smoke run's defaults: a few short requests on the fake server
    pick = (lambda v, full, smoke: v if v is not None else (smoke if small else full))
    try:
        levels = tuple(int(x) for x in pick(a.concurrency, ",".join(map(str, LEVELS)), "1,2,4").split(",") if x.strip())
    except ValueError:
        raise UserError(f"--concurrency {a.concurrency}: expected positive integers separated by commas") from None
    modes = tuple(x.strip() for x in pick(a.sampling, "greedy,sampled", "greedy").split(",") if x.strip())
    budget = None if a.budget is None else a.budget * 60.0
    s = Settings(levels, modes, pick(a.requests, 16, 6), pick(a.max_tokens, 32, 8), pick(a.rounds, 1, 2),
                 pick(a.timeout, 300.0, 2.0), budget, a.smoke, not a.unseeded)
    if not levels or any(c < 1 or c > 256 for c in levels) or list(levels) != sorted(set(levels)):
        raise UserError(f"--concurrency {a.concurrency}: expected increasing levels in 1..256")
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise UserError(f"--sampling {a.sampling}: expected one or both of {', '.join(MODES)}")
    if not (5 <= s.requests <= 256 and 1 <= s.max_tokens <= 2048 and 1 <= s.rounds <= 20 and s.timeout_s > 0):
        raise UserError("--requests 5..256 (5 paired requests are the fewest that can decide), --max-tokens 1..2048, "
                        "--rounds 1..20, --timeout above 0")
    if budget is not None and not 0.05 <= a.budget <= 24 * 60:
        raise UserError(f"--budget {a.budget:g}: expected minutes in 0.05..1440")
    return s


# ---------------------------------------------------------------------------------------------- contenders


def parse_config(spec: str) -> sr.Contender:
    """NAME=JSON or NAME=FILE; a file's {"speculative_config": ...} (planner export; its "env" naming the
    plugin's switch serves it with the plugin) or the config itself."""
    name, sep, value = spec.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not name or not value:
        raise UserError(f"--config {spec!r}: expected NAME=JSON or NAME=FILE")
    if "=" in value and not value.startswith("{") and not Path(value).exists():
        raise UserError(f"--config {spec!r}: a contender's NAME may not contain '=' (it ends at the first one)")
    if name in (sr.PLAIN, PLAIN_LABEL) or name in {n for n, _ in STOCK.values()}:
        raise UserError(f"--config {name}: that name is a built-in contender's; choose another")
    doc, source = _json_arg(f"--config {name}", value)
    notes, plugin = [], False
    if isinstance(doc, dict) and isinstance(doc.get("speculative_config"), dict):
        notes, plugin = list(doc.get("notes") or []), _plugin_of(doc)
        doc = doc["speculative_config"]
    if not isinstance(doc, dict) or not doc:
        raise UserError(f"--config {name}: expected a JSON object (vLLM's speculative config) in {source}")
    return sr.Contender(name, doc, plugin=plugin, source=source, notes=notes)


def _json_arg(flag: str, value: str) -> tuple[object, str]:
    if value.startswith("{"):
        text, source = value, "command line"
    else:
        try:
            text, source = Path(value).read_text(), value
        except OSError as e:
            raise UserError(f"{flag}: cannot read {value} ({e.strerror})") from None
    try:
        return json.loads(text), source
    except json.JSONDecodeError as e:
        raise UserError(f"{flag}: {source} is not JSON ({e.msg} at line {e.lineno})") from None


def _plugin_of(doc: dict) -> bool:
    return bool(doc.get("plugin")) or (doc.get("env") or {}).get(PLUGIN_ENV) == "1"


def decision_contenders(path: str | None) -> list[sr.Contender]:
    """--decision FILE: the main job's decision (chosen.json or exports/vllm.json), with the plugin and, where
    it uses it, without (what vLLM does with the same config when the plugin is not installed)."""
    if not path:
        return []
    doc, _ = _json_arg("--decision", path)
    cfg = doc.get("speculative_config") if isinstance(doc, dict) else None
    if not isinstance(cfg, dict) or not cfg:
        raise UserError(f"--decision {path}: expected a serving decision with a speculative_config (a plain decision "
                        "is vLLM plain itself)")
    if not _plugin_of(doc):
        return [sr.Contender("main job's decision", cfg, source=path)]
    return [sr.Contender("main job's decision (plugin)", cfg, plugin=True, source=path),
            sr.Contender("main job's decision (no plugin)", cfg, source=path)]


def draft_contenders(lengths: str | None) -> list[sr.Contender]:
    """--draft-lengths 1,2,4: vLLM's draft_model method on the project's draft LM, one fixed length each."""
    if not lengths:
        return []
    try:
        ks = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--draft-lengths {lengths}: expected positive integers separated by commas") from None
    if not ks or any(k < 1 or k > 16 for k in ks) or len(set(ks)) != len(ks):
        raise UserError(f"--draft-lengths {lengths}: expected distinct lengths in 1..16")
    return [sr.Contender(f"vLLM draft_model (k={k})", {"method": "draft_model", "num_speculative_tokens": k,
                                                        "model": PROJECT_DRAFT}) for k in ks]


def contenders(specs: list[str], skip: str, draft_lengths: str | None = None, decision: str | None = None
               ) -> list[sr.Contender]:
    """Every contender but plain, in the order they race."""
    left_out = {x.strip() for x in skip.split(",") if x.strip()}
    unknown = left_out - set(STOCK)
    if unknown:
        raise UserError(f"--skip {', '.join(sorted(unknown))}: not a built-in contender ({', '.join(STOCK)})")
    out = decision_contenders(decision) + [sr.Contender(n, dict(c)) for k, (n, c) in STOCK.items() if k not in left_out]
    out += draft_contenders(draft_lengths) + [parse_config(s) for s in specs]
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise UserError(f"--config: two contenders named the same ({names})")
    return out


# ---------------------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Prompt:
    id: str
    group: str
    ids: tuple[int, ...]


@dataclass
class Workload:
    """The prompts of every (level, round) slot, the same for every contender and mode, and the warm-up's."""

    slots: dict  # (level, round) -> [Prompt]
    warmup: list


def workload(s: Settings, encode) -> Workload:
    """Distinct prompts for every slot, chat and repeat alternating while both last; the warm-up's are the
    repeat pool's first, never measured. `encode` turns [text] into [token ids]. A run that needs more
    prompts than the pools hold is refused: no server is sent a prompt twice."""
    from training.splits import bench_prompts

    n_warm = max(s.levels)
    need = sum(s.sent(lv) for lv in s.levels) * s.rounds
    chat, rep = _pool("chat", bench_prompts), _pool("repeat", bench_prompts)
    if need + n_warm > len(chat) + len(rep):
        raise UserError(f"{need} measured prompts and {n_warm} warm-up ones needed ({'+'.join(str(s.sent(lv)) for lv in s.levels)}"
                        f" x {s.rounds} round(s)), {len(chat) + len(rep)} distinct ones exist (training/splits.py "
                        "bench_prompts): fewer --requests, --rounds or levels")
    ids = encode([p.turns[0] for p in chat + rep])
    pool_chat = [Prompt(p.id, "chat", tuple(t)) for p, t in zip(chat, ids[:len(chat)])]
    pool_rep = [Prompt(p.id, "repeat", tuple(t)) for p, t in zip(rep, ids[len(chat):])]
    warm, pool_rep = pool_rep[:n_warm], pool_rep[n_warm:]
    slots = {}
    for lv in s.levels:
        for r in range(s.rounds):
            take = []
            while len(take) < s.sent(lv):
                pool = pool_chat if (len(take) % 2 == 0 and pool_chat) or not pool_rep else pool_rep
                take.append(pool.pop(0))
            slots[(lv, r)] = take
    return Workload(slots, warm)


def _pool(group: str, bench_prompts) -> list:
    """Every prompt of a benchmark group (bench_prompts says how many there are when asked for too many)."""
    import re

    try:
        return bench_prompts(group, 10_000)
    except UserError as e:
        m = re.search(r"(\d+) (?:chat|repeat) prompts", str(e))
        if m is None:
            raise
        return bench_prompts(group, int(m[1]))


def traffic(w: Workload, s: Settings, mode: str) -> sr.Traffic:
    """The race's traffic for a sampling mode: slot (level, round) as its own requests (seeded per request)."""
    def reqs(prompts: list[Prompt], tokens: int, seed0: int) -> list[TokenRequest]:
        extras = dict(MODES[mode])
        seed = mode != "greedy" and s.seeded
        return [TokenRequest(list(p.ids), tokens, extras | ({"seed": seed0 + j} if seed else {}))
                for j, p in enumerate(prompts)]

    requests = {key: reqs(ps, s.max_tokens, 1000 * key[1]) for key, ps in w.slots.items()}
    return sr.Traffic(requests, reqs(w.warmup, sr.WARMUP_TOKENS, 10_000), rounds=s.rounds, repeats=False,
                      timeout_s=s.timeout_s)


# ---------------------------------------------------------------------------------------------- the race


@dataclass
class State:
    """Everything measured so far: a Ctrl-C writes it."""

    races: dict = field(default_factory=dict)  # mode -> sr.Race
    errors: dict = field(default_factory=dict)  # contender name -> one line
    interrupted: bool = False


def race_mode(backend, others: list[sr.Contender], s: Settings, w: Workload, mode: str, state: State) -> None:
    """Plain, every contender, plain again, then (with --budget) further passes at the unresolved levels."""
    race = sr.Race(traffic(w, s, mode), list(s.levels), progress, greedy=mode == "greedy")
    state.races[mode] = race
    progress(f"bench_serving: {mode}")
    sr.race_all(backend, [sr.Contender(sr.PLAIN, None)], race)
    for c in others:
        if c.name in state.errors:
            continue
        sr.race_all(backend, [c], race)
        if c.name in race.failed:
            state.errors[c.name] = race.failed[c.name]
            progress(f"bench_serving: {c.name}: {race.failed[c.name]}")
    sr.close_plain(backend, race)
    if s.budget_s is not None:
        ends = backend.t0 + s.budget_s
        sr.resolve(backend, race, [c for c in others if c.name in race.results], lambda: ends - time.time())


def run(a) -> Results:
    s = settings(a)
    others = contenders(a.configs, a.skip, a.draft_lengths, a.decision)
    backend = FakeBackend() if s.smoke else VllmBackend(a.model, a.startup_timeout)
    w = workload(s, backend.encode)
    state = State()
    try:
        for mode in s.modes:
            race_mode(backend, others, s, w, mode, state)
    except KeyboardInterrupt:  # LoadInterrupted too: a level cut short; the finished ones are kept
        state.interrupted = True
        progress("bench_serving: interrupted; writing the finished levels")
    doc = report(state, s, w, others, backend, time.time() - backend.t0)
    md = markdown(doc)
    failed = doc["mismatches"] or state.errors or any(r["timed_out"] or r["failed"] for r in doc["rows"])
    files = {Path(a.out).with_suffix(".json"): doc, Path(a.out).with_suffix(".md"): md} if doc["rows"] else {}
    return Results(files, md, 130 if state.interrupted else 1 if failed else 0)


# ---------------------------------------------------------------------------------------------- the report


def report(state: State, s: Settings, w: Workload, others: list[sr.Contender], backend, wall_s: float) -> dict:
    rows, mism, compared, modes = [], [], 0, {}
    for mode, race in state.races.items():
        levels = race.rows()
        modes[mode] = {"unresolved": race.resolving, "servers": race.servers,
                       "drift": {str(lv["level"]): lv["contenders"][sr.PLAIN].get("drift") for lv in levels}}
        for lv in levels:
            for name, row in lv["contenders"].items():
                rows.append({"contender": label(name), "mode": mode, "level": lv["level"],
                             "ahead": sr.beats_plain(row) if name != sr.PLAIN else None,
                             "behind": sr.behind_plain(row) if name != sr.PLAIN else None, **_json_row(row)})
        if mode == "greedy":
            plain = race.results.get(sr.PLAIN, {})
            for name, by_level in race.results.items():
                for lv, rounds in by_level.items():
                    if name != sr.PLAIN and lv in plain:
                        compared += sr.compared(plain[lv], rounds)
                        mism += [{"contender": name, "level": lv, "prompt": w.slots[(lv, d["slot"])][d["request"]].id,
                                  **d} for d in sr.differences(plain[lv], rounds)]
    listed = {c.name: c for c in others}
    return {"bench": "serving", "model": backend.model_name, "vllm": backend.version, "machine": machine(),
            "settings": {"levels": list(s.levels), "modes": list(s.modes), "requests": s.requests,
                         "max_tokens": s.max_tokens, "rounds": s.rounds, "timeout_s": s.timeout_s,
                         "budget_s": s.budget_s, "smoke": s.smoke, "sampled": MODES["sampled"], "seeded": s.seeded},
            "contenders": {k: {"config": c.speculative, "plugin": c.plugin, "source": c.source, "notes": c.notes,
                               "error": state.errors.get(k)} for k, c in listed.items()},
            "prompts": {"warmup": [p.id for p in w.warmup],
                        "slots": {f"c={lv}/round {r + 1}": [p.id for p in ps] for (lv, r), ps in w.slots.items()}},
            "modes": modes, "rows": rows, "mismatches": mism, "greedy_compared": compared, "wall_s": wall_s,
            "interrupted": state.interrupted, "load": load_record()}


def _json_row(row: dict) -> dict:
    ms = (lambda x: None if x is None else round(1000 * x, 2))
    return {"tokens_per_s": row["output_tokens_per_s"], "tokens_per_s_rounds": row["tokens_per_s_rounds"],
            "vs_plain": row.get("vs_plain"), "paired": row.get("paired"), "resolved": row.get("resolved"),
            "tpot_p50_ms": ms(row["tpot_p50_s"]), "tpot_p99_ms": ms(row["tpot_p99_s"]),
            "ttft_p50_ms": ms(row["ttft_p50_s"]), "accepted": row["accepted"], "drafted": row["drafted"],
            "mean_acceptance_length": row["mean_acceptance_length"], "completed": row["requests"],
            "requests": row["sent"], "timed_out": row["timed_out"], "failed": row["failed"], "servers": row["servers"],
            "drift": row.get("drift")}


def _f(x, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def markdown(doc: dict) -> str:
    m, st = doc["machine"], doc["settings"]
    load = doc.get("load") or {}
    others = load.get("other_cores") or []
    lines = [f"# vLLM serving under load ({doc['model']}, {doc['vllm']}, {m['cpu']}, {m['cores']} cores)", "",
             f"max({st['requests']}, level) requests per round at each level (chat and input-repeating; prompts no "
             f"tuning step reads, none sent twice to one server), {st['max_tokens']} new tokens"
             + ("" if st.get("seeded", True) or "sampled" not in st["modes"] else ", sampled requests unseeded")
             + f", {st['rounds']} round(s) "
             "per server after a warm-up wave; one server per contender, vLLM plain first and last on fresh servers "
             "(the median over its servers); the paired interval is over requests, widened by the spread between "
             "servers; * ahead of plain (interval above 1 and more tokens/s), ! behind "
             f"(interval below 1 or under {sr.TIE}x tokens/s), ? unresolved (the interval holds 1: more servers could "
             f"change it). Wall time {doc['wall_s']:.0f} s; 1-minute "
             f"load average at the start {_f(load.get('load_avg_1m_start'), '.2f')}, other processes' cores per "
             f"sample at most {_f(max(others, default=None), '.2f')}."
             + (" **Interrupted: finished levels only.**" if doc["interrupted"] else ""), ""]
    for mode, info in doc["modes"].items():
        lines += _mode_lines(doc, mode, info)
    n_mism = len(doc["mismatches"])
    if "greedy" in doc["modes"]:
        lines.append(f"Greedy responses identical to vLLM plain's: {doc['greedy_compared'] - n_mism} of "
                     f"{doc['greedy_compared']} compared." + (f" **{n_mism} differ:** " + "; ".join(
                         f"{x['contender']} c={x['level']} {x['prompt']} at token {x['first_difference']}"
                         for x in doc["mismatches"][:10]) if n_mism else ""))
        lines.append("")
    configs = [f"{k}: `{json.dumps(v['config'], separators=(',', ':'))}`" + (" with the plugin" if v["plugin"] else "")
               + (f" ({v['error']})" if v.get("error") else "") for k, v in doc["contenders"].items()]
    lines += ["Configs: " + "; ".join(configs) + "." if configs else ""]
    return "\n".join(lines).rstrip() + "\n"


def _mode_lines(doc: dict, mode: str, info: dict) -> list[str]:
    levels = doc["settings"]["levels"]
    rows = [r for r in doc["rows"] if r["mode"] == mode]
    # "!?": behind plain by its tokens/s on the servers so far, while its interval still holds 1
    mark = (lambda r: "*" if r["ahead"] else ("!" if r["behind"] else "") + ("?" if r.get("resolved") is False else "")
            if r["ahead"] is not None else "")
    lines = [f"## {mode}", "", "Output tokens/s (ratio to vLLM plain):", "",
             "| contender | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
    for name in dict.fromkeys(r["contender"] for r in rows):
        by = {r["level"]: r for r in rows if r["contender"] == name}
        lines.append(f"| {name} | " + " | ".join(f"{by[c]['tokens_per_s']:.1f} ({_f(by[c]['vs_plain'], '.2f')}x){mark(by[c])}"
                                                 if c in by else "-" for c in levels) + " |")
    lines += ["", "| contender | c | tokens/s | vs plain | paired interval | TPOT p50 / p99 ms | TTFT p50 ms | "
                  "accepted / drafted | mean acceptance length | completed | servers |", "|---|" + "---|" * 10]
    for r in rows:
        p = r["paired"] or {}
        iv = f"{p['mean']:.2f} [{_f(p.get('lo'), '.2f')}, {_f(p.get('hi'), '.2f')}]" if p else "-"
        acc = f"{r['accepted']:.0f} / {r['drafted']:.0f}" if r["drafted"] else "-"
        lines.append(f"| {r['contender']} | {r['level']} | {r['tokens_per_s']:.1f} | {_f(r['vs_plain'], '.2f')}x | {iv} | "
                     f"{_f(r['tpot_p50_ms'], '.0f')} / {_f(r['tpot_p99_ms'], '.0f')} | {_f(r['ttft_p50_ms'], '.0f')} | "
                     f"{acc} | {_f(r['mean_acceptance_length'], '.2f')} | {r['completed']} / {r['requests']}"
                     + (f", {r['timed_out']} timed out" if r["timed_out"] else "") + f" | {r['servers']} |")
    drift = {k: v for k, v in info["drift"].items() if v is not None}
    if drift:
        lines += ["", "vLLM plain's drift (its later servers' tokens/s over its first's): "
                  + ", ".join(f"c={k} {v:.2f}" for k, v in drift.items()) + "."]
    if info["unresolved"]:
        lines += ["", "Unresolved (the paired interval still holds 1 after every pass the budget held): "
                  + "; ".join(f"{n} at {', '.join(map(str, lvs))}" for n, lvs in info["unresolved"].items()) + "."]
    return lines + [""]


# ---------------------------------------------------------------------------------------------- backends


class VllmBackend:
    """Real servers through the vllm engine (decoder/engines/vllm/open.py); each server's CPU is credited to
    this run's load watch when it stops."""

    def __init__(self, model: str, startup_timeout_s: float):
        from decoder.engines.registry import EngineRequest, open_engine
        from decoder.engines.vllm.env import installed_version

        self.t0 = time.time()
        self.engine = open_engine("vllm", EngineRequest(model=model))
        self.startup_timeout_s = startup_timeout_s
        self.version = installed_version()
        self.model_name = self.engine.model_name

    def server(self, speculative_config: dict | None = None, plugin: bool = False):
        if speculative_config and speculative_config.get("model") == PROJECT_DRAFT:
            speculative_config = {**speculative_config, "model": self.draft_dir()}
        return Credited(self.engine.server(speculative_config=speculative_config, plugin=plugin,
                                           startup_timeout_s=self.startup_timeout_s))

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


class Credited:
    """A server whose processes' CPU counts as this run's own in the load watch: stopping signals its whole
    group at once, so its engine core and worker may end after their parent and are then never reaped into
    this process's children's time (about 40 % of a server's CPU, measured); without the credit the watch
    would count a quiet machine's vLLM as another process."""

    def __init__(self, server):
        self.server = server

    def __getattr__(self, name):
        return getattr(self.server, name)

    def __enter__(self):
        self.children0 = children_s()
        self.server.__enter__()
        return self

    def __exit__(self, *exc):
        used = group_cpu_s(getattr(self.server, "pgid", None))
        try:
            self.server.__exit__(*exc)
        finally:
            credit_own_cpu(used - (children_s() - self.children0))
            sample_load()


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
    """Count `seconds` of CPU as this run's own in the load watch (moves the watch's children mark)."""
    import common

    meter = getattr(common._WATCH[0], "meter", None)
    if seconds > 0 and meter is not None and hasattr(meter, "children0"):
        meter.children0 -= seconds


class FakeBackend:
    """--smoke: an OpenAI-style streaming server in this process (no vLLM, no model)."""

    version, model_name = "fake vLLM (smoke)", "fake"

    def __init__(self):
        self.t0 = time.time()

    def server(self, speculative_config: dict | None = None, plugin: bool = False):
        return FakeServer(speculative_config, plugin)

    @staticmethod
    def encode(texts: list[str]) -> list[list[int]]:
        return [[10 + (ord(ch) % 200) for ch in t[:24]] for t in texts]


FAKE_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "num_speculative_tokens_per_batch_size", "suffix_decoding_max_cached_requests"}


class FakeServer:
    """Streams deterministic tokens per prompt (and seed), one per step for plain, chunks of several for a
    speculative config (the same tokens), with vLLM-style /metrics counters. Faults for the tests: an unknown
    config key is refused at start like vLLM's validation; method "fake-hang" never answers every 5th request;
    "fake-wrong" changes a token of some responses."""

    served_model_name = "m"
    STEP_S = 0.001

    def __init__(self, config: dict | None, plugin: bool = False):
        self.spec, self.plugin = config or {}, plugin
        self.counts = [0.0, 0.0, 0.0]  # drafts, drafted, accepted
        self.received = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

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

    def why_stopped(self) -> str:
        return "the fake server stopped"

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
        same = self.spec.get("method") == "fake-same"  # drafts that are never accepted: plain's pace (a tie)
        i = step = 0
        while i < len(toks):
            n = 1 if not self.spec or same else 1 + step % (k + 1)
            if self.spec:
                self.counts = [self.counts[0] + 1, self.counts[1] + k, self.counts[2] + n - 1]
            await asyncio.sleep(self.STEP_S * (0.8 if self.spec and not same else 1.0))
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
    p.add_argument("--concurrency", default=None, help="levels, comma-separated (default 1,2,4,8,16,32)")
    p.add_argument("--sampling", default=None, help="greedy, sampled or both, comma-separated (default both)")
    p.add_argument("--requests", type=int, default=None, help="requests per round (default 16; at least the level)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 32)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per level on one server, each its own prompts "
                                                            "(default 1)")
    p.add_argument("--budget", type=float, default=None, metavar="MINUTES",
                   help="the whole run: further passes at the levels a contender leaves unresolved while it holds them "
                        "(default: one pass)")
    p.add_argument("--timeout", type=float, default=None, help="seconds one request may take (default 300)")
    p.add_argument("--decision", default=None, metavar="FILE",
                   help="the main job's decision (RUN/chosen.json or RUN/exports/vllm.json), raced with the plugin and, "
                        "where it uses it, without")
    p.add_argument("--config", dest="configs", action="append", default=[], metavar="NAME=JSON_OR_FILE",
                   help="another contender: a speculative config as JSON, or a file (planner export --engine vllm); "
                        "repeatable")
    p.add_argument("--draft-lengths", default=None, metavar="K,K,...",
                   help="also race vLLM's draft_model method on the project's draft LM at these fixed lengths")
    p.add_argument("--skip", default="", help="built-in contenders to leave out: suffix, ngram (comma-separated)")
    p.add_argument("--model", default="smollm2-135m", help="registry model or Hugging Face folder vLLM serves")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving"), help="writes OUT.json and OUT.md")
    p.add_argument("--unseeded", action="store_true",
                   help="sampled requests without a seed each: vLLM 0.32's CPU engine (plain's too) dies on seeded "
                        "sampling after a chunked prefill (32 requests here: 'CPU Generator does not use offset')")
    p.add_argument("--smoke", action="store_true", help="a fake server in this process: checks the code paths in seconds")
    return p


def main(argv=None) -> int:
    return bench_main("bench_serving", parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
