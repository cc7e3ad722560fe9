"""The main job's last phases: every finalist's tree and row, the decision as RUN/chosen.json, the
summary with the prediction errors, the report, and the table printed at the end.

    write_phase(run, racing, race, outputs, decision, profiled, accepts) -> summary dict
    report_phase(run, summary, profiled, accepts)
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from planner.guessers import kind as guesser_kind
from planner.tree import PPD, Tree, TreeState, save_tree
from workflows.mainjob.candidates import Candidate
from workflows.mainjob.choose import PLAIN, Arm, Decision, Race, speedup
from workflows.mainjob.race import _Outputs
from workflows.mainjob.runs import Run, decision_line, mark_latest, shown
from workflows.mainjob.signflip import LEVEL, MIN_PROMPTS


def state_frequencies(tree: Tree, states: list[int]) -> dict | None:
    """ppd: how often each state was visited while decoding, next to the Markov model's pi."""
    if tree.method != PPD or not states:
        return None
    counts = {st.state: 0 for st in tree.states}
    for s_ in states:
        counts[s_] += 1
    total = sum(counts.values())
    return {str(st.state): {"measured": counts[st.state] / total, "predicted": st.stationary_probability}
            for st in tree.states}


def plain_plan(reason: str) -> Tree:
    """The decision 'plain decoding' as a plan: one state, no candidates (`planner decode --plan` runs it)."""
    return Tree("medusa", [TreeState(0, [], 1.0, 1)], 1.0, settings={"guesser": PLAIN, "decision": reason})


def _measured(c: Candidate, arm: Arm, plain: Arm, outputs: _Outputs, step_s: float) -> dict:
    """A finalist's measurements next to the cost model's predictions, with the prediction errors."""
    prompts = sorted(arm.seconds)
    tokens = sum(int(outputs.tokens[arm.key][p].numel()) for p in prompts)
    steps = sum(outputs.steps[arm.key][p] for p in prompts)
    decode_s = sum(outputs.decode_s[arm.key][p] for p in prompts)
    up = speedup(arm, plain)
    tps = tokens / max(steps, 1)
    pred_step = c.step_s(step_s)
    meas_step = decode_s / max(steps, 1)
    return {"prompts": len(prompts), "tokens": tokens, "steps": steps,
            "measured_tokens_per_step": tps, "measured_speedup": up.mean, "measured_interval": up.to_json(),
            "predicted_step_s": pred_step, "measured_step_s": meas_step,
            "error_tokens_per_step": tps / c.predicted_tokens_per_step - 1,
            "error_step_s": meas_step / pred_step - 1, "error_speedup": c.predicted_speedup / up.mean - 1,
            "measured_tokens_per_s": tokens / max(sum(arm.seconds[p] for p in prompts), 1e-9),
            "predicted_by": (c.prediction or {}).get("method") or "cost model"}


def _row(c: Candidate, arm: Arm, path: Path, measured: dict | None, states: list[int], greedy: bool | str = True) -> dict:
    """greedy: True (outputs compared with plain greedy decoding's), "coupled" (with plain coupled
    sampling's), False (sampled with the recursive-rejection rule: not compared)."""
    row = {
        "guesser": c.guesser, "method": c.method, "variant": c.variant, "size": c.size, "label": c.label,
        "input_length": round(c.input_length, 3), "planned_input_length": c.tree.max_input_length,
        "draft_s": c.guessing.draft_s, "draft_passes": c.guessing.draft_passes,
        "predicted_tokens_per_step": c.predicted_tokens_per_step, "predicted_speedup": c.predicted_speedup,
        "cost_vs_plain_step": arm.cost, "dropped": arm.dropped or None, "chosen": False, "tree": shown(path),
        "measured_tokens_per_step": None, "measured_speedup": None, "identical_to_greedy": None,
        "identical_to_plain_sampling": None,
        "state_frequencies": state_frequencies(c.tree, states),
        "prediction": c.prediction or None,  # replayed (or the cost model's), with the cost model's numbers
    }
    if measured:
        row.update(measured)
        same = not arm.dropped.startswith("output differs")
        if greedy == "coupled":  # coupled sampling emits plain sampling's text with the same seed
            row["identical_to_plain_sampling"] = same
        elif greedy:  # the recursive-rejection rule's outputs differ from plain sampling's by design
            row["identical_to_greedy"] = same
    return row


def write_phase(run: Run, racing: list[Candidate], race: Race, outputs: _Outputs, decision: Decision,
                profiled, accepts: dict, race_ids: list) -> dict:
    """Every finalist's tree and row, the decision as RUN/chosen.json, and the summary."""
    from planner.cost import plain_step

    profile, profile_path = profiled.profile, profiled.path
    run.clock.phase(6, "writing the run folder", run.budget.report_reserve_s)
    arms = {a.key: a for a in race.arms}
    rows, chosen = [], None
    for c in racing:
        name = f"{c.guesser}-{c.method}-{c.size}{'-auto' if c.variant == 'per-state budgets' else ''}{c.tag}.json"
        g = run.guessers[_measured_as(c.guesser, accepts)]
        c.tree.settings.update(tuned_for(run.settings.sampling))
        c.tree.provenance.update({"accept": shown(accepts[_measured_as(c.guesser, accepts)].path),
                                  "profile": shown(profile_path), "autotune": shown(run.out_dir),
                                  "guesser_dir": shown(g.source_dir) if g.source_dir else None})
        c.tree.settings["raced_with"] = raced_with(run, profile_path, g.source_dir, run.out_dir / "trees")
        c.tree.engine = run.engine.caps.name
        save_tree(c.tree, run.out_dir / "trees" / name)
        arm = arms[c.label]
        measured = _measured(c, arm, race.plain, outputs, plain_step(profile)) if arm.seconds else None
        rule = run.settings.sampling.rule
        rows.append(_row(c, arm, run.out_dir / "trees" / name, measured, outputs.states.get(c.label, []),
                         # PEARL's own loop samples with the lossless rule: its text is not plain sampling's
                         "coupled" if rule == "coupled" and not guesser_kind(c.guesser).loop else rule == "greedy"))
        if c.label == decision.choice:
            chosen = c
            rows[-1]["chosen"] = True
    tree = chosen.tree if chosen else plain_plan(decision.reason)
    files = run.guessers[_measured_as(chosen.guesser, accepts)].source_dir if chosen else None
    tree.settings = dict(tree.settings, decision=decision.reason, measured_speedup=decision.speedup.to_json(),
                         raced_with=raced_with(run, profile_path, files, run.out_dir), **tuned_for(run.settings.sampling))
    tree.engine = run.engine.caps.name
    save_tree(tree, run.out_dir / "chosen.json")
    run.say(f"      {decision_line(run.out_dir, mark_latest(run.out_dir))}")
    summary = _summary(run, chosen, decision, rows, race, outputs, profile_path, accepts)
    summary.update(dtype=run.engine.record()["dtype"], race_prompts=len(race.plain.seconds), rounds=run.settings.rounds,
                   generate=own_generate(run, race, outputs, race_ids))
    ceiling = lookup_ceiling(run, race_ids, outputs, profile, accepts)
    if ceiling is not None:
        summary["oracle_ceiling"] = ceiling
        for r in rows:
            best = r["measured_interval"]["mean"] if r.get("measured_interval") else None
            r["captured_share_of_ceiling"] = _share(best, ceiling["speedup"]) if best else None
    return summary


GENERATE_PROMPTS = 4  # race prompts the engine's own generate is timed on (a comparison for the report)


def own_generate(run: Run, race: Race, outputs: _Outputs, race_ids: list) -> dict:
    """The engine's own library generation (transformers' generate on the hf engine) on the first race prompts
    plain decoding ran, beside plain decoding's time on them, so the report can put the decision against what a
    user would otherwise run (workflows/mainjob/compare.py). Timed after the race: it decides nothing."""
    from workflows.mainjob.compare import own_generate_report

    ids = sorted(race.plain.seconds)[:GENERATE_PROMPTS]
    if not ids:
        return {"skipped": "plain decoding timed no race prompt"}
    tps = sum(int(outputs.tokens[PLAIN][p].numel()) for p in ids) / max(sum(race.plain.seconds[p] for p in ids), 1e-9)
    rep = own_generate_report(run.engine, run.settings, [race_ids[p] for p in ids], tps)
    if rep.get("tokens_per_s"):
        run.say(f"      {rep['stock']} on {len(ids)} race prompts: {rep['tokens_per_s']:.1f} tokens/s (plain decoding "
                f"{rep['plain_vs_generate']:.2f}x it)")
    return rep


def lookup_ceiling(run: Run, race_ids: list, outputs: _Outputs, profile, accepts: dict) -> dict | None:
    """Where prompt lookup was measured (a kind whose signal is a text match): the oracle ceiling of its
    chains on each race prompt, an oracle that knows how many of lookup's guesses each step accepts along
    plain decoding's output, priced with the profile's L(1 + g) and per-step overhead (planner/ceiling.py);
    the decision's own time not counted. What any lookup planner could at most reach on this machine."""
    from decoder.guessers.lookup import available_lengths
    from planner.ceiling import oracle_ceiling
    from planner.cost import step_cost
    from planner.guessers import LOOKUP_SIGNAL

    if not any(guesser_kind(k).signal == LOOKUP_SIGNAL and not guesser_kind(k).members for k in accepts):
        return None
    plain_tokens = outputs.tokens.get(PLAIN, {})
    prompts = sorted(plain_tokens)
    if not prompts:
        return None
    G = min(profile.max_input_length, 16) - 1
    cost = [float(step_cost(profile, g + 1)) for g in range(G + 1)]
    per, plain_s, oracle_s = [], 0.0, 0.0
    for p in prompts:
        _, avail = available_lengths(race_ids[p].tolist(), plain_tokens[p].tolist(), G)
        c = oracle_ceiling(avail, cost)
        per.append(round(c.speedup, 4))
        plain_s, oracle_s = plain_s + c.plain_s, oracle_s + c.oracle_s
    return {"speedup": plain_s / oracle_s if oracle_s else 1.0, "per_prompt": per,
            "method": "an oracle that knows how many of lookup's guesses each step accepts along plain decoding's "
                      "output (sampled: a deterministic guess is accepted exactly when the emitted token is it), "
                      "priced with the profile's L(1+g) + overhead (planner/ceiling.py); the decision's own time not "
                      "counted"}


def _share(measured: float, ceiling: float) -> float | None:
    return (measured - 1.0) / (ceiling - 1.0) if ceiling > 1.0 + 1e-9 else None


def raced_with(run: Run, profile_path: Path, guesser_dir, plan_dir: Path) -> dict:
    """What the plan was raced with, by path relative to the plan file's folder and a checksum, so
    `planner decode --plan` runs it the same way (planner/plan_settings.py): the engine, the threads,
    the profile whose matmul paths the hf engine ran on the CPU, the guesser's files."""
    import torch

    from planner.plan_settings import RacedWith, file_ref

    paths = run.device == "cpu" and run.engine.caps.matmul_paths
    return RacedWith(run.engine.caps.name, run.engine.caps.threads or torch.get_num_threads(),
                     file_ref(profile_path, plan_dir) if paths else None,
                     file_ref(guesser_dir, plan_dir) if guesser_dir else None, run.free_cores).to_json()


def tuned_for(s) -> dict:
    """What chosen.json says it was tuned for: the sampling settings (`planner decode` warns when
    run with others), the verification rule and whether the output follows the target's
    distribution (typical acceptance does not)."""
    from workflows.cli.sampling import record

    return {"sampling": record(s), "verify": s.rule, "distribution_exact": s.rule != "typical"}


def _measured_as(kind: str, accepts: dict) -> str:
    """The guesser whose acceptance and files a candidate uses: a hybrid's are its drafter's; a kind
    with its own loop (PEARL) drafts with the measured guesser that has the same files (the draft LM)."""
    spec = guesser_kind(kind)
    if spec.members:
        return spec.members[-1]
    if kind in accepts:
        return kind
    return next(k for k in accepts if guesser_kind(k).files == spec.files and not guesser_kind(k).members)


def _summary(run: Run, chosen: Candidate | None, decision: Decision, rows: list[dict], race: Race, outputs: _Outputs,
             profile_path: Path, accepts: dict) -> dict:
    s = run.settings
    plain = race.plain
    plain_tokens = sum(int(t.numel()) for t in outputs.tokens[PLAIN].values())
    measured = [r for r in rows if r["measured_speedup"] is not None]
    best = max(measured, key=lambda r: r["measured_speedup"], default=None)
    return {
        "chosen": shown(run.out_dir / "chosen.json"),
        "decision": {"choice": decision.choice, "reason": decision.reason, "measured_speedup": decision.speedup.to_json(),
                     "p_value": decision.p_value,
                     "predicted_speedup": chosen.predicted_speedup if chosen else 1.0,
                     "guesser": chosen.guesser if chosen else PLAIN},
        "chosen_guesser": chosen.guesser if chosen else PLAIN, "chosen_method": chosen.method if chosen else PLAIN,
        "chosen_size": chosen.size if chosen else 0,
        # None under sampling: outputs are compared only when decoding is greedy
        "identical_to_greedy": all(r["identical_to_greedy"] is not False for r in rows) if s.sampling.rule == "greedy" else None,
        # coupled sampling: every raced plan's text against plain sampling's with the same seed
        "identical_to_plain_sampling": (all(r["identical_to_plain_sampling"] is not False for r in rows)
                                        if s.sampling.rule == "coupled" else None),
        **tuned_for(s.sampling),
        "plain": {"tokens": plain_tokens, "seconds": sum(plain.seconds.values()), "prompts": len(plain.seconds),
                  "tokens_per_s": plain_tokens / max(sum(plain.seconds.values()), 1e-9),
                  "by_prompt": {str(p): {"tokens": int(outputs.tokens[PLAIN][p].numel()), "seconds": sec}
                                for p, sec in sorted(plain.seconds.items())}},
        "prediction_error": _prediction_errors(measured, chosen, decision),
        "best_measured": ({"label": best["label"], "measured_speedup": best["measured_speedup"]} if best else None),
        "race": race.to_json(),
        "rows": rows, "profile": shown(profile_path),
        "accept": {k: shown(m.path) for k, m in accepts.items()},
        "guessers": {k: shown(g.source_dir) if g.source_dir else None for k, g in run.guessers.items()},
        "engine": run.engine.caps.name, "model": run.model_name, "device": run.device, "target": run.engine.record(),
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()},
        "wall_s": None,
    }


def _prediction_errors(measured: list[dict], chosen: Candidate | None, decision: Decision) -> dict:
    """How far the predictions were from the measurements: per row in the rows (the selection's
    prompts), summarised here; the chosen plan's also against its confirmation (unbiased, more prompts)."""
    def med_abs(key):
        vals = sorted(abs(r[key]) for r in measured)
        return vals[len(vals) // 2] if vals else None

    def max_abs(key):
        return max((abs(r[key]) for r in measured), default=None)

    out = {"median_abs_tokens_per_step": med_abs("error_tokens_per_step"), "median_abs_step_s": med_abs("error_step_s"),
           "median_abs_speedup": med_abs("error_speedup"), "max_abs_tokens_per_step": max_abs("error_tokens_per_step"),
           "max_abs_speedup": max_abs("error_speedup"), "rows": len(measured),
           "predicted_by": sorted({r.get("predicted_by") or "cost model" for r in measured})}
    row = next((r for r in measured if chosen is not None and r["label"] == chosen.label), None)
    if row:
        out["chosen"] = {k: row[k] for k in ("error_tokens_per_step", "error_step_s", "error_speedup")}
        out["chosen"]["error_speedup_vs_confirmation"] = chosen.predicted_speedup / decision.speedup.mean - 1
    return out


def report_phase(run: Run, summary: dict, profiled, accepts: dict) -> None:
    from workflows.report.page import write_report

    index = write_report(run.out_dir / "report", profiles=[str(profiled.path)],
                         accepts=figure_sources(summary, accepts), trees=[summary["chosen"]], run_dir=str(run.out_dir))
    summary["report"] = shown(index)
    run.say(f"report: {shown(index)}")


def figure_sources(summary: dict, accepts: dict) -> list:
    """The acceptance the report's curves are drawn on: the chosen guesser's (a hybrid's drafter's; a plain
    decision's: the best measured plan's), with the plan families that fit it."""
    from planner.tree import CHAIN, MEDUSA, PPD, SEQUOIA
    from workflows.report.decision import figure_guesser
    from workflows.tune.search import Source

    kind = figure_guesser(summary)
    if kind not in accepts:
        return []
    methods = tuple(m for m in guesser_kind(kind).static if m in (PPD, MEDUSA, SEQUOIA, CHAIN))
    m = accepts[kind]
    return [Source(str(m.path), m.accept, methods)] if methods else []


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(summary: dict) -> str:
    head = (f"{'plan':24} {'n_real':>6} {'tok/step pred':>13} {'meas':>5} {'step ms pred':>12} {'meas':>6} "
            f"{'speedup pred':>12} {f'measured [{LEVEL:.0%} interval]':>24}  note")
    lines = [head, "-" * len(head)]
    for r in summary["rows"]:
        iv = r.get("measured_interval")
        meas = f"{iv['mean']:.2f} [{iv['lo']:.2f}, {iv['hi']:.2f}]" if iv and iv["prompts"] >= MIN_PROMPTS else (
            _fmt(r["measured_speedup"], ".2f"))
        note = "CHOSEN" if r["chosen"] else ("out: " + r["dropped"].split(":")[0] if r["dropped"] else "")
        if r["identical_to_greedy"] is False or r.get("identical_to_plain_sampling") is False:
            note = "OUTPUT DIFFERS"
        lines.append(
            f"{r['label']:24} {r['input_length']:>6.1f} {r['predicted_tokens_per_step']:>13.2f} "
            f"{_fmt(r['measured_tokens_per_step'], '.2f'):>5} {_fmt(r.get('predicted_step_s') and r['predicted_step_s'] * 1e3, '.1f'):>12} "
            f"{_fmt(r.get('measured_step_s') and r['measured_step_s'] * 1e3, '.1f'):>6} {r['predicted_speedup']:>12.2f} "
            f"{meas:>24}  {note}")
    p, d = summary["plain"], summary["decision"]
    ms = d["measured_speedup"]
    lines.append(f"plain decoding: {p['tokens_per_s']:.1f} tokens/s over {p['prompts']} prompts")
    lines.append(f"decision: {d['choice']} -- measured {ms['mean']:.2f}x plain"
                 + (f" [{ms['lo']:.2f}, {ms['hi']:.2f}]" if ms["prompts"] >= MIN_PROMPTS and d["choice"] != PLAIN else "")
                 + f", predicted {d['predicted_speedup']:.2f}x; {d['reason']}")
    return "\n".join(lines)
