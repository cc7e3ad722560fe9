"""`planner decode`: decode prompts with a planned tree, optionally next to plain decoding.

One path for every engine: the engine the plan (or --engine) names is opened once, the plan's recorded
settings and the flags resolve into one RunConfig (workflows/cli/run_config.py), and what the engine
cannot do is refused in one line before any model loads. A plain decision runs the engine's fastest
plain decoding (decoder.loop.decode_plain). Light imports only at top level.
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
from workflows.cli.run_records import dynamic_summary, format_summary, guesser_record, summarize_runs
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
    p.add_argument("--mtad", default=None, metavar="W,GAMMA,TAU",
                   help="MTAD (not lossless above temperature 0): the --guesser draft model beam-samples W beams of "
                        "GAMMA tokens, the target accepts the longest prefix whose joint ratio p~/q~ >= TAU in [0, 1]; "
                        "the warp is --temperature/--top-k/--top-p (the paper: --top-k 20 --top-p 0.9); the summary "
                        "adds perplexity and distinct-n")
    p.add_argument("--max-perplexity-ratio", type=float, default=None, metavar="R",
                   help="with --mtad and --compare-plain: flag whether perplexity <= R x plain sampling's")
    p.add_argument("--pearl", action="store_true",
                   help="PEARL (with --guesser draft[:DIR]): the drafter drafts while the target verifies, each in "
                        "its own thread with half of --threads (or its own CUDA stream); lossless")
    p.add_argument("--gamma", type=int, default=4,
                   help="with --pearl: the window, tokens drafted per round (default 4)")
    p.add_argument("--pearl-serial", action="store_true",
                   help="with --pearl: run the two jobs one after the other (same output), booking max(draft, verify)")
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
    """What the run asks of the engine that it does not have, in one line, before the model loads."""
    caps = spec.caps
    for option, asked, have, why in (
            ("--pearl", run.pearl is not None, caps.torch_modules, "PEARL runs the target's torch model beside the drafter's"),
            ("--mtad", run.mtad is not None, caps.torch_modules, "MTAD scores beams with the target's torch model"),
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
    from workflows.cli.run_config import resolve_run, say

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
    prompts = encode(engine, texts)
    engine.reserve(max(int(p.numel()) for p in prompts) + args.max_new_tokens + 64)
    results, interrupted, t_start = _decode_all(args, run_cfg, engine, guesser, tree, texts, prompts)
    doc = _document(args, run_cfg, engine, guesser, tree, results, interrupted, time.time() - t_start)
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
    if run_cfg.mtad is not None:
        from decoder.guessers.mtad import MTADGuesser

        guesser = MTADGuesser(guesser.draft_model, run_cfg.mtad.width, run_cfg.mtad.gamma, guesser.label)
    guesser.check(tree, run_cfg.plan or "plan")
    return engine, guesser


def _decode_all(args, run_cfg, engine, guesser, tree, texts: list, prompts: list):
    """Every prompt (B at a time with --batch-size), next to plain decoding with --compare-plain;
    Ctrl-C keeps what is done."""
    from tqdm import tqdm

    lengths = step_lengths(guesser, tree, engine)
    if args.compare_plain:  # speed is compared: no timed run may pay a first call at a new shape
        from profiler.measure import warm_up_shapes

        warm_up_shapes(engine, prompts, {1, run_cfg.pearl.gamma} if run_cfg.pearl else set(lengths["real"].values()) | {1})
    results, interrupted, t_start = [], False, time.time()
    try:
        for batch in tqdm(_batches(list(zip(texts, prompts)), args.batch_size), desc="decode", unit="batch",
                          disable=args.no_progress):
            ids_b = [ids for _, ids in batch]
            outs = _decode_one(run_cfg, engine, guesser, tree, ids_b, args.batch_size)
            plains = _plain(engine, ids_b, run_cfg) if args.compare_plain else [None] * len(batch)
            for (text, ids), out, plain in zip(batch, outs, plains):
                results.append(_row(args, run_cfg, engine, text, ids, out, plain, len(batch)))
    except KeyboardInterrupt:
        interrupted = True  # keep what is done; report and write it
    return results, interrupted, t_start


def _decode_one(run_cfg, engine, guesser, tree, ids_b: list, batch_size: int) -> list:
    from decoder.loop import decode_plain, generate

    cfg = run_cfg.decode
    if run_cfg.pearl is not None:
        return [_pearl(engine, guesser, ids_b[0], run_cfg)]
    if run_cfg.mtad is not None:
        from decoder.guessers.mtad import generate_mtad

        s = cfg.sampling
        return [generate_mtad(engine.torch_model(), ids_b[0], guesser, tau_acc=run_cfg.mtad.tau_acc,
                              max_new_tokens=cfg.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, seed=cfg.seed)]
    if run_cfg.plain and batch_size == 1:
        return [decode_plain(engine, ids_b[0], config=cfg)]
    outs = generate(engine, ids_b if batch_size > 1 else ids_b[0], plan=tree, guesser=guesser, config=cfg)
    return outs if isinstance(outs, list) else [outs]


def _document(args, run_cfg, engine, guesser, tree, results: list, interrupted: bool, wall_s: float) -> dict:
    summary = summarize_runs(results, args.compare_plain)
    if tree is not None and tree.dynamic is not None:
        summary.update(dynamic_summary([r["stats"].get("dynamic") for r in results], results))
    if run_cfg.pearl:
        summary.update(_pearl_summary(results))
    if run_cfg.mtad is not None:
        summary.update(_mtad_quality(args, engine, guesser, results, run_cfg))
    s = run_cfg.decode.sampling
    r = engine.record()
    doc = {
        "engine": run_cfg.engine.name, "model": r["model"], **({"config_hash": r["config_hash"]} if r.get("config_hash") else {}),
        "device": str(engine.device), "plan": run_cfg.plan, "matmul_paths_profile": run_cfg.matmul_profile,
        "method": tree.method if tree is not None else CHAIN,
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
    if run_cfg.plain:
        doc["method"] = "plain"
    if run_cfg.mtad is not None:
        m = run_cfg.mtad
        doc["method"] = "mtad"
        doc["mtad"] = {"width": m.width, "gamma": m.gamma, "tau_acc": m.tau_acc, "beams": "tree",  # all W beams scored as one tree
                       "lossless": s.temperature == 0 and m.tau_acc > 0}  # greedy there
        doc["settings"]["distribution_exact"] = doc["mtad"]["lossless"]
    if run_cfg.pearl:
        doc["method"] = "pearl"
        doc["pearl"] = {"gamma": run_cfg.pearl.gamma, "concurrent": not run_cfg.pearl.serial}
    return doc


def _pearl(engine, guesser, ids, run_cfg):
    """PEARL with the draft model the guesser loaded (CPU threads: --threads split between the sides)."""
    from decoder.guessers.pearl import generate_pearl

    cfg, s = run_cfg.decode, run_cfg.decode.sampling
    return generate_pearl(engine.torch_model(), guesser.draft_model, ids, run_cfg.pearl.gamma,
                          concurrent=not run_cfg.pearl.serial, threads=run_cfg.pearl.threads,
                          max_new_tokens=cfg.max_new_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          seed=cfg.seed)


def _pearl_summary(results: list[dict]) -> dict:
    """Rounds (one target forward each: decode's steps), modes A / B, mean tokens per round."""
    rounds = sum(r["stats"]["summary"]["rounds"] for r in results)
    tokens = sum(len(r["tokens"]) for r in results)
    return {"rounds": rounds, "mode_a": sum(r["stats"]["summary"]["mode_a"] for r in results),
            "mode_b": sum(r["stats"]["summary"]["mode_b"] for r in results),
            "mean_tokens_per_round": tokens / rounds if rounds else 0.0}


def _mtad_quality(args, engine, guesser, results: list[dict], run_cfg) -> dict:
    """Perplexity (under the target and the drafter, raw distributions) and distinct-n of the MTAD
    texts and, with --compare-plain, of plain sampling's over the same prompts."""
    import torch

    from decoder.guessers.mtad import text_quality

    model = engine.torch_model()
    prompts = [torch.tensor(r["prompt_ids"]) for r in results]
    out = text_quality(model, prompts, [r["tokens"] for r in results], guesser.draft_model).to_json()
    if args.compare_plain and results:
        plain = text_quality(model, prompts, [r["plain"]["tokens"] for r in results], guesser.draft_model).to_json()
        out.update({f"plain_{k}": v for k, v in plain.items() if k != "tokens"})
        if out["perplexity"] and plain["perplexity"]:
            out["perplexity_ratio"] = out["perplexity"] / plain["perplexity"]
            if args.max_perplexity_ratio is not None:
                out["within_perplexity_cap"] = out["perplexity_ratio"] <= args.max_perplexity_ratio
    return out


def _batches(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


def _plain(engine, ids_b: list, run_cfg) -> list:
    """Plain decoding of the same prompts: one prompt the engine's fastest plain way (coupled: plain
    sampling with the same noise, whose text the plan must emit), a batch through the same batched path."""
    from decoder.loop import decode_plain, generate

    cfg = run_cfg.decode
    if len(ids_b) == 1:
        return [decode_plain(engine, ids_b[0], config=cfg)]
    return generate(engine, ids_b, plan=None, config=cfg)


def _row(args, run_cfg, engine, text: str, ids, out, plain, batch_len: int) -> dict:
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
        s = run_cfg.decode.sampling
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


def step_lengths(guesser, tree, engine) -> dict:
    """Forward lengths per state: the decoder's real ones and the plan's count."""
    if tree is not None and tree.dynamic is not None:  # chosen every step: the sizes it may choose
        n = min(tree.dynamic.max_size + 1, len(tree.dynamic.step_cost_s))
        return {"real": {"0": n}, "planned": {"0": n}}
    if hasattr(guesser, "layouts") and getattr(guesser, "input_embeddings", lambda: None)() is not None:
        layouts = guesser.layouts(tree, engine.dtype, engine.device)
        return {"real": {str(s): b.input_length for s, b in layouts.states.items()},
                "planned": {str(s): b.planned_input_length for s, b in layouts.states.items()}}
    n = 1 + (len(tree.states[0].nodes) if tree is not None else getattr(guesser, "num_distances", 4))
    return {"real": {"0": n}, "planned": {"0": n}}
