"""Racing contenders through a real server under load, and deciding per level (the serving main job's
phases 4 and 5: workflows/mainjob/serving.py).

    from workflows.mainjob.serving_race import Contender, race_all, decide_level, decision
    failed, results = race_all(engine, [Contender("plain", None), Contender("ngram", cfg)], reqs, warm, s, [1, 4], say)
    levels_out = [decide_level(results, lv, greedy=True) for lv in (1, 4)]

One server per contender (started, driven at every level, stopped), every pass from an empty prefix
cache (the passes repeat the race's requests; distinct traffic would not find them cached) and after a
warm-up wave. Plain runs twice, first (its pass prices the plan) and again after the contenders
(close_plain): each level's plain is the median over the two servers, and their drift is on record.
The paired rule, per level: request i of the race is sent to every contender (the same messages,
the same length), so its end-to-end seconds per output token pair up; a contender is ahead of plain at
a level when the sign-flip interval of log(plain / contender) over the requests
(workflows/mainjob/signflip.py, the main job's own test) lies above 1, no greedy answer changed and the
level's tokens/s is above plain's; among those the highest geometric mean takes the level. It is
behind plain when the interval lies below 1, a greedy answer changed or its tokens/s is under TIE x
plain's; otherwise it ties. The decision is one config (an engine runs one proposer): the contender
that won the most levels (then is ahead at the most, then by geometric mean), with its draft length 0
on every level where it was behind plain, so speculation is switched off exactly where it was measured
to lose (not where it tied: a schedule's K = 0 is not plain in vLLM, see ahead_over_range); none ahead
anywhere: plain. confirm races that config as it is written when no contender ran it; then every
candidate is a config measured as it would be deployed, and best_measured picks the one to write: behind
plain at no level, ahead somewhere, the highest geometric mean over plain across the levels. race_sizes
cuts every contender's requests alike at the slowest levels when the budget cannot hold full passes.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from planner.errors import UserError
from planner.export import SCHEDULE_METHODS
from planner.serving import schedule_ranges
from profiler.load_generator import percentile

PLAIN = "plain"
CLOSING = "plain (closing)"  # plain's second server, after the contenders: its rounds join plain's (close_plain)
DECISION = "decision (as written)"  # phase 5's contender: the decided config where no contender ran it


@dataclass
class Contender:
    name: str
    speculative: dict | None  # the speculative config (None: plain)
    predicted: dict = field(default_factory=dict)  # level -> predicted output tokens/s (planned contenders)
    priced: dict = field(default_factory=dict)  # level -> {"tokens_per_step", "step_s"} behind the prediction


def sampling(s):
    """The race's sampling from the run's settings (workflows/mainjob/serving.py ServingSettings)."""
    from planner.sampling import Sampling

    return Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


def config_key(speculative: dict | None) -> str:
    """One key per speculative config (the same config, whatever its keys' order)."""
    return json.dumps(speculative, sort_keys=True)


def by_level(values: dict) -> list[tuple]:
    """(level, value) in level order, for levels as ints or as JSON's strings."""
    return sorted(values.items(), key=lambda t: int(t[0]))


def geomean(ratios) -> float:
    """The geometric mean of ratios to plain (a 0, a contender that produced nothing, counts as 1e-9)."""
    return math.exp(float(np.mean(np.log(np.maximum(ratios, 1e-9))))) if len(ratios) else 0.0


def distinct(contenders: list[Contender]) -> list[Contender]:
    """One server per config: a planned schedule that drafts the same length everywhere is the fixed one,
    and a planned length equal to a stock setting is that setting (which then carries the prediction)."""
    seen: dict[str, Contender] = {}
    for c in contenders:
        key = config_key(c.speculative)
        if key not in seen:
            seen[key] = c
        elif not seen[key].predicted and c.predicted:
            seen[key].predicted, seen[key].priced = dict(c.predicted), dict(c.priced)
    return list(seen.values())


# a warm-up wave's answers: enough steps at the level's batch size for its shapes' first use, at a
# fraction of a measured pass's time (the wave at 16 requests was as long as the pass at full length)
WARMUP_TOKENS = 8
LEARNS = ("suffix",)  # vLLM proposers that also draft from earlier requests' answers (suffix's global tree)


def race_contender(engine, c: Contender, race_reqs: list, warm: list, s, levels, say,
                   results: dict, server_kwargs: dict | None = None, sizes: dict | None = None) -> dict:
    """`c` at every level (results[c.name][level] = its rounds), each pass from an empty prefix cache (where
    the server can empty it: reset_prefix_cache), so that no pass prefills from an earlier pass's copy of
    its prompts, and after a warm-up wave of `level` short requests (WARMUP_TOKENS each) outside the race
    (so no contender's first pass at a batch size is a cold one); at a level in `sizes` the first
    sizes[level] race requests only (race_sizes: the same for every contender, so request i still pairs up).
    One server for all, except for a proposer that learns from earlier answers: it gets a fresh server for
    every pass, or it would draft a repeated request's answer from its own first pass.
    Returns where its time went, {"start_s": [each server's start], "level_s": {level: [each pass, warm-up
    included]}}, which prices the next contenders against the budget (predicted_seconds)."""
    from profiler.serving_level import measure_level
    from profiler.vllm_accept import sampled_requests

    reqs = sampled_requests(race_reqs, sampling(s), s.seed)  # request i seeded seed + i, the same for all
    warm = [replace(r, max_tokens=min(WARMUP_TOKENS, r.max_tokens))
            for r in sampled_requests(warm, sampling(s), s.seed + len(reqs))]
    passes = [level for level in levels for _ in range(s.rounds)]
    timing: dict = {"start_s": [], "level_s": {}}
    for group in ([[p] for p in passes] if learns(c) else [passes]):
        t0 = time.perf_counter()
        say(f"      {c.name}: starting vLLM" + (f" ({json.dumps(c.speculative)})" if c.speculative else ""))
        with engine.server(speculative_config=c.speculative, **(server_kwargs or {})) as server:
            timing["start_s"].append(time.perf_counter() - t0)
            say(f"      {c.name}: ready in {timing['start_s'][-1]:.0f} s")
            for level in group:
                t_level = time.perf_counter()
                wave = [warm[i % len(warm)] for i in range(level)]
                mine = reqs[:(sizes or {}).get(level, len(reqs))]
                # a pass repeats the race's requests: each starts from an empty prefix cache, as distinct traffic
                run = measure_level(server.url, server.served_model_name, wave, [mine], level, s.request_timeout_s,
                                    fresh=getattr(server, "reset_prefix_cache", None))
                res = run.rounds[0]
                if res.records and not any(r.ok for r in res.records):
                    # vLLM's worker can die mid-level (0.32 on CPU: seeded sampling with suffix decoding at
                    # 16 requests, "CPU Generator does not use offset"): that is a failed contender, not 0 tokens/s
                    raise UserError(f"no request completed at concurrency {level}: {server.why_stopped()}")
                if run.spec is None:  # the decision needs accepted/drafted at every level
                    raise UserError(f"{server.url}/metrics: the server's counters could not be read at "
                                    f"concurrency {level}")
                results.setdefault(c.name, {}).setdefault(level, []).append({"result": res, "counters": run.spec})
                timing["level_s"].setdefault(level, []).append(time.perf_counter() - t_level)
                say(f"      {c.name} at {level}: {res.output_tokens_per_s:.1f} output tokens/s"
                    + (f", {res.timed_out} timed out" if res.timed_out else ""))
    return timing


MIN_RACE_REQUESTS = 8  # a cut level keeps this many paired requests at least (5 are the fewest that can decide)
SERVED_STEP = 1.7  # a served step over the profiled one, to size the race before plain's has run: 1.0-1.9
#                    in the committed runs here (median 1.5), taken high so that a cut race fits


def race_sizes(pass_s: dict[int, float], fixed_s: float, n: int, levels, left_s: float,
               races: int) -> dict[int, int]:
    """Race requests per level, the same for every contender: n at every level when `races` races (each
    fixed_s of server start and warm-up waves plus pass_s[level], a pass of n requests) fit in left_s;
    otherwise the levels where a request takes longest (the lowest: fewest requests at once) are cut first,
    each to a multiple of its level (and even: a question's two turns stay together) but never below
    MIN_RACE_REQUESTS or the level itself, until the races fit or nothing more can be cut. Every contender
    then answers the same first requests, so they still pair up one to one."""
    sizes = {lv: n for lv in levels}
    per_request = {lv: pass_s[lv] / n for lv in levels}

    def total() -> float:
        return races * (fixed_s + sum(per_request[lv] * sizes[lv] for lv in levels))

    for lv in sorted(levels, key=lambda x: -per_request[x]):
        over = total() - left_s
        if over <= 0:
            break
        step = lv if lv % 2 == 0 else 2 * lv
        floor = min(n, -(-max(MIN_RACE_REQUESTS, lv) // step) * step)
        fits = sizes[lv] - math.ceil(over / races / per_request[lv]) if per_request[lv] > 0 else sizes[lv]
        sizes[lv] = min(sizes[lv], max(floor, fits // step * step))
    return sizes


def learns(c: Contender) -> bool:
    return (c.speculative or {}).get("method") in LEARNS


def predicted_seconds(c: Contender, plain: dict, levels, rounds: int, plain_tps: dict) -> float:
    """What racing `c` will take, from plain's race (`plain`: race_all's timings of it): its servers at
    plain's start time, and every level's passes at plain's time scaled by plain's tokens/s over the
    contender's predicted tokens/s where it has a prediction (else plain's own time)."""
    wall = float(plain.get("wall_s") or 0.0)
    start = float(np.median(plain["start_s"])) if plain.get("start_s") else 0.0
    level_s = plain.get("level_s") or {lv: [(wall - start) / len(levels) / rounds] * rounds for lv in levels}
    servers = len(levels) * rounds if learns(c) else 1
    passes = 0.0
    for lv in levels:
        pred = c.predicted.get(lv) or 0.0
        slower = plain_tps[lv] / pred if pred > 0 and plain_tps.get(lv) else 1.0
        passes += float(np.sum(level_s.get(lv) or [0.0])) * slower
    return servers * start + passes


def race_order(contenders: list[Contender], plain: dict, levels, rounds: int,
               plain_tps: dict) -> list[tuple[Contender, float]]:
    """(contender, predicted seconds), in the order a budget keeps them: the planned schedules first
    (what the planner decided), then the planner's fixed lengths, then the stock settings; cheapest
    first within each (a proposer that learns from answers needs a server per pass: the dearest)."""
    def rank(c: Contender) -> int:
        if (c.speculative or {}).get("num_speculative_tokens_per_batch_size"):
            return 0
        return 1 if c.predicted else 2

    priced = [(c, predicted_seconds(c, plain, levels, rounds, plain_tps)) for c in contenders]
    return sorted(priced, key=lambda t: (rank(t[0]), t[1]))


def race_all(engine, contenders: list[Contender], race_reqs: list, warm: list, s, levels, say,
             results: dict | None = None, failed: dict | None = None,
             timings: dict | None = None, sizes: dict | None = None) -> tuple[dict, dict]:
    """Every contender in turn; (failed: name -> why its server stopped, results). A contender whose server
    dies (a config vLLM takes, then fails on) is out of the decision and the race goes on; plain's is
    fatal. The dicts passed in fill as it goes, so an interrupted race keeps what it measured; `timings`
    gets each raced contender's race_contender timing plus its "wall_s"."""
    results = {} if results is None else results
    failed = {} if failed is None else failed
    timings = {} if timings is None else timings
    for c in contenders:
        t0 = time.perf_counter()
        try:
            timing = race_contender(engine, c, race_reqs, warm, s, levels, say, results, sizes=sizes)
            timings[c.name] = {**(timing or {}), "wall_s": time.perf_counter() - t0}
        except UserError as e:
            if c.speculative is None:
                raise
            failed[c.name] = str(e)
            results.pop(c.name, None)
            say(f"      {c.name}: failed, out of the race ({e})")
    return failed, results


def close_plain(engine, race_reqs: list, warm: list, s, levels, say, results: dict, failed: dict,
                timings: dict, sizes: dict | None = None) -> None:
    """Plain again, on a server of its own, after the contenders: its rounds join the first server's in
    results[PLAIN], marked "closing", so plain at each level is the median over a server before the
    contenders and one after them. This VM drifts by 10-20 % over a race, and plain measured only at the
    start was compared with contenders measured up to 15 minutes later; now drift that is steady over the
    race cancels to first order, and each level records how far plain moved (plain_drift). A closing
    server that fails leaves plain's first one as it was (failed[CLOSING]); Ctrl-C keeps what it measured."""
    mine: dict = {}
    t0 = time.perf_counter()
    try:
        timing = race_contender(engine, Contender(CLOSING, None), race_reqs, warm, s, levels, say, mine, sizes=sizes)
        timings[CLOSING] = {**(timing or {}), "wall_s": time.perf_counter() - t0}
    except UserError as e:
        failed[CLOSING] = str(e)
        say(f"      {CLOSING}: failed; plain is its first server alone ({e})")
    finally:
        for level, rounds in mine.get(CLOSING, {}).items():
            results[PLAIN].setdefault(level, []).extend({**r, "closing": True} for r in rounds)


def plain_drift(rounds: list[dict]) -> float | None:
    """Plain's closing server over its first one at a level (output tokens/s, median over each server's
    rounds); None without a closing server there."""
    first = [r["result"].output_tokens_per_s for r in rounds if not r.get("closing")]
    last = [r["result"].output_tokens_per_s for r in rounds if r.get("closing")]
    if not first or not last or float(np.median(first)) <= 0:
        return None
    return float(np.median(last)) / float(np.median(first))


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
    from profiler.vllm_accept import decode_steps
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
        # how a request's time splits between decoding steps and the rest (planner/serving.py served_level)
        row = {"output_tokens_per_s": tps, "tpot_p50_s": res[0].tpot_p50_s, "tpot_p99_s": res[0].tpot_p99_s,
               "ttft_p50_s": res[0].ttft_p50_s, "timed_out": sum(r.timed_out for r in res),
               "accepted": counters.accepted_tokens, "drafted": counters.draft_tokens, "drafts": counters.drafts,
               "mean_acceptance_length": counters.mean_acceptance_length if counters.speculating else None,
               "requests": sum(len(r.completed) for r in res), "output_tokens": sum(r.output_tokens for r in res),
               "step_p50_s": percentile([r.step_p50_s for r in res if r.step_p50_s is not None], 50),
               # verification steps counted as the acceptance records count them (the larger lower bound)
               "steps": decode_steps([x for r in res for x in r.completed], counters)["steps"]}
        if name == PLAIN:
            row["drift"] = plain_drift(rounds)
        else:
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


TIE = 0.98  # tokens/s over plain's at or above which a level not won is a tie (the noise allowance)


def behind_plain(row: dict | None) -> bool:
    """A contender's row at a level is behind plain: no row (it did not run there), a greedy answer
    changed, the paired interval lies below 1, or the level's tokens/s is under TIE x plain's."""
    if not row:
        return True
    hi = (row.get("paired") or {}).get("hi")
    return row.get("mismatches") != 0 or (hi if hi is not None else 0.0) < 1.0 or (row.get("vs_plain") or 0.0) < TIE


def decision(contenders: list[Contender], levels_out: list[dict], levels) -> tuple[Contender | None, dict]:
    """The one config: the contender that wins the most levels (then is ahead of plain at the most, then
    the highest geometric mean of tokens/s over plain), its draft length 0 wherever it was behind plain
    (behind_plain); where it tied, its own draft length stays, since a schedule's K = 0 still costs
    vLLM's speculative path (0.81-0.96x plain measured here) and would trade a measured tie for an
    unmeasured loss. A proposer vLLM runs at one draft length only (planner/export.py SCHEDULE_METHODS)
    cannot be switched off by batch size: it is a candidate only if behind plain at no level."""
    scores = []
    at = {lv["level"]: lv for lv in levels_out}
    for c in contenders:
        if c.speculative is None:
            continue
        rows = {lv: at[lv]["contenders"].get(c.name) if lv in at else None for lv in levels}
        wins = [lv for lv in levels if lv in at and at[lv]["winner"] == c.name]
        ahead = [lv for lv in levels if beats_plain(rows[lv] or {})]
        behind = [lv for lv in levels if behind_plain(rows[lv])]
        if c.speculative.get("method") not in SCHEDULE_METHODS["vllm"] and behind:
            continue
        geo = geomean([(rows[lv] or {}).get("vs_plain") or 0.0 for lv in levels if lv in at])
        scores.append((len(wins), len(ahead), geo, c, ahead, behind))
    scores.sort(key=lambda t: t[:3], reverse=True)
    if not scores or scores[0][1] == 0:
        return None, {"winner": PLAIN, "why": "no contender beat plain beyond the noise at any level (a proposer vLLM runs at one "
                                        "draft length must be behind plain at no level)"}
    *_, geo, c, ahead, behind = scores[0]
    cfg = dict(c.speculative)
    k_of = _k_by_level(cfg, levels)
    per_level = {lv: (0 if lv in behind else k_of[lv]) for lv in levels}
    if behind:  # else the raced config as it is (suffix's own default cap stays unwritten: the same server)
        ranges = schedule_ranges(per_level, list(levels))
        cfg.pop("num_speculative_tokens_per_batch_size", None)
        cfg["num_speculative_tokens"] = max(k for *_, k in ranges) or cfg.get("num_speculative_tokens", 1)
        if len(ranges) > 1:
            cfg["num_speculative_tokens_per_batch_size"] = ranges
    return Contender(c.name, cfg), {"winner": c.name, "levels_ahead_of_plain": ahead, "levels_behind_plain": behind,
                                    "geomean_vs_plain": geo, "draft_length_by_level": per_level}


def _k_by_level(cfg: dict, levels) -> dict[int, int]:
    default = int(cfg.get("num_speculative_tokens") or _SUFFIX_CAP)
    table = cfg.get("num_speculative_tokens_per_batch_size") or []
    return {lv: next((k for lo, hi, k in table if lo <= lv <= hi), default) for lv in levels}


_SUFFIX_CAP = 32  # vLLM's suffix method without num_speculative_tokens: its own default cap


def confirm(engine, chosen: Contender | None, contenders: list[Contender], results: dict, failed: dict,
            race_reqs: list, warm: list, s, levels, say, sizes: dict | None = None) -> Contender | None:
    """The decision's measured rows: a raced contender with the same config is the decision as written;
    otherwise (speculation switched off where it lost, a new schedule) it races now, on the race's
    requests, so every level of what the user deploys is measured against plain, not assembled from
    other configs' rows. None: the decision is plain, or its server died (then in `failed`)."""
    if chosen is None:
        say("      the decision is plain: nothing to confirm")
        return None
    same = raced_as_is(chosen, [c for c in contenders if c.name in results])  # raced: failed ones are popped
    if same is not None:
        say(f"      the decision is {same.name}'s config, raced as it is")
        return same
    mine = Contender(DECISION, chosen.speculative)
    race_all(engine, [mine], race_reqs, warm, s, levels, say, results, failed, sizes=sizes)
    return None if DECISION in failed else mine


def raced_as_is(chosen: Contender, raced: list[Contender]) -> Contender | None:
    """The raced contender that ran the decided config as it is; None: a new config (speculation switched
    off where it lost), which confirm races."""
    key = config_key(chosen.speculative)
    return next((c for c in raced if config_key(c.speculative) == key), None)


def measured_record(c: Contender, levels_out: list[dict], levels) -> dict:
    """What `c`'s config measured as it raced, as the decision's record: its draft length, the levels
    where it was ahead of and behind plain, its ratios to plain and their geometric mean."""
    rows = {lv["level"]: lv["contenders"].get(c.name) for lv in levels_out}
    measured = {lv: (row or {}).get("vs_plain") for lv, row in rows.items()}
    return {"winner": c.name, "measured_as": c.name, "draft_length_by_level": _k_by_level(c.speculative, levels),
            "levels_ahead_of_plain": [lv for lv in levels if beats_plain(rows.get(lv) or {})],
            "levels_behind_plain": [lv for lv in levels if behind_plain(rows.get(lv))],
            "geomean_vs_plain": geomean([r for r in measured.values() if r is not None]),
            "vs_plain_by_level": measured}


def as_raced(winner: Contender, levels_out: list[dict], levels, why_skipped: str) -> tuple[Contender | None, dict]:
    """The decision when its confirmation does not fit the budget: the winner's config as it was raced,
    every level measured, if that pays over the levels (ahead_over_range), else plain. The schedule the
    confirmation would have raced is named, not written: a user with more time runs it with a larger
    --budget."""
    record = measured_record(winner, levels_out, levels)
    if not ahead_over_range(record["vs_plain_by_level"]):
        return None, {"winner": PLAIN, "why": f"{winner.name} as raced is not ahead of plain over the levels, and "
                      "switching it off where it lost was not confirmed in the budget", "confirm": why_skipped,
                      "measured_decision": {"winner": winner.name, "vs_plain_by_level": record["vs_plain_by_level"]}}
    return Contender(winner.name, dict(winner.speculative)), {**record, "confirm": why_skipped}


def best_measured(candidates: list[Contender], levels_out: list[dict], levels) -> tuple[Contender, dict] | None:
    """The config to deploy among those measured as written at every level (the raced contenders and the
    confirmed decision): behind plain at no level, ahead of it beyond the noise at one at least, and the
    highest geometric mean of tokens/s over plain across the levels; (it, each eligible one's geometric
    mean) or None. decision() picks the config to confirm by the levels it won, and one pass per server
    decides a level within the spread between servers (+-8 % here): fixed K = 8 won three levels, was
    switched off at 16 and confirmed at 1.16x, below the planned schedule's 1.18x as raced, behind plain
    nowhere. Once every candidate is measured as it would be deployed, the whole range decides."""
    at = {lv["level"]: lv["contenders"] for lv in levels_out}
    scores = {}
    for c in candidates:
        rows = [at.get(lv, {}).get(c.name) for lv in levels]
        if c.speculative is None or any(behind_plain(r) for r in rows) or not any(beats_plain(r) for r in rows):
            continue
        scores[c.name] = geomean([r["vs_plain"] for r in rows])
    eligible = [c for c in candidates if scores.get(c.name, 0.0) > 1.0]
    if not eligible:
        return None
    return max(eligible, key=lambda c: scores[c.name]), scores


def measured_why(c: Contender, levels_out: list[dict], levels, scores: dict, decided: dict) -> dict:
    """The decision's record when best_measured replaced the one decide() raced: what it measured."""
    return {**measured_record(c, levels_out, levels),
            "chosen_by": "the highest geometric mean over plain among the configs measured as written and behind "
                         "plain at no level: " + ", ".join(f"{n} {g:.3f}x" for n, g in
                                                            sorted(scores.items(), key=lambda t: -t[1])),
            "decided_first": decided}


def ahead_over_range(vs_plain_by_level: dict) -> bool:
    """The confirmed decision pays over the levels: the geometric mean of its measured ratios to plain
    is above 1. Speculation switched off by a schedule (K = 0) is not plain in vLLM (its speculative path
    stays: 0.88-0.96x measured at 2-16 requests here), so a config that speculates at few levels can
    lose more where it is off than it gains where it is on; then no config is better."""
    ratios = [r for r in vs_plain_by_level.values() if r is not None]
    return bool(ratios) and all(r > 0 for r in ratios) and geomean(ratios) > 1.0
