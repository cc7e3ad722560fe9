"""Which q a sampling draft LM should draw its children from: its own warped distribution (the
target's temperature, top-k and top-p) or the tempered softmax alone. Either is lossless when
verification uses the same q; this measures which is accepted more.

    python bench/bench_draft_q.py --draft DIR        # SmolLM2 and a draft LM (planner train-drafter --kind draft-lm)
    python bench/bench_draft_q.py --smoke            # the toy model and a one-layer draft of it

Along the target's own sampled continuation of held-out prompts (profiler/sampled.py), at every
position: the first child's acceptance sum_x min(p, q), the sibling procedure's share of ranks
1..3 (Monte Carlo), for reference a deterministic top-k guess's p(x) (the draft used as a fixed
guesser), and under coupled sampling (decoder/noise.py) the chance that the Gumbel top-k of the
warped q holds the target's draw made with the same noise (Monte Carlo over --samples noise
draws per position), the q warped at the target's temperature and, aimed sharper, at --aim
multiples of it (the same noise draws for every q: a paired comparison). Means over positions;
writes bench/results/draft_q.{json,md}.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np
import torch
from common import Results, bench_main, drafter, load_avg, machine, open_hf, sample_load

from planner.errors import UserError
from planner.sampling import Sampling, describe, record

SETTINGS = {"t0.7-p0.9": Sampling(0.7, 0, 0.9), "t1.0-k50": Sampling(1.0, 50, 1.0)}
WIDTH = 4


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, or --smoke's toy-model seconds."""

    prompts: int
    tokens: int
    samples: int
    aims: list[float]


def sizes(a) -> Sizes:
    try:
        aims = [float(x) for x in a.aim.split(",") if x.strip()]
    except ValueError:
        aims = [-1.0]
    s = Sizes(1, 8, 2, aims) if a.smoke else Sizes(a.prompts, a.tokens, a.samples, aims)
    if not (1 <= s.prompts <= 16 and 1 <= s.tokens <= 512 and 0 <= s.samples <= 1000 and len(aims) <= 8
            and all(0 < x <= 2 for x in aims)):
        raise UserError("--prompts 1..16, --tokens 1..512, --samples 0..1000, --aim up to 8 numbers in (0, 2]")
    return s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--samples", type=int, default=16, help="sibling procedures per position (ranks 1+)")
    p.add_argument("--aim", default="0.5,0.75", help="coupled rows aimed with q warped at these multiples of the "
                                                   "target's temperature (comma-separated, in (0, 2])")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--draft", default=None, help="a draft LM directory (planner train-drafter --kind draft-lm): none ships")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_q"))
    return p


def main(argv=None) -> int:
    return bench_main("bench_draft_q", parser(), run, argv)


def run(a) -> Results:
    from decoder.verify import probabilities
    from profiler.sampled import coupled_shares, sampled_continuations, sibling_shares
    from workflows.cli.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts, shipped

    z = sizes(a)
    engine = open_hf("builtin" if a.smoke else "smollm2-135m", threads=1)
    if a.smoke:
        torch.manual_seed(0)
        draft = drafter("first-layers:1", engine)
    else:
        draft = drafter(a.draft, engine)
    texts, _ = held_out_prompts(str(DEFAULT_QUESTIONS), z.prompts, 1)
    prompts = encode_prompts(engine.tokenizer, texts)
    doc = {"model": engine.model_name, "machine": machine(), "prompts": z.prompts, "tokens": z.tokens,
           "samples": z.samples, "aim": z.aims, "settings": {}}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for key, s in SETTINGS.items():
            load0 = load_avg()
            cont = sampled_continuations(engine, prompts, z.tokens, s, seed=0)
            rows = {"warped q": [], "tempered softmax q": []}
            det1, det4 = [], []
            coupled: dict[float, list] = {f: [] for f in [1.0] + z.aims}
            for i, (ids, toks, p) in enumerate(zip(cont.prompts, cont.tokens, cont.probs)):
                T, N = ids.numel(), toks.numel()
                logits = draft(torch.cat([ids, toks])[None]).logits[0, T - 1: T - 1 + N].float()
                qs = {"warped q": probabilities(logits, s), "tempered softmax q": torch.softmax(logits / s.temperature, -1)}
                top = logits.topk(WIDTH, -1).indices
                pt = p.gather(1, top)
                det1 += pt[:, 0].tolist()
                det4 += pt.sum(1).tolist()
                for k, q in qs.items():
                    rows[k] += [sibling_shares(p[j].double(), q[j].double(), WIDTH, z.samples, gen) for j in range(N)]
                for f in coupled:  # one seed per position for every aim: the rows differ by q only
                    q = qs["warped q"] if f == 1.0 else probabilities(logits, Sampling(s.temperature * f, s.top_k, s.top_p))
                    coupled[f] += [coupled_shares(p[j], q[j], WIDTH, z.samples, torch.Generator().manual_seed(
                        1_000_003 * i + j)) for j in range(N)]
            res = {k: {"first_child": float(np.mean([r[0] for r in v])), "ranks": np.mean(v, axis=0).round(4).tolist(),
                       "any_of_4": float(np.mean([r.sum() for r in v]))} for k, v in rows.items()}
            res["deterministic top-k guesses"] = {"first_child": float(np.mean(det1)), "any_of_4": float(np.mean(det4))}
            for f, rows_f in coupled.items():
                name = ("coupled: Gumbel top-k of warped q" if f == 1.0 else
                        f"coupled: Gumbel top-k of q warped at temperature {s.temperature * f:g} ({f:g} T)")
                res[name] = {"first_child": float(np.mean([c[0] for c in rows_f])),
                             "ranks": np.mean(rows_f, axis=0).round(4).tolist(),
                             "any_of_4": float(np.mean([c.sum() for c in rows_f]))}
            doc["settings"][key] = {"label": describe(record(s)), "positions": sum(int(t.numel()) for t in cont.tokens),
                                    "load_avg_1m": load0, "load_avg_1m_after": load_avg(),
                                    "results": res}
            sample_load()
    out = Path(a.out)
    lines = [(f"# The draft LM's q under sampling ({doc['model']}, {doc['machine']['cpu']}, {doc['prompts']} held-out "
              f"prompts x {doc['tokens']} sampled tokens, {doc['samples']} sibling runs per position)"), "",
             "| setting | q | first child accepted | ranks 0..3 | some child of 4 accepted |", "|---|---|---|---|---|"]
    for block in doc["settings"].values():
        for k, r in block["results"].items():
            ranks = ", ".join(f"{x:.3f}" for x in r.get("ranks", [])) or "-"
            lines.append(f"| {block['label']} ({block['positions']} positions, load {block['load_avg_1m']}) | {k} | "
                         f"{r['first_child']:.3f} | {ranks} | {r['any_of_4']:.3f} |")
    md = "\n".join(lines) + "\n"
    return Results({out.with_suffix(".json"): doc, out.with_suffix(".md"): md}, md)


if __name__ == "__main__":
    sys.exit(main())
