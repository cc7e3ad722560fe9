"""`planner accept`: measure a guesser's accuracy[d][r] on validation prompts (and a plan's state transitions).

Light imports only at top level.
"""
from __future__ import annotations

import argparse
import sys
import time

from planner.errors import UserError
from workflows.inputs import (
    DEFAULT_PROMPTS,
    add_model_arguments,
    encode,
    load_everything,
    read_prompts,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens decoded per prompt")
    p.add_argument("--plan", default=None, metavar="TREE",
                   help="also decode with this plan and record its state transitions next to its Markov model")
    p.add_argument("--transitions-output", default=None, metavar="FILE", help="where to write the transitions JSON")
    p.add_argument("-o", "--output", required=True, help="acceptance JSON (loadable by `planner plan --accept`)")


def run(args) -> int:
    if args.max_new_tokens < 2:
        raise UserError("--max-new-tokens: expected an integer >= 2")
    if args.plan and not args.transitions_output:
        raise UserError("--plan needs --transitions-output FILE")
    from planner.accept import from_entry
    from planner.jsonio import atomic_write_json
    from planner.tree import load_tree

    tree = load_tree(args.plan) if args.plan else None
    texts = read_prompts(args.prompts or DEFAULT_PROMPTS, args.num_prompts)
    from profiler.acceptance import measure_accuracy, measure_transitions

    loaded, tokenizer, guesser = load_everything(args)
    model = loaded.model
    prompts = encode(tokenizer, texts, model.get_input_embeddings().weight.shape[0])
    t0 = time.time()
    done = []
    try:
        # one prompt at a time so Ctrl-C keeps the prompts finished so far
        from tqdm import tqdm

        parts = []
        for ids in tqdm(prompts, desc="accept", unit="prompt", disable=args.no_progress):
            parts.append(measure_accuracy(model, guesser, [ids], max_new_tokens=args.max_new_tokens, allow_empty=True))
            done.append(ids)
    except KeyboardInterrupt:
        print(f"planner accept: interrupted after {len(done)} prompts; writing what is measured", file=sys.stderr)
    if not done:
        raise UserError("no prompt finished; nothing written")
    acc = _merge(parts)
    acc.update({"prompts": len(done), "model": loaded.name, "config_hash": loaded.config_hash,
                "source": f"planner accept: {loaded.name}, {len(done)} prompts from {args.prompts or DEFAULT_PROMPTS}, "
                          f"{args.max_new_tokens} greedy tokens each", "wall_s": time.time() - t0})
    acc["guesser"]["dir"] = guesser.source_dir  # ppd: None is random, untrained
    from_entry({"accuracy": acc["accuracy"]}, label=args.output)  # what we write, the planner can read
    atomic_write_json(args.output, acc)
    top = ", ".join(f"d{d + 1}: {row[0]:.3f}" for d, row in enumerate(acc["accuracy"]))
    print(f"rank-0 accuracy {top} over {acc['positions']} positions; wrote {args.output}")
    if tree is not None and len(done) == len(prompts):
        t = measure_transitions(model, prompts, tree, guesser, max_new_tokens=args.max_new_tokens,
                                progress=not args.no_progress)
        doc = {"plan": args.plan, "model": loaded.name, **t.to_json()}
        atomic_write_json(args.transitions_output, doc)
        print(f"state visits {t.visits.tolist()}; wrote {args.transitions_output}")
    return 0 if len(done) == len(prompts) else 130


def _merge(parts: list[dict]) -> dict:
    import statistics

    import numpy as np

    counts = sum(np.array(p["counts"]) for p in parts)
    totals = sum(np.array(p["totals"]) for p in parts)
    if totals[0] == 0:
        raise UserError("too few positions decoded to measure distance 1; raise --max-new-tokens")
    out = dict(parts[0])
    out.update({"accuracy": np.divide(counts, totals[:, None], out=np.zeros(counts.shape), where=totals[:, None] > 0).tolist(), "counts": counts.tolist(), "totals": totals.tolist(),
                "positions": sum(p["positions"] for p in parts)})
    if "draft_s" in out["guesser"]:  # the drafter's pass time: the median over prompts
        out["guesser"] = dict(out["guesser"], draft_s=statistics.median(p["guesser"]["draft_s"] for p in parts))
    return out
