"""The main job's serving phases (an engine whose protocol is SERVING: vLLM): a draft length per concurrency
level, raced under load through a real server. workflows/mainjob/pipeline.py runs them in order:

    from workflows.mainjob.pipeline import autotune
    summary = autotune(ServingSettings(concurrency=(1, 2, 4, 8, 16)))

  profile   the server's own step time by batch size and draft length       profiler/vllm_profile.py
  accept    each proposer's acceptance per draft position, in the server     profiler/vllm_accept.py
  plan      vLLM plain through the server at every level (the race's first contender): its streams split
            a request's time into served steps and the rest (prefill, first token, ramp and tail), which
            speculation does not shorten (planner/serving.py served_level); then per proposer the draft
            length per level with the most output tokens/s and its best fixed length (plan_method). With
            the project's plugin a schedule's K = 0 is vLLM's plain path, priced as plain, and every
            proposer, suffix included, can be switched off at load
  race      one real server per contender and real concurrent clients at every level: the planned
            schedule first (with the plugin every proposer's, best predicted first, each only at the levels
            where it drafts: its K = 0 is plain's path), then the best fixed length and the stock settings
            while the budget holds them, plain again last, then further passes at the levels still
            unresolved (serving_race.py)
  confirm   the decision (serving_decision.py) raced as written where no contender ran it; where the
            budget cannot hold that, a decision measured-safe (K = 0 with the plugin where not ahead) or
            a config raced behind plain nowhere, never a level at a setting measured behind plain
  write     chosen.json (the decision as the engine takes it), exports, race.json, summary, report

Ctrl-C stops the server in use and keeps every file already written; chosen.json is written last,
atomically, so an interrupted run leaves none.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from decoder.serving import ServingEngine
from planner.engines import kind as engine_kind
from planner.errors import UserError
from planner.jsonio import atomic_write_bytes, atomic_write_json
from planner.serving import MAX_CONCURRENCY, server_overhead
from workflows.mainjob.serving_decision import (
    ahead_over_range,
    as_written,
    best_measured,
    confirm,
    decision,
    measured_record,
    measured_why,
    raced_as_is,
    to_resolve,
    unconfirmed,
)
from workflows.mainjob.serving_plan import (
    CONCURRENCY,
    RACE_DRAFT_LENGTHS,
    jsonable,
    planned_contenders,
    race_size_for_budget,
    served_split,
)
from workflows.mainjob.serving_race import (
    CLOSING,
    DECISION,
    PLAIN,
    Contender,
    Race,
    close_plain,
    plain_drift,
    predicted_seconds,
    race_all,
    race_order,
    resolve,
    same_requests,
    warm_requests,
)
from workflows.mainjob.serving_report import exports, prediction_error, prediction_parts, report
from workflows.mainjob.serving_traffic import mixed, requests, spread  # noqa: F401  (mixed, spread: tests)

_DEFAULTS = engine_kind("vllm").defaults  # planner/engines.py: every engine's defaults in one place
WRITE_S = 15.0  # decide, write the exports and the report: kept from the budget with the confirmation
# the acceptance loads: 4 requests at a time, but a drafter model's at 1. Its load is timed to price a draft pass
# (draft_costs: its step less plain's and the profile's price for scoring the drafts), and at 4 requests with 8
# drafts that remainder is a few ms of a 170-410 ms step (0-30 ms a pass across runs, EAGLE-3's served step at one
# request underpriced by 9-15 ms); at 1 it is priced where a drafter drafts, in about the same wall time
ACCEPT_CONCURRENCY, DRAFTER_ACCEPT_CONCURRENCY = 4, 1
# sampled, two draws of the half (other seeds): one draw of suffix measured 1.34 / 1.59 / 1.42 / 1.53 / 1.40 tokens
# a step by its seeds' base (0 / 100 / 1000 / 5000 / 77777), and the first, the same in every run, was 0.05-0.17
# under the race's at 7 of the 8 levels of the last four sampled runs
SAMPLED_ACCEPT_PASSES = 2
PHASES = ("profile", "accept", "plan", "race", "confirm", "write")


@dataclass
class ServingSettings:
    engine: str = "vllm"  # a registered engine whose protocol is SERVING
    model: str = "smollm2-135m"
    out: str | None = None  # run folder; default runs/<date>-cpu-vllm-<model>
    concurrency: tuple[int, ...] = CONCURRENCY
    workload: str | None = None  # --workload FILE (profiler/workload.py); None: the built-in mix (requests())
    methods: tuple[str, ...] = ("ngram", "suffix", "draft_model")
    max_tokens: int = _DEFAULTS.decode_tokens  # per request, acceptance and race
    race_requests: int = _DEFAULTS.decode_prompts  # requests per level (half held-out questions, half input-repeating)
    accept_requests: int = _DEFAULTS.accept_prompts  # the acceptance half's requests measured
    rounds: int = _DEFAULTS.rounds  # passes over a level's requests per server; the median seconds per token counts
    budget_minutes: float = _DEFAULTS.budget_minutes  # the whole run: contenders it cannot fit are not raced
    draft_lengths: tuple[int, ...] = RACE_DRAFT_LENGTHS
    profile: str | None = None  # reuse a vLLM profile instead of measuring
    accept: tuple[str, ...] = ()  # reuse acceptance records (planner accept --engine vllm) instead of measuring
    draft: str | None = None  # the project's draft LM (default: shipped for the model)
    drafter: str | None = None  # a head's folder (EAGLE-1/3, Medusa) for its method (default: the head shipped)
    plugin: bool | None = None  # the project's vLLM plugin: None = on where it is installed (serving_plan.py)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    request_timeout_s: float = 600.0
    quiet: bool = False

    @property
    def kind(self):
        return engine_kind(self.engine)

    @property
    def sampling(self):
        from planner.sampling import Sampling

        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass
class ServingRun:
    """One serving run: what every phase reads and what it leaves for the next."""

    s: ServingSettings
    engine: ServingEngine
    out: Path
    say: object
    accept_reqs: list
    race_reqs: list
    plugin: bool
    t0: float = field(default_factory=lambda: time.time())  # late-bound: a test clock replaces `time`
    summary: dict = field(default_factory=dict)
    profile_path: Path | None = None
    profiles: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)  # method -> the drafter folder it loads (draft LM, head)
    race: Race | None = None
    contenders: list = field(default_factory=list)
    sizes: dict = field(default_factory=dict)
    plain_tps: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    levels_out: list = field(default_factory=list)
    chosen: Contender | None = None
    why: dict = field(default_factory=dict)
    shown_contenders: list = field(default_factory=list)

    @property
    def seeded(self) -> bool:
        """Sampled race requests carry a seed each (False on vLLM's CPU build: VllmEngine.seeded_sampling)."""
        return getattr(self.engine, "seeded_sampling", True)

    @property
    def levels(self) -> list[int]:
        return list(self.s.concurrency)

    def left(self) -> float:
        return self.s.budget_minutes * 60 - (time.time() - self.t0)

    def phase(self, name: str, text: str) -> None:
        self.say(f"[{PHASES.index(name) + 1}/{len(PHASES)}] {name}: {text}  ({time.time() - self.t0:.0f} s in, "
                 f"budget {self.s.budget_minutes:g} min)")
        self.summary["phases"][f"{name}_started_s"] = time.time() - self.t0  # seconds into the run


# ---------------------------------------------------------------------------------------------- settings


def check(s: ServingSettings) -> None:
    from planner.serving import check_levels

    check_levels(s.concurrency, "--concurrency")
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


# ---------------------------------------------------------------------------------------------- the phases


def open_run(s: ServingSettings) -> ServingRun:
    """Checks, the requests (a bad workload is refused before anything starts), the engine and the run folder."""
    from decoder.engines.registry import EngineRequest, open_engine
    from workflows.mainjob.serving_plan import plugin_on
    from workflows.mainjob.runs import default_out

    check(s)
    say = (lambda line: None) if s.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    accept_reqs, race_reqs = requests(s)
    engine = open_engine(s.engine, EngineRequest(model=s.model))
    out = Path(s.out) if s.out else default_out("cpu", engine.model_name, engine.caps.name)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    plugin = plugin_on(engine, s.plugin, say)
    summary = {"engine": engine.caps.name, "model": engine.model_name, "concurrency": list(s.concurrency),
               "settings": {k: v for k, v in asdict(s).items() if k != "quiet"}, "plugin": plugin, "phases": {}}
    return ServingRun(s, engine, out, say, accept_reqs, race_reqs, plugin, summary=summary)


def profile(run: ServingRun) -> None:
    from planner.profile import load_batch_profiles

    run.phase("profile", "vLLM's step time by batch size and draft length")
    run.profile_path = _profile(run.engine, run.s, run.levels, run.out, run.s.budget_minutes * 60 * 0.3, run.say,
                                run.plugin)
    run.profiles = load_batch_profiles(str(run.profile_path))
    missing = [c for c in run.levels if c not in run.profiles]
    if missing:
        raise UserError(f"{run.profile_path}: no series at batch size {', '.join(map(str, missing))} (profile every "
                        "--concurrency level)")


def accept(run: ServingRun) -> None:
    s = run.s
    reused = f" ({len(s.accept)} reused)" if s.accept else ""
    run.phase("accept", f"{', '.join(s.methods)} on {len(run.accept_reqs)} requests{reused}")
    run.models = _models(run.engine, s)
    run.records = _acceptance(run.engine, s, run.accept_reqs, run.models, run.out, run.say, run.plugin)


def plan(run: ServingRun) -> None:
    """Plain through the server at every level, its served split, and the planned contenders."""
    s = run.s
    run.phase("plan", "vLLM plain through the server at every level (its served step and the rest of each "
                      "request's time), then the draft length per level, per proposer")
    # plain's two servers, the first contender and the confirmation must fit what is left: if not at full
    # size, every contender races fewer requests at the levels where a request takes longest
    run.sizes = race_size_for_budget(run.profiles, run.records, s, run.levels, run.left() - WRITE_S,
                                     len(run.race_reqs), run.plugin)
    cut = {lv: n for lv, n in run.sizes.items() if n < len(run.race_reqs)}
    if cut:
        run.say(f"      to fit the budget, every contender races the first "
                f"{', '.join(f'{n} at {lv}' for lv, n in cut.items())} of the {len(run.race_reqs)} requests")
    seeded = run.seeded
    if s.temperature > 0 and not seeded:
        run.say("      sampled requests go unseeded: this vLLM build's engine dies on a seeded request whose prompt "
                "is prefilled in chunks (docs/vllm.md)")
    reqs = _sampled(run.race_reqs, s, seeded)
    traffic = same_requests(reqs, warm_requests(run.accept_reqs, s.sampling, s.seed + len(reqs), seeded), run.levels,
                            s.rounds, run.sizes, s.request_timeout_s)
    # with the plugin a contender's K = 0 levels are vLLM's plain path: decided as plain, not raced
    run.race = Race(traffic, run.levels, run.say, greedy=s.temperature <= 0, skip_plain_path=run.plugin)
    run.contenders = [Contender(PLAIN, None)]
    with _keeping_the_race(run):
        race_all(run.engine, run.contenders, run.race)
        plain_rows = {lv["level"]: lv["contenders"][PLAIN] for lv in run.race.rows()}
        run.plain_tps = {lv: row["output_tokens_per_s"] for lv, row in plain_rows.items()}
        overhead = server_overhead(run.profiles, run.plain_tps, run.levels)
        served = served_split(plain_rows)
        run.summary.update({"server_overhead_s": overhead, "served": {lv: vars(v) for lv, v in served.items()}})
        run.say("      plain's served step / time per request outside it (ms) by level: " + ", ".join(
            f"{lv}: {v.decode_step_s * 1e3:.0f} / {v.request_s * 1e3:.0f}" for lv, v in served.items()))
        run.contenders = planned_contenders(run.records, run.profiles, run.levels, s, run.models, overhead, run.out,
                                            run.say, served, run.plugin)


def race(run: ServingRun) -> None:
    """The contenders in the budget's order, plain again on a fresh server, then the resolving passes."""
    s, r = run.s, run.race
    run.phase("race", f"{len(run.contenders) - 1} contenders against plain x levels {','.join(map(str, run.levels))}, "
                      f"{len(run.race_reqs)} requests each, as the budget allows")
    # plain's closing server and, without the plugin, the decision, which may be a config no contender ran
    # (confirm): plain's time is kept for each, and for writing. With the plugin a decision whose confirmation
    # does not fit is written measured-safe (its own setting where it was ahead, plain's path elsewhere), so
    # that time goes to another contender first: the planner's second proposer, whose prediction may be
    # within the planner's error of the first's
    reserve = (1 if run.plugin else 2) * r.timings[PLAIN]["wall_s"] + WRITE_S
    kept = "plain again and writing" if run.plugin else "plain again, the confirmation and writing"
    with _keeping_the_race(run):
        for i, (c, eta) in enumerate(race_order(run.contenders[1:], r.timings[PLAIN], run.levels, s.rounds,
                                                run.plain_tps, r.skip_plain_path)):
            left = run.left() - reserve
            if i and eta > left:  # the first always races: a race of plain alone decides nothing
                run.skipped[c.name] = (f"not raced: predicted {eta:.0f} s, the budget left {max(left, 0):.0f} s "
                                       f"after keeping {reserve:.0f} s for {kept}")
                run.say(f"      {c.name}: {run.skipped[c.name]}")
                continue
            run.say(f"      {c.name}: predicted {eta:.0f} s")
            race_all(run.engine, [c], r)
        if any(name != PLAIN for name in r.results):
            raced_at = sorted({lv for n, by in r.results.items() if n != PLAIN for lv in by})
            run.say("      plain again, on a fresh server: each level's plain is the median over its servers"
                    + ("" if raced_at == run.levels else f" (at {', '.join(map(str, raced_at))}, where a contender "
                                                         "raced)"))
            close_plain(run.engine, r, raced_at)
            run.say("      plain's drift over the race (closing / first server's tokens/s): " + ", ".join(
                f"{lv}: {d:.2f}" for lv in run.levels if (d := plain_drift(r.results[PLAIN].get(lv) or [])) is not None))
        raced = _raced(run)
        _, why = decision(raced, r.rows(), run.levels, run.plugin)
        # open levels race again, the winner's first, while the budget keeps the confirmation
        resolve(run.engine, r, to_resolve(raced, why, r.rows(), run.levels),
                lambda: run.left() - r.timings[PLAIN]["wall_s"] - WRITE_S, run.plain_tps)
    run.levels_out = r.rows()
    _write_race(run)


def confirm_phase(run: ServingRun) -> None:
    """The decision, its confirmation as written (or what the budget allows), then the best measured config."""
    r = run.race
    raced = _raced(run)
    chosen, why = decision(raced, run.levels_out, run.levels, run.plugin)
    run.phase("confirm", "the decision as it is written, raced against plain unless a contender already ran it")
    if chosen is not None and raced_as_is(chosen, raced) is None:  # a new config: raced only if it fits the budget
        eta = predicted_seconds(as_written(chosen), r.timings[PLAIN], run.levels, run.s.rounds, run.plain_tps,
                                r.skip_plain_path)
        if eta > run.left() - WRITE_S:
            skip = (f"not raced: predicted {eta:.0f} s, the budget left {max(run.left() - WRITE_S, 0):.0f} s; the "
                    f"schedule it would have confirmed: {json.dumps(chosen.speculative)}")
            run.say(f"      the decision as written: {skip}")
            chosen, why = unconfirmed(chosen, why, raced, run.levels_out, run.levels, skip)
            run.say(f"      so the decision is {why['winner']} ({why.get('measured_as', 'plain')})")
            run.chosen, run.why, run.shown_contenders = chosen, why, run.contenders
            return
    run.shown_contenders = run.contenders
    with _keeping_the_race(run):
        confirmed = confirm(run.engine, chosen, run.contenders, r)
    if confirmed is not None:
        chosen, why = _confirmed(run, chosen, why, confirmed)
    pool = raced + ([confirmed] if confirmed is not None and confirmed.name == DECISION else [])
    best = best_measured([c for c in pool if c.name in r.results], run.levels_out, run.levels)
    mine = why.get("measured_as") if chosen is not None else None
    if best is not None and best[0].name != mine and best[1][best[0].name] > best[1].get(mine, 0.0) + 1e-9:
        c, scores = best  # strictly better than the decision as measured (a tie keeps the decision)
        run.say(f"      {c.name} as raced: behind plain nowhere, the highest geometric mean over plain "
                f"({scores[c.name]:.3f}x); it is the decision")
        chosen, why = Contender(c.name, dict(c.speculative), plugin=c.plugin), measured_why(c, run.levels_out,
                                                                                            run.levels, scores, why)
    run.chosen, run.why = chosen, why
    _write_race(run)


def write(run: ServingRun) -> dict:
    from workflows.mainjob.runs import decision_line, mark_latest, shown

    run.phase("write", "the decision, exports, report")
    summary, chosen, why = run.summary, run.chosen, run.why
    summary.update({"decision": why, "levels": run.levels_out, "unresolved": run.race.resolving,
                    "prediction_error": prediction_error(run.contenders, run.levels_out),
                    "prediction_parts": prediction_parts(run.contenders, run.levels_out), "skipped": run.skipped,
                    "race_requests": {"requests": len(run.race_reqs), "by_level": run.sizes}})
    _exports(chosen, run.out, run.models)
    summary["wall_s"] = time.time() - run.t0
    summary["budget"] = {"minutes": run.s.budget_minutes, "used_minutes": summary["wall_s"] / 60,
                         "seconds_by_contender": {n: round(v["wall_s"], 1) for n, v in run.race.timings.items()}}
    atomic_write_bytes(run.out / "report.md", report(summary, run.shown_contenders).encode())
    atomic_write_json(run.out / "summary.json", jsonable(summary))
    doc = {"format": "tree-planner/serving-decision", "engine": run.engine.caps.name, "model": run.engine.model_name,
           "speculative_config": None if chosen is None else chosen.speculative,
           "plugin": bool(chosen is not None and chosen.plugin), "decision": why, "concurrency": run.levels,
           "race": "race.json", "profile": shown(run.profile_path)}
    atomic_write_json(run.out / "chosen.json", jsonable(doc))  # last: a run without it did not finish
    run.say(f"decision: {why['winner']}" + ("" if chosen is None else f" {json.dumps(chosen.speculative)}")
            + (" with the plugin" if doc["plugin"] else ""))
    if summary["wall_s"] > run.s.budget_minutes * 60:
        run.say(f"the run took {summary['wall_s'] / 60:.1f} min of its {run.s.budget_minutes:g}-minute budget (the "
                "first contender and the confirmation race whatever is left)")
    run.say(f"wrote {shown(run.out)}/ (chosen.json, race.json, plans.json, exports/, report.md, summary.json)")
    run.say(decision_line(run.out, mark_latest(run.out)))  # runs/latest: the newest run, any engine's
    return summary


# ---------------------------------------------------------------------------------------------- the phases' parts


def _raced(run: ServingRun) -> list[Contender]:
    return [c for c in run.contenders if c.name not in run.race.failed and c.name not in run.skipped]


def _confirmed(run: ServingRun, chosen: Contender, why: dict, confirmed: Contender) -> tuple:
    """The decision's record from its confirmed rows; plain when they are not ahead over the levels."""
    why["measured_as"] = confirmed.name
    if confirmed.name == DECISION:
        run.shown_contenders = run.contenders + [confirmed]
        run.levels_out = run.race.rows()
    measured = measured_record(confirmed, run.levels_out, run.levels)
    why.update({k: measured[k] for k in ("vs_plain_by_level", "geomean_vs_plain")})
    if not ahead_over_range(why["vs_plain_by_level"]):
        run.say("      the decision as written is not ahead of plain over the levels: plain it is")
        return None, {"winner": PLAIN, "why": "the decided config, raced as written, was not ahead of plain "
                      "over the levels (geometric mean of its ratios below 1)", "measured_decision": why}
    return chosen, why


class _keeping_the_race:
    """Ctrl-C in a pass: the server is stopped (its own `with`), race.json keeps what was raced, no chosen.json."""

    def __init__(self, run: ServingRun):
        self.run = run

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            self.run.say("interrupted: the server is stopped; writing what was raced (no chosen.json)")
            self.run.levels_out = self.run.race.rows() if self.run.race else []
            _write_race(self.run, interrupted=True)
        return False


def _write_race(run: ServingRun, interrupted: bool = False) -> None:
    s, r = run.s, run.race
    shown = run.shown_contenders or run.contenders
    doc = {"levels": run.levels_out, "contenders": [{"name": c.name, "config": c.speculative, "plugin": c.plugin,
                                                     "predicted_tokens_per_s": c.predicted, "priced": c.priced}
                                                    for c in shown],
           "requests": len(run.race_reqs), "requests_by_level": run.sizes, "max_tokens": s.max_tokens,
           "rounds": s.rounds, "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                                         "seeded": s.temperature > 0 and run.seeded},
           "server_overhead_s": run.summary.get("server_overhead_s"), "failed": r.failed if r else {},
           "skipped": run.skipped, "unresolved": r.resolving if r else {}, "plugin": run.plugin,
           "servers": r.servers if r else 0, "interrupted": interrupted}
    atomic_write_json(run.out / "race.json", jsonable(doc))


def _sampled(reqs: list, s: ServingSettings, seeded: bool = True) -> list:
    from profiler.vllm_accept import sampled_requests

    return sampled_requests(reqs, s.sampling, s.seed, seeded)  # request i seeded seed + i for every contender


def _profile(engine, s: ServingSettings, levels, out: Path, budget_s: float, say, plugin: bool = False) -> Path:
    if s.profile:
        if not Path(s.profile).is_file():
            raise UserError(f"--profile {s.profile}: file not found")
        return Path(s.profile)
    from profiler.vllm_profile import ServingProfileSpec, profile_serving

    spec = ServingProfileSpec(draft_lengths=tuple(s.draft_lengths), batch_sizes=tuple(levels),
                              time_budget_s=max(60.0, budget_s), progress=not s.quiet, speculative_k0=False,
                              temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, plugin=plugin)
    profile = profile_serving(engine, spec, say=lambda line: say(f"      {line}"))
    path = atomic_write_json(out / "profile.json", profile)
    if any(i.get("reason") == "interrupted" for i in profile.get("incomplete", [])):
        # profile_serving keeps the steps measured before a Ctrl-C or SIGTERM (planner profile's contract) and
        # returns; the main job must stop there too, not go on to accept and race on a partial profile
        raise KeyboardInterrupt
    return path


def _models(engine, s: ServingSettings) -> dict[str, str]:
    """method -> the folder it loads: the draft LM (converted for vLLM) for draft_model, the head for its method."""
    from decoder.engines.vllm.draft_folder import draft_for
    from decoder.guessers.heads import serving_method
    from profiler.vllm_accept import head_folder

    out = {}
    if "draft_model" in s.methods:
        folder = draft_for(engine.model_name, engine.model_dir, s.draft)
        if folder is None:
            raise UserError(f"--methods draft_model: no draft LM ships for {engine.model_name}; pass --draft DIR")
        out["draft_model"] = str(folder)
    head = head_folder(engine.model_name, s.drafter)  # --drafter, else the head shipped for the model
    if head is not None:
        out[serving_method(head)] = head
    for m in ("eagle", "eagle3", "medusa"):
        if m in s.methods and m not in out:
            raise UserError(f"--methods {m}: no head of that kind given or shipped for {engine.model_name}; pass "
                            "--drafter DIR")
    return out


def _acceptance(engine, s: ServingSettings, accept_reqs: list, models: dict[str, str], out: Path, say,
                plugin: bool) -> dict:
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

        found = measure_methods(engine, todo, accept_reqs, s.sampling, seed=s.seed, draft_length=max(s.draft_lengths),
                                concurrency=ACCEPT_CONCURRENCY, draft_model=models, timeout_s=s.request_timeout_s,
                                say=lambda line: say(f"      {line}"), plugin=plugin,
                                drafter_concurrency=DRAFTER_ACCEPT_CONCURRENCY,
                                passes=SAMPLED_ACCEPT_PASSES if s.temperature > 0 else 1)
        for m, rec in found.items():
            atomic_write_json(out / f"accept-{m}.json", rec)
        records.update(found)
    return records


def _exports(chosen: Contender | None, out: Path, models: dict[str, str]) -> None:
    exports(chosen, out, models)


__all__ = ["CLOSING", "MAX_CONCURRENCY", "ServingSettings", "ServingRun"]
