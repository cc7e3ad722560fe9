"""`planner autotune --engine llama.cpp`: the main job in llama.cpp, on the model's own GGUF file.

    summary = autotune_llama(LlamaAutotune(out="runs/llama"))

  1 profile     L(n) of chains in llama.cpp after 128 and 512 tokens, the loop's own per-step work
  2 acceptance  prompt lookup's acceptance and its live-signal calibration, decoding in llama.cpp
  3 plan        lookup chains of 1..8 tokens and per-step (dynamic) lookup plans, predicted with the cost model
  4 race        the finalists against llama.cpp plain decoding (this project's loop, root-only steps) on
                other held-out prompts, interleaved, medians over rounds; every output must equal plain's;
                llama-cpp-python's own Llama.generate runs beside as a reference (not a candidate)
  5 write       RUN/chosen.json (a plan with "engine": "llama.cpp"; plain decoding when nothing is faster
                beyond the noise), RUN/trees/, RUN/summary.json with the oracle ceiling per race prompt
The decision is workflows/choose.py's (the hf main job's). Only the run folder is written. Ctrl-C in the
race decides on what was measured.
Only prompt lookup races: llama.cpp returns no hidden states (ParallelSpec, PPD) and has no torch modules
to share (the project's draft LM); docs/llama-cpp.md says why and what a draft would cost.
"""
from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from planner.errors import UserError
from planner.jsonio import atomic_write_json
from workflows.runs import shown

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


def autotune_llama(s: LlamaAutotune) -> dict:
    from workflows.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts
    from workflows.llama_target import open_llama

    say = print if s.progress else (lambda *a, **k: None)
    t0 = time.time()
    left = lambda: s.budget_minutes * 60 - (time.time() - t0)  # noqa: E731
    target = open_llama(s.model, s.threads, s.n_ctx, progress=s.progress)
    tokenizer = target.tokenizer()
    out = Path(s.out) if s.out else Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-llama.cpp-{target.name}"
    out.mkdir(parents=True, exist_ok=True)
    accept_texts, race_texts = held_out_prompts(s.questions or str(DEFAULT_QUESTIONS), s.accept_prompts, s.decode_prompts)
    accept_ids, race_ids = encode_prompts(tokenizer, accept_texts), encode_prompts(tokenizer, race_texts)
    say(f"[1/5] profiling {target.name} in llama.cpp ({target.engine.threads} threads), chains of 1..{MAX_INPUT} "
        f"after {', '.join(map(str, CONTEXTS))} tokens  ({left():.0f} s left)")
    profile_path, profile = _profile(s, target, out)
    say(f"[2/5] lookup acceptance and calibration on {len(accept_ids)} held-out prompts x {s.accept_tokens} tokens "
        f"(one greedy decode each)  ({left():.0f} s left)")
    accept_path, accept = _acceptance(s, target, accept_ids, out)
    say("[3/5] planning lookup chains and per-step lookup plans")
    racing = _plan(s, accept, profile, accept_path, profile_path, out)
    say(f"[4/5] racing {len(racing)} plans against plain decoding on {len(race_ids)} other held-out prompts "
        f"x {s.decode_tokens} tokens, {s.rounds} rounds  ({left():.0f} s left)")
    race = _race(s, target, racing, race_ids, left, say)
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


def _acceptance(s: LlamaAutotune, target, accept_ids: list, out: Path):
    """One greedy decode per prompt in llama.cpp, shared: lookup's acceptance and its calibration are replayed
    over the known text (tests/test_llama_engine.py: the counts equal decoding with the guesser)."""
    import numpy as np

    from decoder.registry import LoadRequest, load_guesser
    from planner.accept import load_acceptance
    from profiler.calibration import replay_calibration
    from profiler.teacher_forced import greedy_continuations, replay_accuracy

    lookup = load_guesser("lookup", LoadRequest(target.engine, depth=8))
    cont = greedy_continuations(target.engine, accept_ids, s.accept_tokens)
    acc = replay_accuracy(target.engine, lookup, cont, 8, 1)
    acc["calibration"] = replay_calibration(lookup, cont.prompts, cont.tokens, np.array(acc["accuracy"]))
    acc.update({"engine": "llama.cpp", "decode_s": cont.decode_s, "source": f"planner autotune --engine llama.cpp: "
                f"{target.name}, {len(accept_ids)} held-out prompts, {acc['positions']} positions (one greedy decode each)"})
    acc["guesser"].update(kind="lookup", dir=None)
    path = atomic_write_json(out / "accept-lookup.json", acc)
    return Path(path), load_acceptance(str(path))


def _plan(s: LlamaAutotune, accept, profile, accept_path: Path, profile_path: Path, out: Path) -> list:
    from workflows.candidates import drafter_candidates, dynamic_candidates, finalists

    cands = drafter_candidates("lookup", accept, profile, MAX_INPUT)
    cands += dynamic_candidates("lookup", accept, profile, max_size=MAX_INPUT - 1, sizes=DYNAMIC_SIZES)
    racing = finalists(cands, s.finalists, s.neighbours)
    for c in racing:
        c.tree.engine = "llama.cpp"
        c.tree.provenance = dict(c.tree.provenance, accept=shown(accept_path), profile=shown(profile_path),
                                 autotune=shown(out), guesser_dir=None)
    return racing


@dataclass
class _Arm:
    key: str
    cand: object  # workflows.candidates.Candidate; None: plain decoding (or the stock reference)
    seconds: dict  # prompt -> [seconds per round]
    tokens: dict  # prompt -> tokens
    decide_s: list
    steps: int = 0
    emitted: int = 0
    mismatch: str = ""


def _race(s: LlamaAutotune, target, racing: list, race_ids: list, left, say) -> dict:
    from decoder.guesser import PlainGuesser
    from decoder.llama_stock import StockLlama
    from decoder.loop import generate
    from decoder.registry import LoadRequest, load_guesser

    eng = target.engine
    lookup = load_guesser("lookup", LoadRequest(eng, depth=8))
    arms = [_Arm("plain", None, {}, {}, [])] + [_Arm(c.label, c, {}, {}, []) for c in racing]
    stock = StockLlama(target.gguf, threads=eng.threads, n_ctx=eng.n_ctx)
    ref = _Arm("llama.cpp generate", None, {}, {}, [])
    for a in arms:  # warm every shape once (first calls at a new length cost more)
        generate(eng, race_ids[0], plan=a.cand.tree if a.cand else None, guesser=lookup if a.cand else PlainGuesser(),
                 max_new_tokens=8)
    stock.greedy(race_ids[0], 8)
    rng = random.Random(s.seed)
    per_block = None
    interrupted = False
    try:
        for r in range(s.rounds):
            for p, ids in enumerate(race_ids):
                if per_block is not None and left() < per_block + 20:
                    raise TimeoutError
                t_block = time.time()
                order = arms + [ref]
                rng.shuffle(order)
                for a in order:
                    if a is ref:
                        toks, sec = stock.greedy(ids, s.decode_tokens)
                        a.seconds.setdefault(p, []).append(sec)
                        a.tokens[p] = toks
                        continue
                    o = generate(eng, ids, plan=a.cand.tree if a.cand else None,
                                 guesser=lookup if a.cand else PlainGuesser(), max_new_tokens=s.decode_tokens,
                                 phase_times=False)
                    a.seconds.setdefault(p, []).append(o.stats.total_s)
                    a.tokens[p] = o.tokens.tolist()
                    a.steps += o.steps
                    a.emitted += len(a.tokens[p])
                    if o.stats.dynamic:
                        a.decide_s += [o.stats.dynamic["decide_s_median"]]
                per_block = time.time() - t_block
            say(f"      round {r + 1}/{s.rounds} done")
    except TimeoutError:
        say("      the budget ends the race here; deciding on the prompts every arm decoded")
    except KeyboardInterrupt:
        interrupted = True
        say("      interrupted: deciding on what was measured")
    stock.close()
    plain = arms[0]
    for a in arms[1:] + [ref]:
        bad = [p for p in plain.tokens if a.tokens.get(p) is not None and a.tokens[p] != plain.tokens[p]]
        if bad:
            a.mismatch = f"output differs from plain decoding on race prompt(s) {bad}"
    return {"arms": arms, "reference": ref, "race_ids": race_ids, "interrupted": interrupted}


def _medians(a: _Arm, prompts) -> dict:
    return {p: statistics.median(a.seconds[p]) for p in prompts if a.seconds.get(p)}


def _write(s: LlamaAutotune, target, racing: list, race: dict, profile, out: Path, wall_s: float) -> dict:
    from planner.tree import save_tree
    from workflows.autotune_write import plain_plan
    from workflows.choose import Arm, decide, speedup

    arms, ref = race["arms"], race["reference"]
    plain = arms[0]
    prompts = [p for p in plain.seconds if all(p in a.seconds for a in arms)]
    if len(prompts) == 0:
        raise UserError("the race measured no prompt on every arm (budget too small?); nothing decided")
    scored = [Arm(a.key, 1.0, seconds=_medians(a, prompts), dropped=a.mismatch) for a in arms]
    decision = decide(scored)
    chosen = next((a for a in arms[1:] if a.key == decision.choice), None)
    (out / "trees").mkdir(exist_ok=True)
    rows = []
    ceiling = _ceilings(race, plain, profile, prompts)
    for a, sc in zip(arms[1:], scored[1:]):
        c = a.cand
        path = save_tree(c.tree, out / "trees" / f"{c.guesser}-{c.method}-{c.size}.json")
        up = speedup(sc, scored[0])
        rows.append({"plan": a.key, "method": c.method, "size": c.size, "predicted_speedup": c.predicted_speedup,
                     "predicted_tokens_per_step": c.predicted_tokens_per_step,
                     "measured_speedup": up.to_json(), "per_prompt_speedup": _per_prompt(sc, scored[0], prompts),
                     "measured_tokens_per_step": a.emitted / max(a.steps, 1),
                     "captured_share_of_ceiling": _share(up.mean, ceiling["speedup"]),
                     "decide_s_median": statistics.median(a.decide_s) if a.decide_s else None,
                     "identical_to_plain": not a.mismatch, "mismatch": a.mismatch or None,
                     "chosen": a is chosen, "tree": shown(path)})
    tree = chosen.cand.tree if chosen else plain_plan(decision.reason)
    tree.engine = "llama.cpp"
    save_tree(tree, out / "chosen.json")
    plain_tokens = sum(len(plain.tokens[p]) for p in prompts)
    plain_s = sum(_medians(plain, prompts).values())
    ref_s = sum(_medians(ref, prompts).values()) if all(ref.seconds.get(p) for p in prompts) else None
    summary = {
        "engine": "llama.cpp", "model": target.name, "model_file": str(target.gguf), "llama_cpp": target.engine.describe(),
        "chosen": shown(out / "chosen.json"), "decision": decision.choice, "decision_reason": decision.reason,
        "speedup": decision.speedup.to_json(),
        "plain": {"tokens": plain_tokens, "seconds": plain_s, "tokens_per_s": plain_tokens / plain_s},
        "llama_cpp_generate": {"tokens_per_s": sum(len(ref.tokens[p]) for p in prompts) / ref_s if ref_s else None,
                               "identical_to_plain": not ref.mismatch,
                               "note": "llama-cpp-python's own Llama.generate on the same prompt ids: the loop's "
                                       "overhead against it, a reference, not a candidate"},
        "identical_to_greedy": all(not a.mismatch for a in arms[1:]),
        "oracle_ceiling": ceiling, "rows": rows, "race_prompts": len(prompts), "rounds": s.rounds,
        "interrupted": race["interrupted"], "load_avg_1m": _load(), "wall_s": wall_s,
    }
    summary = _finite(summary)
    atomic_write_json(out / "summary.json", summary)
    return summary


def _finite(x):
    """JSON has no infinities: an interval over too few prompts (no bound) is written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _per_prompt(arm, plain, prompts) -> list[float]:
    return [round(plain.seconds[p] / arm.seconds[p], 4) for p in prompts if p in arm.seconds]


def _share(measured: float, ceiling: float) -> float | None:
    return (measured - 1.0) / (ceiling - 1.0) if ceiling > 1.0 + 1e-9 else None


def _ceilings(race: dict, plain, profile, prompts) -> dict:
    """The oracle ceiling of prompt lookup on each race prompt: plain's own answer, lookup's offers
    along it, priced with the profile's L(n) and per-step overhead (planner/ceiling.py)."""
    from decoder.lookup import available_lengths
    from planner.ceiling import oracle_ceiling
    from planner.cost import step_cost

    G = min(profile.max_input_length, MAX_INPUT) - 1
    cost = [float(step_cost(profile, g + 1)) for g in range(G + 1)]
    per, plain_s, oracle_s = [], 0.0, 0.0
    for p in prompts:
        _, avail = available_lengths(race["race_ids"][p].tolist(), plain.tokens[p], G)
        c = oracle_ceiling(avail, cost)
        per.append(round(c.speedup, 4))
        plain_s, oracle_s = plain_s + c.plain_s, oracle_s + c.oracle_s
    return {"speedup": plain_s / oracle_s if oracle_s else 1.0, "per_prompt": per,
            "method": "an oracle that knows how many of lookup's guesses each step accepts, priced with the profile's "
                      "L(1+g) + overhead (planner/ceiling.py); the decision's own time not counted"}


def _load() -> float | None:
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _table(summary: dict) -> str:
    lines = [f"{'plan':<28} {'predicted':>9} {'measured':>22} {'ceiling share':>13}  identical"]
    for r in summary["rows"]:
        m = r["measured_speedup"]
        share = r["captured_share_of_ceiling"]
        bounds = f"[{m['lo']:.2f}, {m['hi']:.2f}]" if m["lo"] is not None and m["hi"] is not None else "(no interval)"
        lines.append(f"{r['plan']:<28} {r['predicted_speedup']:>8.2f}x {m['mean']:>8.2f}x {bounds:>13} "
                     f"{'' if share is None else f'{share:>12.0%}'}  {r['identical_to_plain']}"
                     + ("  CHOSEN" if r["chosen"] else ""))
    p = summary["plain"]
    ref = summary["llama_cpp_generate"]["tokens_per_s"]
    lines.append(f"plain decoding {p['tokens_per_s']:.1f} tokens/s (llama.cpp generate {ref or float('nan'):.1f}); "
                 f"oracle ceiling {summary['oracle_ceiling']['speedup']:.2f}x; load {summary['load_avg_1m']}")
    return "\n".join(lines)
