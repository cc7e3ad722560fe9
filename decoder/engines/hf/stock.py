"""transformers' own machinery, run as a user of the library would run it: the baselines the benchmarks
time this project's code against (bench/), kept in the engine's package so nothing outside it reaches
into transformers.

    seconds = stock_init_seconds(config_file)       # transformers' full random init of a config
    draw = stock_sampler(sampling)                  # its warpers (temperature, top-k, top-p) + multinomial
"""
from __future__ import annotations

import time
from pathlib import Path

import torch


def stock_init_seconds(config_file: Path) -> float:
    """Seconds transformers' `AutoModelForCausalLM.from_config` takes for a full random init (fp32)."""
    from transformers import AutoModelForCausalLM

    from decoder.engines.hf.load import _load_config

    config = _load_config(Path(config_file))
    t0 = time.perf_counter()
    AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return time.perf_counter() - t0


def stock_sampler(sampling):
    """row [V] logits -> a token id, drawn as transformers' generate(do_sample=True) draws one: its
    logits warpers in its order, then torch.multinomial over the softmax."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    s = sampling
    warpers = LogitsProcessorList(
        ([TemperatureLogitsWarper(s.temperature)] if s.temperature != 1.0 else [])
        + ([TopKLogitsWarper(s.top_k)] if s.top_k else []) + ([TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []))

    def draw(row: torch.Tensor) -> int:
        return int(torch.multinomial(warpers(None, row[None]).softmax(-1), 1))

    return draw
