"""`planner autotune`: the main job on the built-in model (or --model PATH --prompt-tokens DIR)."""
from __future__ import annotations

import argparse

from workflows.autotune import METHODS, AutotuneSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = AutotuneSettings()
    p.add_argument("--model", default=d.model, help="'builtin' (default), a preset name or a local model directory")
    p.add_argument("--prompt-tokens", default=None, metavar="DIR",
                   help="trained PPD prompt tokens (default: the built-in model's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"])
    p.add_argument("--out", default=None, metavar="DIR", help="run folder (default runs/<date>-<device>-<model>)")
    p.add_argument("--questions", default=d.questions, help="MT-bench style questions JSONL (held-out ones are used)")
    p.add_argument("--accept-prompts", type=int, default=d.accept_prompts)
    p.add_argument("--decode-prompts", type=int, default=d.decode_prompts)
    p.add_argument("--accept-tokens", type=int, default=d.accept_tokens, help="greedy tokens per prompt for acceptance")
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens, help="new tokens per prompt when decoding")
    p.add_argument("--max-input-length", type=int, default=d.max_input_length,
                   help="largest forward pass planned (and profiled)")
    p.add_argument("--context-length", type=int, default=d.context_length, help="KV-cache length for the profile")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of ppd,medusa,sequoia")
    p.add_argument("--neighbours", type=int, default=d.neighbours, help="sizes either side of the chosen one to decode")
    p.add_argument("--rounds", type=int, default=d.rounds, help="decoding repeats (median per plan and prompt)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--profile", default=None, help="reuse this profile instead of measuring")
    p.add_argument("--accept", default=None, help="reuse this acceptance file instead of measuring")
    p.add_argument("--profile-budget", type=float, default=d.profile_budget_s, help="seconds of profiling")
    p.add_argument("--no-report", action="store_true", help="skip the plots")
    p.add_argument("--quiet", action="store_true")


def run(args) -> int:
    from planner.errors import UserError
    from workflows.autotune import autotune

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise UserError(f"--methods: expected a comma-separated subset of {','.join(METHODS)}, got {args.methods!r}")
    for name in ("accept_prompts", "decode_prompts", "accept_tokens", "decode_tokens", "max_input_length", "context_length", "rounds"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be a positive integer")
    if args.neighbours < 0:
        raise UserError("--neighbours: must be >= 0")
    s = AutotuneSettings(
        model=args.model, prompt_tokens=args.prompt_tokens, device=args.device, dtype=args.dtype, out=args.out,
        questions=args.questions, accept_prompts=args.accept_prompts, decode_prompts=args.decode_prompts,
        accept_tokens=args.accept_tokens, decode_tokens=args.decode_tokens, max_input_length=args.max_input_length,
        context_length=args.context_length, methods=methods, neighbours=args.neighbours, profile=args.profile,
        accept=args.accept, rounds=args.rounds, threads=args.threads, profile_budget_s=args.profile_budget, report=not args.no_report, progress=not args.quiet,
    )
    summary = autotune(s)
    return 0 if summary["identical_to_greedy"] else 1
