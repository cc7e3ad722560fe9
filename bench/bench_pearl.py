"""PEARL on this machine: plain decoding, speculative decoding and PEARL (concurrent and serial-booked)
with one drafter, measured in one run and set against planner/pearl.py's predictions.

    python bench/bench_pearl.py --draft DIR     # SmolLM2-135M and a draft LM (planner train-drafter --kind draft-lm)
    python bench/bench_pearl.py --draft first-layers:4                   # untrained: the target's first 4 layers
    python bench/bench_pearl.py --smoke                                  # a tiny random model, seconds

Steps:
 1. per-forward latencies: the target's L(n) and the drafter's t_d at the thread split PEARL uses
    (target in the caller's thread, drafter in a worker, torch.set_num_threads in each) and at all
    threads (plain decoding and SD); c = L(1) / t_d at the split;
 2. does the split split? the target's gamma-token forward and the drafter's gamma forwards, alone,
    one after the other, and at the same time in two threads; eta = 1 - (together - max) / min;
 3. decoding on the benchmark prompts (training.splits.bench_prompts: two-turn chats and requests
    that repeat their input, read by no tuning step), interleaved in a shuffled order per prompt and
    repeat after a warm-up (bench/common.py), `--repeats` times: plain
    (decoder.generate with PlainGuesser), SD (decoder.generate, DraftModelGuesser, plan=None: a chain of gamma), PEARL
    concurrent, PEARL serial (booked as max(draft, verify) + decide per round); medians over repeats;
    every output checked against plain greedy decoding;
 4. the planning model: alpha from the PEARL runs' accept/reject counts (or --accept FILE), predicted
    tokens per round, mode-A share and speedup against measured; the planner's gamma against round(c);
 5. a timeline of the draft and verify phases per side over a few rounds.
Writes bench/results/pearl.{json,md,png} (--out) with the machine (CPU model, threads, load average).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from common import (
    ROOT,
    Results,
    bench_ids,
    bench_main,
    drafter,
    interleaved,
    load,
    machine,
    open_hf,
    tokenizer_or_builtin,
)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from planner.errors import UserError  # noqa: E402

METHODS = ("plain", "sd", "pearl", "pearl_serial")


# ---------------------------------------------------------------------------------------------- setup


def _setup(args, s: "Sizes"):
    """(engine, drafter, prompts [BenchIds], label). A tiny random model reads the prompts through the
    built-in model's tokenizer (same vocabulary)."""
    if args.smoke:
        engine = open_hf("tiny", threads=s.threads)
        draft, label = drafter("first-layers:1", engine), "tiny (random) / first-layers:1"
    else:
        engine = open_hf("smollm2-135m", "fp32", s.threads)
        if not engine.record()["has_weights"]:
            raise UserError("smollm2-135m: no weights in the local cache (the bench measures the real model)")
        draft, label = drafter(args.draft, engine), f"smollm2-135m / {args.draft}"
    with torch.inference_mode():
        prompts = bench_ids(tokenizer_or_builtin(engine), {"chat": s.chat_prompts, "repeat": s.repeat_prompts}, engine,
                            first_answer_tokens=8 if args.smoke else 64, keep_last=24 if args.smoke else None)
    return engine, draft, prompts, label


from profiler.overlap import side_latencies as _latencies  # noqa: E402
from profiler.overlap import split_check as _split_check  # noqa: E402

# ---------------------------------------------------------------------------------------------- decoding


def _run(method: str, engine, draft, ids, gamma: int, tokens: int, split, total: int):
    from decoder import DraftModelGuesser, Pearl, PlainGuesser, generate

    torch.set_num_threads(total)
    if method == "plain":
        return generate(engine, ids, None, PlainGuesser(), max_new_tokens=tokens)
    if method == "sd":
        return generate(engine, ids, plan=None, guesser=DraftModelGuesser(draft, top_k=1, depth=gamma),
                        max_new_tokens=tokens)
    return generate(engine, ids, Pearl(draft, gamma, concurrent=method == "pearl", threads=split), max_new_tokens=tokens)


def _record(method: str, out, gamma: int) -> dict:
    n = int(out.tokens.numel())
    if method.startswith("pearl"):
        s = out.stats.summary()
        secs = s["booked_s"] if method == "pearl_serial" else s["total_s"]
        return {"tokens": n, "seconds": secs, "real_seconds": s["total_s"], "rounds": s["rounds"],
                "mode_a": s["mode_a"], "accepted": s["accepted"], "rejected": s["rejected"],
                "decide_s": s["decide_s"], "ids": out.tokens.tolist()}
    st = out.stats
    rec = {"tokens": n, "seconds": st.total_s, "real_seconds": st.total_s, "rounds": len(st.states),
           "ids": out.tokens.tolist()}
    if method == "sd":  # a chain: a step stops at its first rejection unless all gamma are accepted
        rec["accepted"] = sum(st.accepted)
        rec["rejected"] = sum(a < gamma for a in st.accepted)
    return rec


def _decode_all(engine, draft, prompts, gammas, s, split) -> list[dict]:
    """Every (method, gamma, prompt) `repeats` times, interleaved (bench/common.py), after a warm-up."""
    configs = [("plain", 0)] + [(m, g) for g in gammas for m in METHODS[1:]]
    runs, seen = [], {}

    def config(m, g):
        def fn(item):
            k, ids = item
            out = _run(m, engine, draft, ids, max(g, 1), 4 if k < 0 else s.max_new_tokens, split, s.threads)
            if k >= 0:  # not the warm-up
                rep = seen[m, g, k] = seen.get((m, g, k), -1) + 1
                runs.append({"method": m, "gamma": g, "prompt": k, "group": prompts[k].group, "repeat": rep,
                             **_record(m, out, max(g, 1))})
        return fn

    interleaved({f"{m}/{g}": config(m, g) for m, g in configs}, list(enumerate(p.ids for p in prompts)), s.repeats,
                warm_up=(-1, prompts[0].ids))
    plain = {(r["prompt"], r["repeat"]): r["ids"] for r in runs if r["method"] == "plain"}
    for r in runs:
        r["identical_to_plain"] = r["ids"] == plain[(r["prompt"], r["repeat"])]
    return runs


def _medians(runs: list[dict], repeats: int) -> dict:
    """(method, gamma) -> median over repeats of tokens/s summed over prompts, and pooled counts."""
    out = {}
    for key in sorted({(r["method"], r["gamma"]) for r in runs}):
        rows = [r for r in runs if (r["method"], r["gamma"]) == key]
        reps = [[r for r in rows if r["repeat"] == k] for k in range(repeats)]
        per_rep = [sum(r["tokens"] for r in rep) / sum(r["seconds"] for r in rep) for rep in reps]
        fields = ("tokens", "rounds", "mode_a", "accepted", "rejected", "decide_s")
        agg = {f: sum(r.get(f, 0) for r in rows) for f in fields}
        agg["tokens_per_s"] = statistics.median(per_rep)
        agg["tokens_per_s_by_group"] = {
            grp: statistics.median(sum(r["tokens"] for r in rep if r["group"] == grp) /
                                   sum(r["seconds"] for r in rep if r["group"] == grp) for rep in reps)
            for grp in sorted({r["group"] for r in rows})}
        agg["identical_to_plain"] = all(r["identical_to_plain"] for r in rows)
        out[key] = agg
    plain = out[("plain", 0)]
    for v in out.values():
        v["speedup"] = v["tokens_per_s"] / plain["tokens_per_s"]
        v["speedup_by_group"] = {grp: x / plain["tokens_per_s_by_group"][grp] for grp, x in v["tokens_per_s_by_group"].items()}
    return out


# ---------------------------------------------------------------------------------------------- predictions


def _profile(lat: dict[int, float]):
    from planner.profile import LatencyProfile

    n = sorted(lat)
    return LatencyProfile(np.array(n), np.maximum.accumulate(np.array([lat[k] for k in n])))


def _predict(med: dict, lat: dict, split_check: dict, gammas, accept_alpha) -> dict:
    """Per gamma: alpha (measured counts or the acceptance file), predicted vs measured."""
    from planner.pearl import alpha_from_counts, choose_gamma, predict_pearl, predict_sd, stationary

    prof_split, prof_full = _profile(lat["L_split_s"]), _profile(lat["L_full_s"])
    plain_s = lat["L_full_s"][1]
    rows = []
    for g in gammas:
        p, ps, sd = med[("pearl", g)], med[("pearl_serial", g)], med[("sd", g)]
        alpha = accept_alpha if accept_alpha is not None else alpha_from_counts(p["accepted"], p["rejected"])
        coord = p["decide_s"] / max(p["rounds"], 1)
        conc = predict_pearl(alpha, g, lat["t_draft_split_s"], prof_split, split_check["eta"], plain_s, coord)
        booked = predict_pearl(alpha, g, lat["t_draft_split_s"], prof_split, 1.0, plain_s, coord)
        a_sd = accept_alpha if accept_alpha is not None else alpha_from_counts(sd["accepted"], sd["rejected"])
        sdp = predict_sd(a_sd, g, lat["t_draft_full_s"], prof_full, plain_s)
        rows.append({"gamma": g, "alpha": alpha, "alpha_sd": a_sd, "pi_a": stationary(alpha, g)[0],
                     "mode_a_share": p["mode_a"] / p["rounds"], "tokens_per_round_pred": conc.tokens_per_round,
                     "tokens_per_round": p["tokens"] / p["rounds"], "speedup_pred": conc.speedup,
                     "speedup": p["speedup"], "serial_booked_speedup_pred": booked.speedup,
                     "serial_booked_speedup": ps["speedup"], "sd_tokens_per_step_pred": sdp.tokens_per_step,
                     "sd_tokens_per_step": sd["tokens"] / sd["rounds"], "sd_speedup_pred": sdp.speedup,
                     "sd_speedup": sd["speedup"]})
    pooled = accept_alpha if accept_alpha is not None else alpha_from_counts(
        sum(med[("pearl", g)]["accepted"] for g in gammas), sum(med[("pearl", g)]["rejected"] for g in gammas))
    choice = choose_gamma(pooled, lat["t_draft_split_s"], prof_split, split_check["eta"], gammas, plain_s)
    best = max(gammas, key=lambda g: med[("pearl", g)]["speedup"])
    return {"rows": rows, "alpha_pooled": pooled, "planner_gamma": choice.gamma, "paper_gamma": choice.paper_gamma,
            "c": choice.c, "measured_best_gamma": best}


def _weight_bytes_per_token(model) -> int:
    """Parameter bytes a one-token forward reads: every matrix but the input embedding (a row lookup,
    unless a Linear reads the same matrix: a tied LM head); a drafter's shared LM head counts once for
    it, as it reads the head on every pass. Found by module type, not by the model's accessors."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matmuls = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    seen, total = set(), 0
    for prm in model.parameters():
        if id(prm) in seen or (id(prm) in lookups and id(prm) not in matmuls):
            continue
        seen.add(id(prm))
        total += prm.numel() * prm.element_size()
    return total


def _gpu_estimate(target, draft, alpha: float, gammas) -> dict:
    """What the planning model predicts where decoding is memory-bound (a GPU at batch 1): a forward's
    time is its weight bytes, so L(n) = L(1) for these few tokens, t_d / L(1) is the bytes ratio, and the
    two sides overlap fully (eta = 1: two GPUs as in the paper, or two streams). An estimate from the
    model sizes, not a measurement: scripts/gpu_measure.sh measures it where a GPU is lent."""
    from planner.pearl import choose_gamma, predict_sd
    from planner.profile import LatencyProfile

    b_target, b_draft = _weight_bytes_per_token(target), _weight_bytes_per_token(draft)
    t_d = b_draft / b_target  # in units of L(1)
    flat = LatencyProfile(np.arange(1, max(gammas) + 2), np.ones(max(gammas) + 1))
    choice = choose_gamma(alpha, t_d, flat, 1.0, gammas, 1.0)
    rows = [{"gamma": p.gamma, "pearl_speedup": p.speedup, "sd_speedup": predict_sd(alpha, p.gamma, t_d, flat, 1.0).speedup,
             "tokens_per_round": p.tokens_per_round} for p in choice.predictions]
    return {"target_weight_bytes": b_target, "draft_weight_bytes": b_draft, "c": 1.0 / t_d, "alpha": alpha,
            "planner_gamma": choice.gamma, "paper_gamma": choice.paper_gamma, "rows": rows}


# ---------------------------------------------------------------------------------------------- outputs


def _timeline(engine, draft, ids, gamma: int, tokens: int, split, rounds: int = 8) -> tuple[list[dict], bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from decoder import Pearl, generate

    out = generate(engine, ids, Pearl(draft, gamma, threads=split), max_new_tokens=tokens)
    evs = [e for e in out.stats.events if e.phase != "prefill"]
    per_round = 3
    evs = evs[: rounds * per_round]
    t0 = min(e.start for e in evs)
    colors = {"draft": "tab:blue", "pre-verify": "tab:orange", "verify": "tab:red", "decide": "tab:gray"}
    fig, ax = plt.subplots(figsize=(10, 3.0))
    lanes = {"draft": 2, "target": 1, "coordinator": 0}
    for e in evs:
        ax.barh(lanes[e.side], (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, color=colors[e.phase],
                edgecolor="black", linewidth=0.4)
    for k, r in enumerate(out.stats.rounds[:rounds]):
        e = evs[k * per_round + 1]
        ax.text((e.start - t0) * 1e3, 1.45, f"{r.mode}:{r.produced}", fontsize=7)
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_xlabel("ms")
    ax.set_title(f"PEARL gamma={gamma}: draft and verify per side (label: mode:tokens)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=4)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return [{"side": e.side, "phase": e.phase, "start_ms": (e.start - t0) * 1e3, "end_ms": (e.end - t0) * 1e3}
            for e in evs], buf.getvalue()


def _markdown(doc: dict) -> str:
    m, lat, sc, pr = doc["machine"], doc["latency"], doc["split_check"], doc["prediction"]
    lines = [f"# PEARL on {m['cpu']} ({m['cores']} cores; load average {m['load_avg']} at start, "
             f"{doc['load_avg_end']} at end)", "",
             f"Models: {doc['models']}; {doc['prompts']} benchmark prompts (training.splits.bench_prompts: "
             f"{doc['prompt_groups']}), {doc['max_new_tokens']} new tokens, greedy, "
             f"{doc['repeats']} repeats (medians). Thread split (target, drafter) = {tuple(lat['split'])}; "
             f"plain and SD use {lat['total_threads']} threads.", "",
             f"Per forward: L(1) = {lat['L_split_s'][1] * 1e3:.1f} ms at the split ({lat['L_full_s'][1] * 1e3:.1f} ms "
             f"at all threads), t_d = {lat['t_draft_split_s'] * 1e3:.1f} ms ({lat['t_draft_full_s'] * 1e3:.1f} ms); "
             f"c = {lat['c']:.2f}.", "",
             f"Split check (gamma {sc['gamma']}): target alone {sc['target'] * 1e3:.1f} ms, drafter alone "
             f"{sc['draft'] * 1e3:.1f} ms, one after the other {sc['serial'] * 1e3:.1f} ms, together "
             f"{sc['together'] * 1e3:.1f} ms ({sc['together_over_serial']:.2f} of serial): eta = {sc['eta']:.2f}.", "",
             "| gamma | alpha | mode A (pi_A) | tokens/round (pred) | PEARL speedup (pred) "
             "| serial-booked (pred, eta 1) "
             "| SD tokens/step (pred) | SD speedup (pred) |", "|---|---|---|---|---|---|---|---|"]
    for r in pr["rows"]:
        lines.append(f"| {r['gamma']} | {r['alpha']:.3f} | {r['mode_a_share']:.2f} ({r['pi_a']:.2f}) | "
                     f"{r['tokens_per_round']:.2f} ({r['tokens_per_round_pred']:.2f}) | {r['speedup']:.2f}x "
                     f"({r['speedup_pred']:.2f}x) | {r['serial_booked_speedup']:.2f}x "
                     f"({r['serial_booked_speedup_pred']:.2f}x) | "
                     f"{r['sd_tokens_per_step']:.2f} ({r['sd_tokens_per_step_pred']:.2f}) | {r['sd_speedup']:.2f}x "
                     f"({r['sd_speedup_pred']:.2f}x) |")
    lines += ["", "Measured speedup over plain per prompt group:", "",
              "| method | gamma | " + " | ".join(doc["groups"]) + " |", "|---|---|" + "---|" * len(doc["groups"])]
    lines += [f"| {r['method']} | {r['gamma']} | " + " | ".join(f"{r['speedup_by_group'][g]:.2f}x" for g in doc["groups"])
              + " |" for r in doc["methods"]]
    lines += ["", f"Plain: {doc['plain_tokens_per_s']:.1f} tokens/s. Every output identical to plain greedy decoding: "
              f"{doc['all_identical']}.",
              f"gamma: planner {pr['planner_gamma']}, paper round(c) {pr['paper_gamma']}, measured best "
              f"{pr['measured_best_gamma']} (alpha pooled {pr['alpha_pooled']:.3f}, from {doc['alpha_source']}).",
              "", "![timeline](pearl.png)", ""]
    g = doc.get("gpu_estimate")
    if g:
        lines += [f"Memory-bound estimate (a GPU at batch 1; not measured): forward time = weight bytes read, "
                  f"c = {g['c']:.2f} (target {g['target_weight_bytes'] / 1e6:.0f} MB, drafter "
                  f"{g['draft_weight_bytes'] / 1e6:.0f} MB per pass), L(n) flat, eta = 1, alpha {g['alpha']:.3f}: "
                  f"planner gamma {g['planner_gamma']}, paper round(c) {g['paper_gamma']}.", "",
                  "| gamma | PEARL speedup (est.) | SD speedup (est.) |", "|---|---|---|"]
        lines += [f"| {r['gamma']} | {r['pearl_speedup']:.2f}x | {r['sd_speedup']:.2f}x |" for r in g["rows"]]
        lines.append("")
    lines.append(f"Wall time {doc['wall_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def run(args) -> Results:
    from decoder.guessers.pearl import split_threads

    s = sizes(args)
    t_start = time.time()
    torch.set_num_threads(s.threads)
    mach = machine()
    engine, draft, prompts, label = _setup(args, s)
    target = engine  # PEARL's two sides timed as PEARL runs them: the engine and the drafter (profiler/overlap.py)
    split = split_threads(s.threads)
    context = prompts[0].ids
    lat = _latencies(target, draft, context, range(1, max(s.gammas) + 2), split, s.threads, s.forward_repeats)
    sc = _split_check(target, draft, context, s.gammas[len(s.gammas) // 2], split, s.forward_repeats)
    runs = _decode_all(engine, draft, prompts, s.gammas, s, split)
    med = _medians(runs, s.repeats)
    accept_alpha, source = _accept_alpha(args)
    pred = _predict(med, lat, sc, s.gammas, accept_alpha)
    out = Path(args.out)
    timeline, png = _timeline(engine, draft, prompts[0].ids, pred["planner_gamma"], s.max_new_tokens, split)
    groups = sorted({p.group for p in prompts})
    doc = {"machine": mach, "models": label, "prompts": len(prompts), "max_new_tokens": s.max_new_tokens,
           "groups": groups, "prompt_groups": ", ".join(f"{sum(p.group == g for p in prompts)} {g}" for g in groups),
           "repeats": s.repeats, "gammas": s.gammas, "latency": lat, "split_check": sc,
           "methods": [{"method": k[0], "gamma": k[1], **v} for k, v in med.items()],
           "plain_tokens_per_s": med[("plain", 0)]["tokens_per_s"], "prediction": pred, "alpha_source": source,
           "all_identical": all(r["identical_to_plain"] for r in runs),
           "runs": [{k: v for k, v in r.items() if k != "ids"} for r in runs], "timeline": timeline,
           "gpu_estimate": _gpu_estimate(engine.torch_model(), draft, pred["alpha_pooled"], s.gammas),
           "load_avg_end": load(), "wall_s": time.time() - t_start}
    md = _markdown(doc)
    files = {out / "pearl.json": doc, out / "pearl.md": md, out / "pearl.png": png}
    if not args.smoke:
        return Results(files, md)
    ok = doc["all_identical"]
    return Results(files, md + ("smoke: ok" if ok else "smoke: FAILED (an output differs from plain greedy decoding)"),
                   0 if ok else 1)


def _accept_alpha(args) -> tuple[float | None, str]:
    if not args.accept:
        return None, "the PEARL runs' accept/reject counts (maximum likelihood)"
    from planner.accept import load_acceptance
    from planner.pearl import alpha_from_acceptance

    return alpha_from_acceptance(load_acceptance(args.accept), args.alpha_rule), f"{args.accept} ({args.alpha_rule})"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default=None,
                   help="a draft LM directory (planner train-drafter --kind draft-lm) or first-layers:N (untrained)")
    p.add_argument("--gammas", default="2,3,4,5,6")
    p.add_argument("--chat-prompts", type=int, default=2, help="two-turn chats (training.splits.bench_prompts)")
    p.add_argument("--repeat-prompts", type=int, default=2, help="requests that repeat their input")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--forward-repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2, help="all CPU threads (PEARL splits them between the sides)")
    p.add_argument("--accept", default=None, help="an acceptance file (planner accept --guesser draft) for alpha")
    p.add_argument("--alpha-rule", default="mean", choices=["mean", "first", "geometric"])
    p.add_argument("--smoke", action="store_true", help="a tiny random model, seconds")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, or --smoke's seconds on a tiny random model."""

    gammas: list[int]
    max_new_tokens: int
    repeats: int
    forward_repeats: int
    threads: int
    chat_prompts: int
    repeat_prompts: int


def sizes(a) -> Sizes:
    if a.smoke:  # one thread (split (1, 1)): the smoke checks the code, and a 2-thread team on a busy machine is slow
        return Sizes([2, 3], 10, 1, 3, 1, 1, 1)
    try:
        gammas = [int(x) for x in a.gammas.split(",")]
    except ValueError:
        raise UserError(f"--gammas {a.gammas}: expected integers separated by commas") from None
    if a.chat_prompts + a.repeat_prompts < 1:
        raise UserError("--chat-prompts, --repeat-prompts: one prompt at least")
    return Sizes(gammas, a.max_new_tokens, a.repeats, a.forward_repeats, a.threads, a.chat_prompts, a.repeat_prompts)


def main(argv=None) -> int:
    return bench_main("bench_pearl", parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
