"""`planner decode`: decode prompts with a planned tree, optionally next to plain decoding.

Light imports only at top level: torch, transformers and the decoder load inside run().
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
    parse_guesser,
    read_prompts,
)

# ------------------------------------------------------------------ planner decode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", default=None, metavar="TREE",
                   help="tree file from `planner plan` (or autotune); needed by --guesser ppd, optional for the "
                        "others (default: a chain as deep as the drafter guesses, lookup: 4 tokens)")
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", default=None, help="a prompt text (repeatable); overrides --prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: off)")
    p.add_argument("--verify", default="auto", choices=["auto", "greedy", "typical", "lossless"],
                   help="auto: greedy at temperature 0, lossless sampling above")
    p.add_argument("--eps", type=float, default=0.09, help="typical acceptance: hard threshold")
    p.add_argument("--delta", type=float, default=0.3, help="typical acceptance: entropy-scaled threshold")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1,
                   help="decode the prompts B at a time, each accepting its own tokens per step (default 1)")
    p.add_argument("--layout", default="packed", choices=["packed", "padded"],
                   help="with --batch-size > 1: packed (EMS-SD: no padding of inputs or cache, default) or padded "
                        "(the vanilla baseline: inputs padded to the longest tree, caches advance by the longest path)")
    p.add_argument("--compare-plain", action="store_true", help="also decode plainly (same cache path) and compare")
    p.add_argument("--print", dest="print_text", action="store_true", help="print each decoded text")
    p.add_argument("-o", "--output", default=None, help="results JSON (default: print a summary only)")


FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "eps": "--eps", "delta": "--delta",
         "verify rule": "--verify"}


def check_sampling(args) -> None:
    """The sampling options as the decoder will see them, before any model loads."""
    from decoder.verify import Sampling

    try:
        Sampling(args.temperature, args.top_k, args.top_p, getattr(args, "verify", "auto"), getattr(args, "eps", 0.09),
                 getattr(args, "delta", 0.3))
    except UserError as e:
        field, _, rest = str(e).partition(": ")
        raise UserError(f"{FLAGS.get(field, field)}: {rest}") from None


def _check(args) -> None:
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens: expected a positive integer")
    if not 1 <= args.batch_size <= 1024:
        raise UserError(f"--batch-size: expected an integer in 1..1024, got {args.batch_size}")
    check_sampling(args)


def run(args) -> int:
    _check(args)
    from planner.jsonio import atomic_write_json, writable_target
    from planner.tree import load_tree

    tree = load_tree(args.plan) if args.plan else None  # bad plans fail before the model loads
    args.guesser = args.guesser or _recorded_guesser(tree) or "ppd"
    if tree is None and parse_guesser(args.guesser)[0] == "ppd":
        raise UserError("--plan: needed with --guesser ppd (plan one with `planner plan ppd` or take trees/autotune-*.json)")
    if args.output:
        writable_target(args.output)
    texts = args.prompt or read_prompts(args.prompts or DEFAULT_PROMPTS, args.num_prompts)
    if args.prompt and args.num_prompts:
        texts = texts[: args.num_prompts]

    from tqdm import tqdm

    from decoder.loop import generate

    loaded, tokenizer, guesser = load_everything(args)
    model = loaded.model
    w = model.get_input_embeddings().weight
    guesser.check(tree, args.plan or "plan")
    lengths = step_lengths(guesser, tree, w)
    prompts = encode(tokenizer, texts, w.shape[0])
    if args.compare_plain:  # speed is compared: no timed run may pay a first call at a new shape
        from profiler.measure import warm_up_shapes

        warm_up_shapes(model, prompts, set(lengths["real"].values()) | {1})
    gen_kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed)
    results = []
    interrupted = False
    t_start = time.time()
    try:
        for batch in tqdm(_batches(list(zip(texts, prompts)), args.batch_size), desc="decode", unit="batch",
                          disable=args.no_progress):
            ids_b = [ids for _, ids in batch]
            outs = generate(model, ids_b if args.batch_size > 1 else ids_b[0], plan=tree, guesser=guesser,
                            verify_rule=args.verify, eps=args.eps, delta=args.delta, layout=args.layout, **gen_kw)
            outs = outs if isinstance(outs, list) else [outs]
            plains = _plain(model, ids_b, args, gen_kw) if args.compare_plain else [None] * len(batch)
            for (text, ids), out, plain in zip(batch, outs, plains):
                results.append(_row(args, model, tokenizer, text, ids, out, plain, len(batch)))
    except KeyboardInterrupt:
        interrupted = True  # keep what is done; report and write it
    summary = _summary(results, args.compare_plain)
    doc = {
        "model": loaded.name, "config_hash": loaded.config_hash, "device": str(w.device),
        "plan": args.plan, "method": tree.method if tree is not None else "chain",
        "guesser": guesser_record(args.guesser, guesser),
        "settings": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "verify": args.verify,
                     "max_new_tokens": args.max_new_tokens, "seed": args.seed},
        "real_input_length_by_state": lengths["real"],
        "planned_input_length_by_state": lengths["planned"],
        "summary": summary, "results": results, "interrupted": interrupted, "wall_s": time.time() - t_start,
    }
    if parse_guesser(args.guesser)[0] == "ppd":
        doc["prompt_tokens"] = doc["guesser"]  # the field earlier tools read
    print(_format(summary, doc["method"]))
    if args.output:
        atomic_write_json(args.output, doc)
        print(f"wrote {args.output}")
    if interrupted:
        print("planner decode: interrupted; results so far kept", file=sys.stderr)
        return 130
    return 0


def _recorded_guesser(tree) -> str | None:
    """The guesser a plan was made for (autotune writes it into the tree file), as KIND[:DIR]."""
    if tree is None or not isinstance(tree.settings.get("guesser"), str):
        return None
    kind, where = tree.settings["guesser"], tree.provenance.get("guesser_dir")
    return f"{kind}:{where}" if isinstance(where, str) and kind != "lookup" else kind


def _batches(items: list, size: int) -> list[list]:
    return [items[i: i + size] for i in range(0, len(items), size)]


def _plain(model, ids_b: list, args, gen_kw) -> list:
    """Plain decoding of the same prompts through the same path (batched the same way)."""
    from decoder.guesser import PlainGuesser
    from decoder.loop import generate, generate_plain

    if len(ids_b) == 1:
        return [generate_plain(model, ids_b[0], **gen_kw)]
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
        row["comparison"] = classify(model, ids, plain.tokens.tolist(), row["tokens"])
        row["identical_to_plain"] = row["comparison"]["status"] == "identical"
    if args.print_text:
        print(f"--- {text[:60]!r}\n{row.get('text', row['tokens'])}")
    return row


def step_lengths(guesser, tree, w) -> dict:
    """Forward lengths per state: the decoder's real ones and the plan's count."""
    if hasattr(guesser, "layouts") and getattr(guesser, "input_embeddings", lambda: None)() is not None:
        layouts = guesser.layouts(tree, w.dtype, w.device)
        return {"real": {str(s): b.input_length for s, b in layouts.states.items()},
                "planned": {str(s): b.planned_input_length for s, b in layouts.states.items()}}
    n = 1 + (len(tree.states[0].nodes) if tree is not None else getattr(guesser, "num_distances", 4))
    return {"real": {"0": n}, "planned": {"0": n}}


def guesser_record(spec: str, guesser) -> dict:
    kind, _ = parse_guesser(spec)
    rec = {"kind": kind, "dir": getattr(guesser, "source_dir", None), "top_k": getattr(guesser, "top_k", None)}
    if kind == "ppd":
        rec.update(P=guesser.num_prompt_tokens, E=guesser.ensemble, random=guesser.source_dir is None)
    if kind in ("parallelspec", "chain"):
        rec.update(num_masks=guesser.num_masks, mode=guesser.mode)
    return rec


def _summary(results: list[dict], plain: bool) -> dict:
    tokens = sum(len(r["tokens"]) for r in results)
    steps = sum(r["steps"] for r in results)
    seconds = sum(r["wall_share_s"] for r in results)
    s = {"prompts": len(results), "tokens": tokens, "steps": steps,
         "tokens_per_step": tokens / steps if steps else 0.0,
         "tokens_per_s": tokens / seconds if seconds > 0 else None}
    if plain and results:
        p_tokens = sum(len(r["plain"]["tokens"]) for r in results)
        p_seconds = sum(r["plain"]["wall_share_s"] for r in results)
        s["plain_tokens_per_s"] = p_tokens / p_seconds if p_seconds > 0 else None
        s["speedup"] = (s["tokens_per_s"] / s["plain_tokens_per_s"]) if s["tokens_per_s"] and s["plain_tokens_per_s"] else None
        s["identical_to_plain"] = all(r["identical_to_plain"] for r in results)
        from profiler.compare import summarize

        s.update(summarize([r["comparison"]["status"] for r in results]))  # near ties (bf16 rounding) apart from mismatches
    return s


def _format(s: dict, method: str) -> str:
    line = (f"{method}: {s['prompts']} prompts, {s['tokens']} tokens in {s['steps']} steps "
            f"({s['tokens_per_step']:.2f} tokens/step")
    if s.get("tokens_per_s"):
        line += f", {s['tokens_per_s']:.1f} tokens/s"
    if "speedup" in s and s["speedup"]:
        line += f"; plain {s['plain_tokens_per_s']:.1f} tokens/s, speedup {s['speedup']:.2f}x, identical: {s['identical_to_plain']}"
    return line + ")"
