"""The serving main job's plan phase, its parts: plain's served split, the contenders the planner puts
forward, the race's size in the budget, and whether the project's vLLM plugin is on.

    contenders = planned_contenders(records, profiles, levels, s, models, overhead, out, say, served, plugin=True)

Per proposer, planner/serving.py's plan_method gives the draft length per level and the best fixed one,
priced on the profile and plain's served split. With the plugin, a schedule's K = 0 is vLLM's plain path, so
it is priced as plain (off_ratio 1) and suffix takes a schedule too; without it, K = 0 is priced at the
engine's schedule_off_ratio (vLLM keeps its speculative path there) and suffix runs one length.
"""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np

from planner.engines import kind as engine_kind
from planner.jsonio import atomic_write_json
from planner.serving import (
    PLUGIN_ENV,
    ServedLevel,
    draft_costs,
    plan_method,
    schedulable,
    schedule_ranges,
    served_level,
)
from profiler.vllm_accept import LEARNS
from workflows.mainjob.serving_race import PLAIN, SERVED_STEP, WARMUP_TOKENS, Contender, distinct, race_sizes

CONCURRENCY = (1, 2, 4, 8, 16)
RACE_DRAFT_LENGTHS = (0, 2, 4, 8)  # profiled K: the ends and the middle; the planner interpolates between
STOCK = {  # vLLM's documented defaults a user would otherwise run
    "suffix defaults": {"method": "suffix"},
    "ngram defaults": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
}
# with the plugin, a level whose planned K gains less than this over plain is planned K = 0 (vLLM's plain path)
# for the race: the spread between two servers of one config here is about 6 % (serving_race.SERVER_SPREAD), so
# a race cannot show such a level ahead of plain, and the decision writes K = 0 at every level not shown ahead
RACE_GAIN = 0.05
PLUGIN_PACKAGE = "tree_planner_vllm"  # vllm_plugin/: the package registered under vllm.general_plugins


def plugin_on(engine, asked: bool | None, say) -> bool:
    """Whether the race serves planned schedules with the plugin: as asked (--plugin on / off), else where the
    engine's environment has it registered (scripts/setup_vllm.sh installs it)."""
    if asked is not None:
        return asked
    python = getattr(engine, "python", None)
    if python is None:
        return False
    code = ("import importlib.metadata as m, sys; sys.exit(0 if any(e.value.split(':')[0].split('.')[0] == "
            f"'{PLUGIN_PACKAGE}' for e in m.entry_points(group='vllm.general_plugins')) else 1)")
    try:
        found = subprocess.run([str(python), "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    state = (f"installed, on ({PLUGIN_ENV}=1 where a planned schedule needs it)" if found else
             "not installed (bash scripts/setup_vllm.sh): a schedule's K = 0 keeps vLLM's speculative path")
    say(f"      the project's vLLM plugin: {state}")
    return found


def method_config(method: str, k: int, models: dict[str, str], ranges: list[list[int]] | None = None) -> dict:
    """vLLM's config for `method` at K (a schedule over `ranges`); models: method -> the drafter folder it loads."""
    from profiler.vllm_accept import speculative_config

    cfg = speculative_config(method, k, models)
    if ranges and len(ranges) > 1:
        cfg["num_speculative_tokens_per_batch_size"] = ranges
    return cfg


def served_split(plain_rows: dict[int, dict]) -> dict[int, ServedLevel]:
    """level -> plain's ServedLevel from its race rows, where the pass decoded (its streams' times)."""
    out = {}
    for lv, row in plain_rows.items():
        v = served_level(lv, row["output_tokens_per_s"], row.get("requests", 0), row.get("output_tokens", 0),
                         row.get("step_p50_s"))
        if v is not None:
            out[lv] = v
    return out


def plans(records: dict, profiles: dict, levels, s, overhead: dict, served: dict, plugin: bool, say) -> dict:
    """plan_method for every measured proposer."""
    out = {}
    off_ratio = 1.0 if plugin else engine_kind(s.engine).defaults.schedule_off_ratio
    for m, rec in records.items():
        costs = draft_costs(rec, profiles, levels, served) if rec["guesser"].get("draft_passes") == "depth" else {}
        out[m] = plan_method(m, rec, profiles, levels, max(s.draft_lengths), costs, schedulable=schedulable(m, plugin),
                             overhead_s=overhead, off_ratio=off_ratio, served=served)
        say(f"      {m}: draft length by level {out[m]['per_level']}, best fixed {out[m]['best_fixed']}")
    return out


def planned_contenders(records: dict, profiles: dict, levels, s, models: dict[str, str], overhead: dict[int, float],
                       out: Path, say, served: dict[int, ServedLevel] | None = None,
                       plugin: bool = False) -> list[Contender]:
    """Plain, the stock settings, the best proposer's best fixed length and its planned schedule (served with
    the plugin where it has one), each priced on the profile and plain's served levels; plans.json records
    every proposer's."""
    served = served or {}
    by_method = plans(records, profiles, levels, s, overhead, served, plugin, say)

    def score(p: dict) -> float:
        return float(np.mean(np.log([p["predicted"][b] for b in levels])))

    best = max(by_method.values(), key=score)
    # sampled, every speculative contender needs the plugin: vLLM 0.32's CPU build verifies sampled drafts at an
    # uninitialised temperature without it (docs/vllm.md), so its answers would not be the model's distribution
    sampled = plugin and s.temperature > 0
    contenders = [Contender(PLAIN, None)] + [Contender(n, dict(c), plugin=sampled) for n, c in STOCK.items()]
    contenders.append(Contender(f"fixed {best['method']} K={best['best_fixed']}",
                                method_config(best["method"], best["best_fixed"], models), plugin=sampled,
                                predicted=dict(best["fixed_predicted"]), priced=dict(best["fixed_priced"])))
    # a proposer that runs at one length is the decision only if ahead at every level, and its own work is
    # not in the profile (it drafts with a stub); so the best proposer a schedule can switch off by batch
    # size races its schedule too. With the plugin every proposer's schedule is a contender, best predicted
    # first: a schedule races only the levels where it drafts (its K = 0 is plain's path), so two fit a
    # 15-minute race, and the planner's ranking of two proposers within its own error (sampled: suffix over
    # ngram by 3 %, raced the other way round) is decided by the race
    switchable = sorted((p for m, p in by_method.items() if schedulable(m, plugin)), key=score, reverse=True)
    if plugin:
        planned = [best] + [p for p in switchable if p is not best]
    else:
        planned = [best] + ([switchable[0]] if not schedulable(best["method"], plugin) and switchable else [])
    for p in planned:
        per_level, predicted, priced = worth_racing(p, levels) if plugin else (p["per_level"], p["predicted"],
                                                                                p["priced"])
        p["raced_per_level"] = per_level
        ranges = schedule_ranges(per_level, levels)
        if any(k for *_, k in ranges):
            cfg = method_config(p["method"], max(k for *_, k in ranges), models, ranges)
            needs = sampled or (plugin and (any(k == 0 for *_, k in ranges) or not schedulable(p["method"])))
            contenders.append(Contender(f"planned {p['method']}", cfg, plugin=needs, predicted=dict(predicted),
                                        priced=dict(priced)))
    atomic_write_json(out / "plans.json", {"plans": jsonable(by_method), "chosen_method": best["method"],
                                           "planned_methods": [p["method"] for p in planned], "plugin": plugin,
                                           "server_overhead_s": jsonable(overhead),
                                           "served": jsonable({lv: vars(v) for lv, v in served.items()})})
    return distinct(contenders)


def worth_racing(p: dict, levels, gain: float = RACE_GAIN) -> tuple[dict, dict, dict]:
    """A plan as the race takes it with the plugin: (K by level, predicted tokens/s, priced) with K = 0, plain's
    prediction and no price at every level whose planned K is predicted to gain less than `gain` over plain."""
    per_level, predicted, priced = dict(p["per_level"]), dict(p["predicted"]), dict(p["priced"])
    for lv in levels:
        if per_level[lv] and predicted[lv] < (1.0 + gain) * p["plain_predicted"][lv]:
            per_level[lv], predicted[lv] = 0, p["plain_predicted"][lv]
            priced.pop(lv, None)
    return per_level, predicted, priced


def race_size_for_budget(profiles: dict, records: dict, s, levels, left_s: float, n: int,
                         plugin: bool = False) -> dict[int, int]:
    """Race requests per level (serving_race.py race_sizes) for four races within left_s: plain's two servers, the
    first contender's and the confirmation's (the decision as written, which switches speculation off where it
    lost); with the plugin the last three only where a plan drafts (drafting_levels). Priced before any has run: a
    served step at SERVED_STEP times the profiled plain step, a server start at the longest acceptance server's wait
    (the first of them started alone), each level's warm-up wave of WARMUP_TOKENS and its passes of n requests.
    Where a measured proposer learns from answers (suffix) and the plugin is off, the first contender and the
    confirmation may be it, each a fresh server per pass: their further starts are priced too (a 15-minute run took
    16.1 when they were not). With the plugin they race on one server like the others: its reset makes them forget."""
    from profiler.vllm_profile import START_GUESS_S

    step = {lv: float(profiles[lv].latency(1)) * SERVED_STEP for lv in levels}
    waits = [(r.get("vllm") or {}).get("server_start_s") for r in records.values()]
    start = max([float(w) for w in waits if isinstance(w, (int, float)) and w > 0] or [START_GUESS_S])
    fixed = start + s.rounds * sum(WARMUP_TOKENS * step[lv] for lv in levels)
    pass_s = {lv: s.rounds * math.ceil(n / lv) * s.max_tokens * step[lv] for lv in levels}
    learner = not plugin and any((r.get("guesser") or {}).get("method") in LEARNS for r in records.values())
    extra = 2 * (len(levels) * s.rounds - 1) * start if learner else 0.0
    drafting = drafting_levels(records, profiles, levels, s) if plugin else set(levels)
    once = [lv for lv in levels if lv not in drafting] if drafting else []
    return race_sizes(pass_s, fixed, n, levels, left_s, races=4, extra_s=extra, once=once)


def drafting_levels(records: dict, profiles: dict, levels, s) -> set[int]:
    """With the plugin, the levels where some proposer's plan drafts, before plain's race: the other three of
    race_size_for_budget's races (plain's closing server, the first planned schedule, the confirmation) run
    only there, since a schedule's K = 0 is vLLM's plain path and is not raced. Priced on the profile alone,
    which leaves out the seconds a server adds to every step and request (speculation does not shorten them),
    so it finds a gain at least where the plan on plain's served split will [D: the sampled runs here drafted
    at 1-2 requests and the greedy ones at 1-8; the budget still checks each contender before it races]."""
    by_method = plans(records, profiles, levels, s, {}, {}, True, lambda *_: None)
    return {lv for p in by_method.values() for lv, k in worth_racing(p, levels)[0].items() if k}


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x
