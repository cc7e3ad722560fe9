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
    add_serving_arguments(p)


def add_serving_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving engines (--engine vllm): the acceptance of vLLM's own proposers, measured in its "
                             "server from its speculative-decoding counters (docs/vllm.md)")
    g.add_argument("--method", default=None, metavar="M[,M...]",
                   help="the proposers measured, one server each: ngram, suffix, draft_model (default all three); one "
                        "method writes its entry, several a collection (`planner plan --accept FILE:METHOD`)")
    g.add_argument("--max-depth", type=int, default=None, metavar="K",
                   help="the draft length every method drafts with (suffix: at most K; default 8)")
    g.add_argument("--concurrency", type=int, default=None, metavar="N", help="requests in flight (default 4)")
    g.add_argument("--passes", type=int, default=None, metavar="N",
                   help="sampled: send the requests N times, each pass with its own seeds, all counted (default 1; "
                        "one draw of a few short answers is noisy; suffix forgets the passes before only with the "
                        "project's vLLM plugin, so without it it runs one)")
    g.add_argument("--workload", default=None, metavar="FILE",
                   help="the user's requests (OpenAI chat-completions JSON lines or ShareGPT; each keeps its own "
                        "max_tokens, sampling set by this command) instead of the held-out acceptance prompts of "
                        "--prompts (the MT-bench questions' acceptance split, with their follow-ups)")
    g.add_argument("--draft-model", default=None, metavar="DIR",
                   help="draft_model's drafter: the project's draft LM (converted once into a Hugging Face folder) or "
                        "a Hugging Face model folder (default: the draft LM shipped for --model)")


SERVING_OPTIONS = ("--method", "--max-depth", "--concurrency", "--passes", "--workload", "--draft-model")


def _serving_given(args) -> dict[str, bool]:
    return {f: getattr(args, f[2:].replace("-", "_")) is not None for f in SERVING_OPTIONS}


def _served(args, s, spec) -> int:
    """Serving engines: vLLM's own proposers in its server (profiler/vllm_accept.py), one entry per method."""
    from planner.accept import from_entry
    from planner.jsonio import atomic_write_json, writable_target
    from planner.sampling import describe, record
    from decoder.guessers.heads import serving_method
    from profiler import vllm_accept as va
    from workflows.cli.engines import open_from_args, refuse_options

    refuse_options(spec, {"--device": args.device is not None, "--dtype": args.dtype is not None,
                          "--n-ctx": args.n_ctx is not None})
    head = serving_method(args.drafter) if args.drafter is not None else None  # its layout's method: eagle, eagle3, medusa
    for flag, on in {"--plan": args.plan is not None, "--calibrate": args.calibrate, "--guesser": args.guesser is not None,
                     "--prompt-tokens": args.prompt_tokens is not None,
                     "--random-prompt-tokens": args.random_prompt_tokens is not None}.items():
        if on:
            raise UserError(f"{flag}: not with --engine {spec.name}, which measures its own proposers (--method)")
    if args.max_new_tokens < 2:
        raise UserError("--max-new-tokens: expected an integer >= 2")
    # ngram, suffix and draft_model where a draft LM is given or ships; a head's method with --drafter only
    defaults = [m for m in va.default_methods(args.model or "smollm2-135m", args.draft_model) if m in va.DEFAULT_METHODS]
    methods = [m.strip() for m in (args.method or head or ",".join(defaults)).split(",") if m.strip()]
    k = va.DEFAULT_DRAFT_LENGTH if args.max_depth is None else args.max_depth
    if not methods or len(set(methods)) != len(methods):
        raise UserError(f"--method {args.method}: expected distinct names among {', '.join(va.METHODS)}")
    for m in methods:
        # names, K and a head's folder checked before anything starts (the draft LM's is found once the engine opens)
        va.speculative_config(m, k, args.drafter if m == head else "" if m == "draft_model" else None)
    concurrency = 4 if args.concurrency is None else args.concurrency
    if not 1 <= concurrency <= 1024:
        raise UserError(f"--concurrency: expected an integer in 1..1024, got {concurrency}")
    writable_target(args.output)
    requests, where = _served_requests(args)
    engine = open_from_args(args, spec, server_ok=True)
    va.check_methods(methods, engine.python)
    draft = {"draft_model": _served_draft(args, engine)} if "draft_model" in methods else {}
    if head is not None:
        draft[head] = args.drafter
    from workflows.mainjob.serving_plan import plugin_on

    say = None if args.no_progress else va.progress_line
    plugin = plugin_on(engine, None, lambda line: None)  # where installed: on CPU it makes sampled verification right
    t0 = time.time()
    records = va.measure_methods(engine, methods, requests, s, seed=args.seed, draft_length=k,
                                 concurrency=concurrency, draft_model=draft, say=say, plugin=plugin,
                                 passes=1 if args.passes is None else args.passes)
    for m, rec in records.items():
        rec["source"] = (f"planner accept --engine {spec.name}: {engine.model_name}, {rec['prompts']} requests from "
                         f"{where}" + (f" ({rec['vllm']['passes']} passes)" if rec['vllm']['passes'] > 1 else "")
                         + f", vLLM {m} drafting {k} at concurrency {rec['vllm']['concurrency']}, "
                         f"{describe(record(s))}")
        from_entry({"accuracy": rec["accuracy"]}, label=f"{args.output}:{m}")  # what we write, the planner can read
    doc = records[methods[0]] if len(methods) == 1 else dict(records)
    atomic_write_json(args.output, doc)
    for m, rec in records.items():
        top = ", ".join(f"d{d + 1}: {row[0]:.3f}" for d, row in enumerate(rec["accuracy"]))
        print(f"{m}: rank-0 accuracy {top}; {rec['vllm']['tokens_per_step']:.2f} tokens/step over {rec['positions']} "
              f"steps ({rec['wall_s']:.0f} s)")
    print(f"wrote {args.output}" + ("" if len(methods) == 1 else f" (entries {', '.join(methods)}: FILE:METHOD)")
          + f" in {time.time() - t0:.0f} s")
    return 0


def _served_requests(args) -> tuple[list, str]:
    """The requests: --workload's, else the held-out acceptance prompts (training.splits: disjoint from the
    race and the benchmarks), first turns and, where the answers file is there, their follow-ups."""
    from pathlib import Path

    from profiler.workload import Request, read_workload
    from training.data import ANSWERS_FILE
    from training.splits import accept_and_race, tuning_questions
    from workflows.cli.inputs import DEFAULT_QUESTIONS

    if args.num_prompts is not None and args.num_prompts < 1:
        raise UserError("--num-prompts: expected a positive integer")
    if args.workload:
        if args.prompts:
            raise UserError("--workload and --prompts: give one (the workload's requests, or prompts)")
        return read_workload(args.workload, default_max_tokens=args.max_new_tokens, limit=args.num_prompts), args.workload
    questions = args.prompts or DEFAULT_QUESTIONS
    turns = 2 if (Path(questions).parent / ANSWERS_FILE).is_file() else 1
    available = (len(tuning_questions(questions)) + 1) // 2 * turns  # the even places of the held-out questions
    if not available:
        raise UserError(f"--prompts {questions}: no held-out question (question_id % 5 == 0) to measure on")
    accept, _ = accept_and_race(questions, min(args.num_prompts or available, available), 0, turns)
    requests = [Request(messages=p.messages() if hasattr(p, "messages") else [{"role": "user", "content": p}],
                        max_tokens=args.max_new_tokens) for p in accept]
    return requests, f"the held-out acceptance split of {questions}"


def _served_draft(args, engine):
    """The folder vLLM's draft_model loads: --draft-model, else the draft LM shipped for the model."""
    from decoder.engines.vllm.draft_folder import draft_for

    folder = draft_for(engine.model_name, engine.model_dir, args.draft_model)
    if folder is None:
        raise UserError(f"--method draft_model: no draft LM ships for {engine.model_name}; give --draft-model DIR")
    return folder


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
    from planner.engines import SERVING, STEP
    from workflows.cli.engines import engine_kind

    s = sampling_from_args(args)
    spec = engine_kind(args)
    return {STEP: _stepped, SERVING: _served}[spec.protocol](args, s, spec)


def _stepped(args, s, spec) -> int:
    """A step engine: a guesser's acceptance along the target's own decoding, in this process."""
    from planner.engines import SERVING, kinds
    from planner.jsonio import writable_target
    from planner.tree import load_tree
    from workflows.cli.engines import refuse_options

    _check(args, s)
    given = [f for f, on in _serving_given(args).items() if on]
    if given:
        raise UserError(f"{given[0]}: only with a serving engine (--engine "
                        f"{', '.join(k.name for k in kinds() if k.protocol == SERVING)})")
    tree = load_tree(args.plan) if args.plan else None
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
