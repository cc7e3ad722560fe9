"""`planner autotune --engine llama.cpp`: the main job in llama.cpp, on the model's own GGUF file.

    summary = autotune_llama(LlamaAutotune(out="runs/llama"))

  1 profile     L(n) of chains in llama.cpp after 128 and 512 tokens, the loop's own per-step work
  2 acceptance  prompt lookup's acceptance and its live-signal calibration, decoding in llama.cpp (under
                --temperature / --top-k / --top-p: sampled, each guess scored with the target's warped p)
  3 plan        lookup chains of 1..8 tokens and per-step (dynamic) lookup plans, predicted with the cost model
  4 race        the finalists against llama.cpp plain decoding (this project's loop, root-only steps) on
                other held-out prompts: the hf main job's race (workflows/mainjob/choose.py: selection, then the
                winner's confirmation on prompts it was not chosen on); every output must equal plain's
                (sampled: every arm with the same seed per prompt, speeds compared only); llama-cpp-python's
                own Llama.generate runs beside as a reference (not a candidate), sampled with the same settings
  5 write       RUN/chosen.json (a plan with "engine": "llama.cpp"; plain decoding when nothing is faster
                beyond the noise), RUN/trees/, RUN/summary.json with the oracle ceiling per race prompt; the
                plans record the sampling settings they were tuned for (workflows.mainjob.write.tuned_for)
The decision is workflows/mainjob/choose.py's (the hf main job's). Only the run folder is written. Ctrl-C in the
race decides on what was measured.
Only prompt lookup races: llama.cpp returns no hidden states (ParallelSpec, PPD) and has no torch modules
to share (the project's draft LM); docs/llama-cpp.md says why and what a draft would cost.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from planner.errors import UserError
from planner.guessers import LOOKUP
from planner.jsonio import atomic_write_json
from workflows.mainjob.runs import shown

CONTEXTS = (128, 512)
MAX_INPUT = 16  # chains up to 15 guesses: L(16) is 7.5 L(1) here, nothing longer can pay
DYNAMIC_SIZES = (4, 8, 15)


@dataclass
class LlamaAutotune:
    model: str = "smollm2-135m"
    out: str | None = None
    questions: str | None = None
    accept_prompts: int = 8
    decode_prompts: int = 8
    turns: int = 1  # prompts per held-out question (2: its follow-up too)
    accept_tokens: int = 64
    decode_tokens: int = 96
    rounds: int = 3
    finalists: int = 4
    neighbours: int = 1
    threads: int | None = None
    n_ctx: int = 4096
    profile: str | None = None
    profile_budget_s: float = 45.0
    budget_minutes: float = 10.0
    progress: bool = True
    seed: int = 0
    # the user's sampling settings: acceptance is measured, plans are sized and the race decodes under them
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0

    @property
    def sampling(self):
        from planner.sampling import Sampling

        return Sampling(self.temperature, self.top_k, self.top_p)


def autotune_llama(s: LlamaAutotune) -> dict:
    from workflows.cli.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts
    from workflows.cli.llama_target import open_llama

    say = print if s.progress else (lambda *a, **k: None)
    t0 = time.time()
    left = lambda: s.budget_minutes * 60 - (time.time() - t0)  # noqa: E731
    target = open_llama(s.model, s.threads, s.n_ctx, progress=s.progress)
    tokenizer = target.tokenizer()
    out = Path(s.out) if s.out else Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-llama.cpp-{target.name}"
    out.mkdir(parents=True, exist_ok=True)
    accept_texts, race_texts = held_out_prompts(s.questions or str(DEFAULT_QUESTIONS), s.accept_prompts, s.decode_prompts, s.turns)
    accept_ids, race_ids = encode_prompts(tokenizer, accept_texts), encode_prompts(tokenizer, race_texts)
    say(f"[1/5] profiling {target.name} in llama.cpp ({target.engine.threads} threads), chains of 1..{MAX_INPUT} "
        f"after {', '.join(map(str, CONTEXTS))} tokens  ({left():.0f} s left)")
    profile_path, profile = _profile(s, target, out)
    say(f"[2/5] lookup acceptance and calibration on {len(accept_ids)} held-out prompts x {s.accept_tokens} tokens "
        f"(one {_how(s)} decode each)  ({left():.0f} s left)")
    accept_path, accept = _acceptance(s, target, accept_ids, out)
    say("[3/5] planning lookup chains and per-step lookup plans")
    racing = _plan(s, accept, profile, accept_path, profile_path, out)
    say(f"[4/5] racing {len(racing)} plans against plain decoding on {len(race_ids)} other held-out prompts "
        f"x {s.decode_tokens} tokens, {s.rounds} rounds  ({left():.0f} s left)")
    race = _race(s, target, racing, race_ids, profile, left, say)
    say("[5/5] writing the decision")
    summary = _write(s, target, racing, race, profile, out, time.time() - t0)
    say(_table(summary))
    say(f"run folder: {shown(out)}; decision: {shown(out / 'chosen.json')} ({summary['decision']})")
    return summary


def _profile(s: LlamaAutotune, target, out: Path):
    from planner.profile import load_profile
    from profiler.llama_profile import profile_llama

    if s.profile:
        path = Path(s.profile)
    else:
        prof = profile_llama(target.engine, list(range(1, MAX_INPUT + 1)), list(CONTEXTS), s.profile_budget_s,
                             progress=False, model=target.record(), seed=s.seed)
        path = atomic_write_json(out / "profile.json", prof)
    profile = load_profile(str(path))
    if profile.source.get("engine") != "llama.cpp":
        raise UserError(f"--profile {path}: not a llama.cpp profile (planner profile --engine llama.cpp)")
    return Path(path), profile


def _how(s: LlamaAutotune) -> str:
    from workflows.cli.sampling import describe, record

    return "greedy" if s.sampling.rule == "greedy" else f"sampled ({describe(record(s.sampling))})"


def _acceptance(s: LlamaAutotune, target, accept_ids: list, out: Path):
    """One decode per prompt in llama.cpp, shared: lookup's acceptance and its calibration are replayed
    over the known text (tests/test_llama_engine.py: the counts equal decoding with the guesser). Under
    sampling the text is the target's sampled continuation (prompt i with seed + i, profiler.sampled as
    the hf main job measures it) and each guess scores the target's warped p(x), in the record and in
    the calibration's observations (tests/test_llama_sampling.py: equal to calibrating by sampled decoding)."""
    import numpy as np

    from decoder.guessers.registry import LoadRequest, load_guesser
    from planner.accept import load_acceptance
    from profiler.calibration import replay_calibration
    from profiler.sampled import replay_sampled_accuracy, sampled_continuations
    from profiler.teacher_forced import greedy_continuations, replay_accuracy

    lookup = load_guesser(LOOKUP, LoadRequest(target.engine, depth=8))
    samp = s.sampling
    if samp.rule == "greedy":
        cont, soft = greedy_continuations(target.engine, accept_ids, s.accept_tokens), {}
        acc = replay_accuracy(target.engine, lookup, cont, 8, 1)
    else:
        cont = sampled_continuations(target.engine, accept_ids, s.accept_tokens, samp, seed=s.seed)
        soft = {"probs": cont.probs, "sampling": samp}
        acc = replay_sampled_accuracy(target.engine, lookup, cont, 8, 1)
    acc["calibration"] = replay_calibration(lookup, cont.prompts, cont.tokens, np.array(acc["accuracy"]), **soft)
    acc.update({"engine": "llama.cpp", "decode_s": cont.decode_s, "source": f"planner autotune --engine llama.cpp: "
                f"{target.name}, {len(accept_ids)} held-out prompts, {acc['positions']} positions (one {_how(s)} "
                "decode each)"})
    acc["guesser"].update(kind=LOOKUP, dir=None)
    path = atomic_write_json(out / "accept-lookup.json", acc)
    return Path(path), load_acceptance(str(path))


def _plan(s: LlamaAutotune, accept, profile, accept_path: Path, profile_path: Path, out: Path) -> list:
    from workflows.mainjob.candidates import drafter_candidates, dynamic_candidates, finalists

    cands = drafter_candidates(LOOKUP, accept, profile, MAX_INPUT)
    cands += dynamic_candidates(LOOKUP, accept, profile, max_size=MAX_INPUT - 1, sizes=DYNAMIC_SIZES)
    racing = finalists(cands, s.finalists, s.neighbours)
    for c in racing:
        c.tree.engine = "llama.cpp"
        c.tree.provenance = dict(c.tree.provenance, accept=shown(accept_path), profile=shown(profile_path),
                                 autotune=shown(out), guesser_dir=None)
    return racing


REPORT_RESERVE_S = 15.0  # writing the run folder, kept out of the race


@dataclass
class _Record:
    """What each race arm decoded: per prompt its first tokens; steps, tokens and decision times."""

    tokens: dict = field(default_factory=dict)  # key -> {prompt: tokens}
    steps: dict = field(default_factory=dict)  # key -> steps over its runs
    emitted: dict = field(default_factory=dict)  # key -> tokens over its runs
    decide_s: dict = field(default_factory=dict)  # key -> per-run median decision seconds (dynamic plans)
    reference: dict = field(default_factory=dict)  # prompt -> (tokens, seconds) of llama-cpp-python's generate


def _arms(racing: list, race_ids: list, profile, n: int) -> list:
    """Plain decoding and every finalist as race arms (workflows/mainjob/choose.py), with predicted seconds per prompt."""
    from planner.cost import plain_step
    from workflows.mainjob.choose import PLAIN, Arm

    step = plain_step(profile)

    def arm(key, cost, up):
        return Arm(key, cost, up, {p: n * step / max(up, 1e-3)
                                   for p in range(len(race_ids))})

    return [arm(PLAIN, 1.0, 1.0)] + [arm(c.label, c.predicted_tokens_per_step / max(c.predicted_speedup, 1e-9),
                                          c.predicted_speedup) for c in racing]


def _race(s: LlamaAutotune, target, racing: list, race_ids: list, profile, left, say) -> dict:
    """The hf main job's race (workflows/mainjob/choose.py: selection, then the winner's confirmation against
    plain on prompts it was not chosen on, a sign-flip test), decoding in llama.cpp; llama-cpp-python's
    own Llama.generate decodes each prompt once beside plain's first run, as a reference. Under sampling
    every arm decodes prompt p with seed + p, as the hf race does, and only speeds are compared: sampled
    outputs differ per arm by design (their law is the distribution tests')."""
    from decoder.guesser import PlainGuesser
    from decoder.engines.llama_cpp.stock import StockLlama
    from decoder.loop import generate
    from decoder.guessers.registry import LoadRequest, load_guesser
    from profiler.load import OtherLoad, other_cores
    from training.splits import question_of
    from workflows.mainjob.choose import LOADED_CORES, PLAIN, Race, Run, run_race, speedup

    eng = target.engine
    lookup = load_guesser(LOOKUP, LoadRequest(eng, depth=8))
    by_key = {c.label: c for c in racing}
    race = Race(_arms(racing, race_ids, profile, s.decode_tokens), list(range(len(race_ids))), rounds=s.rounds,
                seed=s.seed, groups=question_of(len(race_ids), s.turns), same_text=s.sampling.one_text)
    rec = _Record()
    stock = StockLlama(target.gguf, threads=eng.threads, n_ctx=eng.n_ctx)
    samp = s.sampling
    warp = dict(temperature=samp.temperature, top_k=samp.top_k, top_p=samp.top_p)

    def decode(key: str, ids, n: int, seed: int):
        cand = by_key.get(key)
        return generate(eng, ids, plan=cand.tree if cand else None, guesser=lookup if cand else PlainGuesser(),
                        max_new_tokens=n, phase_times=False, seed=seed, **warp)

    for a in race.arms:  # warm every shape once (first calls at a new length cost more)
        decode(a.key, race_ids[0], 8, s.seed)
    stock.sample(race_ids[0], 8, samp, s.seed)
    meter, t0 = OtherLoad(), time.perf_counter()
    others = other_cores(0.5)
    race.loaded_now = others is not None and others >= LOADED_CORES

    def measure(key: str, p: int) -> Run:
        meter.start()
        start = time.perf_counter()
        o = decode(key, race_ids[p], s.decode_tokens, s.seed + p)
        run = Run(key, p, time.perf_counter() - start, start - t0, meter.stop())
        rec.tokens.setdefault(key, {}).setdefault(p, o.tokens.tolist())
        rec.steps[key] = rec.steps.get(key, 0) + o.steps
        if race.same_text:
            race.arm(key).steps.setdefault(p, int(o.steps))
        rec.emitted[key] = rec.emitted.get(key, 0) + len(o.tokens)
        if o.stats.dynamic:
            rec.decide_s.setdefault(key, []).append(o.stats.dynamic["decide_s_median"])
        if key == PLAIN and p not in rec.reference:
            rec.reference[p] = stock.sample(race_ids[p], s.decode_tokens, samp, s.seed + p)
        return run

    def check(p: int, keys: list[str]) -> None:
        plain = rec.tokens[PLAIN][p]
        for k in set(keys) - {PLAIN}:
            a = race.arm(k)
            if not a.dropped and rec.tokens[k][p] != plain:
                a.dropped = f"output differs from plain decoding on race prompt {p}"
                race.log.append(f"{k}: {a.dropped}")

    def progress(phase: str, p: int) -> None:
        lead = race.leader() if phase == "selection" else race.winner
        say(f"      {phase} prompt {p}: {len(race.candidates())} plans left; "
            f"{lead.key} {speedup(lead)} plain ({left():.0f} s left)")

    interrupted = False
    try:
        decision = run_race(race, measure, lambda: left() - REPORT_RESERVE_S, check if samp.rule == "greedy" else None,
                            progress)
    except KeyboardInterrupt:
        interrupted = True
        say("      interrupted: deciding on what was measured")
        decision = race.decide()
    stock.close()
    return {"race": race, "decision": decision, "record": rec, "race_ids": race_ids, "interrupted": interrupted}


def _write(s: LlamaAutotune, target, racing: list, raced: dict, profile, out: Path, wall_s: float) -> dict:
    from planner.plan_settings import RacedWith
    from planner.tree import save_tree
    from workflows.mainjob.write import plain_plan, tuned_for
    from workflows.mainjob.choose import PLAIN, speedup

    race, decision, rec = raced["race"], raced["decision"], raced["record"]
    tuned = tuned_for(s.sampling)
    greedy = s.sampling.rule == "greedy"  # sampled outputs differ per arm by design: none is compared
    plain = race.plain
    prompts = sorted(plain.seconds)
    if not prompts:
        raise UserError("the race measured no prompt (budget too small?); nothing decided")
    (out / "trees").mkdir(exist_ok=True)
    ceiling = _ceilings(raced["race_ids"], rec.tokens[PLAIN], profile, prompts)
    rows = []
    for c in racing:
        a = race.arm(c.label)
        c.tree.settings.update(tuned)
        path = save_tree(c.tree, out / "trees" / f"{c.guesser}-{c.method}-{c.size}.json")
        up = speedup(a) if a.ratios else None
        confirmed = decision.speedup if decision.choice == a.key else None
        best = confirmed or up
        rows.append({"plan": a.key, "method": c.method, "size": c.size, "predicted_speedup": c.predicted_speedup,
                     "predicted_tokens_per_step": c.predicted_tokens_per_step,
                     "measured_speedup": up.to_json() if up else None,
                     "confirmed_speedup": confirmed.to_json() if confirmed else None,
                     "per_prompt_speedup": _per_prompt(a, plain),
                     "measured_tokens_per_step": rec.emitted.get(a.key, 0) / max(rec.steps.get(a.key, 0), 1),
                     "captured_share_of_ceiling": _share(best.mean, ceiling["speedup"]) if best else None,
                     "decide_s_median": statistics.median(rec.decide_s[a.key]) if rec.decide_s.get(a.key) else None,
                     "identical_to_plain": not a.dropped.startswith("output differs") if greedy else None,
                     "dropped": a.dropped or None,
                     "chosen": decision.choice == a.key, "tree": shown(path)})
    chosen = by_label(racing).get(decision.choice)
    tree = chosen.tree if chosen else plain_plan(decision.reason)
    tree.engine = "llama.cpp"
    tree.settings = dict(tree.settings, decision=decision.reason, measured_speedup=decision.speedup.to_json(),
                         raced_with=RacedWith("llama.cpp", target.engine.threads).to_json(), **tuned)
    save_tree(tree, out / "chosen.json")
    plain_tokens = sum(len(rec.tokens[PLAIN][p]) for p in prompts)
    plain_s = sum(plain.seconds[p] for p in prompts)
    ref = [rec.reference[p] for p in prompts if p in rec.reference]
    ref_s = sum(sec for _, sec in ref)
    summary = {
        "engine": "llama.cpp", "model": target.name, "model_file": str(target.gguf), "llama_cpp": target.engine.describe(),
        "chosen": shown(out / "chosen.json"), "decision": decision.choice, "decision_reason": decision.reason,
        "speedup": decision.speedup.to_json(), "p_value": decision.p_value,
        "plain": {"tokens": plain_tokens, "seconds": plain_s, "tokens_per_s": plain_tokens / plain_s},
        "llama_cpp_generate": {"tokens_per_s": sum(len(t) for t, _ in ref) / ref_s if ref_s else None,
                               "identical_to_plain": all(rec.reference[p][0] == rec.tokens[PLAIN][p]
                                                         for p in prompts if p in rec.reference) if greedy else None,
                               "note": "llama-cpp-python's own Llama.generate on the same prompt ids: the loop's "
                                       "overhead against it, a reference, not a candidate"
                                       + ("" if greedy else "; sampled by llama.cpp's own chain (top-k, top-p, then "
                                          "temperature) with the same settings and seed: a speed reference")},
        # None under sampling: outputs are compared only when decoding is greedy
        "identical_to_greedy": all(r["identical_to_plain"] for r in rows) if greedy else None, **tuned,
        "oracle_ceiling": ceiling, "rows": rows, "race": race.to_json(), "race_prompts": len(prompts),
        "rounds": s.rounds, "interrupted": raced["interrupted"], "load_avg_1m": _load(), "wall_s": wall_s,
    }
    summary = _finite(summary)
    atomic_write_json(out / "summary.json", summary)
    return summary


def by_label(racing: list) -> dict:
    return {c.label: c for c in racing}


def _finite(x):
    """JSON has no infinities: an interval over too few prompts (no bound) is written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _per_prompt(arm, plain) -> dict[int, float]:
    """plain's seconds over the arm's, per prompt both decoded (medians of their runs there)."""
    return {p: round(plain.seconds[p] / arm.seconds[p], 4) for p in sorted(arm.seconds) if p in plain.seconds}


def _share(measured: float, ceiling: float) -> float | None:
    return (measured - 1.0) / (ceiling - 1.0) if ceiling > 1.0 + 1e-9 else None


def _ceilings(race_ids: list, plain_tokens: dict, profile, prompts) -> dict:
    """The oracle ceiling of prompt lookup on each race prompt: plain's own answer, lookup's offers
    along it, priced with the profile's L(n) and per-step overhead (planner/ceiling.py)."""
    from decoder.guessers.lookup import available_lengths
    from planner.ceiling import oracle_ceiling
    from planner.cost import step_cost

    G = min(profile.max_input_length, MAX_INPUT) - 1
    cost = [float(step_cost(profile, g + 1)) for g in range(G + 1)]
    per, plain_s, oracle_s = [], 0.0, 0.0
    for p in prompts:
        _, avail = available_lengths(race_ids[p].tolist(), plain_tokens[p], G)
        c = oracle_ceiling(avail, cost)
        per.append(round(c.speedup, 4))
        plain_s, oracle_s = plain_s + c.plain_s, oracle_s + c.oracle_s
    return {"speedup": plain_s / oracle_s if oracle_s else 1.0, "per_prompt": per,
            "method": "an oracle that knows how many of lookup's guesses each step accepts along plain decoding's "
                      "output (sampled: a deterministic guess is accepted exactly when the emitted token is it), "
                      "priced with the profile's L(1+g) + overhead (planner/ceiling.py); the decision's own time not "
                      "counted"}


def _load() -> float | None:
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _table(summary: dict) -> str:
    lines = [f"{'plan':<28} {'predicted':>9} {'measured':>22} {'ceiling share':>13}  identical"]
    for r in summary["rows"]:
        same = "-" if r["identical_to_plain"] is None else r["identical_to_plain"]  # None: sampled
        m = r["confirmed_speedup"] or r["measured_speedup"] or {"mean": float("nan"), "lo": None, "hi": None}
        share = r["captured_share_of_ceiling"]
        bounds = f"[{m['lo']:.2f}, {m['hi']:.2f}]" if m["lo"] is not None and m["hi"] is not None else "(no interval)"
        lines.append(f"{r['plan']:<28} {r['predicted_speedup']:>8.2f}x {m['mean']:>8.2f}x {bounds:>13} "
                     f"{'' if share is None else f'{share:>12.0%}'}  {same}"
                     + ("  CHOSEN" if r["chosen"] else ""))
    p = summary["plain"]
    ref = summary["llama_cpp_generate"]["tokens_per_s"]
    lines.append(f"plain decoding {p['tokens_per_s']:.1f} tokens/s (llama.cpp generate {ref or float('nan'):.1f}); "
                 f"oracle ceiling {summary['oracle_ceiling']['speedup']:.2f}x; load {summary['load_avg_1m']}")
    return "\n".join(lines)
