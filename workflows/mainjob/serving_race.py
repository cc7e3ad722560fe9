"""The serving race: contenders through a real server under load, plain before and after them, and the
per-level paired statistics and rows. One module for the main job (workflows/mainjob/serving.py) and the
benchmark (bench/bench_serving.py).

    race = Race(traffic, levels=[1, 4, 16], say=print, greedy=True)
    race_all(engine, [Contender(PLAIN, None), Contender("ngram", cfg)], race)   # plain first
    close_plain(engine, race)                                                    # plain again, last
    left = resolve(engine, race, [candidate], seconds_left)                      # more passes, in the budget
    rows = race.rows()                                                           # decide_level at every level

One server per contender (started, driven at every level, stopped) and after each level's warm-up wave.
The traffic says what a pass sends: the main job repeats the race's requests in every pass (so each pass
starts from an empty prefix cache, and a proposer that learns from answers forgets them: with the plugin the
reset does that, without it the proposer gets a server per pass), the
benchmark gives every round its own prompts, the same for every contender. Plain runs first and again
after the contenders (close_plain): each level's plain is the median over its servers and the drift between
them is on record. The paired rule, per level: request i of a round slot is sent to every contender, so its
end-to-end seconds per output token pair up; the sign-flip interval of log(plain / contender) over the
requests (workflows/mainjob/signflip.py), widened by the spread between servers (across_servers: the
requests of one server share its state, and one config measured 11-28 % apart on two here), says whether a
contender is ahead of plain there (the interval above 1 and the level's tokens/s above plain's), behind (below
1, a changed greedy answer, or under TIE x plain's tokens/s) or neither. `resolve` runs further passes,
plain's and the candidate's each on a fresh server, at the levels still neither ahead nor behind, while the
budget holds them: every pass adds a server to each side, which narrows the widening; the levels still open
then are reported as unresolved. A level's rows and the rules ahead and behind are
workflows/mainjob/serving_rows.py's; the decision rules are workflows/mainjob/serving_decision.py's.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from statistics import NormalDist

import numpy as np

from decoder.serving import ServingEngine
from planner.errors import UserError
from profiler.vllm_accept import LEARNS
from workflows.mainjob.serving_rows import TIE, beats_plain, behind_plain, level_row, plain_path_row  # noqa: F401

PLAIN = "plain"
CLOSING = "plain (closing)"  # plain's second server, after the contenders: its rounds join plain's (close_plain)
DECISION = "decision (as written)"  # the decided config where no contender ran it (serving_decision.confirm)
SERVER_SPREAD = 0.06  # sd of log tokens/s between two servers of one config at one level, before a race measures
#                       its own: plain's closing over its first server in the committed runs here had an rms log
#                       of 0.05 in benchmarks and 0.11 in main jobs (0.036-0.08 per server); 0.06 between
PRIOR_SERVERS = 3  # the weight of SERVER_SPREAD, in degrees of freedom, against a race's own plain servers
WARMUP_TOKENS = 8  # a warm-up wave's answers: the level's shapes used once, at a fraction of a pass's time
MIN_RACE_REQUESTS = 8  # a cut level keeps this many paired requests at least (5 are the fewest that can decide)
SUFFIX_CAP = 32  # vLLM's suffix method without num_speculative_tokens: its own default cap
SERVED_STEP = 1.7  # a served step over the profiled one, to size the race before plain's has run: 1.0-1.9
#                    in the committed runs here (median 1.5), taken high so that a cut race fits


@dataclass
class Contender:
    name: str
    speculative: dict | None  # the speculative config (None: plain)
    predicted: dict = field(default_factory=dict)  # level -> predicted output tokens/s (planned contenders)
    priced: dict = field(default_factory=dict)  # level -> {"tokens_per_step", "step_s"} behind the prediction
    plugin: bool = False  # served with the project's engine plugin on (a schedule's K = 0 is the plain path)
    source: str = "built in"  # where its config came from (the benchmark's --config FILE)
    notes: list = field(default_factory=list)

    @property
    def key(self) -> str:
        """One key per served setting (the same config, whatever its keys' order, with the plugin or not)."""
        return json.dumps([self.speculative, bool(self.plugin and self.speculative)], sort_keys=True)


@dataclass
class Traffic:
    """What a pass sends at each level, the same for every contender: requests[(level, round)]."""

    requests: dict  # (level, round) -> [Request | TokenRequest] that round sends
    warm: list  # requests outside the race: `level` of them, at WARMUP_TOKENS, before each level's rounds
    rounds: int = 1  # rounds per level on one server
    repeats: bool = True  # every round sends the same requests (the main job): the prefix cache is emptied
    #                       before each pass, and a proposer that learns from answers forgets them (the plugin's
    #                       reset) or gets a server per pass
    timeout_s: float = 600.0

    def slot(self, r: int) -> int:
        """The key that pairs a round's requests across contenders: rounds that repeat share one."""
        return 0 if self.repeats else r


def same_requests(race_reqs: list, warm: list, levels, rounds: int, sizes: dict | None, timeout_s: float) -> Traffic:
    """The main job's traffic: the first sizes[level] race requests at every level, every round."""
    return Traffic({(lv, r): race_reqs[:(sizes or {}).get(lv, len(race_reqs))] for lv in levels for r in range(rounds)},
                   warm, rounds, True, timeout_s)


@dataclass
class Race:
    """Everything raced so far (an interrupted race keeps it): results[name][level] = its rounds, each
    {"result": LoadResult, "counters": SpecDecodeCounters, "slot", "server", "closing"}."""

    traffic: Traffic
    levels: list
    say: Callable[[str], None]
    greedy: bool = True
    results: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)  # name -> why its server stopped
    timings: dict = field(default_factory=dict)  # name -> {"start_s": [...], "level_s": {level: [...]}, "wall_s"}
    servers: int = 0  # servers started so far: each round records which one ran it
    resolving: dict = field(default_factory=dict)  # name -> levels its extra passes left unresolved
    skip_plain_path: bool = False  # the main job: a contender served with the plugin is not raced where its K = 0
    plain_path: dict = field(default_factory=dict)  # name -> levels not raced: its K = 0 there, vLLM's plain path

    def rows(self, levels=None, contenders=None) -> list[dict]:
        """decide_level at every level plain ran (every contender, or only `contenders`' names)."""
        results = self.results if contenders is None else {
            n: v for n, v in self.results.items() if n == PLAIN or n in contenders}
        off = {n: lvs for n, lvs in self.plain_path.items() if n in results}
        return [decide_level(results, lv, self.greedy, off) for lv in (levels or self.levels)
                if PLAIN in results and lv in results[PLAIN]]


def k_by_level(cfg: dict, levels) -> dict[int, int]:
    """A speculative config's draft length at each level (the per-batch-size schedule's, else its one K)."""
    default = int(cfg.get("num_speculative_tokens") or SUFFIX_CAP)
    table = cfg.get("num_speculative_tokens_per_batch_size") or []
    return {lv: next((k for lo, hi, k in table if lo <= lv <= hi), default) for lv in levels}


def plain_path_levels(c: Contender, levels) -> list[int]:
    """The levels where `c` runs vLLM's plain path: served with the plugin, its schedule's K = 0 there. Its
    steps there are plain's (tests/test_vllm_plugin.py; served 0.99-1.01x greedy, bench/serving_probe), so
    the main job need not race them: the level is plain, decided as plain (decide_level's plain-path row).
    The batch passes through smaller sizes while a level's requests ramp up and drain, where the schedule may
    draft; what the decision writes there is the same schedule, and the benchmark measures it at every level."""
    if not (c.plugin and c.speculative):
        return []
    k = k_by_level(c.speculative, levels)
    return [lv for lv in levels if k[lv] == 0]


def learns(c: Contender) -> bool:
    return (c.speculative or {}).get("method") in LEARNS


def server_per_pass(c: Contender) -> bool:
    """A proposer that learns from answers needs a fresh server for every pass of repeated requests, unless it
    is served with the plugin, whose prefix cache reset also makes it forget them (the server checks it did)."""
    return learns(c) and not c.plugin


def race_contender(engine: ServingEngine, c: Contender, race: Race, levels=None, into: str | None = None) -> dict:
    """`c` at every level (race.results[into or c.name][level] gets its rounds), each level after a warm-up
    wave of `level` short requests outside the race, from an empty prefix cache where the traffic repeats
    (reset_prefix_cache). One server for all. A proposer that learns from earlier answers would draft a
    repeated request's answer from its own first pass: where the traffic repeats, its reset must also make it
    forget them (the plugin's, which the server confirms), or without the plugin it gets a fresh server for
    every pass. Returns where its time went, {"start_s": [each server's start], "level_s":
    {level: [each pass, warm-up included]}}, which prices the next passes (predicted_seconds)."""
    from profiler.serving_level import measure_level

    t, name, levels = race.traffic, into or c.name, list(levels or race.levels)
    passes = [(lv, r) for lv in levels for r in range(t.rounds)]
    timing: dict = {"start_s": [], "level_s": {}}
    forget = learns(c) and c.plugin  # its resets must also make it forget (server_per_pass otherwise)
    for group in ([[p] for p in passes] if server_per_pass(c) and t.repeats else [passes]):
        t0 = time.perf_counter()
        race.say(f"      {c.name}: starting the server" + (f" ({json.dumps(c.speculative)})" if c.speculative else "")
                 + (" with the plugin" if c.plugin and c.speculative else ""))
        with engine.server(speculative_config=c.speculative, plugin=bool(c.plugin and c.speculative)) as server:
            race.servers += 1
            timing["start_s"].append(time.perf_counter() - t0)
            race.say(f"      {c.name}: ready in {timing['start_s'][-1]:.0f} s")
            for lv, r in group:
                t_level = time.perf_counter()
                wave = [t.warm[i % len(t.warm)] for i in range(lv)] if t.warm else []
                # a pass that repeats the race's requests starts from an empty prefix cache, as distinct traffic
                run = measure_level(server.url, server.served_model_name, wave, [t.requests[(lv, r)]], lv, t.timeout_s,
                                    fresh=_fresh(server, forget) if t.repeats else None)
                _check_level(run, lv, server)
                race.results.setdefault(name, {}).setdefault(lv, []).append(
                    {"result": run.rounds[0], "counters": run.spec, "slot": t.slot(r), "server": race.servers})
                timing["level_s"].setdefault(lv, []).append(time.perf_counter() - t_level)
                race.say(f"      {c.name} at {lv}: {run.rounds[0].output_tokens_per_s:.1f} output tokens/s"
                         + (f", {run.rounds[0].timed_out} timed out" if run.rounds[0].timed_out else ""))
    return timing


def _fresh(server, forget: bool) -> Callable[[], None] | None:
    """What empties a server before a pass that repeats earlier requests: its prefix cache, and where the
    proposer learns from answers, those answers too."""
    reset = getattr(server, "reset_prefix_cache", None)
    if reset is None or not forget:
        return reset
    return lambda: reset(forget_answers=True)


def _check_level(run, level: int, server) -> None:
    res = run.rounds[0]
    if res.records and not any(r.ok for r in res.records):
        # vLLM's worker can die mid-level (0.32 on CPU: seeded sampling with suffix decoding at 16
        # requests, "CPU Generator does not use offset"): that is a failed contender, not 0 tokens/s
        raise UserError(f"no request completed at concurrency {level}: {server.why_stopped()}")
    if run.spec is None:  # the decision needs accepted/drafted at every level
        raise UserError(f"{server.url}/metrics: the server's counters could not be read at concurrency {level}")


def race_all(engine, contenders: list[Contender], race: Race) -> tuple[dict, dict]:
    """Every contender in turn; (failed, results). A contender whose server dies (a config vLLM takes, then
    fails on) is out and the race goes on; plain's is fatal. race.timings gets each one's time and "wall_s".
    Where race.skip_plain_path, a contender is not raced at its plain-path levels (race.plain_path)."""
    for c in contenders:
        t0, levels = time.perf_counter(), list(race.levels)
        if race.skip_plain_path and (off := plain_path_levels(c, levels)):
            race.plain_path[c.name] = off
            race.say(f"      {c.name}: not raced at {', '.join(map(str, off))}: K = 0 with the plugin, vLLM's plain "
                     "path")
            levels = [lv for lv in levels if lv not in off]
        try:
            timing = race_contender(engine, c, race, levels) if levels else {}
            race.timings[c.name] = {**(timing or {}), "wall_s": time.perf_counter() - t0}
        except UserError as e:
            if c.speculative is None:
                raise
            race.failed[c.name] = str(e)
            race.results.pop(c.name, None)
            race.say(f"      {c.name}: failed, out of the race ({e})")
    return race.failed, race.results


def close_plain(engine, race: Race, levels=None) -> None:
    """Plain again, on a server of its own, after the contenders: its rounds join plain's, marked "closing",
    so plain at each level is the median over a server before the contenders and one after them (this VM
    drifts 10-20 % over a race; steady drift cancels to first order) and plain_drift records how far it
    moved. A closing server that fails leaves plain's first one as it was (failed[CLOSING])."""
    t0 = time.perf_counter()
    mine = Race(race.traffic, race.levels, race.say, race.greedy, servers=race.servers)
    try:
        timing = race_contender(engine, Contender(CLOSING, None), mine, levels)
        race.timings[CLOSING] = {**(timing or {}), "wall_s": time.perf_counter() - t0}
    except UserError as e:
        race.failed[CLOSING] = str(e)
        race.say(f"      {CLOSING}: failed; plain is its first server alone ({e})")
    finally:
        race.servers = max(race.servers, mine.servers)
        for level, rounds in mine.results.get(CLOSING, {}).items():
            race.results[PLAIN].setdefault(level, []).extend({**r, "closing": True} for r in rounds)


def resolve(engine, race: Race, candidates: list[Contender], seconds_left: Callable[[], float],
            plain_tps: dict | None = None) -> dict[str, list[int]]:
    """Further passes while a candidate is unresolved somewhere and the next pass fits seconds_left(): each
    candidate's fresh server at its open levels, then plain's (plain on both sides of every pass), the last
    candidates left out of a pass that cannot hold them all; each pass narrows the intervals. Returns the levels
    still unresolved per candidate (race.resolving)."""
    plain_tps = plain_tps or {}
    while True:
        rows = {lv["level"]: lv["contenders"] for lv in race.rows()}
        todo = {c.name: [lv for lv in race.levels if c.name in rows.get(lv, {}) and unresolved(rows[lv][c.name])]
                for c in candidates if c.name in race.results}
        todo = {n: lvs for n, lvs in todo.items() if lvs}
        race.resolving = todo
        if not todo or PLAIN not in race.timings:
            return todo
        now = dict(todo)
        while len(now) > 1 and _pass_seconds(race, candidates, now, plain_tps) > seconds_left():
            now.pop(list(now)[-1])
        if (eta := _pass_seconds(race, candidates, now, plain_tps)) > seconds_left():
            race.say(f"      unresolved (the interval still holds 1): {_levels_said(todo)}; another pass "
                     f"(predicted {eta:.0f} s) does not fit the {max(seconds_left(), 0):.0f} s left")
            return todo
        open_levels, servers_before = sorted({lv for lvs in now.values() for lv in lvs}), race.servers
        race.say(f"      another pass, plain and the candidate each on a fresh server, at the unresolved levels: "
                 f"{_levels_said(now)} (predicted {eta:.0f} s)")
        for c in candidates:
            if c.name in now:
                try:
                    race_contender(engine, c, race, now[c.name])
                except UserError as e:
                    race.failed[c.name] = str(e)
                    race.results.pop(c.name, None)
                    race.say(f"      {c.name}: failed, out of the race ({e})")
        close_plain(engine, race, open_levels)
        if race.servers == servers_before:  # no server started, so no interval can have narrowed
            return todo


def _pass_seconds(race: Race, candidates: list[Contender], todo: dict[str, list[int]], plain_tps: dict) -> float:
    """What one resolving pass of the candidates named in `todo` takes: theirs and plain's at their open levels."""
    plain, rounds, open_levels = race.timings[PLAIN], race.traffic.rounds, sorted({lv for v in todo.values() for lv in v})
    return sum(predicted_seconds(c, plain, todo[c.name] if c.speculative else open_levels, rounds, plain_tps)
               for c in [Contender(PLAIN, None), *(c for c in candidates if c.name in todo)])


def _levels_said(todo: dict) -> str:
    return "; ".join(f"{n} at {', '.join(map(str, lvs))}" for n, lvs in todo.items())


def unresolved(row: dict) -> bool:
    """More servers could still change what a contender's row at a level says: no greedy answer changed and
    its interval holds 1 (its tokens/s under TIE x plain's on few servers is within the spread between
    servers too), or it is neither ahead of plain nor behind it."""
    if row.get("plain_path"):
        return False
    paired = row.get("paired") or {}
    lo, hi = paired.get("lo"), paired.get("hi")
    holds_one = lo is None or hi is None or lo <= 1.0 <= hi
    return row.get("mismatches") == 0 and holds_one or not beats_plain(row) and not behind_plain(row)


# ---------------------------------------------------------------------------------------------- budget


def race_sizes(pass_s: dict[int, float], fixed_s: float, n: int, levels, left_s: float,
               races: int, extra_s: float = 0.0, once=()) -> dict[int, int]:
    """Race requests per level, the same for every contender: n at every level when `races` races (each fixed_s
    of server start and warm-up waves plus pass_s[level], a pass of n requests) fit in left_s; otherwise the
    levels where the requests take longest over the races are cut first, each to a multiple of its level (and
    even) but never below MIN_RACE_REQUESTS or the level, until the races fit or nothing more can be cut; every
    contender answers the same first requests, so they pair up one to one. extra_s: seconds no cut shortens
    (a learner's further server starts). once: levels only the first race runs (plain's first server where no
    plan drafts: with the plugin a schedule's K = 0 is not raced)."""
    sizes = {lv: n for lv in levels}
    per_request = {lv: pass_s[lv] / n * (1 if lv in once else races) for lv in levels}

    def total() -> float:
        return extra_s + races * fixed_s + sum(per_request[lv] * sizes[lv] for lv in levels)

    for lv in sorted(levels, key=lambda x: -per_request[x]):
        over = total() - left_s
        if over <= 0:
            break
        step = lv if lv % 2 == 0 else 2 * lv
        floor = min(n, -(-max(MIN_RACE_REQUESTS, lv) // step) * step)
        fits = sizes[lv] - math.ceil(over / per_request[lv]) if per_request[lv] > 0 else sizes[lv]
        sizes[lv] = min(sizes[lv], max(floor, fits // step * step))
    return sizes


def predicted_seconds(c: Contender, plain: dict, levels, rounds: int, plain_tps: dict,
                      skip_plain_path: bool = False) -> float:
    """What racing `c` at `levels` will take, from plain's race (`plain`: its timing): its servers at
    plain's start time, and every level's passes at plain's time scaled by plain's tokens/s over the
    contender's predicted tokens/s where it has a prediction (else plain's own time). skip_plain_path: the
    levels where it runs vLLM's plain path are not raced (Race.skip_plain_path)."""
    if skip_plain_path:
        levels = [lv for lv in levels if lv not in plain_path_levels(c, levels)]
        if not levels:
            return 0.0
    wall = float(plain.get("wall_s") or 0.0)
    start = float(np.median(plain["start_s"])) if plain.get("start_s") else 0.0
    level_s = plain.get("level_s") or {lv: [(wall - start) / max(len(levels), 1) / rounds] * rounds for lv in levels}
    servers = len(levels) * rounds if server_per_pass(c) else 1
    passes = 0.0
    for lv in levels:
        pred = c.predicted.get(lv) or 0.0
        slower = plain_tps[lv] / pred if pred > 0 and plain_tps.get(lv) else 1.0
        passes += float(np.sum(level_s.get(lv) or [0.0])) * slower
    return servers * start + passes


def race_order(contenders: list[Contender], plain: dict, levels, rounds: int,
               plain_tps: dict, skip_plain_path: bool = False) -> list[tuple[Contender, float]]:
    """(contender, predicted seconds), in the order a budget keeps them: the planned schedules first, in the
    planner's order (the best predicted first), then the planner's fixed lengths, then the stock settings,
    cheapest first within each of those two (a proposer that learns from answers needs a server per pass
    without the plugin: the dearest)."""
    def rank(c: Contender) -> int:
        if (c.speculative or {}).get("num_speculative_tokens_per_batch_size"):
            return 0
        return 1 if c.predicted else 2

    priced = [(c, predicted_seconds(c, plain, levels, rounds, plain_tps, skip_plain_path)) for c in contenders]
    return sorted(priced, key=lambda t: (rank(t[0]), 0.0 if rank(t[0]) == 0 else t[1]))  # stable: planner's order


def distinct(contenders: list[Contender]) -> list[Contender]:
    """One server per served setting: a planned schedule that drafts the same length everywhere is the fixed
    one, and a planned length equal to a stock setting is that setting (which then carries the prediction)."""
    seen: dict[str, Contender] = {}
    for c in contenders:
        if c.key not in seen:
            seen[c.key] = c
        elif not seen[c.key].predicted and c.predicted:
            seen[c.key].predicted, seen[c.key].priced = dict(c.predicted), dict(c.priced)
    return list(seen.values())


# ---------------------------------------------------------------------------------------------- per level


def plain_drift(rounds: list[dict]) -> float | None:
    """Plain's closing servers over its first one at a level (output tokens/s, median over each side's
    rounds); None without a closing server there."""
    first = [r["result"].output_tokens_per_s for r in rounds if not r.get("closing")]
    last = [r["result"].output_tokens_per_s for r in rounds if r.get("closing")]
    if not first or not last or float(np.median(first)) <= 0:
        return None
    return float(np.median(last)) / float(np.median(first))


def per_request_s(rounds: list[dict]) -> dict[tuple[int, int], float]:
    """(slot, request) -> the median over the rounds that sent it of its end-to-end seconds per output
    token; a request that failed in any of them is left out."""
    by: dict[tuple[int, int], list] = {}
    for r in rounds:
        for i, x in enumerate(r["result"].records):
            by.setdefault((int(r.get("slot", 0)), i), []).append(x)
    out = {}
    for key, xs in by.items():
        ok = [x.latency_s / x.output_tokens for x in xs if x.ok and x.latency_s and x.output_tokens > 0]
        if len(ok) == len(xs):
            out[key] = float(np.median(ok))
    return out


def mismatches(plain_rounds: list[dict], rounds: list[dict]) -> int:
    """Requests whose token ids differ from plain's first server's (greedy: speculation must not change a
    token), over every round of the contender, paired by slot."""
    return len({(d["slot"], d["request"]) for d in differences(plain_rounds, rounds)})


def differences(plain_rounds: list[dict], rounds: list[dict]) -> list[dict]:
    """Every response of `rounds` whose token ids differ from plain's first answer to the same request:
    {"slot", "request", "first_difference", "plain_tokens", "tokens", "compared"} (compared on the first)."""
    ref = {}
    for r in plain_rounds:
        for i, x in enumerate(r["result"].records):
            if x.ok and x.token_ids is not None:
                ref.setdefault((int(r.get("slot", 0)), i), x.token_ids)
    out = []
    for r in rounds:
        for i, y in enumerate(r["result"].records):
            want = ref.get((int(r.get("slot", 0)), i))
            if y.ok and y.token_ids is not None and want is not None and y.token_ids != want:
                at = next((j for j, (a, b) in enumerate(zip(y.token_ids, want)) if a != b),
                          min(len(want), len(y.token_ids)))
                out.append({"slot": int(r.get("slot", 0)), "request": i, "first_difference": at,
                            "plain_tokens": len(want), "tokens": len(y.token_ids)})
    return out


def compared(plain_rounds: list[dict], rounds: list[dict]) -> int:
    """Responses of `rounds` that have a plain answer to compare with."""
    ref = {(int(r.get("slot", 0)), i) for r in plain_rounds for i, x in enumerate(r["result"].records)
           if x.ok and x.token_ids is not None}
    return sum((int(r.get("slot", 0)), i) in ref for r in rounds for i, y in enumerate(r["result"].records)
               if y.ok and y.token_ids is not None)


def decide_level(results: dict, level: int, greedy: bool, plain_path: dict | None = None) -> dict:
    """Each contender against plain at one level (the paired rule), its report row, and the level's winner.
    plain_path: name -> levels it was not raced at, its K = 0 with the plugin: its row there is plain's own
    (plain_path_row), neither ahead nor behind and never the winner."""
    from workflows.mainjob.signflip import interval

    plain_s = per_request_s(results[PLAIN][level])
    spread = server_spread(results[PLAIN])
    rows, winner, best = {}, PLAIN, 1.0
    for name, by_level in results.items():
        rounds = by_level.get(level)
        if rounds is None:
            continue
        row = level_row(rounds)
        if name == PLAIN:
            row["drift"] = plain_drift(rounds)
        else:
            mine = per_request_s(rounds)
            iv = interval([math.log(plain_s[k] / mine[k]) for k in sorted(mine) if k in plain_s])
            paired = across_servers(iv, servers(rounds), servers(results[PLAIN][level]), spread)
            row.update({"paired": paired, "mismatches": mismatches(results[PLAIN][level], rounds) if greedy else 0})
        rows[name] = row
    for name, lvs in (plain_path or {}).items():
        if level in lvs and name not in rows:
            rows[name] = plain_path_row(rows[PLAIN])
    plain_tps = rows[PLAIN]["output_tokens_per_s"]
    for name, row in rows.items():
        row["vs_plain"] = row["output_tokens_per_s"] / plain_tps if plain_tps > 0 else None
        if name != PLAIN:
            row["resolved"] = not unresolved(row)
            if beats_plain(row) and row["paired"]["mean"] > best:
                winner, best = name, row["paired"]["mean"]
    return {"level": level, "contenders": rows, "winner": winner}


def servers(rounds: list[dict]) -> int:
    """How many servers ran these rounds (a round without a server id counts as one server)."""
    return len({r.get("server") for r in rounds})


def server_spread(plain: dict) -> float:
    """The standard deviation of log(output tokens/s) between servers running the same config at the same
    level: pooled over plain's levels from its own servers there (first, closing, each pass's), shrunk
    toward SERVER_SPREAD with PRIOR_SERVERS pseudo-degrees of freedom, so that a race with few servers leans
    on what was measured here and a long race on a quieter machine learns that its servers agree."""
    ss, dof = PRIOR_SERVERS * SERVER_SPREAD ** 2, float(PRIOR_SERVERS)
    for rounds in plain.values():
        by_server: dict = {}
        for r in rounds:
            by_server.setdefault(r.get("server"), []).append(r["result"].output_tokens_per_s)
        logs = [math.log(float(np.median(v))) for v in by_server.values() if float(np.median(v)) > 0]
        if len(logs) >= 2:
            ss += float(np.var(logs, ddof=1)) * (len(logs) - 1)
            dof += len(logs) - 1
    return math.sqrt(ss / dof)


def across_servers(iv, n_mine: int, n_plain: int, spread: float) -> dict:
    """The paired interval widened by the spread between servers: the requests of one server share its
    state (its warm-up, its memory layout, the machine's moment), so the per-request interval alone
    resolves a level within one server (two here said 1.03x and 0.79x on the same plain path at 16
    requests, each interval tight). The widening is the one-sided LEVEL quantile of the normal times the
    spread of a difference between the mean of n_mine servers and of n_plain; it shrinks as passes add
    servers. The per-request interval stays on record as "within"."""
    from workflows.mainjob.signflip import ALPHA

    out = iv.to_json()
    if out["lo"] is None:
        return {**out, "within": None, "server_spread": spread, "servers": [n_mine, n_plain]}
    z = NormalDist().inv_cdf(1.0 - ALPHA)
    widen = z * spread * math.sqrt(1.0 / max(n_mine, 1) + 1.0 / max(n_plain, 1))
    m, lo, hi = math.log(iv.mean), math.log(iv.lo), math.log(iv.hi)
    return {**out, "lo": math.exp(m - math.hypot(m - lo, widen)), "hi": math.exp(m + math.hypot(hi - m, widen)),
            "within": [iv.lo, iv.hi], "server_spread": spread, "servers": [n_mine, n_plain]}


# ---------------------------------------------------------------------------------------------- small helpers


def config_key(speculative: dict | None) -> str:
    """One key per speculative config (the same config, whatever its keys' order)."""
    return json.dumps(speculative, sort_keys=True)


def by_level(values: dict) -> list[tuple]:
    """(level, value) in level order, for levels as ints or as JSON's strings."""
    return sorted(values.items(), key=lambda t: int(t[0]))


def geomean(ratios) -> float:
    """The geometric mean of ratios to plain (a 0, a contender that produced nothing, counts as 1e-9)."""
    return math.exp(float(np.mean(np.log(np.maximum(ratios, 1e-9))))) if len(ratios) else 0.0


def warm_requests(requests: list, sampling, seed: int, seeded: bool = True) -> list:
    """The warm-up wave's requests: `requests` under the race's sampling, cut to WARMUP_TOKENS each."""
    from profiler.vllm_accept import sampled_requests

    return [replace(r, max_tokens=min(WARMUP_TOKENS, r.max_tokens))
            for r in sampled_requests(requests, sampling, seed, seeded)]
