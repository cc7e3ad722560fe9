"""How one decode runs, as one object: what `generate` and the loops around it take instead of a
parameter list.

    cfg = DecodeConfig(max_new_tokens=96, sampling=Sampling(0.7, top_p=0.9, mode="coupled"), seed=3)
    out = generate(engine, ids, plan, guesser, config=cfg)
    out = generate(engine, ids, plan, guesser, max_new_tokens=96, temperature=0.7)   # the same, as keywords

Keywords are DecodeConfig's fields, plus the sampling ones (temperature, top_k, top_p, verify_rule,
eps, delta), which go into its `Sampling` (planner/sampling.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from planner.errors import UserError
from planner.sampling import Sampling

SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "verify_rule": "mode",
                 "eps": "eps", "delta": "delta"}
MAX_NEW_TOKENS = 1 << 20


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: Sampling = field(default_factory=Sampling)  # the warp and the verification rule
    seed: int = 0  # sampled draws (coupled sampling: the noise of every token index)
    eos_token_id: object = None  # None: the engine's own; an id, a list of ids, or False (none)
    record_guesses: bool = False  # keep every step's proposal (acceptance measurement)
    progress: bool = False  # a progress bar over the new tokens
    phase_times: bool = True  # split each step into phases (on CUDA: a sync per phase)
    attention: str = "auto"  # engines with tree kernels: auto, kernels or dense
    layout: str = "packed"  # batches: packed (EMS-SD, no padding) or padded
    matmul_paths: object = None  # engines with CPU matmul paths: a profile (file or table) whose paths to install

    def __post_init__(self):
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_NEW_TOKENS:
            raise UserError(f"max_new_tokens: expected an integer in 0..{MAX_NEW_TOKENS}, got {n!r}")
        if self.layout not in ("packed", "padded"):
            raise UserError(f"layout: expected packed or padded, got {self.layout!r}")


_FIELDS = {f.name for f in fields(DecodeConfig)}


def decode_config(config: DecodeConfig | None = None, **overrides) -> DecodeConfig:
    """`config` (default: the defaults) with keyword overrides, the sampling keywords included."""
    config = config or DecodeConfig()
    warp = {SAMPLING_KEYS[k]: overrides.pop(k) for k in list(overrides) if k in SAMPLING_KEYS}
    unknown = sorted(set(overrides) - _FIELDS)
    if unknown:
        raise TypeError(f"unexpected decoding option(s): {', '.join(unknown)}")
    if warp:
        overrides["sampling"] = replace(config.sampling, **warp)
    return replace(config, **overrides) if overrides else config
