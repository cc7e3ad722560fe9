"""The main job's measuring phases: this machine's latency profile, each guesser's acceptance, and
PEARL's side latencies (workflows/mainjob/pipeline.py runs them in order).

    profile_phase(run) -> Profiled             1 profile: L(n) after the context, the matmul paths (CPU)
    acceptance_phase(run, ids, profile)        2 acceptance: one decode per prompt, shared by every guesser
        -> dict[kind, Measured]                  (profiler.teacher_forced; under sampling profiler.sampled)
    pearl_phase(run, accepts, profile, ctx)    4 PEARL: each side at its share of the cores, and the overlap
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from planner.accept import Acceptance, load_acceptance
from planner.engines import DEFAULT
from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from planner.guessers import kinds as guesser_kinds
from planner.jsonio import atomic_write_json
from planner.profile import LatencyProfile, load_profile
from workflows.mainjob.runs import Run, shown


@dataclass(frozen=True)
class Profiled:
    path: Path
    profile: LatencyProfile


@dataclass(frozen=True)
class Measured:
    """One guesser's acceptance file and what it holds."""

    path: Path
    accept: Acceptance


def profile_lengths(max_n: int) -> list[int]:
    """Every length to 16, then every 2nd to 32, 4th to 64, 8th beyond (and max_n): trees are small
    more often than large, and with a fixed budget fewer points get more repeats each. A first run on
    SmolLM2 measured all 64 lengths 4 times each and read L(1) 19 % above the plain loop's step, which
    made every predicted speedup optimistic by as much."""
    out = [n for n in range(1, max_n + 1) if n <= 16 or (n <= 32 and n % 2 == 0) or (n <= 64 and n % 4 == 0)
           or n % 8 == 0]
    return out if out[-1] == max_n else out + [max_n]


def profile_phase(run: Run) -> Profiled:
    from profiler.measure import ProfileSpec, profile_engine

    s, engine = run.settings, run.engine
    if engine.caps.tree_kernels:  # time the attention path decoding will take (the tree kernels on CUDA)
        engine.select_attention("auto")
    if s.profile:
        path = Path(s.profile)
    else:
        budget = run.budget.profile_s
        paths = engine.caps.matmul_paths and run.device == "cpu"
        paths_s = run.budget.matmul_share * budget if paths else 0.0
        contexts = s.context_lengths
        run.clock.phase(1, f"profiling {run.model_name} with the {engine.caps.name} engine on {run.device}: "
                           + (f"each Linear's fastest matmul path per input length ({paths_s:.0f} s), " if paths_s else "")
                           + f"input lengths 1..{s.max_input_length} after {', '.join(map(str, contexts))}-token "
                           f"contexts and the decoder's own per-step work ({budget - paths_s:.0f} s)", run.clock.left())
        spec = ProfileSpec(tuple(profile_lengths(s.max_input_length)), contexts, time_budget_s=budget - paths_s,
                           matmul_budget_s=paths_s or None, matmul_paths="auto" if paths_s else "off",
                           deadline=time.time() + budget, progress=s.progress and sys.stderr.isatty())  # bars: terminals only
        path = atomic_write_json(run.out_dir / "profile.json", profile_engine(engine, spec))
    profile = load_profile(str(path))
    from planner.simulate import refuse_to_measure

    refuse_to_measure(profile, "planner autotune")  # it decodes here against the profile's predictions
    made_for = profile.source.get("engine") or DEFAULT
    if made_for != engine.caps.name:
        raise UserError(f"--profile {path}: measured with the {made_for} engine, this run decodes with "
                        f"{engine.caps.name} (planner profile --engine {engine.caps.name})")
    if engine.caps.matmul_paths and run.device == "cpu":  # decode what was profiled: its matmul paths (none: F.linear)
        engine.use_matmul_paths(str(path))
    if profile.max_input_length < s.max_input_length:
        raise UserError(f"{path}: profiled up to {profile.max_input_length} tokens, --max-input-length is {s.max_input_length}")
    return Profiled(Path(path), profile)


CHAIN_PROMPTS = 4  # the chain drafter replays depth passes per position: half the prompts, half the time


def _acceptance_eta(run: Run, profile: LatencyProfile, prompts: int) -> float:
    """The acceptance phase's time: one greedy decode per prompt (with PPD's tokens along) and a
    few proposals per position per replayed guesser."""
    from planner.cost import step_cost

    s = run.settings
    ppd = _riding(run.guessers)
    n = 1 + (ppd.num_distances * ppd.ensemble if ppd is not None else 0)
    step = float(step_cost(profile, min(n, profile.max_input_length)))
    replays = sum(1 for k in run.guessers if guesser_kind(k).needs_hidden)
    return prompts * s.accept_tokens * (step + 0.15 * replays * step)


def _riding(guessers: dict):
    """The guesser whose guesses ride along the greedy decode's roots (PPD's prompt tokens: they
    need the target's own pass), if any."""
    return next((g for k, g in guessers.items() if guesser_kind(k).needs_embeddings), None)


def acceptance_phase(run: Run, accept_ids: list, profile: LatencyProfile) -> dict[str, Measured]:
    """Each guesser's acceptance on held-out prompts, from one shared greedy decode per prompt
    (a reused acceptance file, --accept, stands for the guesser whose guesses ride along)."""
    from profiler.teacher_forced import greedy_continuations
    from workflows.mainjob.predict import calibration_step, ppd_capture

    s = run.settings
    riding = _riding(run.guessers)
    reused = next((k for k, g in run.guessers.items() if g is riding), None) if s.accept else None
    measure = {k: g for k, g in run.guessers.items() if k != reused}
    out = {reused: Measured(Path(s.accept), load_acceptance(s.accept))} if reused else {}
    if not measure:
        return out
    eta = _acceptance_eta(run, profile, len(accept_ids))
    share = run.budget.acceptance_share * run.clock.left()  # the race needs the rest
    floor = run.budget.accept_prompts_min
    if eta > share and len(accept_ids) > floor:
        keep = max(floor, int(len(accept_ids) * share / eta))
        run.say(f"      the budget fits {keep} of {len(accept_ids)} acceptance prompts (predicted {eta:.0f} s for all)")
        accept_ids, eta = accept_ids[:keep], eta * keep / len(accept_ids)
    samp = s.sampling
    sampled = samp.rule != "greedy"
    how = f"sampled at {_settings_text(samp)}" if sampled else "greedy"
    run.clock.phase(2, f"acceptance of {', '.join(measure)} on {len(accept_ids)} held-out prompts x {s.accept_tokens} "
                       f"tokens (one {how} decode each, shared)", run.clock.left())
    ppd = riding if riding in measure.values() else None
    capture = None if sampled else ppd_capture(run, ppd)  # PPD's logits kept: calibration and predictions replay them
    if sampled:
        from decoder.verify import Sampling
        from profiler.sampled import sampled_continuations

        # measured with the run's exact rule (coupled or lossless); a typical-acceptance run with the
        # lossless rule's acceptance (its lower bound)
        rule = "coupled" if samp.rule == "coupled" else "auto"
        cont = sampled_continuations(run.engine, accept_ids, s.accept_tokens,
                                     Sampling(samp.temperature, samp.top_k, samp.top_p, rule), seed=s.seed, ppd=ppd)
    else:
        cont = greedy_continuations(run.engine, accept_ids, s.accept_tokens, ppd=capture)
    run.say(f"      {how} decode: {cont.decode_s:.0f} s (predicted {eta:.0f} s with the replays)")
    for kind, g in measure.items():
        spec = guesser_kind(kind)
        if g is ppd:
            acc = cont.ppd
        else:
            depth, width = spec.measure_shape or (g.num_distances, getattr(g, "top_k", 1))
            # a drafter paying a pass per level replays depth passes per position: half the prompts, half the time
            few = spec.needs_hidden and spec.passes == "depth"
            part = _first(cont, CHAIN_PROMPTS) if few else cont
            acc = _measure(run, g, spec, part, depth, width, sampled)
        acc["source"] = (f"planner autotune: {run.model_name}, {kind} {shown(g.source_dir) if g.source_dir else '(no model)'}, "
                         f"{len(accept_ids)} held-out prompts, {acc['positions']} positions ({acc['source']})")
        acc["guesser"]["dir"] = shown(g.source_dir) if g.source_dir else None
        acc["guesser"]["kind"] = kind
        acc["engine"] = run.engine.caps.name
        path = atomic_write_json(run.out_dir / f"accept-{kind}.json", acc)
        out[kind] = Measured(Path(path), load_acceptance(str(path)))
    # sampled: deterministic guessers are calibrated on the sampled text with p-scored observations
    return calibration_step(run, cont, capture, out)


SIBLING_SAMPLES = 16  # Monte Carlo runs of the sibling procedure per position (a draft LM's ranks 1+)


def _measure(run: Run, g, spec, cont, depth: int, width: int, sampled: bool) -> dict:
    """One guesser's acceptance record along the shared continuations: greedy hits; under sampling a
    deterministic guesser's guesses scored with the target's warped p, a sampling drafter's children
    with sum min(p, q) and the sibling procedure (profiler/sampled.py)."""
    from profiler.teacher_forced import replay_accuracy

    if not sampled:
        return replay_accuracy(run.engine, g, cont, depth, width)
    from profiler.sampled import draft_sampled_accuracy, replay_sampled_accuracy

    if spec.samples:
        return draft_sampled_accuracy(run.engine, g, cont, depth, width, SIBLING_SAMPLES, run.settings.seed)
    return replay_sampled_accuracy(run.engine, g, cont, depth, width)


def _first(cont, n: int):
    """The first n prompts' continuations (greedy or sampled)."""
    from dataclasses import fields, replace

    cut = {f.name: getattr(cont, f.name)[:n] for f in fields(cont) if f.name in ("prompts", "tokens", "probs")}
    return replace(cont, **cut)


def _settings_text(s) -> str:
    from workflows.cli.sampling import describe, record

    return describe(record(s))


def pearl_phase(run: Run, drafter: str, accepts: dict[str, Measured], profile: LatencyProfile, context) -> dict:
    """PEARL needs each side's latency at its share of the cores and how much the two really
    overlap (eta): both measured here at every thread split worth trying (profiler.overlap), one
    candidate per gamma (workflows.mainjob.candidates). The split whose best plan is predicted fastest
    stays; it is recorded in the summary and in every PEARL plan (settings.pearl.threads), so the
    race and `planner decode --plan` run it the same way."""
    import torch

    from planner.cost import plain_step
    from profiler.overlap import pearl_splits, side_latencies, split_check
    from workflows.mainjob.candidates import pearl_candidates

    total = torch.get_num_threads()
    model = run.engine
    draft = run.guessers[drafter].drafter
    splits = pearl_splits(total)
    run.clock.phase(4, f"PEARL: target and draft LM at thread splits {', '.join(map(str, splits))} and {total}, "
                       "and their overlap", run.clock.left())
    ctx = context.to(run.engine.device)
    own_loop = next(k.name for k in guesser_kinds() if k.loop is not None)  # PEARL's kind
    tried = []
    for split in splits:
        lat = side_latencies(model, draft, ctx, range(1, 9), split, total, repeats=3)
        check = split_check(model, draft, ctx, 4, split, repeats=3)
        torch.set_num_threads(total)
        eta = max(0.0, min(1.0, check["eta"]))
        cands = pearl_candidates(accepts[drafter].accept, lat, eta, plain_step(profile), own_loop)
        for c in cands:
            c.tree.settings["pearl"]["threads"] = list(split)
        tried.append({"candidates": cands, "split": list(split), "latencies": lat, "split_check": check, "eta": eta,
                      "best_predicted_speedup": max((c.predicted_speedup for c in cands), default=0.0)})
    best = max(tried, key=lambda t: t["best_predicted_speedup"])
    return best | {"splits": [{k: t[k] for k in ("split", "eta", "best_predicted_speedup")} for t in tried]}


