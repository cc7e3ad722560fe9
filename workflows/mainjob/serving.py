"""The main job on an engine that serves (caps.server: vLLM): a draft length per concurrency, raced under load.

    from workflows.mainjob.serving import ServingSettings, autotune_serving
    summary = autotune_serving(ServingSettings(concurrency=(1, 2, 4, 8, 16)))

Six named phases, each announced with the time left:
  1 profile   the server's own step time by batch size and draft length       profiler/vllm_profile.py
  2 accept    each proposer's acceptance per draft position, in the server     profiler/vllm_accept.py
  3 plan      vLLM plain through the server at every level (the first contender of the race): its
              streams split a request's time into served steps and the rest (prefill, first token,
              ramp and tail), which speculation does not shorten (planner/serving.py served_level);
              then per proposer the draft length per level with the most output tokens/s, a draft
              priced at the profile's cost of scoring it on plain's served step (plan_method), and
              its best fixed length
  4 race      one real server per contender and real concurrent clients at every level: the
              stock suffix and ngram settings, the best fixed length, the planned schedule; every greedy
              answer must equal plain's; each level is decided by the paired rule (serving_race.py).
              (--budget: priced from plain's race, the planned schedule first, the rest while they fit)
  5 confirm   the decided config raced against plain at every level where no contender ran it as it is
              (speculation switched off where it lost makes a new schedule), so its rows are measured;
              if that does not fit the budget, the winner as raced is the decision (or plain); then the
              decision is the config measured as written with the highest geometric mean over plain
              among those behind plain at no level (serving_race.py best_measured), where there is one
  6 write     chosen.json (the decision as the engine takes it), exports, race.json, summary, report

The paired rule and the one-config decision: workflows/mainjob/serving_race.py.
Ctrl-C stops the server in use and keeps every file already written; chosen.json is written last,
atomically, so an interrupted run leaves none (or the previous run's, untouched, in another folder).
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from planner.engines import kind as engine_kind
from planner.errors import UserError
from planner.export import SCHEDULE_METHODS, DraftRange
from planner.jsonio import atomic_write_bytes, atomic_write_json
from planner.serving import (
    MAX_CONCURRENCY,
    ServedLevel,
    draft_costs,
    plan_method,
    schedule_ranges,
    served_level,
    server_overhead,
)
from workflows.mainjob.serving_race import (
    DECISION,
    PLAIN,
    SERVED_STEP,
    WARMUP_TOKENS,
    Contender,
    ahead_over_range,
    as_raced,
    best_measured,
    close_plain,
    confirm,
    decide_level,
    decision,
    distinct,
    measured_record,
    measured_why,
    plain_drift,
    predicted_seconds,
    raced_as_is,
    race_all,
    race_order,
    race_sizes,
)
from workflows.mainjob.serving_race import sampling as _sampling
from workflows.mainjob.serving_report import prediction_error, prediction_parts, report

PHASES = 6
_DEFAULTS = engine_kind("vllm").defaults  # planner/engines.py: every engine's defaults in one place
CONCURRENCY = (1, 2, 4, 8, 16)
WRITE_S = 15.0  # decide, write the exports and the report: kept from the budget with the confirmation
RACE_DRAFT_LENGTHS = (0, 2, 4, 8)  # profiled K: the ends and the middle; the planner interpolates between
STOCK = {  # vLLM's documented defaults a user would otherwise run
    "suffix defaults": {"method": "suffix"},
    "ngram defaults": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
}


@dataclass
class ServingSettings:
    engine: str = "vllm"  # a registered engine whose caps.server
    model: str = "smollm2-135m"
    out: str | None = None  # run folder; default runs/<date>-cpu-vllm-<model>
    concurrency: tuple[int, ...] = CONCURRENCY
    workload: str | None = None  # --workload FILE (profiler/workload.py); None: the held-out questions
    methods: tuple[str, ...] = ("ngram", "suffix", "draft_model")
    max_tokens: int = _DEFAULTS.decode_tokens  # per request, acceptance and race
    race_requests: int = _DEFAULTS.decode_prompts  # requests per level (the held-out race questions' two turns)
    accept_requests: int = _DEFAULTS.accept_prompts  # the acceptance half's requests measured
    rounds: int = _DEFAULTS.rounds  # passes over a level's requests per contender; the median seconds per token counts
    budget_minutes: float = _DEFAULTS.budget_minutes  # the whole run: contenders it cannot fit are not raced
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

    reused = f" ({len(s.accept)} reused)" if s.accept else ""
    phase(2, f"accept: {', '.join(s.methods)} on {len(accept_reqs)} requests{reused}")
    draft_dir = _draft_dir(engine, s) if "draft_model" in s.methods else None
    records = _acceptance(engine, s, accept_reqs, draft_dir, out, say)
    summary["phases"]["accept_s"] = time.time() - t0

    phase(3, "plan: vLLM plain through the server at every level (its served step and the rest of each "
             "request's time), then the draft length per level, per proposer")
    results: dict = {}
    failed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    timings: dict = {}
    contenders = [Contender(PLAIN, None)]
    # plain's two servers, the first contender and the confirmation must fit what is left: if not at full
    # size, every contender races fewer requests at the levels where a request takes longest
    sizes = _race_sizes(profiles, records, s, levels, budget - (time.time() - t0) - WRITE_S, len(race_reqs))
    cut = {lv: n for lv, n in sizes.items() if n < len(race_reqs)}
    if cut:
        say(f"      to fit the budget, every contender races the first {', '.join(f'{n} at {lv}' for lv, n in cut.items())}"
            f" of the {len(race_reqs)} requests")
    interrupted = False
    try:  # Ctrl-C in plain's pass or in the race: race.json keeps what was raced
        race_all(engine, contenders, race_reqs, accept_reqs, s, levels, say, results, failed, timings, sizes)
        plain_rows = {lv: decide_level(results, lv, False)["contenders"][PLAIN] for lv in levels}
        plain_tps = {lv: row["output_tokens_per_s"] for lv, row in plain_rows.items()}
        overhead = server_overhead(profiles, plain_tps, levels)
        summary["server_overhead_s"] = overhead
        served = _served(plain_rows)
        summary["served"] = {lv: vars(v) for lv, v in served.items()}
        say("      the server's own cost per step (ms) by level: "
            + ", ".join(f"{lv}: {overhead[lv] * 1e3:.0f}" for lv in levels))
        if served:
            say("      plain's served step / time per request outside it (ms) by level: "
                + ", ".join(f"{lv}: {v.decode_step_s * 1e3:.0f} / {v.request_s * 1e3:.0f}" for lv, v in served.items()))
        contenders = _planned_contenders(records, profiles, levels, s, draft_dir, overhead, out, say, served)
        summary["phases"]["plan_s"] = time.time() - t0

        phase(4, f"race: {len(contenders) - 1} contenders against plain x levels {','.join(map(str, levels))}, "
                 f"{len(race_reqs)} requests each, as the budget allows")
        # plain's closing server (close_plain) and the decision, which may be a config no contender ran
        # (confirm): plain's time is kept for each, and for writing
        reserve = 2 * timings[PLAIN]["wall_s"] + WRITE_S
        for i, (c, eta) in enumerate(race_order(contenders[1:], timings[PLAIN], levels, s.rounds, plain_tps)):
            left = budget - (time.time() - t0) - reserve
            if i and eta > left:  # the first always races: a race of plain alone decides nothing
                skipped[c.name] = (f"not raced: predicted {eta:.0f} s, the budget left {max(left, 0):.0f} s "
                                   f"after keeping {reserve:.0f} s for plain again, the confirmation and writing")
                say(f"      {c.name}: {skipped[c.name]}")
                continue
            say(f"      {c.name}: predicted {eta:.0f} s")
            race_all(engine, [c], race_reqs, accept_reqs, s, levels, say, results, failed, timings, sizes)
        if any(name != PLAIN for name in results):
            say("      plain again, on a fresh server: each level's plain is the median over a server before the "
                "contenders and one after them")
            close_plain(engine, race_reqs, accept_reqs, s, levels, say, results, failed, timings, sizes)
            say("      plain's drift over the race (closing / first server's tokens/s): " + ", ".join(
                f"{lv}: {d:.2f}" for lv in levels if (d := plain_drift(results[PLAIN].get(lv) or [])) is not None))
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: the server is stopped; writing what was raced (no chosen.json)")
    greedy = s.temperature <= 0
    levels_out = [decide_level(results, lv, greedy) for lv in levels
                  if PLAIN in results and lv in results[PLAIN]]
    race_doc = {"levels": levels_out, "contenders": [{"name": c.name, "config": c.speculative,
                                                      "predicted_tokens_per_s": c.predicted, "priced": c.priced}
                                                     for c in contenders],
                "requests": len(race_reqs), "requests_by_level": sizes, "max_tokens": s.max_tokens, "rounds": s.rounds,
                "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k},
                "server_overhead_s": summary.get("server_overhead_s"), "failed": failed, "skipped": skipped,
                "interrupted": interrupted}
    atomic_write_json(out / "race.json", race_doc)
    summary["phases"]["race_s"] = time.time() - t0
    if interrupted:
        raise KeyboardInterrupt

    raced = [c for c in contenders if c.name not in failed and c.name not in skipped]
    chosen, why = decision(raced, levels_out, levels)
    phase(5, "confirm: the decision as it is written, raced against plain unless a contender already ran it")
    if chosen is not None and raced_as_is(chosen, raced) is None:  # a new config: raced only if it fits the budget
        eta = predicted_seconds(Contender(DECISION, chosen.speculative), timings[PLAIN], levels, s.rounds, plain_tps)
        left = budget - (time.time() - t0) - WRITE_S
        if eta > left:
            skip = (f"not raced: predicted {eta:.0f} s, the budget left {max(left, 0):.0f} s; the schedule it would "
                    f"have confirmed: {json.dumps(chosen.speculative)}")
            say(f"      the decision as written: {skip}")
            winner = next(c for c in raced if c.name == why["winner"])
            chosen, why = as_raced(winner, levels_out, levels, skip)
            say(f"      so the decision is {why['winner']} as raced")
    shown_contenders = contenders
    try:
        confirmed = confirm(engine, chosen, contenders, results, failed, race_reqs, accept_reqs, s, levels, say, sizes)
    except KeyboardInterrupt:
        say("interrupted: the server is stopped; race.json keeps the race (no chosen.json)")
        raise
    if confirmed is not None:
        why["measured_as"] = confirmed.name
        if confirmed.name == DECISION:
            shown_contenders = contenders + [confirmed]
            for lv in levels_out:  # the decision's own rows beside the race's, which decided the winners
                if confirmed.name in results and lv["level"] in results[confirmed.name]:
                    lv["contenders"][DECISION] = decide_level(results, lv["level"], greedy)["contenders"][DECISION]
            race_doc["levels"] = levels_out
            race_doc["contenders"].append({"name": DECISION, "config": confirmed.speculative,
                                           "predicted_tokens_per_s": {}})
        # the decision's own ratios and mean, as it is written (decision() gave the winner's as it raced)
        measured = measured_record(confirmed, levels_out, levels)
        why.update({k: measured[k] for k in ("vs_plain_by_level", "geomean_vs_plain")})
        if not ahead_over_range(why["vs_plain_by_level"]):
            say("      the decision as written is not ahead of plain over the levels: plain it is")
            chosen, why = None, {"winner": PLAIN, "why": "the decided config, raced as written, was not ahead of plain "
                                 "over the levels (geometric mean of its ratios below 1)", "measured_decision": why}
    # every candidate is now measured as written: the best of them over the whole range is deployed
    pool = [c for c in raced if c.name in results] + ([confirmed] if confirmed is not None and confirmed.name == DECISION
                                                       else [])
    best = best_measured(pool, levels_out, levels)
    if best is not None and best[0].name != (why.get("measured_as") if chosen is not None else None):
        c, scores = best
        say(f"      {c.name} as raced: behind plain nowhere, the highest geometric mean over plain "
            f"({scores[c.name]:.3f}x); it is the decision")
        chosen, why = Contender(c.name, dict(c.speculative)), measured_why(c, levels_out, levels, scores, why)
    race_doc["failed"] = failed
    atomic_write_json(out / "race.json", race_doc)
    summary["phases"]["confirm_s"] = time.time() - t0

    phase(6, "write: the decision, exports, report")
    summary.update({"decision": why, "levels": levels_out, "prediction_error": prediction_error(contenders, levels_out),
                    "prediction_parts": prediction_parts(contenders, levels_out),
                    "skipped": skipped, "race_requests": {"requests": len(race_reqs), "by_level": sizes}})
    _exports(chosen, out, draft_dir)
    summary["wall_s"] = time.time() - t0
    summary["budget"] = {"minutes": s.budget_minutes, "used_minutes": summary["wall_s"] / 60,
                         "seconds_by_contender": {n: round(v["wall_s"], 1) for n, v in timings.items()}}
    atomic_write_bytes(out / "report.md", report(summary, shown_contenders).encode())
    atomic_write_json(out / "summary.json", _jsonable(summary))
    doc = {"format": "tree-planner/serving-decision", "engine": engine.caps.name, "model": engine.model_name,
           "speculative_config": None if chosen is None else chosen.speculative, "decision": why,
           "concurrency": levels, "race": "race.json", "profile": shown(profile_path)}
    atomic_write_json(out / "chosen.json", doc)  # last: a run without it did not finish
    say(f"decision: {why['winner']}" + ("" if chosen is None else f" {json.dumps(chosen.speculative)}"))
    if summary["wall_s"] > budget:
        say(f"the run took {summary['wall_s'] / 60:.1f} min of its {s.budget_minutes:g}-minute budget (the first "
            "contender and the confirmation race whatever is left)")
    say(f"wrote {shown(out)}/ (chosen.json, race.json, plans.json, exports/, report.md, summary.json)")
    return summary


def _served(plain_rows: dict[int, dict]) -> dict[int, ServedLevel]:
    """level -> plain's ServedLevel from its race rows, where the pass decoded (its streams' times)."""
    out = {}
    for lv, row in plain_rows.items():
        v = served_level(lv, row["output_tokens_per_s"], row.get("requests", 0), row.get("output_tokens", 0),
                         row.get("step_p50_s"))
        if v is not None:
            out[lv] = v
    return out


def _planned_contenders(records: dict, profiles: dict, levels, s: ServingSettings, draft_dir: str | None,
                        overhead: dict[int, float], out: Path, say,
                        served: dict[int, ServedLevel] | None = None) -> list[Contender]:
    """Plain, the stock settings, the best proposer's best fixed length and its planned schedule, each
    priced on the profile and plain's served levels (else the server's cost per step); plans.json
    records every proposer's."""
    max_k = max(s.draft_lengths)
    served = served or {}
    plans = {}
    for m, rec in records.items():
        costs = draft_costs(rec, profiles, levels, served) if rec["guesser"].get("draft_passes") == "depth" else {}
        plans[m] = plan_method(m, rec, profiles, levels, max_k, costs, schedulable=m in SCHEDULE_METHODS["vllm"],
                               overhead_s=overhead, off_ratio=engine_kind(s.engine).defaults.schedule_off_ratio,
                               served=served)
        say(f"      {m}: draft length by level {plans[m]['per_level']}, best fixed {plans[m]['best_fixed']}")

    def score(p: dict) -> float:
        return float(np.mean(np.log([p["predicted"][b] for b in levels])))

    best = max(plans.values(), key=score)
    contenders = [Contender(PLAIN, None)]
    contenders += [Contender(n, dict(c)) for n, c in STOCK.items()]
    fixed_cfg = method_config(best["method"], best["best_fixed"], draft_dir)
    contenders.append(Contender(f"fixed {best['method']} K={best['best_fixed']}", fixed_cfg,
                                dict(best["fixed_predicted"]), dict(best["fixed_priced"])))
    # a proposer vLLM runs at one length is the decision only if ahead at every level, and its own work is
    # not in the profile (it drafts with a stub); so the best proposer a schedule can switch off by batch
    # size races its schedule too
    switchable = [p for m, p in plans.items() if m in SCHEDULE_METHODS["vllm"]]
    planned = [best] + ([max(switchable, key=score)] if best["method"] not in SCHEDULE_METHODS["vllm"]
                        and switchable else [])
    for plan in planned:
        planned_ranges = schedule_ranges(plan["per_level"], levels)
        if any(k for *_, k in planned_ranges):
            cfg = method_config(plan["method"], max(k for *_, k in planned_ranges), draft_dir, planned_ranges)
            contenders.append(Contender(f"planned {plan['method']}", cfg, dict(plan["predicted"]), dict(plan["priced"])))
    atomic_write_json(out / "plans.json", {"plans": _jsonable(plans), "chosen_method": best["method"],
                                           "planned_methods": [p["method"] for p in planned],
                                           "server_overhead_s": _jsonable(overhead),
                                           "served": _jsonable({lv: vars(v) for lv, v in served.items()})})
    return distinct(contenders)


def _race_sizes(profiles: dict, records: dict, s: ServingSettings, levels, left_s: float, n: int) -> dict[int, int]:
    """Race requests per level (serving_race.py race_sizes) for four races within left_s: plain's two
    servers, the first contender's and the confirmation's (the decision as written, which switches
    speculation off where it lost). Priced before any has run: a served step at SERVED_STEP times the
    profiled plain step, a server start at the longest acceptance server's wait (the first of them
    started alone), each level's warm-up wave of WARMUP_TOKENS and its passes of n requests."""
    from profiler.vllm_profile import START_GUESS_S

    step = {lv: float(profiles[lv].latency(1)) * SERVED_STEP for lv in levels}
    waits = [(r.get("vllm") or {}).get("server_start_s") for r in records.values()]
    start = max([float(w) for w in waits if isinstance(w, (int, float)) and w > 0] or [START_GUESS_S])
    fixed = start + s.rounds * sum(WARMUP_TOKENS * step[lv] for lv in levels)
    pass_s = {lv: s.rounds * math.ceil(n / lv) * s.max_tokens * step[lv] for lv in levels}
    return race_sizes(pass_s, fixed, n, levels, left_s, races=4)


def _profile(engine, s: ServingSettings, levels, out: Path, budget_s: float, say) -> Path:
    if s.profile:
        if not Path(s.profile).is_file():
            raise UserError(f"--profile {s.profile}: file not found")
        return Path(s.profile)
    from profiler.vllm_profile import ServingProfileSpec, profile_serving

    spec = ServingProfileSpec(draft_lengths=tuple(s.draft_lengths), batch_sizes=tuple(levels),
                              time_budget_s=max(60.0, budget_s), progress=not s.quiet, speculative_k0=False)
    profile = profile_serving(engine, spec, say=lambda line: say(f"      {line}"))
    return atomic_write_json(out / "profile.json", profile)


def _draft_dir(engine, s: ServingSettings) -> str:
    from decoder.engines.vllm.draft_folder import draft_for

    folder = draft_for(engine.model_name, engine.model_dir, s.draft)
    if folder is None:
        raise UserError(f"--methods draft_model: no draft LM ships for {engine.model_name}; pass --draft DIR")
    return str(folder)


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


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x
