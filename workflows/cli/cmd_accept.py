"""`planner accept`: measure a guesser's accuracy[d][r] on validation prompts (and a plan's state transitions).

Light imports only at top level.
"""
from __future__ import annotations

import argparse
import sys
import time

from planner.errors import UserError
from workflows.cli.engines import add_engine_argument
from workflows.cli.inputs import DEFAULT_PROMPTS, add_model_arguments, encode, open_everything
from workflows.cli.run_records import (
    check_sampled_accept,
    merge_accuracy,
    prompt_texts,
    sampled_acceptance,
    write_sampled_acceptance,
)
from workflows.cli.sampling import add_sampling_arguments, sampling_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_argument(p)
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens decoded per prompt (greedily; sampled with --temperature)")
    p.add_argument("--seed", type=int, default=0, help="with --temperature: the sampling seed (prompt i: seed + i)")
    p.add_argument("--plan", default=None, metavar="TREE",
                   help="also decode with this plan and record its state transitions next to its Markov model")
    p.add_argument("--transitions-output", default=None, metavar="FILE", help="where to write the transitions JSON")
    add_sampling_arguments(p, "measure acceptance under sampling")
    p.add_argument("--width", type=int, default=4, help="with --temperature and a draft LM: sampled children per node measured")
    p.add_argument("--samples", type=int, default=32,
                   help="with --temperature and a draft LM: sibling procedures simulated per position (ranks 1+)")
    p.add_argument("--held-out", action="store_true",
                   help="measure on the MT-bench questions held out of every shipped guesser's training "
                        "(question_id %% 5 == 0, first turns) of --prompts (default the MT-bench file)")
    p.add_argument("--calibrate", action="store_true",
                   help="also map the guesser's live signal to acceptance (draft probability per depth; lookup: n-gram "
                        "length and follow count) for dynamic plans: one more pass over the prompts (greedy, or "
                        "sampled with --temperature, each guess scored with p(x)); stored under 'calibration' with a "
                        "cross-fitted reliability table")
    p.add_argument("-o", "--output", required=True, help="acceptance JSON (loadable by `planner plan --accept`)")


def _sampled(args, s, engine, guesser, prompts: list) -> int:
    """Acceptance under the user's temperature, top-k and top-p (workflows.cli.run_records.sampled_acceptance)."""
    t0 = time.time()
    acc = sampled_acceptance(engine, guesser, prompts, args, s)
    acc.update({**_target(engine), "wall_s": time.time() - t0,
                "source": f"planner accept: {engine.model_name}, {len(prompts)} prompts from {args.prompts or DEFAULT_PROMPTS}, "
                          f"{args.max_new_tokens} sampled tokens each ({acc['source']})"})
    write_sampled_acceptance(args, acc, s)
    return 0


def _target(engine) -> dict:
    """What the record says of the target: the model and its hash, and the engine it was measured in."""
    r = engine.record()
    return {"model": r["model"], "engine": r["engine"], **({"config_hash": r["config_hash"]} if r.get("config_hash") else {})}


def _check(args, s) -> None:
    if s.temperature > 0:
        check_sampled_accept(args)
    if args.max_new_tokens < 2:
        raise UserError("--max-new-tokens: expected an integer >= 2")
    if args.plan and not args.transitions_output:
        raise UserError("--plan needs --transitions-output FILE")


def run(args) -> int:
    from planner.jsonio import writable_target
    from planner.tree import load_tree
    from workflows.cli.engines import engine_kind, refuse_options

    s = sampling_from_args(args)
    _check(args, s)
    tree = load_tree(args.plan) if args.plan else None
    spec = engine_kind(args)
    refuse_options(spec, {"--device": args.device is not None, "--dtype": args.dtype is not None,
                          "--n-ctx": args.n_ctx is not None})
    writable_target(args.output)
    texts = prompt_texts(args)
    engine, guesser = open_everything(args, spec, context=None)
    prompts = encode(engine, texts)
    engine.reserve(max(int(p.numel()) for p in prompts) + args.max_new_tokens + 64)
    if s.temperature > 0:
        return _sampled(args, s, engine, guesser, prompts)
    return _greedy(args, engine, guesser, prompts, tree)


def _greedy(args, engine, guesser, prompts: list, tree) -> int:
    from planner.accept import from_entry
    from planner.jsonio import atomic_write_json
    from profiler.acceptance import measure_accuracy, measure_transitions

    t0 = time.time()
    done = []
    try:
        # one prompt at a time so Ctrl-C keeps the prompts finished so far
        from tqdm import tqdm

        parts = []
        for ids in tqdm(prompts, desc="accept", unit="prompt", disable=args.no_progress):
            parts.append(measure_accuracy(engine, guesser, [ids], max_new_tokens=args.max_new_tokens, allow_empty=True))
            done.append(ids)
    except KeyboardInterrupt:
        print(f"planner accept: interrupted after {len(done)} prompts; writing what is measured", file=sys.stderr)
    if not done:
        raise UserError("no prompt finished; nothing written")
    acc = merge_accuracy(parts)
    acc.update({"prompts": len(done), **_target(engine),
                "source": f"planner accept: {engine.model_name}, {len(done)} prompts from {args.prompts or DEFAULT_PROMPTS}, "
                          f"{args.max_new_tokens} greedy tokens each", "wall_s": time.time() - t0})
    acc["guesser"]["dir"] = guesser.source_dir  # ppd: None is random, untrained
    acc["guesser"]["kind"] = guesser.kind
    if args.calibrate and len(done) == len(prompts):
        import numpy as np

        from profiler.calibration import measure_calibration

        acc["calibration"] = measure_calibration(engine, guesser, prompts, np.array(acc["accuracy"]),
                                                 max_new_tokens=args.max_new_tokens, progress=not args.no_progress)
    from_entry({"accuracy": acc["accuracy"]}, label=args.output)  # what we write, the planner can read
    atomic_write_json(args.output, acc)
    top = ", ".join(f"d{d + 1}: {row[0]:.3f}" for d, row in enumerate(acc["accuracy"]))
    print(f"rank-0 accuracy {top} over {acc['positions']} positions ({engine.caps.name}); wrote {args.output}")
    if tree is not None and len(done) == len(prompts):
        t = measure_transitions(engine, prompts, tree, guesser, max_new_tokens=args.max_new_tokens,
                                progress=not args.no_progress)
        doc = {"plan": args.plan, "model": engine.model_name, **t.to_json()}
        atomic_write_json(args.transitions_output, doc)
        print(f"state visits {t.visits.tolist()}; wrote {args.transitions_output}")
    return 0 if len(done) == len(prompts) else 130
