"""`planner decode`: decode prompts with a planned tree, optionally next to plain decoding.

Light imports only at top level: torch, transformers and the decoder load inside run().
"""
from __future__ import annotations

import argparse
import sys
import time

from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from planner.tree import CHAIN
from workflows.cli.inputs import (
    DEFAULT_GUESSER,
    DEFAULT_PROMPTS,
    add_model_arguments,
    encode,
    load_everything,
    parse_guesser,
    read_prompts,
)
from workflows.cli.llama_target import add_engine_argument
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
    _check_mtad(args)
    _check_pearl(args)


def _draft_lm(args) -> bool:
    """--pearl and --mtad draft with a draft LM: a guesser kind whose files are the draft LM's."""
    k = guesser_kind(parse_guesser(args.guesser or DEFAULT_GUESSER)[0])
    return k.files == "draft_lm" and not k.hybrid  # the draft LM's directory (decoder/guessers/draft.py)


def _check_pearl(args) -> None:
    """--pearl: a draft model, a chain of --gamma, batch size 1, lossless."""
    if not getattr(args, "pearl", False):
        return
    if not _draft_lm(args) or getattr(args, "mtad", None):
        raise UserError(f"--pearl: needs --guesser draft[:DIR] (a draft model) and no --mtad, "
                        f"got {args.guesser or 'ppd'}")
    if args.plan or args.batch_size != 1 or args.verify in ("typical", "coupled") or args.gamma < 1:
        raise UserError("--pearl: drafts a chain of --gamma >= 1 tokens for one prompt at a time, losslessly (the "
                        "recursive-rejection rule); drop --plan, --batch-size and --verify typical/coupled")


def _check_mtad(args) -> None:
    """--mtad W,GAMMA,TAU: a draft model, no plan, batch size 1, its own verification rule."""
    from planner.mtad import MTADSettings

    args.mtad_settings = MTADSettings.parse(args.mtad) if getattr(args, "mtad", None) else None
    ratio = getattr(args, "max_perplexity_ratio", None)
    if args.mtad_settings is None:
        if ratio is not None:
            raise UserError("--max-perplexity-ratio: needs --mtad")
        return
    if not _draft_lm(args):
        raise UserError(f"--mtad: needs --guesser draft[:DIR] (a draft model), got {args.guesser or 'ppd'}")
    if args.plan:
        raise UserError("--mtad: drafts a chain of GAMMA tokens; drop --plan")
    if args.batch_size != 1 or args.verify != "auto":
        raise UserError("--mtad: decodes at --batch-size 1 with its own joint acceptance rule (no --verify)")
    if ratio is not None and not (ratio > 0 and args.compare_plain):
        raise UserError("--max-perplexity-ratio: expected a number > 0, with --compare-plain (the reference perplexity)")


def run(args) -> int:
    _check(args)
    from planner.jsonio import atomic_write_json, writable_target
    from planner.tree import load_tree

    tree = load_tree(args.plan) if args.plan else None  # bad plans fail before the model loads
    from workflows.cli.llama_runs import decode_llama, engine_of

    warn_settings(tree, args)
    _as_raced(args, tree)
    if engine_of(args, tree) == "llama.cpp":  # the plan's engine, or --engine
        return decode_llama(args, tree)
    paths = _matmul_paths(args.profile)
    tree = _follow_recorded_pearl(args, tree)
    args.guesser = args.guesser or _recorded_guesser(tree, getattr(args, "guesser_files", None)) or DEFAULT_GUESSER
    if tree is None and guesser_kind(parse_guesser(args.guesser)[0]).needs_embeddings:
        raise UserError(f"--plan: needed with --guesser {args.guesser} (prompt tokens: plan one with `planner plan ppd` "
                        "or take trees/autotune-*.json)")
    if args.output:
        writable_target(args.output)
    texts = args.prompt or read_prompts(args.prompts or DEFAULT_PROMPTS, args.num_prompts)
    if args.prompt and args.num_prompts:
        texts = texts[: args.num_prompts]

    from tqdm import tqdm

    from decoder.loop import generate

    loaded, tokenizer, guesser = load_everything(args)
    model = loaded.model
    if paths is not None:
        from decoder.engines.hf.cpu_paths import use_profile_paths

        use_profile_paths(model, paths)
    w = model.get_input_embeddings().weight
    if args.mtad_settings is not None:
        from decoder.guessers.mtad import MTADGuesser, generate_mtad

        guesser = MTADGuesser(guesser.draft_model, args.mtad_settings.width, args.mtad_settings.gamma, guesser.label)
    guesser.check(tree, args.plan or "plan")
    lengths = step_lengths(guesser, tree, w)
    prompts = encode(tokenizer, texts, w.shape[0])
    if args.compare_plain:  # speed is compared: no timed run may pay a first call at a new shape
        from profiler.measure import warm_up_shapes

        warm_up_shapes(model, prompts, {1, args.gamma} if args.pearl else set(lengths["real"].values()) | {1})
    gen_kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed)
    results = []
    interrupted = False
    t_start = time.time()
    try:
        for batch in tqdm(_batches(list(zip(texts, prompts)), args.batch_size), desc="decode", unit="batch",
                          disable=args.no_progress):
            ids_b = [ids for _, ids in batch]
            if args.pearl:
                outs = _pearl(model, guesser, ids_b[0], args, gen_kw)
            elif args.mtad_settings is not None:
                outs = generate_mtad(model, ids_b[0], guesser, tau_acc=args.mtad_settings.tau_acc, **gen_kw)
            else:
                outs = generate(model, ids_b if args.batch_size > 1 else ids_b[0], plan=tree, guesser=guesser,
                                verify_rule=args.verify, eps=args.eps, delta=args.delta, layout=args.layout, **gen_kw)
            outs = outs if isinstance(outs, list) else [outs]
            plains = _plain(model, ids_b, args, gen_kw) if args.compare_plain else [None] * len(batch)
            for (text, ids), out, plain in zip(batch, outs, plains):
                results.append(_row(args, model, tokenizer, text, ids, out, plain, len(batch)))
    except KeyboardInterrupt:
        interrupted = True  # keep what is done; report and write it
    summary = summarize_runs(results, args.compare_plain)
    if tree is not None and tree.dynamic is not None:
        summary.update(dynamic_summary([r["stats"].get("dynamic") for r in results], results))
    if args.pearl:
        summary.update(_pearl_summary(results))
    if args.mtad_settings is not None:
        summary.update(_mtad_quality(args, model, guesser, results))
    doc = {
        "model": loaded.name, "config_hash": loaded.config_hash, "device": str(w.device),
        "plan": args.plan, "matmul_paths_profile": args.profile, "method": tree.method if tree is not None else CHAIN,
        "guesser": guesser_record(args.guesser, guesser),
        "settings": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "verify": args.verify,
                     "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                     # typical acceptance (and MTAD above temperature 0) does not sample the target's distribution
                     "distribution_exact": not (args.verify == "typical" and args.temperature > 0)},
        "real_input_length_by_state": lengths["real"],
        "planned_input_length_by_state": lengths["planned"],
        "summary": summary, "results": results, "interrupted": interrupted, "wall_s": time.time() - t_start,
    }
    if guesser_kind(parse_guesser(args.guesser)[0]).needs_embeddings:
        doc["prompt_tokens"] = doc["guesser"]  # the field earlier tools read
    if args.mtad_settings is not None:
        doc["method"] = "mtad"
        doc["mtad"] = {"width": args.mtad_settings.width, "gamma": args.mtad_settings.gamma,
                       "tau_acc": args.mtad_settings.tau_acc, "beams": "tree",  # all W beams scored as one tree
                       "lossless": args.temperature == 0 and args.mtad_settings.tau_acc > 0}  # greedy there
        doc["settings"]["distribution_exact"] = doc["mtad"]["lossless"]
    if args.pearl:
        doc["method"] = "pearl"
        doc["pearl"] = {"gamma": args.gamma, "concurrent": not args.pearl_serial}
    print(format_summary(summary, doc["method"]))
    if not doc["settings"]["distribution_exact"]:
        print(f"{doc['method']}: NOT distribution-exact: the output does not follow the target's sampling distribution")
    if args.output:
        atomic_write_json(args.output, doc)
        print(f"wrote {args.output}")
    if interrupted:
        print("planner decode: interrupted; results so far kept", file=sys.stderr)
        return 130
    return 0


def _matmul_paths(profile):
    """The profile's matmul paths, read (and checked) before any model loads; None without --profile."""
    if profile is None:
        return None
    from planner.matmul_paths import load_matmul_paths

    return load_matmul_paths(profile)


def _pearl(model, guesser, ids, args, gen_kw):
    """PEARL with the draft model the guesser loaded (CPU threads: --threads split between the sides)."""
    from decoder.guessers.pearl import generate_pearl

    return generate_pearl(model, guesser.draft_model, ids, args.gamma, concurrent=not args.pearl_serial,
                          threads=getattr(args, "pearl_threads", None), **gen_kw)


def _pearl_summary(results: list[dict]) -> dict:
    """Rounds (one target forward each: decode's steps), modes A / B, mean tokens per round."""
    rounds = sum(r["stats"]["summary"]["rounds"] for r in results)
    tokens = sum(len(r["tokens"]) for r in results)
    return {"rounds": rounds, "mode_a": sum(r["stats"]["summary"]["mode_a"] for r in results),
            "mode_b": sum(r["stats"]["summary"]["mode_b"] for r in results),
            "mean_tokens_per_round": tokens / rounds if rounds else 0.0}


def _as_raced(args, tree) -> None:
    """A plan autotune raced carries what it was raced with (planner/plan_settings.py): the profile
    whose matmul paths ran, the threads and the guesser's files, each checked against its recorded
    checksum (a missing or changed file is a one-line error); a flag given overrides each."""
    from pathlib import Path

    from planner.plan_settings import plan_settings

    raced = plan_settings(tree.settings, args.plan).raced_with if tree is not None else None
    if raced is None:
        return
    plan_dir, used = Path(args.plan).parent, []
    if args.profile is None and raced.profile is not None:
        args.profile = str(raced.profile.check(plan_dir, args.plan, "the profile (matmul paths)"))
        used.append(f"matmul paths of {args.profile}")
    if args.threads is None and raced.free_cores:
        import torch

        from profiler.load import free_threads

        args.threads, _ = free_threads(torch.get_num_threads(), 0.3)
        used.append(f"{args.threads} threads (the cores free now; raced on the {raced.threads} a busy machine left)")
    elif args.threads is None and raced.threads is not None:
        args.threads = raced.threads
        used.append(f"{args.threads} threads")
    if args.verify == "auto" and args.temperature > 0 and tree.settings.get("verify") == "coupled" and args.batch_size == 1:
        args.verify = "coupled"
        used.append("coupled sampling (plain sampling's text with the same --seed)")
    if args.guesser is None and raced.guesser is not None and tree.settings.get("guesser"):
        where = raced.guesser.check(plan_dir, args.plan, "the guesser's files")
        args.guesser_files = str(where)
        used.append(f"guesser files {where}")
    if used and not args.no_progress:
        print(f"decoding as raced: {', '.join(used)} (flags override)", file=sys.stderr)


def _follow_recorded_pearl(args, tree):
    """A plan autotune chose for PEARL (its tree is the draft chain): decode it with --pearl and
    its gamma and thread split, the draft LM it was measured with; the chain itself is not a plan
    PEARL takes."""
    from planner.plan_settings import plan_settings

    if tree is None or args.guesser is not None:
        return tree
    run = plan_settings(tree.settings, args.plan)
    if run.pearl is None or guesser_kind(run.guesser).loop is None:
        return tree
    drafter = _drafter_of(run.guesser)
    where = getattr(args, "guesser_files", None) or tree.provenance.get("guesser_dir")
    args.guesser = f"{drafter}:{where}" if isinstance(where, str) else drafter
    args.pearl_threads = run.pearl.threads
    args.pearl, args.gamma, args.plan = True, run.pearl.gamma, None
    _check_pearl(args)
    return None


def _drafter_of(kind: str) -> str:
    """The guesser a kind with its own loop (PEARL) drafts with: the one with its files and the one loop."""
    from planner.guessers import kinds

    own = guesser_kind(kind)
    return next(k.name for k in kinds(hybrids=False) if k.files == own.files and k.loop is None and k.autotune)


def _recorded_guesser(tree, files: str | None = None) -> str | None:
    """The guesser a plan was made for (autotune writes it into the tree file), as KIND[:DIR]: the
    files raced with (checked), else the recorded directory."""
    if tree is None or not isinstance(tree.settings.get("guesser"), str):
        return None
    kind, where = tree.settings["guesser"], files or tree.provenance.get("guesser_dir")
    return f"{kind}:{where}" if isinstance(where, str) and guesser_kind(kind).files is not None else kind


def _mtad_quality(args, model, guesser, results: list[dict]) -> dict:
    """Perplexity (under the target and the drafter, raw distributions) and distinct-n of the MTAD
    texts and, with --compare-plain, of plain sampling's over the same prompts."""
    import torch

    from decoder.guessers.mtad import text_quality

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


def _plain(model, ids_b: list, args, gen_kw) -> list:
    """Plain decoding of the same prompts through the same path (batched the same way)."""
    from decoder.guesser import PlainGuesser
    from decoder.loop import generate, generate_plain

    if len(ids_b) == 1:  # coupled: plain sampling with the same noise, whose text the plan must emit
        return [generate_plain(model, ids_b[0], verify_rule=args.verify, **gen_kw)]
    return generate(model, ids_b, plan=None, guesser=PlainGuesser(), layout=args.layout, **gen_kw)


def _row(args, model, tokenizer, text: str, ids, out, plain, batch_len: int) -> dict:
    """One prompt's record. wall_share_s: its share of its batch's time (the whole time unbatched),
    so that summed over prompts it is the run's wall time."""
    from profiler.compare import classify

    row = {"prompt": text, "prompt_length": int(ids.numel()), "prompt_ids": ids.tolist(), "tokens": out.tokens.tolist(),
           "steps": out.steps, "stats": out.stats.to_json(), "wall_share_s": out.stats.total_s / batch_len}
    if out.batch is not None:
        row["batch"] = out.batch.summary()
    if tokenizer is not None:
        row["text"] = tokenizer.decode(out.tokens.tolist(), skip_special_tokens=True)
    if plain is not None:
        row["plain"] = {"tokens": plain.tokens.tolist(), "steps": plain.steps, "summary": plain.stats.summary(),
                        "wall_share_s": plain.stats.total_s / batch_len}
        if args.temperature > 0 and args.verify != "coupled":  # each samples with its own draws
            row["comparison"] = {"status": "not compared",
                                 "reason": "sampled outputs differ from plain sampling's by design (--verify coupled "
                                           "emits plain sampling's text with the same --seed)"}
            row["identical_to_plain"] = None
        else:
            coupled = dict(sampling=sampling_from_args(args), seed=args.seed) if args.verify == "coupled" else {}
            row["comparison"] = classify(model, ids, plain.tokens.tolist(), row["tokens"], **coupled)
            row["identical_to_plain"] = row["comparison"]["status"] == "identical"
    if args.print_text:
        print(f"--- {text[:60]!r}\n{row.get('text', row['tokens'])}")
    return row


def step_lengths(guesser, tree, w) -> dict:
    """Forward lengths per state: the decoder's real ones and the plan's count."""
    if tree is not None and tree.dynamic is not None:  # chosen every step: the sizes it may choose
        n = min(tree.dynamic.max_size + 1, len(tree.dynamic.step_cost_s))
        return {"real": {"0": n}, "planned": {"0": n}}
    if hasattr(guesser, "layouts") and getattr(guesser, "input_embeddings", lambda: None)() is not None:
        layouts = guesser.layouts(tree, w.dtype, w.device)
        return {"real": {str(s): b.input_length for s, b in layouts.states.items()},
                "planned": {str(s): b.planned_input_length for s, b in layouts.states.items()}}
    n = 1 + (len(tree.states[0].nodes) if tree is not None else getattr(guesser, "num_distances", 4))
    return {"real": {"0": n}, "planned": {"0": n}}
