"""MTAD on this machine: speed against perplexity of beam-sampled drafts with joint acceptance, next
to plain sampling and lossless speculative decoding with the same drafter, and the planner's choice
under a perplexity cap, in one run.

    python bench/bench_mtad.py --draft DIR    # SmolLM2-135M and a draft LM (planner train-drafter --kind draft-lm)
    python bench/bench_mtad.py --draft first-layers:4 --quick          # untrained: the target's first 4 layers
    python bench/bench_mtad.py --smoke --out /tmp/mtad                 # a tiny random model, seconds

Steps, after a warm-up of every shape:
 1. calibrate on autotune's acceptance prompts (held-out MT-bench questions, training.splits): plain sampling and MTAD at every grid point give
    the walks D_j per (W, gamma) and the produced-text perplexity per point and for plain sampling;
 2. time the target's forward L(n), n = 1..gamma_max + 1, the decoder's own work per plain step, and
    one drafter beam step at W rows (t_d(W): cache reorder, forward, warp, Gumbel-top-W) at the
    prompts' context;
 3. plan: planner.mtad.choose, predicted speedup per point, the chosen point under
    --max-perplexity-ratio R (perplexity <= R x plain sampling's), the Pareto front;
 4. evaluate on the benchmark prompts (training.splits.bench_prompts: two-turn chats and requests
    that repeat their input, read by no tuning step; speedups per group), every method on every
    prompt in a shuffled order (bench/common.py) with one seed per prompt: plain sampling, lossless speculative decoding (a chain of --sd-gamma drafter
    tokens, temperature > 0) and MTAD at every grid point: tokens/step, tokens/s, perplexity under
    the target and the drafter (raw distributions), distinct-n;
 5. write bench/results/mtad.{json,md,png} (--smoke writes only with --out).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from common import DRAFT_LM_GONE, ROOT, BenchIds, Results, bench_ids, bench_main, drafter, interleaved, machine, open_hf, sample_load

from planner.errors import UserError

GRIDS = {  # (widths, gammas, taus)
    "full": ((2, 4), (2, 3, 4, 5), (0.05, 0.1, 0.3, 0.9)),
    "quick": ((2, 4), (2, 4), (0.1, 0.9)),
    "smoke": ((2,), (2,), (0.1, 0.9)),
}


# ---------------------------------------------------------------------------------------------- setup


def _draft(spec: str | None, engine):
    """(the drafter, its label): a draft LM directory or first-layers:N (common.drafter)."""
    if spec is None:
        raise UserError(DRAFT_LM_GONE)
    if spec.startswith("first-layers:"):
        return drafter(spec, engine), f"{spec} (untrained)"
    shown = Path(spec).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown  # results files travel with the repo
    return drafter(spec, engine), str(shown)


SMOKE_MODEL = ROOT / "bench" / "data" / "mtad-smoke.json"  # a random 2-layer Llama of 512 tokens


def _setup(args, s: "Sizes"):
    """-> (target name, target engine, draft, draft label, calibration prompts, evaluation prompts)."""
    import torch

    from workflows.cli.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts

    if args.smoke:
        torch.manual_seed(0)
        engine = open_hf(str(SMOKE_MODEL), threads=args.threads)
        draft, label = _draft(args.draft or "first-layers:1", engine)
        g = torch.Generator().manual_seed(0)  # a 512-token random model has no tokenizer: random ids
        prompts = [torch.randint(1, 500, (int(t),), generator=g) for t in (5, 9)]
        return "smoke (random 2-layer Llama)", engine, draft, label, prompts[:1], [BenchIds("s0", "random", prompts[1])]
    engine = open_hf(args.model, "fp32", args.threads)
    draft, label = _draft(args.draft, engine)
    calib, _ = held_out_prompts(str(DEFAULT_QUESTIONS), s.calib_prompts, 0)
    with torch.inference_mode():
        evaluate = bench_ids(engine.tokenizer, {"chat": s.chat_prompts, "repeat": s.repeat_prompts}, engine)
    return engine.model_name, engine, draft, label, encode_prompts(engine.tokenizer, calib), evaluate


# ---------------------------------------------------------------------------------------------- decoding


def _run(kind: str, engine, draft, ids, cfg, seed: int, settings=None, n: int | None = None):
    """One decode; kind plain | speculative | mtad (MTAD's guesser carries its joint rule; its walks are the
    guesser's, returned beside the output)."""
    from decoder import DraftModelGuesser, PlainGuesser, generate
    from decoder.guessers.mtad import MTADGuesser

    kw = dict(max_new_tokens=n or cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
              top_p=cfg.top_p, seed=seed)
    if kind == "plain":
        return generate(engine, ids, None, PlainGuesser(), **kw)
    if kind == "speculative":
        return generate(engine, ids, None, DraftModelGuesser(draft, depth=cfg.sd_gamma), **kw)
    g = MTADGuesser(draft, settings.width, settings.gamma, tau_acc=settings.tau_acc)
    out = generate(engine, ids, None, g, **kw)
    out.walks = g.walks  # per step: D_1..D_gamma of its draft
    return out


def _warm_up(engine, draft, prompts, points, cfg) -> None:
    from profiler.measure import warm_up_shapes

    gmax = max(p.gamma for p in points)
    if not cfg.smoke:
        warm_up_shapes(engine, prompts, range(1, max(gmax, cfg.sd_gamma) + 2))
    _run("plain", engine, draft, prompts[0], cfg, 0, n=4)
    _run("speculative", engine, draft, prompts[0], cfg, 0, n=4)
    for p in {(p.width, p.gamma): p for p in points}.values():
        _run("mtad", engine, draft, prompts[0], cfg, 0, p, n=4)


def _calibrate(engine, draft, prompts, points, cfg) -> dict:
    """Walks per (W, gamma), perplexity per point and of plain sampling, on the calibration prompts."""
    import numpy as np

    from profiler.text_quality import perplexity

    walks, sizes, outputs = {}, {}, {p: [] for p in points}
    plain, overhead = [], []
    for i, ids in enumerate(prompts):
        out = _run("plain", engine, draft, ids, cfg, i)
        plain.append(out.tokens.tolist())
        t = out.stats.times
        overhead += [sum(t[k][j] for k in t if k != "forward") for j in range(len(t["forward"]))]
        for p in points:
            out = _run("mtad", engine, draft, ids, cfg, i, p)
            outputs[p].append(out.tokens.tolist())
            walks.setdefault((p.width, p.gamma), []).extend(out.walks)
            sizes.setdefault((p.width, p.gamma), []).extend(out.stats.input_lengths)  # root + the beams' tree
        sample_load()
    target = engine  # perplexity under the target's raw distribution (profiler/text_quality.py)
    return {"walks": {k: np.array(v, dtype=np.float64) for k, v in walks.items()},
            "forward_tokens": {k: float(np.mean(v)) for k, v in sizes.items() if v},
            "perplexity": {p: perplexity(target, prompts, o) for p, o in outputs.items()},
            "plain_perplexity": perplexity(target, prompts, plain),
            "overhead_s": statistics.median(overhead) if overhead else 0.0}


def _evaluate(engine, draft, prompts, points, cfg) -> list[dict]:
    """Every method on every prompt (BenchIds) in a shuffled order per prompt (bench/common.py: a
    slow spell hits all alike), one sampling seed per prompt."""
    from decoder.torch_ops.draft import HFDraft
    from profiler.text_quality import text_quality

    methods = [("plain", None), ("speculative", None)] + [("mtad", p) for p in points]
    runs = {m: {"tokens": [], "steps": 0, "seconds": [], "outputs": []} for m in methods}

    def method(kind, p):
        def fn(item):
            i, ids = item
            out = _run(kind, engine, draft, ids, cfg, 1000 + i, p)
            r = runs[(kind, p)]
            r["tokens"].append(out.tokens.numel())
            r["steps"] += out.steps
            r["seconds"].append(out.stats.total_s)
            r["outputs"].append(out.tokens.tolist())
        return fn

    interleaved({m: method(*m) for m in methods}, list(enumerate(p.ids for p in prompts)), 1, warm=False,
                progress=False)  # _warm_up ran every shape already
    groups = sorted({p.group for p in prompts})
    rows = []
    for (kind, p), r in runs.items():
        q = text_quality(engine, [x.ids for x in prompts], r["outputs"], HFDraft(draft)).to_json()
        tps = {g: sum(n for n, x in zip(r["tokens"], prompts) if x.group == g) /
               sum(s for s, x in zip(r["seconds"], prompts) if x.group == g) for g in groups}
        rows.append({"method": kind, "name": p.name if p else kind, "settings": _settings(p), "tokens": sum(r["tokens"]),
                     "tokens_per_step": sum(r["tokens"]) / max(r["steps"], 1),
                     "tokens_per_s": sum(r["tokens"]) / sum(r["seconds"]), "tokens_per_s_by_group": tps, **q})
    plain_tps, plain_ppl = rows[0]["tokens_per_s"], rows[0]["perplexity"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / plain_tps
        row["speedup_by_group"] = {g: v / rows[0]["tokens_per_s_by_group"][g] for g, v in row["tokens_per_s_by_group"].items()}
        row["perplexity_ratio"] = row["perplexity"] / plain_ppl if row["perplexity"] and plain_ppl else None
    return rows


def _settings(p) -> dict | None:
    return None if p is None else {"width": p.width, "gamma": p.gamma, "tau_acc": p.tau_acc}


# ---------------------------------------------------------------------------------------------- timing


def _median_time(fn, repeats: int) -> float:
    fn()  # untimed: a first call at a new shape costs many warm ones on the CPU
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timings(engine, draft, ids, widths, n_max: int, cfg) -> tuple[dict, dict]:
    """L(n): the target's forward over n tokens, n = 1..n_max; t_d(W): one beam step of the drafter as the
    decoder runs it (decoder/guessers/mtad.py: the W beams' tokens in one pass of the drafter's cache, each
    seeing the context; warp; Gumbel-top-W). Both after a cache of the prompt, cut back after every pass:
    the target through its engine (context_forwards), the drafter through decoder/drafter.py."""
    import torch

    from decoder.guessers.mtad import beam_step, draft_logprobs
    from decoder.torch_ops.draft import HFDraft
    from decoder.verify import Sampling
    from profiler.overlap import DraftForwards, context_forwards

    s = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size

    def forward(fw, n: int):
        C = fw.context_length
        fw.forward(torch.randint(1, vocab, (1, n)), torch.arange(C, C + n)[None])
        fw.reset()

    def beam(dfw, w: int):
        C = dfw.context_length
        visible = torch.zeros(w, C + w, dtype=torch.bool)
        visible[:, :C] = True
        visible[torch.arange(w), C + torch.arange(w)] = True
        out = dfw.state.forward(torch.randint(1, vocab, (w,)), torch.full((w,), C), visible, None)
        dfw.reset()
        beam_step(torch.zeros(w, dtype=torch.float64), draft_logprobs(out.logits, s), w,
                  gen if s.temperature > 0 else None, s.top_k)

    with torch.inference_mode():
        fw = context_forwards(engine, ids)
        L = {n: _median_time(lambda n=n: forward(fw, n), cfg.repeats) for n in range(1, n_max + 1)}
        dfw = DraftForwards(HFDraft(draft), ids)
        draft_s = {w: _median_time(lambda w=w: beam(dfw, w), cfg.repeats) for w in widths}
    return L, draft_s


def _profile(L: dict, overhead_s: float):
    import numpy as np

    from planner.profile import LatencyProfile, Overhead

    n = np.array(sorted(L))
    lat = np.maximum.accumulate(np.array([L[k] for k in n]))  # medians may dip by noise; a profile never falls
    return LatencyProfile(n, lat, {"file": "measured in bench_mtad"}, Overhead(fixed_s=overhead_s))


# ---------------------------------------------------------------------------------------------- run


def measure(args, s: "Sizes") -> dict:
    from planner.mtad import choose, grid, walks_to_json

    t_start = time.time()
    widths, gammas, taus = GRIDS["smoke" if args.smoke else "quick" if args.quick else "full"]
    points = grid(widths, gammas, taus)
    name, engine, draft, draft_label, calib, evaluate = _setup(args, s)
    _warm_up(engine, draft, [p.ids for p in evaluate] + calib, points, s)
    cal = _calibrate(engine, draft, calib, points, s)
    L, draft_s = _timings(engine, draft, calib[0], widths, max(widths) * max(gammas) + 1, s)  # up to W beams' tree
    profile = _profile(L, cal["overhead_s"])
    choice = choose(cal["walks"], cal["perplexity"], cal["plain_perplexity"], profile, draft_s,
                    s.max_perplexity_ratio, cal["forward_tokens"])
    rows = _evaluate(engine, draft, evaluate, points, s)
    predicted = {p.settings.name: p for p in choice.points}
    for row in rows:
        p = predicted.get(row["name"])
        row["predicted"] = None if p is None else {"tokens_per_step": p.tokens_per_step, "speedup": p.speedup,
                                                   "calibration_perplexity": p.perplexity}
        row["chosen"] = choice.chosen is not None and row["name"] == choice.chosen.settings.name
    result = {
        "machine": machine(), "model": name, "draft": draft_label,
        "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p},
        "max_new_tokens": s.max_new_tokens, "calibration_prompts": len(calib), "evaluation_prompts": len(evaluate),
        "sd_gamma": s.sd_gamma, "grid": {"widths": widths, "gammas": gammas, "taus": taus},
        "timing": {"target_forward_s": {str(k): v for k, v in L.items()}, "draft_forward_s": {str(k): v for k, v in draft_s.items()},
                   "overhead_s": cal["overhead_s"],
                   "forward_tokens": {f"W{w}-g{g}": v for (w, g), v in cal["forward_tokens"].items()}},
        "calibration": {"plain_perplexity": cal["plain_perplexity"],
                        "perplexity": {p.name: v for p, v in cal["perplexity"].items()},
                        "walks": walks_to_json(cal["walks"])},
        "choice": choice.to_json(), "methods": rows, "wall_s": round(time.time() - t_start, 1),
    }
    return result


# ---------------------------------------------------------------------------------------------- report


def markdown(r: dict) -> str:
    m, s, c = r["machine"], r["sampling"], r["choice"]
    groups = list(r["methods"][0]["speedup_by_group"])
    chosen = c["chosen"]["name"] if c["chosen"] else "none (no point meets the cap: decode plainly)"
    lines = [
        "# MTAD: speed against perplexity", "",
        f"{r['model']} with drafter {r['draft']}; CPU {m['cpu']} ({m['torch_threads']} threads, {m['cores']} cores, torch "
        f"{m['torch']}, load {m['load_avg']}). Sampling: temperature {s['temperature']}, top-k {s['top_k']}, top-p "
        f"{s['top_p']} (target and drafter alike); {r['max_new_tokens']} new tokens per prompt. Planner inputs (walks, "
        f"perplexity per point, plain perplexity) from {r['calibration_prompts']} held-out MT-bench prompts (autotune's "
        f"acceptance split); the table measures {r['evaluation_prompts']} benchmark prompts no tuning step read "
        f"(training.splits.bench_prompts), every method per prompt in a shuffled order with the same seed. "
        f"Perplexity: under the target's (and the drafter's) raw distribution; distinct-n within each text.", "",
        f"Planner's choice under perplexity <= {c['max_perplexity_ratio']} x plain sampling's "
        f"({c['plain_perplexity']:.2f} on the calibration prompts): **{chosen}**.", "",
        "| method | tokens/step pred | meas | tok/s | speedup pred | meas | " + "".join(f"{g} | " for g in groups)
        + "ppl target | ratio | ppl draft | distinct-2 | front | chosen |",
        "|" + "---|" * (12 + len(groups)),
    ]
    front = set(c["front"])
    for x in r["methods"]:
        p = x["predicted"] or {}
        lines.append(
            f"| {x['name']} | {_f(p.get('tokens_per_step'))} | {x['tokens_per_step']:.2f} | {x['tokens_per_s']:.1f} | "
            f"{_f(p.get('speedup'))} | {x['speedup']:.2f} | " + "".join(f"{x['speedup_by_group'][g]:.2f} | " for g in groups)
            + f"{_f(x['perplexity'])} | {_f(x['perplexity_ratio'])} | "
            f"{_f(x['draft_perplexity'])} | {_f(x['distinct_2'], 3)} | {'yes' if x['name'] in front else ''} | "
            f"{'**yes**' if x['chosen'] else ''} |")
    lines += ["", "front: the predicted (speedup, calibration perplexity) Pareto front. speculative: lossless, a chain "
              f"of {r['sd_gamma']} drafter tokens. MTAD is not lossless above temperature 0.", "",
              f"Wall time {r['wall_s']} s.", ""]
    return "\n".join(lines)


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5))
    mt = [x for x in r["methods"] if x["method"] == "mtad"]
    for w, color in zip(r["grid"]["widths"], ("tab:blue", "tab:orange", "tab:green", "tab:purple")):
        pts = [x for x in mt if x["settings"]["width"] == w]
        ax.scatter([x["perplexity"] for x in pts], [x["tokens_per_s"] for x in pts], c=color, label=f"MTAD W={w}")
        for x in pts:
            ax.annotate(f"g{x['settings']['gamma']} t{x['settings']['tau_acc']:g}", (x["perplexity"], x["tokens_per_s"]),
                        fontsize=6)
    for x, marker in zip([x for x in r["methods"] if x["method"] != "mtad"], ("s", "D")):
        ax.scatter([x["perplexity"]], [x["tokens_per_s"]], marker=marker, c="k", label=x["name"])
    chosen = [x for x in mt if x["chosen"]]
    if chosen:
        ax.scatter([chosen[0]["perplexity"]], [chosen[0]["tokens_per_s"]], s=200, facecolors="none", edgecolors="r",
                   label="planner's choice")
    front = [x for x in mt if x["name"] in set(r["choice"]["front"])]
    front.sort(key=lambda x: x["perplexity"])
    ax.plot([x["perplexity"] for x in front], [x["tokens_per_s"] for x in front], "r--", lw=0.8, label="predicted front")
    ax.set_xlabel("perplexity under the target (lower is better)")
    ax.set_ylabel("tokens/s (measured)")
    ax.legend(fontsize=7)
    pred = [x for x in mt if x["predicted"]]
    bx.scatter([x["predicted"]["speedup"] for x in pred], [x["speedup"] for x in pred])
    lim = max([1.0] + [x["speedup"] for x in pred] + [x["predicted"]["speedup"] for x in pred]) * 1.1
    bx.plot([0, lim], [0, lim], "k:", lw=0.8)
    bx.set_xlabel("predicted speedup (planner.mtad)")
    bx.set_ylabel("measured speedup over plain sampling")
    fig.suptitle(f"MTAD, {r['model']} + {r['draft']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _files(out: Path, r: dict) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # the plot as bytes: every file is written at the end, or none
        plot(r, Path(tmp) / "mtad.png")
        png = (Path(tmp) / "mtad.png").read_bytes()
    return {out / "mtad.json": r, out / "mtad.md": markdown(r), out / "mtad.png": png}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default=None, metavar="DIR|first-layers:N",
                   help="the drafter: a draft_lm (or Hugging Face) directory, or the target's first N layers "
                        "(untrained)")
    p.add_argument("--calib-prompts", type=int, default=8, help="held-out prompts (acceptance split) for the planner's inputs")
    p.add_argument("--chat-prompts", type=int, default=4, help="two-turn chats for the measured table (bench_prompts)")
    p.add_argument("--repeat-prompts", type=int, default=4, help="requests that repeat their input, for the measured table")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--sd-gamma", type=int, default=4, help="chain length of the lossless speculative baseline")
    p.add_argument("--max-perplexity-ratio", type=float, default=1.0, metavar="R")
    p.add_argument("--repeats", type=int, default=7, help="timing repeats for L(n) and t_d(W)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a small grid, 4 calibration + 2 + 2 prompts, 32 tokens")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, seconds; writes only with --out")
    p.add_argument("--out", default=None, help="default bench/results")
    return p


@dataclass(frozen=True)
class Sizes:
    """What one run measures and samples with: the flags, or --quick's or --smoke's."""

    calib_prompts: int
    chat_prompts: int
    repeat_prompts: int
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    sd_gamma: int
    max_perplexity_ratio: float
    repeats: int
    smoke: bool


def sizes(a) -> Sizes:
    s = Sizes(a.calib_prompts, a.chat_prompts, a.repeat_prompts, a.max_new_tokens, a.temperature, a.top_k, a.top_p,
              a.sd_gamma, a.max_perplexity_ratio, a.repeats, a.smoke)
    if a.quick:
        s = replace(s, calib_prompts=4, chat_prompts=2, repeat_prompts=2, max_new_tokens=32)
    if not (1 <= s.calib_prompts <= 8 and s.chat_prompts + s.repeat_prompts >= 1):
        raise UserError("--calib-prompts 1..8; --chat-prompts, --repeat-prompts: one prompt at least")
    if a.smoke:  # random weights: any point will do under the cap, the code paths are the test
        s = replace(s, max_new_tokens=8, sd_gamma=2, max_perplexity_ratio=10.0, repeats=2)
    return s


def main(argv=None) -> int:
    return bench_main("bench_mtad", parser(), run, argv, writes=lambda a: not a.smoke or a.out is not None)


def run(args) -> Results:
    result = measure(args, sizes(args))
    files = _files(Path(args.out or ROOT / "bench" / "results"), result) if args.out or not args.smoke else {}
    return Results(files, markdown(result) + ("smoke: ok" if args.smoke else ""))


if __name__ == "__main__":
    sys.exit(main())
