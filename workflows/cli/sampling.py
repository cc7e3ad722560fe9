"""The user's sampling settings on the command line, and in the files tuned for them.

    add_sampling_arguments(p)            --temperature, --top-k, --top-p (the same on accept, plan, decode,
                                         tune and autotune)
    s = sampling_from_args(args)         decoder.verify.Sampling, bad values refused naming the flag
    record, recorded, mismatch, describe   planner/sampling.py's, re-exported

Light imports only: no torch (planner plan imports this).
"""
from __future__ import annotations

import argparse
import math

from planner.errors import UserError
from planner.sampling import Sampling, describe, mismatch, record, recorded  # noqa: F401  (the commands' one import)

FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "eps": "--eps", "delta": "--delta",
         "verify rule": "--verify"}
MAX_TOP_K = 1_000_000  # any vocabulary; a larger top-k is the whole vocabulary anyway
MAX_TEMPERATURE = 100.0


def add_sampling_arguments(p: argparse.ArgumentParser, what: str = "decoding") -> None:
    p.add_argument("--temperature", type=float, default=0.0,
                   help=f"{what} at this temperature (0: greedy, the default); with --top-k and --top-p, applied as "
                        "transformers does: temperature, then top-k, then top-p")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most probable tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sampling: keep the smallest set of most probable tokens whose mass reaches p (1: off)")


def sampling_from_args(args, verify: str | None = None):
    """The settings as decoder.verify.Sampling, checked before any model loads. verify: the rule
    (default: the command's --verify, else auto)."""
    t, k = args.temperature, args.top_k
    if isinstance(t, (int, float)) and not isinstance(t, bool) and not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
        raise UserError(f"--temperature: expected a finite number in [0, {MAX_TEMPERATURE:g}], got {t}")
    if isinstance(k, int) and k > MAX_TOP_K:
        raise UserError(f"--top-k: expected an integer in 0..{MAX_TOP_K}, got {k}")
    try:
        return Sampling(t, k, args.top_p, verify or getattr(args, "verify", "auto"), getattr(args, "eps", 0.09),
                        getattr(args, "delta", 0.3))
    except UserError as e:
        field, _, rest = str(e).partition(": ")
        raise UserError(f"{FLAGS.get(field, field)}: {rest}") from None
