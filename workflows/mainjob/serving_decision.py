"""The serving main job's decision from the race's rows (workflows/mainjob/serving_race.py): one config,
since a server runs one proposer, never written at a level where its own race measured it behind plain.

    chosen, why = decision(raced, levels_out, levels, plugin=True)
    confirmed = confirm(engine, chosen, contenders, race)
    best = best_measured(candidates, levels_out, levels)

decision: the contender that won the most levels (then is ahead of plain at the most, then by geometric
mean), its draft length 0 where it lost. Without the plugin a schedule's K = 0 is not plain in vLLM
(0.81-1.07x measured, its speculative path stays), so only a level measured behind plain is switched off
and a tie keeps its length. With the project's plugin (planner/serving.py PLUGIN_ENV) K = 0 is vLLM's
plain path, so every level not measured ahead is switched off: measured-safe. A proposer that takes one
draft length only (suffix and medusa in vLLM 0.32 without the plugin) cannot be switched off by batch
size, so without the plugin it is a candidate only where it is behind at no level. confirm races the
decided config as written when no contender ran it; best_measured then writes the config measured as
deployed with the highest geometric mean over plain among those behind plain nowhere.
"""
from __future__ import annotations

from planner.serving import schedulable, schedule_ranges
from workflows.mainjob.serving_race import (
    DECISION,
    PLAIN,
    Contender,
    Race,
    beats_plain,
    behind_plain,
    geomean,
    k_by_level,
    race_all,
    unresolved,
)


def decision(contenders: list[Contender], levels_out: list[dict], levels, plugin: bool = False
             ) -> tuple[Contender | None, dict]:
    """The one config (see the module docstring) and its record; (None, why) for plain."""
    scores = []
    at = {lv["level"]: lv for lv in levels_out}
    for c in contenders:
        if c.speculative is None:
            continue
        rows = {lv: at[lv]["contenders"].get(c.name) if lv in at else None for lv in levels}
        wins = [lv for lv in levels if lv in at and at[lv]["winner"] == c.name]
        ahead = [lv for lv in levels if beats_plain(rows[lv] or {})]
        behind = [lv for lv in levels if behind_plain(rows[lv])]
        if not schedulable(c.speculative.get("method"), plugin) and behind:
            continue
        geo = geomean([(rows[lv] or {}).get("vs_plain") or 0.0 for lv in levels if lv in at])
        scores.append((len(wins), len(ahead), geo, c, ahead, behind))
    scores.sort(key=lambda t: t[:3], reverse=True)
    if not scores or scores[0][1] == 0:
        return None, {"winner": PLAIN, "why": "no contender beat plain beyond the noise at any level (a proposer vLLM "
                                              "runs at one draft length must be behind plain at no level)"}
    *_, geo, c, ahead, behind = scores[0]
    off = [lv for lv in levels if lv not in ahead] if plugin else behind
    cfg, per_level = switched_off(c.speculative, levels, off)
    on = plugin and bool(off)
    return Contender(c.name, cfg, plugin=on or c.plugin), {
        "winner": c.name, "levels_ahead_of_plain": ahead, "levels_behind_plain": behind,
        "geomean_vs_plain": geo, "draft_length_by_level": per_level, "plugin": on or c.plugin}


def to_resolve(raced: list[Contender], why: dict, levels_out: list[dict], levels) -> list[Contender]:
    """The contenders the race's further passes serve, first to last: the decision's winner (if a contender
    won), then every other one that could overturn the decision: unresolved at a level where it ran more
    tokens/s than the decision as written would (the winner's row there; plain's where the winner is switched
    off or the decision is plain). Passes for the winner alone once left a proposer that raced 1.25x plain at
    one request (sampled, unresolved on one server each) behind a decision that wrote plain there."""
    at = {lv["level"]: lv["contenders"] for lv in levels_out}
    ks = why.get("draft_length_by_level") or {}
    winner = next((c for c in raced if c.name == why.get("winner")), None)

    def written(lv: int) -> float:
        row = at.get(lv, {}).get(winner.name) if winner is not None else None
        return (row.get("vs_plain") or 0.0) if row and ks.get(lv) else 1.0

    def challenges(c: Contender) -> bool:
        rows = {lv: at.get(lv, {}).get(c.name) for lv in levels}
        return any(r and unresolved(r) and (r.get("vs_plain") or 0.0) > written(lv) for lv, r in rows.items())

    first = [winner] if winner is not None else []
    return first + [c for c in raced if c is not winner and c.speculative is not None and challenges(c)]


def switched_off(speculative: dict, levels, off) -> tuple[dict, dict[int, int]]:
    """The config with draft length 0 at the levels `off` (a per-batch-size schedule), and K by level."""
    cfg = dict(speculative)
    k_of = k_by_level(cfg, levels)
    per_level = {lv: (0 if lv in off else k_of[lv]) for lv in levels}
    if off:  # else the raced config as it is (suffix's own default cap stays unwritten: the same server)
        ranges = schedule_ranges(per_level, list(levels))
        cfg.pop("num_speculative_tokens_per_batch_size", None)
        cfg["num_speculative_tokens"] = max(k for *_, k in ranges) or cfg.get("num_speculative_tokens", 1)
        if len(ranges) > 1:
            cfg["num_speculative_tokens_per_batch_size"] = ranges
    return cfg, per_level


def confirm(engine, chosen: Contender | None, contenders: list[Contender], race: Race) -> Contender | None:
    """The decision's measured rows: a raced contender with the same setting is the decision as written;
    otherwise (speculation switched off where it lost, a new schedule) it races now, on the race's
    requests, so every level of what the user deploys is measured against plain, not assembled from
    other configs' rows. None: the decision is plain, or its server died (then in race.failed)."""
    if chosen is None:
        race.say("      the decision is plain: nothing to confirm")
        return None
    same = raced_as_is(chosen, [c for c in contenders if c.name in race.results])  # failed ones are popped
    if same is not None:
        race.say(f"      the decision is {same.name}'s config, raced as it is")
        return same
    mine = as_written(chosen)
    race_all(engine, [mine], race)
    return None if DECISION in race.failed else mine


def as_written(chosen: Contender) -> Contender:
    """The decision as confirm races it, the row DECISION: its config and its plugin flag, which also says how
    many servers it races on (one for suffix with the plugin, whose reset makes it forget; else one per pass)."""
    return Contender(DECISION, chosen.speculative, plugin=chosen.plugin)


def raced_as_is(chosen: Contender, raced: list[Contender]) -> Contender | None:
    """The raced contender that ran the decided setting as it is; None: a new one, which confirm races."""
    return next((c for c in raced if c.key == chosen.key), None)


def measured_record(c: Contender, levels_out: list[dict], levels) -> dict:
    """What `c`'s config measured as it raced, as the decision's record: its draft length, the levels
    where it was ahead of and behind plain, its ratios to plain and their geometric mean."""
    rows = {lv["level"]: lv["contenders"].get(c.name) for lv in levels_out}
    measured = {lv: (row or {}).get("vs_plain") for lv, row in rows.items()}
    return {"winner": c.name, "measured_as": c.name, "draft_length_by_level": k_by_level(c.speculative, levels),
            "levels_ahead_of_plain": [lv for lv in levels if beats_plain(rows.get(lv) or {})],
            "levels_behind_plain": [lv for lv in levels if behind_plain(rows.get(lv))],
            "geomean_vs_plain": geomean([r for r in measured.values() if r is not None]),
            "vs_plain_by_level": measured, "plugin": c.plugin}


def unconfirmed(chosen: Contender, why: dict, raced: list[Contender], levels_out: list[dict], levels,
                skipped: str) -> tuple[Contender | None, dict]:
    """The decision when its confirmation does not fit the budget, never a level at a setting measured behind
    plain. With the plugin: the decided config as written is measured-safe (K = 0, vLLM's plain path, at
    every level not measured ahead; its own setting only where it was), its ratios by level the winner's
    where it speculates and 1 where it is off. Without it: the best raced config behind plain nowhere
    (best_measured), else plain; the switched-off schedule is named for a larger --budget, not written."""
    if chosen.plugin:
        winner = next(c for c in raced if c.name == why["winner"])
        measured = measured_record(winner, levels_out, levels)["vs_plain_by_level"]
        ratios = {lv: (1.0 if why["draft_length_by_level"][lv] == 0 else measured.get(lv)) for lv in levels}
        return chosen, {**why, "measured_as": f"{winner.name} where it speculates, plain where it is off (K = 0 with "
                        "the plugin)", "vs_plain_by_level": ratios,
                        "geomean_vs_plain": geomean([r for r in ratios.values() if r is not None]), "confirm": skipped}
    best = best_measured(raced, levels_out, levels)
    if best is None:
        return None, {"winner": PLAIN, "why": f"{why['winner']} lost to plain at some level, switching it off there "
                      "was not confirmed in the budget, and no raced config was behind plain nowhere and ahead "
                      "somewhere", "confirm": skipped, "measured_decision": why}
    c, scores = best
    return Contender(c.name, dict(c.speculative), plugin=c.plugin), {
        **measured_why(c, levels_out, levels, scores, why), "confirm": skipped}


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
    """The decision's record when best_measured replaced the one decision() raced: what it measured."""
    return {**measured_record(c, levels_out, levels),
            "chosen_by": "the highest geometric mean over plain among the configs measured as written and behind "
                         "plain at no level: " + ", ".join(f"{n} {g:.3f}x" for n, g in
                                                            sorted(scores.items(), key=lambda t: -t[1])),
            "decided_first": decided}


def ahead_over_range(vs_plain_by_level: dict) -> bool:
    """The confirmed decision pays over the levels: the geometric mean of its measured ratios to plain
    is above 1. Without the plugin, speculation switched off by a schedule (K = 0) is not plain in vLLM (its
    speculative path stays: 0.88-0.96x measured at 2-16 requests here), so a config that speculates at few
    levels can lose more where it is off than it gains where it is on; then no config is better."""
    ratios = [r for r in vs_plain_by_level.values() if r is not None]
    return bool(ratios) and all(r > 0 for r in ratios) and geomean(ratios) > 1.0
