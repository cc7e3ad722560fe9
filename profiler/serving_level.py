"""One concurrency level on a running server: a warm-up wave, then the measured rounds, with vLLM's
speculative-decoding counters read around the rounds.

    from profiler.serving_level import measure_level
    run = measure_level(server.url, server.served_model_name, warm, [requests], concurrency=8, timeout_s=600)
    run.rounds[0].output_tokens_per_s, run.spec.accepted_tokens if run.spec else None

The warm-up wave (requests outside the measurement, as many as the level runs at once) makes no
contender's first measured pass at a batch size a cold one. `fresh` (the server's reset_prefix_cache)
runs before it: a pass that repeats an earlier pass's prompts then prefills them again, as distinct
traffic does (a repeated pass at 16 requests served 1.8x the tokens/s from vLLM's prefix cache), while
the prompts of one pass still share their common prefixes, as served requests do. The main job's race
(workflows/mainjob/serving_race.py) and bench/bench_serving.py both measure a level this way; what they
do with a level (the paired rule, the interleaved summary) stays theirs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.errors import UserError
from profiler import load_generator, serving_metrics
from profiler.load_generator import AnyRequest, LoadResult
from profiler.serving_metrics import SpecDecodeCounters


@dataclass
class LevelRun:
    warmup: LoadResult
    rounds: list[LoadResult]  # one per measured round, in order
    spec: SpecDecodeCounters | None  # the counters' change over the rounds; None: /metrics could not be read


def measure_level(url: str, model: str, warmup: Sequence[AnyRequest], rounds: Sequence[Sequence[AnyRequest]],
                  concurrency: int, timeout_s: float,
                  on_round: Callable[[int, LoadResult], None] | None = None,
                  fresh: Callable[[], None] | None = None) -> LevelRun:
    """`fresh()`, the warm-up wave, then each round's requests at `concurrency` (rounds after the first find
    the earlier rounds' prompts cached: give each its own requests); Ctrl-C raises run_load's
    LoadInterrupted (the round in flight is in it, the finished rounds are lost with this call)."""
    if fresh is not None:
        fresh()
    warm = load_generator.run_load(url, model, warmup, concurrency, timeout_s)
    before = _counters(url)
    results = []
    for i, requests in enumerate(rounds):
        res = load_generator.run_load(url, model, requests, concurrency, timeout_s)
        results.append(res)
        if on_round is not None:
            on_round(i, res)
    after = _counters(url)
    spec = after - before if before is not None and after is not None else None
    return LevelRun(warm, results, spec)


def _counters(url: str) -> SpecDecodeCounters | None:
    try:
        return serving_metrics.fetch_spec_decode(url)
    except UserError:
        return None
