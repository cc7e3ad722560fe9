"""The race of the main job: plain decoding and the finalists decode the race prompts, stage by stage
(workflows.choose holds the statistics); moved out of workflows/autotune.py unchanged.
`run` is autotune's _Run (settings, model, guessers, clock, say)."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from planner.profile import LatencyProfile
from workflows.candidates import Candidate
from workflows.choose import MIN_PROMPTS, PLAIN, Arm, Race, speedup

REPORT_RESERVE_S = 12.0  # writing the run folder and drawing the report, kept out of the decoding budget
PEARL_SPLIT = (1, 1)  # target threads, drafter threads: the two cores of this machine, one each


def _decode_one(run, cand: Candidate | None, ids, seed: int = 0):
    """One prompt decoded with one plan (None: plain decoding) under the run's sampling settings;
    every arm decodes a prompt with the same seed. Returns the GenerateOutput."""
    from decoder import generate, generate_plain
    from decoder.pearl import generate_pearl

    n = run.settings.decode_tokens
    s = run.settings.sampling
    warp = dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed)
    if cand is None:
        return generate_plain(run.model, ids, max_new_tokens=n, phase_times=False, **warp)
    if cand.guesser == "pearl":  # its own two-job loop, the draft LM as drafter
        return generate_pearl(run.model, run.guessers["draft"].draft_model, ids, gamma=cand.size, max_new_tokens=n,
                              threads=PEARL_SPLIT, **warp)
    return generate(run.model, ids, plan=cand.tree, guesser=run.guessers[cand.guesser], max_new_tokens=n,
                    phase_times=False, verify_rule=s.mode, **warp)


def _arms(run, racing: list[Candidate], profile: LatencyProfile, decode_ids: list) -> list[Arm]:
    """Plain decoding and every finalist as race arms, with each one's predicted time per prompt."""
    from planner.cost import plain_step

    step = plain_step(profile)
    n = run.settings.decode_tokens

    def prefill(ids) -> float:
        return float(profile.latency(min(max(int(ids.numel()) - 1, 1), profile.max_input_length)))

    def arm(key, cost, up):
        return Arm(key, cost, up, {p: prefill(ids) + n * step / max(up, 1e-3) for p, ids in enumerate(decode_ids)})

    out = [arm(PLAIN, 1.0, 1.0)]
    for c in racing:
        cost = c.predicted_tokens_per_step / max(c.predicted_speedup, 1e-9)  # step time / plain's
        out.append(arm(c.label, cost, c.predicted_speedup))
    return out


def _stages(num_prompts: int) -> list[list[int]]:
    """The first stage has enough prompts for an interval; later ones add two at a time."""
    first = min(MIN_PROMPTS, num_prompts)
    out = [list(range(first))]
    out += [list(range(i, min(i + 2, num_prompts))) for i in range(first, num_prompts, 2)]
    return out


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


def _race_phase(run, decode_ids: list, racing: list[Candidate], profile: LatencyProfile) -> tuple[Race, _Outputs]:
    """Plain decoding and the finalists on the decode prompts, stage by stage (workflows.choose.Race)."""
    from profiler.measure import warm_up_shapes

    s = run.settings
    by_key = {c.label: c for c in racing}
    race = Race(_arms(run, racing, profile, decode_ids))
    outputs = _Outputs()
    rng = random.Random(s.seed)
    deadline = run.clock.budget_s - REPORT_RESERVE_S
    stages = _stages(len(decode_ids))
    eta = sum(race.stage_seconds(st) for st in stages) * s.rounds
    run.clock.phase(5, f"racing plain decoding and {len(racing)} plans on {len(decode_ids)} held-out prompts x "
                       f"{s.decode_tokens} tokens in {len(stages)} stages (predicted {eta:.0f} s for all; the budget "
                       "cuts the slower half when short)", min(eta, deadline - run.clock.elapsed()) + REPORT_RESERVE_S)
    warm_up_shapes(run.model, decode_ids, _step_lengths(run, racing))
    for k, prompts in enumerate(stages, 1):
        while (run.clock.elapsed() + race.stage_seconds(prompts) * s.rounds > deadline
               and len(race.running()) > 3 and race.halve(k)):  # two plans left: the race ends instead
            pass
        if run.clock.elapsed() + race.stage_seconds(prompts) * s.rounds > deadline and k > 1:
            race.log.append(f"stage {k}: stopped, the budget's time is spent")
            break
        _run_stage(run, race, by_key, decode_ids, prompts, outputs, rng)
        _disqualify_mismatches(run, race, outputs, decode_ids, prompts)
        race.prune(k)
        lead = race.leader()
        left = sum(race.stage_seconds(st) for st in stages[k:]) * s.rounds
        run.say(f"      stage {k}/{len(stages)}: {len(race.running()) - 1} plans left; leader {lead.key} "
                f"{speedup(lead, race.plain) if lead is not race.plain else '1.00x'} plain; about "
                f"{min(left, max(deadline - run.clock.elapsed(), 0)) + REPORT_RESERVE_S:.0f} s left")
    return race, outputs


def _run_stage(run, race: Race, by_key: dict, decode_ids: list, prompts: list[int], outputs: _Outputs, rng) -> None:
    """Every running arm on every prompt of the stage, in a shuffled order per prompt and round, so a
    slow spell of the machine spreads over all of them; each (arm, prompt) time is the median."""
    import statistics

    w = run.model.get_input_embeddings().weight
    for p in prompts:
        ids = decode_ids[p].to(w.device)
        times: dict[str, list[float]] = {}
        for _ in range(run.settings.rounds):
            arms = race.running()
            rng.shuffle(arms)
            for a in arms:
                t0 = time.perf_counter()
                out = _decode_one(run, by_key.get(a.key), ids, seed=run.settings.seed + p)
                times.setdefault(a.key, []).append(time.perf_counter() - t0)
                if p not in outputs.tokens.get(a.key, {}):
                    outputs.add(a.key, p, out)
        for a in race.running():
            a.seconds[p] = statistics.median(times[a.key])


def _disqualify_mismatches(run, race: Race, outputs: _Outputs, decode_ids: list, prompts: list[int]) -> None:
    """A plan whose output differs from plain greedy decoding (beyond a near tie of the target's
    top two logits, profiler.compare) leaves the race: it is never the decision. Sampled outputs
    differ from plain sampling's with the same seed by design; their law is the distribution
    tests' to check (tests/test_sampling_rules.py), so a sampled race compares speeds only."""
    from profiler.compare import classify

    if run.settings.sampling.rule != "greedy":
        return
    plain = outputs.tokens[PLAIN]
    for a in race.running():
        if a is race.plain:
            continue
        for p in prompts:
            status = classify(run.model, decode_ids[p], plain[p].tolist(), outputs.tokens[a.key][p].tolist())["status"]
            if status == "mismatch":
                a.dropped = f"output differs from plain greedy decoding on prompt {p}"
                race.log.append(f"{a.key}: {a.dropped}")
                break


def _step_lengths(run, tried: list[Candidate]) -> set[int]:
    """Every forward length the decoding phase will run: plain decoding, each plan's states and bootstrap."""
    w = run.model.get_input_embeddings().weight
    lengths = {1}
    for c in tried:
        if c.method == "dynamic":  # any size up to its limit, step by step
            lengths |= set(range(1, c.size + 2))
        elif c.guesser == "ppd":
            layouts = run.guessers["ppd"].layouts(c.tree, w.dtype, w.device)
            lengths |= {b.input_length for b in layouts.states.values()} | {layouts.bootstrap.input_length}
        else:
            lengths.add(1 + len(c.tree.states[0].nodes))
            lengths.add(c.size)  # PEARL's post-verify forward
    return lengths
