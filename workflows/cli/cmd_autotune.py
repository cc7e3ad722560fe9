"""`planner autotune`: the main job on SmolLM2-135M-Instruct (or --model DIR with its guessers)."""
from __future__ import annotations

import argparse

from workflows.mainjob.pipeline import GUESSERS, METHODS, AutotuneSettings
from workflows.cli.llama_target import add_engine_argument
from workflows.cli.sampling import add_sampling_arguments, sampling_from_args

MAX_PROMPTS = 40  # held-out MT-bench questions: 16, split between acceptance and decoding
MAX_TOKENS = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = AutotuneSettings()
    p.add_argument("--model", default=d.model,
                   help="smollm2-135m (default), builtin (the 2.4 M toy), a preset name or a local model directory")
    p.add_argument("--guessers", default="auto",
                   help=f"comma-separated subset of {','.join(GUESSERS)}, or auto (default): every guesser shipped "
                        "for the model, and prompt lookup")
    p.add_argument("--prompt-tokens", default=None, metavar="DIR", help="PPD prompt tokens (default: shipped for the model)")
    p.add_argument("--draft", default=None, metavar="DIR", help="a draft LM (default: models/<model>/draft_lm)")
    p.add_argument("--parallelspec", default=None, metavar="DIR",
                   help="a ParallelSpec drafter, also run as a chain (default: models/<model>/parallelspec)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"])
    p.add_argument("--out", default=None, metavar="DIR", help="run folder (default runs/<date>-<device>-<model>)")
    p.add_argument("--questions", default=d.questions, help="MT-bench style questions JSONL (held-out ones are used)")
    p.add_argument("--accept-prompts", type=int, default=d.accept_prompts)
    p.add_argument("--decode-prompts", type=int, default=None,
                   help=f"held-out prompts the plans race on (default {d.decode_prompts}; 8 with --engine llama.cpp)")
    p.add_argument("--turns", type=int, default=None, choices=[1, 2],
                   help=f"prompts per held-out question: 1 its first turn, 2 also its follow-up asked after an answer "
                        f"(the answers file beside --questions) (default {d.turns}; 1 with --engine llama.cpp)")
    p.add_argument("--accept-tokens", type=int, default=d.accept_tokens,
                   help="tokens per prompt decoded for acceptance (greedily, or sampled with --temperature)")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help=f"new tokens per prompt when decoding (default {d.decode_tokens}; 96 with --engine llama.cpp)")
    p.add_argument("--max-input-length", type=int, default=d.max_input_length,
                   help="largest forward pass planned (and profiled)")
    p.add_argument("--context-length", type=int, default=d.context_length, help="KV-cache length for the profile")
    p.add_argument("--methods", default=",".join(METHODS), help="PPD's tree families: a subset of ppd,medusa,sequoia")
    p.add_argument("--budget", type=float, default=None, metavar="MINUTES",
                   help=f"bounds the whole run, loading to report (default {d.budget_minutes:g}; 10 with --engine "
                        "llama.cpp); the race of the plans gets what the other phases leave")
    p.add_argument("--finalists", type=int, default=d.finalists,
                   help="(guesser, method) families whose best predicted plan races against plain decoding")
    p.add_argument("--neighbours", type=int, default=d.neighbours,
                   help="sizes either side of the best predicted plan that also race")
    p.add_argument("--sweep", type=int, default=d.sweep, help="sizes of the best predicted method spread over its range "
                                                               "that also race (0: none)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"runs of each (plan, prompt) in the race, the median counts (default {d.rounds}; 3 with "
                        "--engine llama.cpp, whose runs take a second)")
    add_engine_argument(p)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--profile", default=None, help="reuse this profile instead of measuring")
    p.add_argument("--accept", default=None, help="reuse this PPD acceptance file instead of measuring")
    p.add_argument("--profile-budget", type=float, default=d.profile_budget_s, help="seconds of profiling")
    add_sampling_arguments(p, "tune for (and race) decoding")
    p.add_argument("--verify", default=None, choices=["coupled", "lossless", "typical"],
                   help="with --temperature, the rule raced and written into chosen.json: coupled (the default; "
                        "position-keyed draws, every plan emits plain sampling's text with the same seed, so the "
                        "race compares them on one text and checks they match), lossless (recursive rejection; the "
                        "default with --engine llama.cpp, whose race compares speeds only), or typical (Medusa's "
                        "typical acceptance: faster, NOT distribution-exact; chosen.json says so)")
    p.add_argument("--no-report", action="store_true", help="skip the plots")
    p.add_argument("--quiet", action="store_true")


def _check(args) -> tuple[tuple[str, ...], tuple[str, ...]]:
    import math

    from planner.errors import UserError
    from planner.tree import MAX_INPUT_LENGTH

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if not methods or any(m not in METHODS for m in methods):
        raise UserError(f"--methods: expected a comma-separated subset of {','.join(METHODS)}, got {args.methods!r}")
    guessers = tuple(g.strip() for g in args.guessers.split(",") if g.strip())
    if not guessers or any(g not in GUESSERS + ("auto",) for g in guessers):
        raise UserError(f"--guessers: expected auto or a comma-separated subset of {','.join(GUESSERS)}, got {args.guessers!r}")
    for name, top in (("accept_prompts", MAX_PROMPTS), ("decode_prompts", MAX_PROMPTS), ("accept_tokens", MAX_TOKENS),
                      ("decode_tokens", MAX_TOKENS), ("max_input_length", MAX_INPUT_LENGTH),
                      ("context_length", 32768), ("rounds", 100)):
        if not 1 <= getattr(args, name) <= top:
            raise UserError(f"--{name.replace('_', '-')}: must be an integer in 1..{top}, got {getattr(args, name)}")
    if args.neighbours < 0 or args.sweep < 0:
        raise UserError("--neighbours and --sweep: must be >= 0")
    if not 1 <= args.finalists <= 100:
        raise UserError(f"--finalists: must be an integer in 1..100, got {args.finalists}")
    if not (math.isfinite(args.budget) and 0.5 <= args.budget <= 24 * 60):
        raise UserError(f"--budget: expected minutes in 0.5..1440, got {args.budget}")
    if args.verify in ("typical", "coupled") and args.temperature <= 0:
        raise UserError(f"--verify {args.verify}: samples; give --temperature > 0 (at temperature 0 every rule is greedy)")
    sampling_from_args(args, verify=_rule(args))
    if not (math.isfinite(args.profile_budget) and args.profile_budget > 0):
        raise UserError(f"--profile-budget: expected a positive number of seconds, got {args.profile_budget}")
    return methods, guessers


def _rule(args) -> str:
    """The decoder's rule for --verify: coupled by default under sampling on the hf engine, lossless
    (recursive rejection) with --engine llama.cpp."""
    if args.temperature <= 0:
        return "auto"
    if args.verify is None:
        return "lossless" if args.engine == "llama.cpp" else "coupled"
    return args.verify


def _defaults(args) -> None:
    """Defaults that differ by engine: llama.cpp decodes ten times faster, so its race affords more."""
    llama = args.engine == "llama.cpp"
    d = AutotuneSettings()
    for name, hf, ll in (("decode_tokens", d.decode_tokens, 96), ("rounds", d.rounds, 3),
                         ("budget", d.budget_minutes, 10.0), ("decode_prompts", d.decode_prompts, 8), ("turns", d.turns, 1)):
        if getattr(args, name) is None:
            setattr(args, name, ll if llama else hf)


def _llama(args) -> int:
    from planner.errors import UserError
    from workflows.mainjob.llama import LlamaAutotune, autotune_llama

    for flag, given in (("--device", args.device), ("--dtype", args.dtype), ("--prompt-tokens", args.prompt_tokens),
                        ("--draft", args.draft), ("--parallelspec", args.parallelspec), ("--accept", args.accept),
                        ("--guessers", args.guessers != "auto")):
        if given:
            raise UserError(f"{flag}: not with --engine llama.cpp (it races prompt lookup, the guesser llama.cpp runs)")
    if args.verify in ("typical", "coupled"):
        raise UserError(f"--verify {args.verify}: not with --engine llama.cpp (it races lossless sampling only)")
    summary = autotune_llama(LlamaAutotune(
        model=args.model, out=args.out, questions=args.questions, accept_prompts=args.accept_prompts,
        decode_prompts=args.decode_prompts, turns=args.turns, accept_tokens=args.accept_tokens,
        decode_tokens=args.decode_tokens, rounds=args.rounds, finalists=min(args.finalists, 8), neighbours=args.neighbours, threads=args.threads,
        n_ctx=args.n_ctx, profile=args.profile, profile_budget_s=args.profile_budget, budget_minutes=args.budget,
        progress=not args.quiet, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p))
    return 0 if summary["identical_to_greedy"] is not False else 1  # None: sampled, nothing to compare


def run(args) -> int:
    from workflows.mainjob.pipeline import autotune

    _defaults(args)
    methods, guessers = _check(args)
    if args.engine == "llama.cpp":
        return _llama(args)
    from planner.guessers import kinds

    # each directory flag names one kind of files; every guesser kind reading such files takes it
    by_files = {"prompt_tokens": args.prompt_tokens, "draft_lm": args.draft, "parallelspec": args.parallelspec}
    dirs = {k.name: by_files[k.files] for k in kinds(hybrids=False) if by_files.get(k.files)}
    s = AutotuneSettings(
        model=args.model, guessers=guessers, guesser_dirs=dirs, device=args.device, dtype=args.dtype, out=args.out,
        questions=args.questions, accept_prompts=args.accept_prompts, decode_prompts=args.decode_prompts,
        turns=args.turns, accept_tokens=args.accept_tokens, decode_tokens=args.decode_tokens, max_input_length=args.max_input_length,
        context_length=args.context_length, methods=methods, neighbours=args.neighbours, sweep=args.sweep,
        finalists=args.finalists, budget_minutes=args.budget,
        profile=args.profile, accept=args.accept, rounds=args.rounds, threads=args.threads,
        profile_budget_s=args.profile_budget, report=not args.no_report, progress=not args.quiet,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        verify=_rule(args),
    )
    summary = autotune(s)
    return 0 if summary["identical_to_greedy"] is not False else 1
