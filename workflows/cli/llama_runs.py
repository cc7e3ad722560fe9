"""`planner decode` and `planner accept` on the llama.cpp engine (--engine llama.cpp, or a plan that names it).

Same loop (decoder.loop.generate), same guessers (the registry's, those the engine can run: prompt
lookup, and per-step plans of it), same result files as the hf engine: decode writes
summary.tokens_per_s, summary.tokens and per prompt prompt_ids (exactly what llama.cpp is fed: the
model's chat template) and tokens; accept writes the acceptance JSON `planner plan` reads.
"""
from __future__ import annotations

import sys
import time

from planner.errors import UserError
from planner.guessers import LOOKUP


def engine_of(args, tree) -> str:
    """The engine to decode in: the plan's, else --engine, else hf; a contradiction is an error."""
    asked = getattr(args, "engine", None)
    planned = getattr(tree, "engine", None) if tree is not None else None
    if asked and planned and asked != planned:
        raise UserError(f"--engine {asked}: the plan {args.plan} was made for the {planned} engine (its profile); "
                        f"decode it there, or plan again from a {asked} profile")
    return asked or planned or "hf"


def _refuse_hf_options(args) -> None:
    from workflows.cli.llama_target import refuse_hf_only

    refuse_hf_only(args, {"--profile": getattr(args, "profile", None), "--pearl": getattr(args, "pearl", False),
                          "--mtad": getattr(args, "mtad", None), "--batch-size": getattr(args, "batch_size", 1) != 1,
                          "--device": args.device, "--dtype": args.dtype, "--prompt-tokens": args.prompt_tokens,
                          "--random-prompt-tokens": args.random_prompt_tokens})


def _open(args, default_guesser: str):
    """(target, tokenizer, guesser) on the llama.cpp engine; the guesser through the registry, which
    refuses in one line what the engine cannot run (hidden states, input embeddings, torch modules),
    here before the model loads."""
    from decoder.engine import EngineCaps, refuse
    from decoder.guessers.registry import LoadRequest, load_guesser, needs
    from planner.guessers import kind as guesser_kind
    from workflows.cli.inputs import parse_guesser
    from workflows.cli.llama_target import open_llama

    kind, path = parse_guesser(args.guesser or default_guesser)
    refuse(EngineCaps("llama.cpp", hidden_states=False, input_embeddings=False, trees=False, batches=False), kind,
           needs(guesser_kind(kind)))
    target = open_llama(args.model, args.threads, args.n_ctx, progress=not args.no_progress)
    guesser = load_guesser(kind, LoadRequest(target.engine, path, top_k=args.top_k_guesses, label=str(path or kind)))
    return target, target.tokenizer(), guesser


def compare(reference: list[int], other: list[int]) -> dict:
    """Greedy output against llama.cpp plain decoding from the same build: identical or a mismatch (chains are
    bit-identical by construction, so any difference is one)."""
    from profiler.compare import first_difference

    i = first_difference(reference, other)
    if i is None:
        return {"status": "identical"}
    return {"status": "mismatch", "position": i, "reference_token": reference[i] if i < len(reference) else None,
            "other_token": other[i] if i < len(other) else None}


def decode_llama(args, tree) -> int:
    from tqdm import tqdm

    from decoder.guesser import PlainGuesser
    from decoder.loop import generate
    from planner.jsonio import atomic_write_json, writable_target
    from workflows.cli.inputs import DEFAULT_PROMPTS, encode_prompts, read_prompts
    from workflows.cli.run_records import dynamic_summary, format_summary, guesser_record, summarize_runs

    _refuse_hf_options(args)
    if args.output:
        writable_target(args.output)
    texts = args.prompt or read_prompts(args.prompts or DEFAULT_PROMPTS, args.num_prompts)
    if args.prompt and args.num_prompts:
        texts = texts[: args.num_prompts]
    target, tokenizer, guesser = _open(args, LOOKUP)
    guesser.check(tree, args.plan or "plan")
    prompts = encode_prompts(tokenizer, texts)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              seed=args.seed)
    if args.compare_plain and prompts:  # speed is compared: warm llama.cpp's first calls at each length first
        generate(target.engine, prompts[0], plan=tree, guesser=guesser, **dict(kw, max_new_tokens=8))
    results, interrupted, t_start = [], False, time.time()
    try:
        for text, ids in tqdm(list(zip(texts, prompts)), desc="decode", unit="prompt", disable=args.no_progress):
            out = generate(target.engine, ids, plan=tree, guesser=guesser, verify_rule=args.verify, eps=args.eps,
                           delta=args.delta, **kw)
            row = {"prompt": text, "prompt_length": int(ids.numel()), "prompt_ids": ids.tolist(),
                   "tokens": out.tokens.tolist(), "steps": out.steps, "stats": out.stats.to_json(),
                   "wall_share_s": out.stats.total_s,
                   "text": tokenizer.decode(out.tokens.tolist(), skip_special_tokens=True)}
            if args.compare_plain:
                plain = generate(target.engine, ids, plan=None, guesser=PlainGuesser(), **kw)
                row["plain"] = {"tokens": plain.tokens.tolist(), "steps": plain.steps, "summary": plain.stats.summary(),
                                "wall_share_s": plain.stats.total_s}
                row["comparison"] = compare(row["plain"]["tokens"], row["tokens"])
                row["identical_to_plain"] = row["comparison"]["status"] == "identical"
            if args.print_text:
                print(f"--- {text[:60]!r}\n{row['text']}")
            results.append(row)
    except KeyboardInterrupt:
        interrupted = True
    summary = summarize_runs(results, args.compare_plain)
    if tree is not None and tree.dynamic is not None:
        summary.update(dynamic_summary([r["stats"].get("dynamic") for r in results], results))
    doc = {"engine": "llama.cpp", "model": target.name, "model_file": str(target.gguf), "device": "cpu",
           "llama_cpp": target.engine.describe(), "plan": args.plan,
           "method": tree.method if tree is not None else "chain", "guesser": guesser_record(args.guesser or LOOKUP, guesser),
           "settings": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "verify": args.verify,
                        "max_new_tokens": args.max_new_tokens, "seed": args.seed, "threads": target.engine.threads},
           "summary": summary, "results": results, "interrupted": interrupted, "wall_s": time.time() - t_start}
    print(format_summary(summary, f"llama.cpp {doc['method']}"))
    if args.output:
        atomic_write_json(args.output, doc)
        print(f"wrote {args.output}")
    if interrupted:
        print("planner decode: interrupted; results so far kept", file=sys.stderr)
        return 130
    return 0


def accept_llama(args) -> int:
    """Acceptance (and with --calibrate the live-signal map) of a guesser the engine runs, decoding in
    llama.cpp: greedily, or under --temperature / --top-k / --top-p as the hf engine measures it (one
    sampled continuation per prompt, each guess scored with the target's warped p; the record says
    "sampling"). The statistics plans for llama.cpp are made from."""
    import numpy as np
    from tqdm import tqdm

    from planner.accept import from_entry
    from planner.jsonio import atomic_write_json, writable_target
    from profiler.acceptance import measure_accuracy
    from workflows.cli.inputs import encode_prompts
    from workflows.cli.run_records import check_sampled_accept, merge_accuracy, prompt_texts
    from workflows.cli.sampling import sampling_from_args

    s = sampling_from_args(args)
    if s.temperature > 0:
        check_sampled_accept(args)
    elif args.plan:
        raise UserError("--plan: not with --engine llama.cpp (state transitions are measured on the hf engine)")
    if args.max_new_tokens < 2:
        raise UserError("--max-new-tokens: expected an integer >= 2")
    _refuse_hf_options(args)
    writable_target(args.output)
    texts = prompt_texts(args)
    target, tokenizer, guesser = _open(args, LOOKUP)
    prompts = encode_prompts(tokenizer, texts)
    if s.temperature > 0:
        return _accept_sampled(args, s, target, guesser, prompts)
    t0, parts, done = time.time(), [], 0
    try:
        for ids in tqdm(prompts, desc="accept", unit="prompt", disable=args.no_progress):
            parts.append(measure_accuracy(target.engine, guesser, [ids], max_new_tokens=args.max_new_tokens,
                                          allow_empty=True))
            done += 1
    except KeyboardInterrupt:
        print(f"planner accept: interrupted after {done} prompts; writing what is measured", file=sys.stderr)
    if not done:
        raise UserError("no prompt finished; nothing written")
    acc = merge_accuracy(parts)
    acc.update({"prompts": done, "model": target.name, "engine": "llama.cpp",
                "source": f"planner accept --engine llama.cpp: {target.name}, {done} prompts, {args.max_new_tokens} greedy "
                          "tokens each", "wall_s": time.time() - t0})
    acc["guesser"]["dir"] = guesser.source_dir
    acc["guesser"]["kind"] = guesser.kind
    if args.calibrate and done == len(prompts):
        from profiler.calibration import measure_calibration

        acc["calibration"] = measure_calibration(target.engine, guesser, prompts, np.array(acc["accuracy"]),
                                                 max_new_tokens=args.max_new_tokens, progress=not args.no_progress)
    from_entry({"accuracy": acc["accuracy"]}, label=args.output)
    atomic_write_json(args.output, acc)
    top = ", ".join(f"d{d + 1}: {row[0]:.3f}" for d, row in enumerate(acc["accuracy"]))
    print(f"rank-0 accuracy {top} over {acc['positions']} positions (llama.cpp); wrote {args.output}")
    return 0 if done == len(prompts) else 130


def _accept_sampled(args, s, target, guesser, prompts: list) -> int:
    from workflows.cli.run_records import sampled_acceptance, write_sampled_acceptance

    t0 = time.time()
    acc = sampled_acceptance(target.engine, guesser, prompts, args, s)
    acc.update({"prompts": len(prompts), "model": target.name, "engine": "llama.cpp", "wall_s": time.time() - t0,
                "source": f"planner accept --engine llama.cpp: {target.name}, {len(prompts)} prompts, "
                          f"{args.max_new_tokens} sampled tokens each ({acc['source']})"})
    write_sampled_acceptance(args, acc, s, " (llama.cpp)")
    return 0
