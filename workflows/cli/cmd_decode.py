"""`planner decode`: decode prompts with a planned tree, optionally next to plain decoding.

One path for every engine and every way of decoding: the engine the plan (or --engine) names is opened
once, the plan's recorded settings and the flags resolve into one RunConfig (workflows/cli/run_config.py),
what the engine cannot do is refused in one line before any model loads, and the run configuration
becomes what the Python API takes (decoder/api.py): a strategy and a DecodeConfig, decoded by the one
`generate` (decoder/loop.py). A plain decision runs the engine's fastest plain decoding, PEARL its
rounds, MTAD its guesser with the joint rule. Light imports only at top level.
"""
from __future__ import annotations

import argparse
import sys
import time

from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from planner.tree import CHAIN
from workflows.cli.engines import add_engine_argument
from workflows.cli.inputs import DEFAULT_PROMPTS, add_model_arguments, encode, parse_guesser, read_prompts
from workflows.cli.run_records import (
    dynamic_summary,
    format_summary,
    guesser_record,
    step_lengths,
    strategy_record,
    summarize_runs,
)
from workflows.cli.run_config import add_strategy_arguments
from workflows.cli.sampling import add_sampling_arguments, mismatch, recorded, sampling_from_args

# ------------------------------------------------------------------ planner decode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", default=None, metavar="TREE",
                   help="tree file from `planner plan` (or autotune); needed by --guesser ppd, optional for the "
                        "others (default: a chain as deep as the drafter guesses, lookup: 4 tokens)")
    add_model_arguments(p)
    add_engine_argument(p)
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="a profile from `planner profile`: run every Linear on the matmul paths it chose for this CPU "
                        "('matmul_paths'; a profile without them changes nothing)")
    p.add_argument("--prompt", action="append", default=None, help="a prompt text (repeatable); overrides --prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_arguments(p)
    p.add_argument("--verify", default="auto", choices=["auto", "greedy", "typical", "lossless", "coupled"],
                   help="auto: greedy at temperature 0, above it the rule a sampled plan was raced with, else lossless "
                        "(recursive rejection; the target's own distribution); coupled: position-keyed draws, the "
                        "same text as plain sampling with the same --seed (exact too); typical: Medusa's typical "
                        "acceptance, faster, NOT distribution-exact (the output is marked so)")
    p.add_argument("--eps", type=float, default=0.09, help="typical acceptance: hard threshold")
    p.add_argument("--delta", type=float, default=0.3, help="typical acceptance: entropy-scaled threshold")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1,
                   help="decode the prompts B at a time, each accepting its own tokens per step (default 1)")
    p.add_argument("--layout", default="packed", choices=["packed", "padded"],
                   help="with --batch-size > 1: packed (EMS-SD: no padding of inputs or cache, default) or padded "
                        "(the vanilla baseline: inputs padded to the longest tree, caches advance by the longest path)")
    p.add_argument("--compare-plain", action="store_true", help="also decode plainly (same cache path) and compare")
    add_strategy_arguments(p)
    p.add_argument("--print", dest="print_text", action="store_true", help="print each decoded text")
    p.add_argument("-o", "--output", default=None, help="results JSON (default: print a summary only)")


def check_sampling(args) -> None:
    """The sampling options as the decoder will see them, before any model loads."""
    sampling_from_args(args)


def warn_settings(tree, args) -> None:
    """One line on stderr when the plan was tuned for other sampling settings than this run's."""
    if tree is None:
        return
    line = mismatch(recorded(tree.settings), sampling_from_args(args), f"--plan {args.plan}")
    if line:
        print(f"planner decode: warning: {line}", file=sys.stderr)


def _check(args) -> None:
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens: expected a positive integer")
    if not 1 <= args.batch_size <= 1024:
        raise UserError(f"--batch-size: expected an integer in 1..1024, got {args.batch_size}")
    check_sampling(args)
    if args.verify == "coupled" and args.batch_size != 1:
        raise UserError("--verify coupled: decodes one prompt at a time (its noise is keyed by each sequence's token "
                        "index); drop --batch-size or use --verify lossless")


def _given(args) -> dict[str, bool]:
    """The options set away from their defaults, by the names an engine kind refuses them under."""
    return {"--device": args.device is not None, "--dtype": args.dtype is not None,
            "--profile": args.profile is not None, "--n-ctx": args.n_ctx is not None}


def _refuse_caps(spec, run, args) -> None:
    """What the run asks of the engine that it does not have, in one line, before the model loads (a
    guesser the engine cannot run is refused by the registry: workflows/cli/inputs.py check_guesser)."""
    caps = spec.caps
    for option, asked, have, why in (
            ("--profile", run.matmul_profile is not None, caps.matmul_paths, "it has no CPU matmul paths to install"),
            ("--batch-size", args.batch_size > 1, caps.batches, "it decodes one sequence at a time")):
        if asked and not have:
            raise UserError(f"{option}: not with --engine {spec.name} ({why})")


def run(args) -> int:
    _check(args)
    from planner.jsonio import atomic_write_json, writable_target
    from planner.tree import load_tree
    from workflows.cli.engines import engine_kind, refuse_options
    from workflows.cli.inputs import check_guesser, default_guesser_for
    from workflows.cli.run_config import decode_job, resolve_run, say

    tree = load_tree(args.plan) if args.plan else None  # bad plans fail before the model loads
    spec = engine_kind(args, tree)
    refuse_options(spec, _given(args))
    warn_settings(tree, args)
    run_cfg = resolve_run(args, tree, spec, default_guesser_for(spec.caps))
    tree = tree if run_cfg.plan else None
    _refuse_caps(spec, run_cfg, args)
    check_guesser(spec, run_cfg.guesser)
    if tree is None and guesser_kind(parse_guesser(run_cfg.guesser)[0]).needs_embeddings:
        raise UserError(f"--plan: needed with --guesser {run_cfg.guesser} (prompt tokens: plan one with `planner plan "
                        "ppd` or take trees/autotune-*.json)")
    say(run_cfg, args.no_progress)
    if args.output:
        writable_target(args.output)
    texts = args.prompt or read_prompts(args.prompts or DEFAULT_PROMPTS, args.num_prompts)
    if args.prompt and args.num_prompts:
        texts = texts[: args.num_prompts]
    engine, guesser = _open(args, spec, run_cfg, tree)
    job = decode_job(run_cfg, engine, guesser, tree, args.batch_size > 1)
    prompts = encode(engine, texts)
    engine.reserve(max(int(p.numel()) for p in prompts) + args.max_new_tokens + 64)
    results, interrupted, t_start = _decode_all(args, engine, job, texts, prompts)
    doc = _document(args, run_cfg, engine, job.guesser, tree, results, interrupted, time.time() - t_start)
    print(format_summary(doc["summary"], doc["method"]))
    if not doc["settings"]["distribution_exact"]:
        print(f"{doc['method']}: NOT distribution-exact: the output does not follow the target's sampling distribution")
    if args.output:
        atomic_write_json(args.output, doc)
        print(f"wrote {args.output}")
    if interrupted:
        print("planner decode: interrupted; results so far kept", file=sys.stderr)
        return 130
    return 0


def _open(args, spec, run_cfg, tree):
    """The engine, opened once (its threads and matmul paths as the run says), and the guesser."""
    from workflows.cli.engines import open_from_args
    from workflows.cli.inputs import make_guesser

    engine = open_from_args(args, spec, threads=run_cfg.threads)
    if run_cfg.matmul_profile is not None:
        from planner.matmul_paths import load_matmul_paths

        engine.use_matmul_paths(load_matmul_paths(run_cfg.matmul_profile))
    guesser = make_guesser(args, engine, run_cfg.guesser)
    guesser.check(tree, run_cfg.plan or "plan")
    return engine, guesser


def _decode_all(args, engine, job, texts: list, prompts: list):
    """Every prompt (B at a time with --batch-size), next to plain decoding with --compare-plain;
    Ctrl-C keeps what is done."""
    from tqdm import tqdm

    from decoder.loop import decode

    if args.compare_plain:  # speed is compared: no timed run may pay a first call at a new shape
        from profiler.measure import warm_up_shapes

        warm_up_shapes(engine, prompts, job.lengths)
    results, interrupted, t_start = [], False, time.time()
    try:
        for batch in tqdm(_batches(list(zip(texts, prompts)), args.batch_size), desc="decode", unit="batch",
                          disable=args.no_progress):
            ids_b = [ids for _, ids in batch]
            ids = ids_b if args.batch_size > 1 else ids_b[0]
            outs = _listed(decode(engine, ids, job.plan, job.decoding))
            # plain decoding of the same prompts: one prompt the engine's fastest plain way (coupled: plain
            # sampling with the same noise, whose text the plan must emit), a batch through the same batched path
            plains = _listed(decode(engine, ids, job.plain, job.decoding)) if args.compare_plain else [None] * len(batch)
            for (text, ids), out, plain in zip(batch, outs, plains):
                results.append(_row(args, job.decoding.sampling, engine, text, ids, out, plain, len(batch)))
    except KeyboardInterrupt:
        interrupted = True  # keep what is done; report and write it
    return results, interrupted, t_start


def _document(args, run_cfg, engine, guesser, tree, results: list, interrupted: bool, wall_s: float) -> dict:
    summary = summarize_runs(results, args.compare_plain)
    if tree is not None and tree.dynamic is not None:
        summary.update(dynamic_summary([r["stats"].get("dynamic") for r in results], results))
    method, own_summary, own_fields = strategy_record(args, run_cfg, engine, guesser, results)
    summary.update(own_summary)
    s = run_cfg.decode.sampling
    r = engine.record()
    doc = {
        "engine": run_cfg.engine.name, "model": r["model"], **({"config_hash": r["config_hash"]} if r.get("config_hash") else {}),
        "device": str(engine.device), "plan": run_cfg.plan, "matmul_paths_profile": run_cfg.matmul_profile,
        "method": method or (tree.method if tree is not None else CHAIN),
        "guesser": guesser_record(run_cfg.guesser, guesser),
        "settings": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "verify": s.mode,
                     "max_new_tokens": args.max_new_tokens, "seed": args.seed, "threads": engine.caps.threads,
                     # typical acceptance (and MTAD above temperature 0) does not sample the target's distribution
                     "distribution_exact": not (s.mode == "typical" and s.temperature > 0)},
        "summary": summary, "results": results, "interrupted": interrupted, "wall_s": wall_s,
    }
    if "model_file" in r:
        doc.update(model_file=r["model_file"], llama_cpp=r.get("llama_cpp"))
    lengths = step_lengths(guesser, tree, engine)
    doc.update(real_input_length_by_state=lengths["real"], planned_input_length_by_state=lengths["planned"])
    if guesser_kind(parse_guesser(run_cfg.guesser)[0]).needs_embeddings:
        doc["prompt_tokens"] = doc["guesser"]  # the field earlier tools read
    for key, value in own_fields.items():  # the strategy's own record (and its say on exactness)
        doc[key] = {**doc[key], **value} if isinstance(doc.get(key), dict) else value
    return doc


def _batches(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


def _listed(outs) -> list:
    return outs if isinstance(outs, list) else [outs]


def _row(args, sampling, engine, text: str, ids, out, plain, batch_len: int) -> dict:
    """One prompt's record. wall_share_s: its share of its batch's time (the whole time unbatched),
    so that summed over prompts it is the run's wall time."""
    from profiler.compare import classify

    row = {"prompt": text, "prompt_length": int(ids.numel()), "prompt_ids": ids.tolist(), "tokens": out.tokens.tolist(),
           "steps": out.steps, "stats": out.stats.to_json(), "wall_share_s": out.stats.total_s / batch_len}
    if out.batch is not None:
        row["batch"] = out.batch.summary()
    if engine.tokenizer is not None:
        row["text"] = engine.tokenizer.decode(out.tokens.tolist(), skip_special_tokens=True)
    if plain is not None:
        row["plain"] = {"tokens": plain.tokens.tolist(), "steps": plain.steps, "summary": plain.stats.summary(),
                        "wall_share_s": plain.stats.total_s / batch_len}
        s = sampling
        coupled_run = s.rule == "coupled"
        if s.temperature > 0 and not coupled_run:  # each samples with its own draws
            row["comparison"] = {"status": "not compared",
                                 "reason": "sampled outputs differ from plain sampling's by design (--verify coupled "
                                           "emits plain sampling's text with the same --seed)"}
            row["identical_to_plain"] = None
        else:
            coupled = dict(sampling=s, seed=args.seed) if coupled_run else {}
            row["comparison"] = classify(engine, ids, plain.tokens.tolist(), row["tokens"], **coupled)
            row["identical_to_plain"] = row["comparison"]["status"] == "identical"
    if args.print_text:
        print(f"--- {text[:60]!r}\n{row.get('text', row['tokens'])}")
    return row
