"""The user's sampling settings on the command line, and in the files tuned for them.

    add_sampling_arguments(p)            --temperature, --top-k, --top-p (the same on accept, plan, decode,
                                         tune and autotune)
    s = sampling_from_args(args)         decoder.verify.Sampling, bad values refused naming the flag
    record(s)                            {"temperature", "top_k", "top_p"}: what acceptance files, plans
                                         and chosen.json say they were made for
    mismatch(recorded, s, what)          one line when a file was made for other settings, else None

Light imports only (the decoder loads inside).
"""
from __future__ import annotations

import argparse
import math

from planner.errors import UserError

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
    from decoder.verify import Sampling

    t, k = args.temperature, args.top_k
    if isinstance(t, (int, float)) and not isinstance(t, bool) and not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
        raise UserError(f"--temperature: expected a number in [0, {MAX_TEMPERATURE:g}], got {t}")
    if isinstance(k, int) and k > MAX_TOP_K:
        raise UserError(f"--top-k: expected an integer in 0..{MAX_TOP_K}, got {k}")
    try:
        return Sampling(t, k, args.top_p, verify or getattr(args, "verify", "auto"), getattr(args, "eps", 0.09),
                        getattr(args, "delta", 0.3))
    except UserError as e:
        field, _, rest = str(e).partition(": ")
        raise UserError(f"{FLAGS.get(field, field)}: {rest}") from None


def record(s) -> dict:
    """What a file made for these settings records (greedy: temperature 0, the cut-offs off)."""
    if s.temperature <= 0:
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    return {"temperature": float(s.temperature), "top_k": int(s.top_k), "top_p": float(s.top_p)}


def describe(rec: dict) -> str:
    if rec["temperature"] <= 0:
        return "greedy decoding"
    parts = [f"temperature {rec['temperature']:g}"]
    if rec["top_k"]:
        parts.append(f"top-k {rec['top_k']}")
    if rec["top_p"] < 1:
        parts.append(f"top-p {rec['top_p']:g}")
    return ", ".join(parts)


def recorded(obj: dict | None) -> dict | None:
    """The settings a file records ("sampling": {...}), checked; None when it records none."""
    if not isinstance(obj, dict) or obj.get("sampling") is None:
        return None
    rec = obj["sampling"]
    ok = isinstance(rec, dict) and all(
        isinstance(rec.get(k), (int, float)) and not isinstance(rec.get(k), bool) for k in ("temperature", "top_k", "top_p"))
    if not ok:
        raise UserError("field 'sampling': expected an object with numbers 'temperature', 'top_k' and 'top_p'")
    return {"temperature": float(rec["temperature"]), "top_k": int(rec["top_k"]), "top_p": float(rec["top_p"])}


def mismatch(rec: dict | None, s, what: str, made: str = "was tuned for",
             now: str = "this run uses {}: its choice may not be the fastest here") -> str | None:
    """One line saying that `what` was made for other settings than s, or None when they agree.
    A file recording none was made for greedy decoding (every file before sampled tuning)."""
    want = record(s)
    have = rec if rec is not None else {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    if have == want:
        return None
    return f"{what} {made} {describe(have)}, {now.format(describe(want))}"
