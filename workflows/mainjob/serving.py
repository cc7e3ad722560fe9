"""The main job on an engine that serves (caps.server: vLLM): a draft length per concurrency, raced under load.

    from workflows.mainjob.serving import ServingSettings, autotune_serving
    summary = autotune_serving(ServingSettings(concurrency=(1, 2, 4, 8, 16)))

Five named phases, each announced with the time left:
  1 profile   the server's own step time by batch size and draft length       profiler/vllm_profile.py
  2 accept    each proposer's acceptance per draft position, in the server     profiler/vllm_accept.py
  3 plan      vLLM plain through the server at every level (the first contender of the race), whose
              tokens/s give the server's own cost per step beyond the profiled forward (scheduling,
              streaming, detokenising on the same cores: planner/serving.py server_overhead); then per
              proposer the draft length per level with the most output tokens/s on the profile plus
              that cost (planner/serving.py plan_method), and its best fixed length
  4 race      one real server per contender and real concurrent clients at every level: the
              stock suffix and ngram settings, the best fixed length, the planned schedule; every greedy
              answer must equal plain's; each level is decided by the paired rule below
  5 write     chosen.json (the decision as the engine takes it), exports, race.json, summary, report

The paired rule, per level: request i of the race is sent to every contender (the same messages,
the same length), so its end-to-end seconds per output token pair up; a contender wins a level when
the sign-flip interval of log(plain / contender) over the requests (workflows/mainjob/signflip.py,
the main job's own test) lies above 1, and among winners the highest geometric mean takes the level.
The decision is one config (an engine runs one proposer): the contender ahead on the most levels
(then by geometric mean), with its draft length set to 0 on every level where it was not ahead of plain, so
speculation is switched off exactly where it was measured to lose; no winner anywhere: plain.
Ctrl-C stops the server in use and keeps every file already written; chosen.json is written last,
atomically, so an interrupted run leaves none (or the previous run's, untouched, in another folder).
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from planner.errors import UserError
from planner.export import SCHEDULE_METHODS, DraftRange
from planner.jsonio import atomic_write_bytes, atomic_write_json
from planner.serving import MAX_CONCURRENCY, draft_costs, plan_method, schedule_ranges, server_overhead

PHASES = 5
CONCURRENCY = (1, 2, 4, 8, 16)
RACE_DRAFT_LENGTHS = (0, 2, 4, 8)  # profiled K: the ends and the middle; the planner interpolates between
STOCK = {  # vLLM's documented defaults a user would otherwise run
    "suffix defaults": {"method": "suffix"},
    "ngram defaults": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
}
PLAIN = "plain"


@dataclass
class ServingSettings:
    engine: str = "vllm"  # a registered engine whose caps.server
    model: str = "smollm2-135m"
    out: str | None = None  # run folder; default runs/<date>-cpu-vllm-<model>
    concurrency: tuple[int, ...] = CONCURRENCY
    workload: str | None = None  # --workload FILE (profiler/workload.py); None: the held-out questions
    methods: tuple[str, ...] = ("ngram", "suffix", "draft_model")
    max_tokens: int = 32  # per request, acceptance and race
    race_requests: int = 16  # requests per level (the held-out race questions, first turns and follow-ups)
    accept_requests: int = 12
    rounds: int = 1  # passes over a level's requests per contender; the median seconds per token counts
    budget_minutes: float = 25.0
    draft_lengths: tuple[int, ...] = RACE_DRAFT_LENGTHS
    profile: str | None = None  # reuse a vLLM profile instead of measuring
    accept: tuple[str, ...] = ()  # reuse acceptance records (planner accept --engine vllm) instead of measuring
    draft: str | None = None  # the project's draft LM (default: shipped for the model)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    request_timeout_s: float = 600.0
    quiet: bool = False


@dataclass
class Contender:
    name: str
    speculative: dict | None  # the speculative config (None: plain)
    predicted: dict = field(default_factory=dict)  # level -> predicted output tokens/s (planned contenders)


# ---------------------------------------------------------------------------------------------- settings


def check(s: ServingSettings) -> None:
    levels = s.concurrency
    if not levels or any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CONCURRENCY
                         for c in levels) or list(levels) != sorted(set(levels)):
        raise UserError(f"--concurrency: expected increasing integers in 1..{MAX_CONCURRENCY}, got "
                        f"{','.join(map(str, levels))}")
    # 5 paired requests are the fewest whose sign-flip interval can exclude 1 (2^5 ALPHA >= 1)
    for name, v, lo, hi in (("--decode-tokens", s.max_tokens, 2, 4096), ("--decode-prompts", s.race_requests, 5, 4096),
                            ("--accept-prompts", s.accept_requests, 1, 4096), ("--rounds", s.rounds, 1, 20)):
        if not lo <= v <= hi:
            raise UserError(f"{name}: expected an integer in {lo}..{hi}, got {v}")
    if not 1.0 <= s.budget_minutes <= 24 * 60:
        raise UserError(f"--budget: expected minutes in 1..1440, got {s.budget_minutes:g}")
    from profiler.vllm_accept import METHODS

    bad = [m for m in s.methods if m not in METHODS]
    if bad or not s.methods:
        raise UserError(f"--methods: expected a subset of {','.join(METHODS)}, got {','.join(s.methods)}")


def _sampling(s: ServingSettings):
    from planner.sampling import Sampling

    return Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


def requests(s: ServingSettings) -> tuple[list, list]:
    """(acceptance requests, race requests): disjoint halves of the user's workload (even / odd lines),
    else of the held-out questions (training/splits.py: never trained on, never benchmarked)."""
    from profiler.workload import Request

    if s.workload:
        from profiler.workload import read_workload

        rows = read_workload(s.workload, default_max_tokens=s.max_tokens)
        accept, race = rows[0::2], rows[1::2]
        if len(race) < 2:
            raise UserError(f"{s.workload}: {len(rows)} requests; the race needs at least 4 (half measure acceptance)")
        return accept[:s.accept_requests], race[:s.race_requests]
    from training.splits import accept_and_race
    from workflows.cli.inputs import DEFAULT_QUESTIONS

    a, r = accept_and_race(DEFAULT_QUESTIONS, s.accept_requests, s.race_requests, turns=2)  # disjoint halves

    def req(p):
        msgs = p.messages() if hasattr(p, "messages") else [{"role": "user", "content": p}]
        return Request(messages=msgs, max_tokens=s.max_tokens)

    return [req(p) for p in a[:s.accept_requests]], [req(p) for p in r[:s.race_requests]]


def method_config(method: str, k: int, draft_dir: str | None, ranges: list[list[int]] | None = None) -> dict:
    from profiler.vllm_accept import speculative_config

    cfg = speculative_config(method, k, draft_dir)
    if ranges and len(ranges) > 1:
        cfg["num_speculative_tokens_per_batch_size"] = ranges
    return cfg


# ---------------------------------------------------------------------------------------------- 4 race


def distinct(contenders: list[Contender]) -> list[Contender]:
    """One server per config: a planned schedule that drafts the same length everywhere is the fixed one,
    and a planned length equal to a stock setting is that setting (which then carries the prediction)."""
    seen: dict[str, Contender] = {}
    for c in contenders:
        key = json.dumps(c.speculative, sort_keys=True)
        if key not in seen:
            seen[key] = c
        elif not seen[key].predicted and c.predicted:
            seen[key].predicted = dict(c.predicted)
    return list(seen.values())


LEARNS = ("suffix",)  # vLLM proposers that also draft from earlier requests' answers (suffix's global tree)


def race_contender(engine, c: Contender, race_reqs: list, warm: list, s: ServingSettings, levels, say,
                   results: dict, server_kwargs: dict | None = None) -> None:
    """`c` at every level (results[c.name][level] = its rounds), each pass after a warm-up wave of `level`
    requests outside the race (so no contender's first pass at a batch size is a cold one). One server
    for all, except for a proposer that learns from earlier answers: it gets a fresh server for every
    pass, or it would draft a repeated request's answer from its own first pass."""
    from profiler.load_generator import run_load
    from profiler.serving_metrics import fetch_spec_decode
    from profiler.vllm_accept import sampled_requests

    reqs = sampled_requests(race_reqs, _sampling(s), s.seed)  # request i seeded seed + i, the same for all
    warm = sampled_requests(warm, _sampling(s), s.seed + len(reqs))
    passes = [level for level in levels for _ in range(s.rounds)]
    fresh = (c.speculative or {}).get("method") in LEARNS
    for group in ([[p] for p in passes] if fresh else [passes]):
        t0 = time.perf_counter()
        say(f"      {c.name}: starting vLLM" + (f" ({json.dumps(c.speculative)})" if c.speculative else ""))
        with engine.server(speculative_config=c.speculative, **(server_kwargs or {})) as server:
            say(f"      {c.name}: ready in {time.perf_counter() - t0:.0f} s")
            for level in group:
                wave = [warm[i % len(warm)] for i in range(level)]
                run_load(server.url, server.served_model_name, wave, level, s.request_timeout_s)
                before = fetch_spec_decode(server.url)
                res = run_load(server.url, server.served_model_name, reqs, level, s.request_timeout_s)
                counters = fetch_spec_decode(server.url) - before
                results.setdefault(c.name, {}).setdefault(level, []).append({"result": res, "counters": counters})
                say(f"      {c.name} at {level}: {res.output_tokens_per_s:.1f} output tokens/s"
                    + (f", {res.timed_out} timed out" if res.timed_out else ""))


def race_all(engine, contenders: list[Contender], race_reqs: list, warm: list, s: ServingSettings, levels, say,
             results: dict | None = None, failed: dict | None = None) -> tuple[dict, dict]:
    """Every contender in turn; (failed: name -> why its server stopped, results). A contender whose server
    dies (a config vLLM takes, then fails on) is out of the decision and the race goes on; plain's is
    fatal. The dicts passed in fill as it goes, so an interrupted race keeps what it measured."""
    results = {} if results is None else results
    failed = {} if failed is None else failed
    for c in contenders:
        try:
            race_contender(engine, c, race_reqs, warm, s, levels, say, results)
        except UserError as e:
            if c.speculative is None:
                raise
            failed[c.name] = str(e)
            results.pop(c.name, None)
            say(f"      {c.name}: failed, out of the race ({e})")
    return failed, results


def per_request_s(rounds: list[dict]) -> list[float | None]:
    """Per request: median over rounds of end-to-end seconds per output token (None: failed)."""
    n = len(rounds[0]["result"].records)
    out = []
    for i in range(n):
        xs = [r["result"].records[i] for r in rounds]
        ok = [x.latency_s / x.output_tokens for x in xs if x.ok and x.latency_s and x.output_tokens > 0]
        out.append(float(np.median(ok)) if len(ok) == len(xs) else None)
    return out


def mismatches(plain_rounds: list[dict], rounds: list[dict]) -> int:
    """Requests whose token ids differ from plain's (greedy: speculation must not change a token)."""
    a = plain_rounds[0]["result"].records
    b = rounds[0]["result"].records
    return sum(1 for x, y in zip(a, b) if x.ok and y.ok and x.token_ids is not None and x.token_ids != y.token_ids)


def decide_level(results: dict, level: int, greedy: bool) -> dict:
    """Each contender against plain at one level (the paired rule), and the level's winner."""
    from workflows.mainjob.signflip import interval

    plain_s = per_request_s(results[PLAIN][level])
    rows, winner, best = {}, PLAIN, 1.0
    for name, by_level in results.items():
        rounds = by_level.get(level)
        if rounds is None:
            continue
        res = [r["result"] for r in rounds]
        tps = float(np.median([r.output_tokens_per_s for r in res]))
        counters = rounds[0]["counters"]
        row = {"output_tokens_per_s": tps, "tpot_p50_s": res[0].tpot_p50_s, "tpot_p99_s": res[0].tpot_p99_s,
               "ttft_p50_s": res[0].ttft_p50_s, "timed_out": sum(r.timed_out for r in res),
               "accepted": counters.accepted_tokens, "drafted": counters.draft_tokens,
               "mean_acceptance_length": counters.mean_acceptance_length if counters.speculating else None}
        if name != PLAIN:
            mine = per_request_s(rounds)
            x = [math.log(p / m) for p, m in zip(plain_s, mine) if p and m]
            iv = interval(x)
            bad = mismatches(results[PLAIN][level], rounds) if greedy else 0
            row.update({"paired": iv.to_json(), "mismatches": bad})
        rows[name] = row
    plain_tps = rows[PLAIN]["output_tokens_per_s"]
    for name, row in rows.items():
        row["vs_plain"] = row["output_tokens_per_s"] / plain_tps if plain_tps > 0 else None
        if name != PLAIN and beats_plain(row) and row["paired"]["mean"] > best:
            winner, best = name, row["paired"]["mean"]
    return {"level": level, "contenders": rows, "winner": winner}


def beats_plain(row: dict) -> bool:
    """A contender's row at a level is ahead of plain: the paired interval over requests lies above 1,
    no greedy answer changed, and the level's output tokens/s is above plain's too (per-request
    seconds per token weigh every request alike; the level's throughput waits for its slowest one,
    and at 16 requests the two were seen to disagree: interval above 1, 0.85x tokens/s)."""
    paired = row.get("paired") or {}
    return (row.get("mismatches") == 0 and (paired.get("lo") or 0.0) > 1.0
            and (row.get("vs_plain") or 0.0) > 1.0)


def decision(contenders: list[Contender], levels_out: list[dict], levels) -> tuple[Contender | None, dict]:
    """The one config: the contender that wins the most levels (then is ahead of plain at the most, then
    the highest geometric mean of tokens/s over plain), its draft length 0 wherever it was not ahead of
    plain (beats_plain). A proposer vLLM runs at one draft length only (planner/export.py
    SCHEDULE_METHODS) cannot be switched off by batch size: it is a candidate only if ahead everywhere."""
    scores = []
    for c in contenders:
        if c.speculative is None:
            continue
        wins = [lv["level"] for lv in levels_out if lv["winner"] == c.name]
        ahead = [lv["level"] for lv in levels_out if beats_plain(lv["contenders"].get(c.name) or {})]
        if c.speculative.get("method") not in SCHEDULE_METHODS["vllm"] and len(ahead) < len(levels):
            continue
        ratios = [lv["contenders"].get(c.name, {}).get("vs_plain") or 0.0 for lv in levels_out]
        geo = math.exp(float(np.mean(np.log(np.maximum(ratios, 1e-9))))) if ratios else 0.0
        scores.append((len(wins), len(ahead), geo, c, ahead))
    scores.sort(key=lambda t: t[:3], reverse=True)
    if not scores or scores[0][1] == 0:
        return None, {"winner": PLAIN, "why": "no contender beat plain beyond the noise at any level (a proposer vLLM runs at one "
                                        "draft length must win every level)"}
    *_, geo, c, ahead = scores[0]
    cfg = dict(c.speculative)
    k_of = _k_by_level(cfg, levels)
    per_level = {lv: (k_of[lv] if lv in ahead else 0) for lv in levels}
    ranges = schedule_ranges(per_level, list(levels))
    cfg.pop("num_speculative_tokens_per_batch_size", None)
    cfg["num_speculative_tokens"] = max(k for *_, k in ranges) or cfg.get("num_speculative_tokens", 1)
    if len(ranges) > 1:
        cfg["num_speculative_tokens_per_batch_size"] = ranges
    return Contender(c.name, cfg), {"winner": c.name, "levels_ahead_of_plain": ahead, "geomean_vs_plain": geo,
                                    "draft_length_by_level": per_level}


def _k_by_level(cfg: dict, levels) -> dict[int, int]:
    default = int(cfg.get("num_speculative_tokens") or _SUFFIX_CAP)
    table = cfg.get("num_speculative_tokens_per_batch_size") or []
    return {lv: next((k for lo, hi, k in table if lo <= lv <= hi), default) for lv in levels}


_SUFFIX_CAP = 32  # vLLM's suffix method without num_speculative_tokens: its own default cap


# ---------------------------------------------------------------------------------------------- the pipeline


def autotune_serving(s: ServingSettings) -> dict:
    from decoder.engines.registry import EngineRequest, open_engine
    from workflows.mainjob.runs import default_out, shown

    check(s)
    say = (lambda line: None) if s.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    t0, budget = time.time(), s.budget_minutes * 60

    def phase(k: int, text: str) -> None:
        say(f"[{k}/{PHASES}] {text}  ({time.time() - t0:.0f} s in, budget {s.budget_minutes:g} min)")

    accept_reqs, race_reqs = requests(s)  # a bad workload is refused before anything starts
    engine = open_engine(s.engine, EngineRequest(model=s.model))
    out = Path(s.out) if s.out else default_out("cpu", engine.model_name, engine.caps.name)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    levels = list(s.concurrency)
    summary: dict = {"engine": engine.caps.name, "model": engine.model_name, "concurrency": levels,
                     "settings": {k: v for k, v in asdict(s).items() if k != "quiet"}, "phases": {}}

    phase(1, "profile: vLLM's step time by batch size and draft length")
    profile_path = _profile(engine, s, levels, out, budget * 0.3, say)
    from planner.profile import load_batch_profiles

    profiles = load_batch_profiles(str(profile_path))
    missing = [c for c in levels if c not in profiles]
    if missing:
        raise UserError(f"{profile_path}: no series at batch size {', '.join(map(str, missing))} (profile every "
                        "--concurrency level)")
    summary["phases"]["profile_s"] = time.time() - t0

    phase(2, f"accept: {', '.join(s.methods)} on {len(accept_reqs)} requests")
    draft_dir = _draft_dir(engine, s) if "draft_model" in s.methods else None
    records = _acceptance(engine, s, accept_reqs, draft_dir, out, say)
    summary["phases"]["accept_s"] = time.time() - t0

    phase(3, "plan: vLLM plain through the server at every level (its cost per step beyond the profile), "
             "then the draft length per level, per proposer")
    results: dict = {}
    failed: dict[str, str] = {}
    contenders = [Contender(PLAIN, None)]
    interrupted = False
    try:
        race_all(engine, contenders, race_reqs, accept_reqs, s, levels, say, results, failed)
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: the server is stopped; writing what was raced (no chosen.json)")
    if not interrupted:
        plain_tps = {lv: decide_level(results, lv, False)["contenders"][PLAIN]["output_tokens_per_s"] for lv in levels}
        overhead = server_overhead(profiles, plain_tps, levels)
        summary["server_overhead_s"] = overhead
        say("      the server's own cost per step (ms) by level: "
            + ", ".join(f"{lv}: {overhead[lv] * 1e3:.0f}" for lv in levels))
        contenders = _planned_contenders(records, profiles, levels, s, draft_dir, overhead, out, say)
        summary["phases"]["plan_s"] = time.time() - t0

        phase(4, f"race: {len(contenders) - 1} contenders against plain x levels {','.join(map(str, levels))}, "
                 f"{len(race_reqs)} requests each")
        try:
            race_all(engine, contenders[1:], race_reqs, accept_reqs, s, levels, say, results, failed)
        except KeyboardInterrupt:
            interrupted = True
            say("interrupted: the server is stopped; writing what was raced (no chosen.json)")
    greedy = s.temperature <= 0
    levels_out = [decide_level(results, lv, greedy) for lv in levels
                  if PLAIN in results and lv in results[PLAIN]]
    race_doc = {"levels": levels_out, "contenders": [{"name": c.name, "config": c.speculative,
                                                      "predicted_tokens_per_s": c.predicted} for c in contenders],
                "requests": len(race_reqs), "max_tokens": s.max_tokens, "rounds": s.rounds,
                "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k},
                "server_overhead_s": summary.get("server_overhead_s"), "failed": failed, "interrupted": interrupted}
    atomic_write_json(out / "race.json", race_doc)
    summary["phases"]["race_s"] = time.time() - t0
    if interrupted:
        raise KeyboardInterrupt

    phase(5, "write: the decision, exports, report")
    chosen, why = decision([c for c in contenders if c.name not in failed], levels_out, levels)
    summary.update({"decision": why, "levels": levels_out, "prediction_error": _prediction_error(contenders, levels_out)})
    _exports(chosen, out, draft_dir)
    atomic_write_bytes(out / "report.md", report(summary, contenders).encode())
    summary["wall_s"] = time.time() - t0
    atomic_write_json(out / "summary.json", _jsonable(summary))
    doc = {"format": "tree-planner/serving-decision", "engine": engine.caps.name, "model": engine.model_name,
           "speculative_config": None if chosen is None else chosen.speculative, "decision": why,
           "concurrency": levels, "race": "race.json", "profile": shown(profile_path)}
    atomic_write_json(out / "chosen.json", doc)  # last: a run without it did not finish
    say(f"decision: {why['winner']}" + ("" if chosen is None else f" {json.dumps(chosen.speculative)}"))
    say(f"wrote {shown(out)}/ (chosen.json, race.json, plans.json, exports/, report.md, summary.json)")
    return summary


def _planned_contenders(records: dict, profiles: dict, levels, s: ServingSettings, draft_dir: str | None,
                        overhead: dict[int, float], out: Path, say) -> list[Contender]:
    """Plain, the stock settings, the best proposer's best fixed length and its planned schedule, each
    priced on the profile plus the server's measured cost per step; plans.json records every proposer's."""
    max_k = max(s.draft_lengths)
    plans = {}
    for m, rec in records.items():
        costs = draft_costs(rec, profiles, levels) if rec["guesser"].get("draft_passes") == "depth" else {}
        plans[m] = plan_method(m, rec, profiles, levels, max_k, costs, schedulable=m in SCHEDULE_METHODS["vllm"],
                               overhead_s=overhead)
        say(f"      {m}: draft length by level {plans[m]['per_level']}, best fixed {plans[m]['best_fixed']}")
    best = max(plans.values(), key=lambda p: float(np.mean(np.log([p["predicted"][b] for b in levels]))))
    contenders = [Contender(PLAIN, None)]
    contenders += [Contender(n, dict(c)) for n, c in STOCK.items()]
    fixed_cfg = method_config(best["method"], best["best_fixed"], draft_dir)
    contenders.append(Contender(f"fixed {best['method']} K={best['best_fixed']}", fixed_cfg,
                                dict(best["fixed_predicted"])))
    planned_ranges = schedule_ranges(best["per_level"], levels)
    if any(k for *_, k in planned_ranges):
        cfg = method_config(best["method"], max(k for *_, k in planned_ranges), draft_dir, planned_ranges)
        contenders.append(Contender(f"planned {best['method']}", cfg, dict(best["predicted"])))
    atomic_write_json(out / "plans.json", {"plans": _jsonable(plans), "chosen_method": best["method"],
                                           "server_overhead_s": _jsonable(overhead)})
    return distinct(contenders)


def _prediction_error(contenders: list[Contender], levels_out: list[dict]) -> dict:
    """Per planned contender and level: predicted / measured output tokens/s - 1."""
    out = {}
    for c in contenders:
        for lv in levels_out:
            row = lv["contenders"].get(c.name)
            if c.predicted and row and row["output_tokens_per_s"] > 0:
                out.setdefault(c.name, {})[lv["level"]] = c.predicted[lv["level"]] / row["output_tokens_per_s"] - 1
    return out


def _profile(engine, s: ServingSettings, levels, out: Path, budget_s: float, say) -> Path:
    if s.profile:
        if not Path(s.profile).is_file():
            raise UserError(f"--profile {s.profile}: file not found")
        return Path(s.profile)
    from profiler.vllm_profile import ServingProfileSpec, profile_serving

    spec = ServingProfileSpec(draft_lengths=tuple(s.draft_lengths), batch_sizes=tuple(levels),
                              time_budget_s=max(60.0, budget_s), progress=not s.quiet)
    profile = profile_serving(engine, spec, say=lambda line: say(f"      {line}"))
    return atomic_write_json(out / "profile.json", profile)


def _draft_dir(engine, s: ServingSettings) -> str:
    from decoder.engines.models import shipped
    from decoder.engines.vllm.draft_folder import served_draft

    src = s.draft or shipped(engine.model_name, "draft_lm")
    if src is None:
        raise UserError(f"--methods draft_model: no draft LM ships for {engine.model_name}; pass --draft DIR")
    return str(served_draft(src, engine.model_dir))


def _acceptance(engine, s: ServingSettings, accept_reqs: list, draft_dir: str | None, out: Path, say) -> dict:
    from planner.jsonio import read_json

    records = {}
    for path in s.accept:
        rec = read_json(path)
        m = (rec.get("guesser") or {}).get("method")
        if m not in s.methods:
            raise UserError(f"--accept {path}: 'guesser.method' {m!r} is not one of --methods {','.join(s.methods)}")
        records[m] = rec
    todo = [m for m in s.methods if m not in records]
    if todo:
        from profiler.vllm_accept import measure_methods

        found = measure_methods(engine, todo, accept_reqs, _sampling(s), seed=s.seed, draft_length=max(s.draft_lengths),
                                concurrency=4, draft_model=draft_dir, timeout_s=s.request_timeout_s,
                                say=lambda line: say(f"      {line}"))
        for m, rec in found.items():
            atomic_write_json(out / f"accept-{m}.json", rec)
        records.update(found)
    return records


def _exports(chosen: Contender | None, out: Path, draft_dir: str | None) -> None:
    """The decision for each engine that takes a per-batch-size schedule: vLLM's config as it was raced;
    TensorRT-LLM's draft_len_schedule and SGLang's flags from the same ranges where they express them."""
    d = out / "exports"
    d.mkdir(exist_ok=True)
    if chosen is None:
        atomic_write_json(d / "vllm.json", {"speculative_config": None, "notes": ["plain decoding: no speculation"]})
        return
    cfg = chosen.speculative
    atomic_write_json(d / "vllm.json", {"speculative_config": cfg, "command_line": "--speculative-config "
                                        + json.dumps(cfg, separators=(",", ":"))})
    ranges = cfg.get("num_speculative_tokens_per_batch_size") or [[1, MAX_CONCURRENCY, cfg.get("num_speculative_tokens")]]
    notes = []
    for engine in ("trtllm", "sglang"):  # planner/export.py's builders: each engine's own constraints and notes
        try:
            export = _export_for(engine, cfg["method"], [DraftRange(*r) for r in ranges], draft_dir, d)
        except UserError as e:
            notes.append(f"{engine}: {e}")
            continue
        atomic_write_json(d / f"{engine}.json", export.to_json())
    atomic_write_json(d / "notes.json", {"notes": notes})


def _export_for(engine: str, method: str, ranges: list, draft_dir: str | None, d: Path):
    """The same ranges as another engine's settings (a chain plan as deep as the longest draft)."""
    from planner.export import ENGINE_METHODS, ExportOptions, build
    from planner.tree import Tree, TreeState

    if method not in ENGINE_METHODS[engine]:
        raise UserError(f"no {method} proposer (it has {', '.join(ENGINE_METHODS[engine])})")
    depth = max(r.k for r in ranges) or 1
    chain = Tree("medusa", [TreeState(0, [(0,) * i for i in range(1, depth + 1)], 1.0, depth + 1)], 1.0)
    opts = ExportOptions(engine, method, draft_dir if method == "draft_model" else None,
                         adaptive_config_path=str(d / f"{engine}.adaptive.json"))
    return build(chain, ranges, opts, {"source": "planner autotune --engine vllm, the raced schedule"}, [])


def report(summary: dict, contenders: list[Contender]) -> str:
    levels = summary["concurrency"]
    lines = [f"# Serving autotune: {summary['model']} on {summary['engine']}", "",
             f"Decision: **{summary['decision']['winner']}**"
             + (f", draft length by level {summary['decision'].get('draft_length_by_level')}"
                if summary['decision'].get('draft_length_by_level') else ""), "",
             "Output tokens/s (x vLLM plain at the same level; * = beat plain beyond the noise, paired per request)", "",
             "| contender | " + " | ".join(str(c) for c in levels) + " |", "|---" * (len(levels) + 1) + "|"]
    by_level = {lv["level"]: lv for lv in summary["levels"]}
    for c in contenders:
        cells = []
        for lv in levels:
            row = by_level.get(lv, {}).get("contenders", {}).get(c.name)
            if row is None:
                cells.append("-")
                continue
            star = "*" if by_level[lv]["winner"] == c.name != PLAIN else ""
            cells.append(f"{row['output_tokens_per_s']:.1f} ({row['vs_plain']:.2f}x){star}")
        lines.append(f"| {c.name} | " + " | ".join(cells) + " |")
    lines += ["", "Time per output token p50 / p99 (ms)", "", "| contender | " + " | ".join(map(str, levels)) + " |",
              "|---" * (len(levels) + 1) + "|"]
    for c in contenders:
        cells = []
        for lv in levels:
            row = by_level.get(lv, {}).get("contenders", {}).get(c.name)
            ok = row and row["tpot_p50_s"] is not None and row["tpot_p99_s"] is not None
            cells.append(f"{row['tpot_p50_s'] * 1e3:.0f} / {row['tpot_p99_s'] * 1e3:.0f}" if ok else "-")
        lines.append(f"| {c.name} | " + " | ".join(cells) + " |")
    err = summary.get("prediction_error") or {}
    if err:
        lines += ["", "Predicted / measured output tokens/s - 1:", ""]
        lines += [f"- {name}: " + ", ".join(f"{lv}: {e:+.0%}" for lv, e in sorted(v.items(), key=lambda t: int(t[0])))
                  for name, v in err.items()]
    overhead = summary.get("server_overhead_s") or {}
    if overhead:
        lines += ["", "The server's own cost per step beyond the profiled forward, from vLLM plain's pass (ms; "
                  "added to every priced step): " + ", ".join(f"{lv}: {v * 1e3:.0f}" for lv, v in
                                                            sorted(overhead.items(), key=lambda t: int(t[0])))]
    return "\n".join(lines) + "\n"


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x
