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
from workflows.llama_target import add_engine_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_argument(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens decoded per prompt")
    p.add_argument("--plan", default=None, metavar="TREE",
                   help="also decode with this plan and record its state transitions next to its Markov model")
    p.add_argument("--transitions-output", default=None, metavar="FILE", help="where to write the transitions JSON")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0, with --guesser draft: the acceptance vector of sampled children at this temperature "
                        "(what sequoia trees for lossless sampling are planned with), instead of greedy top-k")
    p.add_argument("--width", type=int, default=4, help="with --temperature: sampled children per node measured")
    p.add_argument("--samples", type=int, default=32, help="with --temperature: sibling procedures simulated per position")
    p.add_argument("--held-out", action="store_true",
                   help="measure on the MT-bench questions held out of every shipped guesser's training "
                        "(question_id %% 5 == 0, first turns) of --prompts (default the MT-bench file)")
    p.add_argument("--calibrate", action="store_true",
                   help="also map the guesser's live signal to acceptance (draft probability per depth; lookup: n-gram "
                        "length and follow count) for dynamic plans: one more greedy pass over the prompts; stored "
                        "under 'calibration' with a cross-fitted reliability table")
    p.add_argument("-o", "--output", required=True, help="acceptance JSON (loadable by `planner plan --accept`)")


def prompt_texts(args) -> list[str]:
    """--prompts (or the MT-bench default), the held-out questions only with --held-out."""
    if not getattr(args, "held_out", False):
        return read_prompts(args.prompts or DEFAULT_PROMPTS, args.num_prompts)
    from workflows.inputs import held_out_questions

    texts = held_out_questions(str(args.prompts or DEFAULT_PROMPTS))
    if not texts:
        raise UserError(f"--held-out: {args.prompts or DEFAULT_PROMPTS} has no held-out question (question_id % 5 == 0)")
    return texts[: args.num_prompts] if args.num_prompts else texts


def _sampled(args) -> int:
    """Sampled children of a draft LM: the positional acceptance vector at --temperature."""
    import math
    import time

    from planner.accept import from_entry
    from planner.jsonio import atomic_write_json
    from profiler.acceptance import measure_accuracy, measure_sampled_acceptance

    if not (math.isfinite(args.temperature) and args.temperature > 0) or not 1 <= args.width <= 64 \
            or not 1 <= args.samples <= 10000:
        raise UserError("--temperature > 0, --width in 1..64, --samples in 1..10000")
    texts = prompt_texts(args)
    loaded, tokenizer, guesser = load_everything(args)
    if not hasattr(guesser, "draft_model"):
        raise UserError("--temperature: sampled acceptance is measured for --guesser draft[:DIR] (sampled children)")
    prompts = encode(tokenizer, texts, loaded.model.get_input_embeddings().weight.shape[0])
    t0 = time.time()
    acc = measure_sampled_acceptance(loaded.model, guesser.draft_model, prompts, args.temperature, args.max_new_tokens,
                                     args.width, args.samples, progress=not args.no_progress)
    timing = measure_accuracy(loaded.model, guesser, prompts[:1], max_new_tokens=16, allow_empty=True)  # pass time
    acc.update({"model": loaded.name, "guesser": dict(timing["guesser"], dir=guesser.source_dir),
                "wall_s": time.time() - t0})
    from_entry({"positional": acc["positional"]}, label=args.output)
    atomic_write_json(args.output, acc)
    print(f"sampled-child acceptance per rank {[round(x, 3) for x in acc['positional']]} at temperature "
          f"{args.temperature} over {acc['positions']} positions; wrote {args.output}")
    return 0


def run(args) -> int:
    if getattr(args, "engine", None) == "llama.cpp":
        from workflows.llama_runs import accept_llama

        return accept_llama(args)
    if args.temperature != 0:
        return _sampled(args)
    if args.max_new_tokens < 2:
        raise UserError("--max-new-tokens: expected an integer >= 2")
    if args.plan and not args.transitions_output:
        raise UserError("--plan needs --transitions-output FILE")
    from planner.accept import from_entry
    from planner.jsonio import atomic_write_json
    from planner.tree import load_tree

    tree = load_tree(args.plan) if args.plan else None
    texts = prompt_texts(args)
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
    if args.calibrate and len(done) == len(prompts):
        import numpy as np

        from profiler.calibration import measure_calibration

        acc["calibration"] = measure_calibration(model, guesser, prompts, np.array(acc["accuracy"]),
                                                 max_new_tokens=args.max_new_tokens, progress=not args.no_progress)
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
