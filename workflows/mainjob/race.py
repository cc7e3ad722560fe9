"""The race of the main job: plain decoding and the finalists decode the race prompts, timed one
decode at a time with the machine's load beside each (profiler.load); workflows.mainjob.choose decides.

    race, outputs, decision = race_phase(run, decode_ids, racing, profile)

`run` is autotune's _Run (settings, model, guessers, clock, say). Every output is checked against
plain greedy decoding as it comes: a plan whose output differs leaves the race at once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from planner.guessers import kind as guesser_kind
from planner.profile import LatencyProfile
from workflows.mainjob.candidates import Candidate
from workflows.mainjob.choose import LOADED_CORES, PLAIN, REPLAYED, Arm, Decision, Race, Run, run_race, speedup


def _decode_one(run, cand: Candidate | None, ids, seed: int = 0):
    """One prompt decoded with one plan (None: plain decoding, the engine's fastest way) under the run's
    sampling settings; every arm decodes a prompt with the same seed. Returns the GenerateOutput."""
    from decoder.config import DecodeConfig
    from decoder.guessers.pearl import Pearl
    from decoder.loop import generate

    cfg = DecodeConfig(run.settings.decode_tokens, run.settings.sampling, seed, phase_times=False)
    if cand is None:
        return generate(run.engine, ids, config=cfg)
    if guesser_kind(cand.guesser).loop:  # PEARL's rounds, the draft LM as drafter, at the split measured for it
        drafter = next(g for k, g in run.guessers.items() if guesser_kind(k).files == guesser_kind(cand.guesser).files)
        pearl = Pearl(drafter.drafter, cand.size, tuple(cand.tree.settings["pearl"]["threads"]))
        return generate(run.engine, ids, pearl, config=cfg)
    return generate(run.engine, ids, plan=cand.tree, guesser=run.guessers[cand.guesser], config=cfg)


def _arms(run, racing: list[Candidate], profile: LatencyProfile, decode_ids: list) -> list[Arm]:
    """Plain decoding and every finalist as race arms, with each one's predicted time per prompt."""
    from planner.cost import plain_step, prefill_cost

    step = plain_step(profile)
    n = run.settings.decode_tokens

    def arm(key, cost, up, parallel=False, how="cost model"):
        return Arm(key, cost, up, {p: prefill_cost(profile, int(ids.numel())) + n * step / max(up, 1e-3) for p, ids in enumerate(decode_ids)},
                   parallel=parallel, predicted_by=how)

    out = [arm(PLAIN, 1.0, 1.0)]
    for c in racing:
        out.append(arm(c.label, c.step_s(step) / step, c.predicted_speedup, parallel=guesser_kind(c.guesser).loop is not None,
                       how=(c.prediction or {}).get("method") or "cost model"))
    return out


def _replayed_steps(racing: list[Candidate], arms: list[Arm]) -> None:
    """Where every plan decodes one text (Race.same_text), each replayed plan's steps over the
    acceptance prompts' text join its race steps for the race's tie (Race.tie_costs): exact counts
    on more text than the race's selection decodes. Only when every replay covered the same tokens."""
    replays = {a.key: c.prediction for c, a in zip(racing, arms)
               if (c.prediction or {}).get("method") == "replay" and not a.parallel}
    if len({p["tokens"] for p in replays.values()}) == 1:
        for a in arms:
            if a.key in replays:
                a.steps[REPLAYED] = int(replays[a.key]["steps"])


@dataclass
class _Outputs:
    """Per arm key: per prompt the tokens, steps and decode seconds (prefill excluded) of its first run."""

    tokens: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    decode_s: dict = field(default_factory=dict)
    states: dict = field(default_factory=dict)

    def add(self, key: str, p: int, out) -> None:
        self.tokens.setdefault(key, {})[p] = out.tokens.cpu()
        self.steps.setdefault(key, {})[p] = int(out.steps)
        self.decode_s.setdefault(key, {})[p] = float(out.stats.total_s - out.stats.prefill_s)
        self.states.setdefault(key, []).extend(st for st in getattr(out.stats, "states", []) if st >= 0)


def race_phase(run, decode_ids: list, racing: list[Candidate], profile: LatencyProfile) -> tuple[Race, _Outputs, Decision]:
    """Plain decoding and the finalists on the race prompts (workflows.mainjob.choose.run_race); returns
    the race (arms, log, every run), each arm's outputs, and the decision."""
    from profiler.load import OtherLoad, other_cores
    from profiler.measure import warm_up_shapes
    from training.splits import question_of

    s = run.settings
    by_key = {c.label: c for c in racing}
    race = Race(_arms(run, racing, profile, decode_ids), list(range(len(decode_ids))), rounds=s.rounds, seed=s.seed,
                groups=question_of(len(decode_ids), s.turns), same_text=s.sampling.one_text)
    if race.same_text:
        _replayed_steps(racing, race.arms[1:])
    outputs = _Outputs()
    deadline = run.clock.budget_s - run.budget.after_race_s
    eta = race.selection_seconds(0) * len(race.selection) + race.confirmation_seconds(2 * s.rounds)
    floor = race_floor_s(race)
    if run.clock.elapsed() + floor > deadline:  # a race too short to confirm anything would decide plain by default
        run.say(f"      the budget leaves {max(deadline - run.clock.elapsed(), 0):.0f} s; the race takes its minimum "
                f"{floor:.0f} s (one selection prompt, then a pair on each of {len(race.confirmation)} confirmation "
                "prompts: fewer pairs cannot show a plan faster at the test's level)")
        deadline = run.clock.elapsed() + floor
    run.clock.phase(5, f"racing plain decoding and {len(racing)} plans: selection on {len(race.selection)} held-out "
                       f"prompts, the winner's confirmation against plain on {len(race.confirmation)} others, "
                       f"x {s.decode_tokens} tokens (predicted {eta:.0f} s; the budget halves the field when short)",
                    min(eta, deadline - run.clock.elapsed()) + run.budget.after_race_s)
    warm_up_shapes(run.engine, decode_ids, _step_lengths(run, racing))
    _warm_plain(run, decode_ids[0])
    device = run.engine.device
    meter, t0 = OtherLoad(), time.perf_counter()
    others = other_cores(0.5)  # before the first run: a loaded machine ranks parallel plans last
    race.loaded_now = others is not None and others >= LOADED_CORES

    def measure(key: str, p: int) -> Run:
        ids = decode_ids[p].to(device)
        meter.start()
        start = time.perf_counter()
        out = _decode_one(run, by_key.get(key), ids, seed=s.seed + p)
        seconds = time.perf_counter() - start
        if p not in outputs.tokens.get(key, {}):
            outputs.add(key, p, out)
        a = race.arm(key)
        if race.same_text and not a.parallel:  # PEARL samples with the lossless rule: its text is its own
            a.steps.setdefault(p, int(out.steps))
        return Run(key, p, seconds, start - t0, meter.stop())

    def check(p: int, keys: list[str]) -> None:
        _disqualify_mismatches(run, race, outputs, decode_ids, p, set(keys) - {PLAIN})

    def progress(phase: str, p: int) -> None:
        others = [r.others for r in race.runs if r.prompt == p and r.others is not None]
        load = f"; other processes {max(others):.1f} cores" if others else ""
        if phase == "selection":
            lead = race.leader()
            run.say(f"      selection prompt {race.selected_on.index(p) + 1}/{len(race.selection)}: "
                    f"{len(race.candidates())} plans left; leader {lead.key} {speedup(lead)} plain{load}")
        else:
            w = race.winner
            base = len(race.confirmation) - len(race.spare)
            extra = f" (+{len(race.spare)} while time is left)" if race.spare else ""
            run.say(f"      confirmation prompt {race.confirmation.index(p) + 1}/{base}{extra}: {w.key} "
                    f"{len(w.pairs)} pairs{load}; about {max(deadline - run.clock.elapsed(), 0):.0f} s left")

    decision = run_race(race, measure, lambda: deadline - run.clock.elapsed(), check, progress)
    return race, outputs, decision


def race_floor_s(race: Race) -> float:
    """The shortest race that can decide for a plan: one selection prompt with every plan, and one
    pair (the leader and plain) on every confirmation prompt; with fewer than MIN_PROMPTS pairs the
    sign-flip test cannot reach its level, so a starved race would always fall back to plain."""
    if not race.selection:
        return 0.0
    return race.selection_seconds(race.selection[0]) + race.confirmation_seconds(1)


def _disqualify_mismatches(run, race: Race, outputs: _Outputs, decode_ids: list, p: int, keys: set[str]) -> None:
    """A plan whose output on prompt p differs from plain greedy decoding (beyond a near tie of
    the target's top two logits, profiler.compare) leaves the race: it is never the decision.
    Under coupled sampling (decoder/noise.py) a plan emits plain sampling's text with the same seed,
    so it is checked the same way (the near tie then of log p + g). Under the recursive-rejection rule
    sampled outputs differ from plain sampling's by design; their law is the distribution tests' to
    check (tests/test_sampling_rules.py), so that race compares speeds only."""
    from profiler.compare import classify

    s = run.settings.sampling
    if not s.one_text:
        return
    coupled = dict(sampling=s, seed=run.settings.seed + p) if s.rule == "coupled" else {}
    plain = outputs.tokens[PLAIN][p].tolist()
    for key in sorted(keys):
        a = race.arm(key)
        if a.dropped.startswith("output differs") or p not in outputs.tokens.get(key, {}):
            continue
        if a.parallel and coupled:  # PEARL (its own two-job loop) samples with the lossless rule
            continue
        if classify(run.engine, decode_ids[p], plain, outputs.tokens[key][p].tolist(), **coupled)["status"] == "mismatch":
            a.dropped = f"output differs from plain {'coupled sampling' if coupled else 'greedy decoding'} on prompt {p}"
            race.log.append(f"{a.key}: {a.dropped}")


def _step_lengths(run, tried: list[Candidate]) -> set[int]:
    """Every forward length the decoding phase will run: plain decoding, each plan's states and bootstrap."""
    lengths = {1}
    for c in tried:
        if c.method == "dynamic":  # any size up to its limit, step by step
            lengths |= set(range(1, c.size + 2))
        elif guesser_kind(c.guesser).needs_embeddings:  # PPD: its prompt tokens' layouts per state
            layouts = run.guessers[c.guesser].layouts(c.tree, run.engine.dtype, run.engine.device)
            lengths |= {b.input_length for b in layouts.states.values()} | {layouts.bootstrap.input_length}
        else:
            lengths.add(1 + len(c.tree.states[0].nodes))
            lengths.add(c.size)  # PEARL's post-verify forward
    return lengths


def _warm_plain(run, ids) -> None:
    """The engine's fastest plain decoding once, untimed: a library's own generation (caps.stock_plain)
    has first-call costs of its own."""
    if run.engine.caps.stock_plain:
        _decode_one(run, None, ids, run.settings.seed)
