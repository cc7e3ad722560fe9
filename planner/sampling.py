"""Sampling settings: how the target's distribution is warped, and what a file was tuned for.

    s = Sampling(0.7, top_k=0, top_p=0.9)      temperature, then top-k, then top-p (transformers' order;
                                               decoder.verify applies it), and the verification rule
    record(s)                                  {"temperature", "top_k", "top_p"}: what acceptance files,
                                               plans and chosen.json say they were made for
    mismatch(recorded, s, what)                one line when a file was made for other settings

Kept at the ground floor (no torch) so that planning and the command line can check settings
without loading the decoder.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from planner.errors import UserError

RULES = ("auto", "greedy", "typical", "lossless", "coupled")
LOSSLESS = ("lossless", "coupled")  # sampled rules whose output follows the warped distribution exactly
ONE_TEXT = ("greedy", "coupled")  # rules under which every plan emits plain decoding's own text (same seed)


@dataclass(frozen=True)
class Sampling:
    """How the base model's distribution is formed; identical for plain and tree decoding."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    # auto (greedy at T=0, else lossless), greedy, typical, lossless (recursive rejection),
    # coupled (position-keyed Gumbel draws: plain sampling's text; decoder/noise.py)
    mode: str = "auto"
    eps: float = 0.09  # typical acceptance: hard threshold
    delta: float = 0.3  # typical acceptance: entropy-scaled threshold

    def __post_init__(self):
        for name, lo, hi in (("temperature", 0.0, math.inf), ("top_p", 0.0, 1.0), ("eps", 0.0, 1.0), ("delta", 0.0, math.inf)):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not lo <= x <= hi:
                raise UserError(f"{name}: expected a finite number in [{lo}, {hi}], got {x!r}")
        if self.top_p == 0:
            raise UserError("top_p: expected a number in (0, 1], got 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k: expected an integer >= 0, got {self.top_k!r}")
        if self.mode not in RULES:
            raise UserError(f"verify rule: expected one of {', '.join(RULES)}, got {self.mode!r}")
        if self.mode in ("typical", "lossless", "coupled") and self.temperature == 0:
            raise UserError(f"verify rule: '{self.mode}' samples, but temperature is 0, where every rule is greedy; "
                            "give a temperature > 0, or the rule greedy (or auto)")

    @property
    def rule(self) -> str:
        if self.temperature <= 0 or self.mode == "greedy":
            return "greedy"
        return "lossless" if self.mode == "auto" else self.mode

    @property
    def one_text(self) -> bool:
        """Every plan emits plain decoding's text (greedy, or coupled sampling with the same seed), so
        two plans' outputs and step counts on a prompt compare token for token."""
        return self.rule in ONE_TEXT



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
