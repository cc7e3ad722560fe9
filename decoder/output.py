"""What decoding returns: the new tokens and per-step records (single and batched runs alike)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

PHASES = ("prepare", "forward", "verify", "cache", "guess")  # guess: the session's commit (PPD: its next guesses)


@dataclass
class DecodeStats:
    """Per-step records. state -1 is the bootstrap step; accepted counts candidates (tokens = accepted + 1)."""

    states: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)  # after EOS / max_new_tokens truncation
    input_lengths: list[int] = field(default_factory=list)  # real forward length (prompt tokens x E)
    planned_input_lengths: list[int] = field(default_factory=list)  # the plan's count
    times: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    guesses: list[torch.Tensor | None] | None = None  # record_guesses: the [k, K] guesses each step's proposal used
    prefill_s: float = 0.0
    total_s: float = 0.0
    dynamic: dict | None = None  # dynamic plans: sizes chosen per step, decision cost, online corrections

    def summary(self) -> dict:
        steps = len(self.states)
        tokens = sum(self.emitted)
        out = {
            "steps": steps,
            "tokens": tokens,
            "tokens_per_step": tokens / steps if steps else 0.0,
            "mean_input_length": sum(self.input_lengths) / steps if steps else 0.0,
            "prefill_s": self.prefill_s,
            "total_s": self.total_s,
            "tokens_per_s": tokens / self.total_s if self.total_s > 0 else None,
        }
        out.update({f"{p}_s": sum(self.times[p]) if self.times[p] or not steps else None for p in PHASES})
        return out

    def to_json(self) -> dict:
        return {
            "states": self.states,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "input_lengths": self.input_lengths,
            "planned_input_lengths": self.planned_input_lengths,
            "times": self.times,
            "summary": self.summary(),
            **({"dynamic": self.dynamic} if self.dynamic is not None else {}),
        }


@dataclass
class GenerateOutput:
    tokens: torch.Tensor  # [T_new] long, new tokens only
    steps: int  # forward passes of the base model after the prefill
    stats: DecodeStats
    batch: object = None  # decoder.batch.BatchStats of the batch this sequence ran in (batched calls)


def truncate(tokens: list[int], eos: set[int], room: int) -> tuple[list[int], bool]:
    """The emitted tokens up to the first EOS and at most `room` of them; whether decoding stops."""
    for i, tok in enumerate(tokens):
        if tok in eos:
            tokens = tokens[: i + 1]
            return tokens[:room], True
    return tokens[:room], len(tokens) >= room
