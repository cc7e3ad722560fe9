"""Timing two models side by side, as PEARL runs them: each at its share of the cores.

`side_latencies`: the target's L(n) and the drafter's pass time at the thread split PEARL gives
each side (the drafter's measured in a worker thread, as PEARL runs it) and at all threads (what
plain and vanilla speculative decoding get). `split_check`: the target's gamma-token forward and
the drafter's gamma passes alone, one after the other, and at the same time in two threads;
eta = 1 - (together - max) / min, 1 when the overlap is perfect, 0 when the two only take turns.
The target runs through its engine's `context_forwards` (caps.torch_modules); the drafter through
decoder/drafter.py's protocol, as PEARL itself runs it (`DraftForwards`); a bare transformers model on
either side is the hf engine's.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from decoder.engines.registry import as_engine
from decoder.guessers.pearl import set_thread_count


class DraftForwards:
    """A drafter's forwards of new tokens after one fixed context, cut back to it after each use: its
    cache (decoder/drafter.py) holds the context, as the engines' context_forwards do theirs."""

    def __init__(self, drafter, context: torch.Tensor):
        ctx = context.reshape(-1)
        self.state = drafter.open(torch.cat([ctx, ctx[-1:]]), None)  # open keeps all but the last: the context
        self.context_length = self.state.length
        self.vocab_size = drafter.vocab_size  # the range random inputs are drawn from

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        self.state.forward(input_ids.reshape(-1), position_ids.reshape(-1), None, None)

    def reset(self) -> None:
        self.state.keep(self.context_length, [])


def context_forwards(side, context: torch.Tensor):
    """Forwards after `context` on one side: a drafter's (decoder/drafter.py), or an engine's (a bare model:
    the hf engine's)."""
    if hasattr(side, "open"):
        return DraftForwards(side, context)
    return as_engine(side).context_forwards(context)


@torch.inference_mode()
def forward_seconds(model, context: torch.Tensor, n: int, threads: int, repeats: int) -> float:
    """Median seconds of one forward over n new tokens after `context`, at `threads` (in this thread)."""
    set_thread_count(threads)
    fw = context_forwards(model, context)
    C = fw.context_length
    x = torch.randint(3, fw.vocab_size - 1, (1, n))
    pos = torch.arange(C, C + n)[None]
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        fw.forward(x, pos)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
        fw.reset()
    return statistics.median(times)


def pearl_splits(total: int) -> list[tuple[int, int]]:
    """(target, drafter) thread splits of `total` worth measuring: the drafter on one thread (a
    draft LM is small) and the threads halved. One thread: (1, 1), the two sides take turns."""
    if total < 2:
        return [(1, 1)]
    return sorted({(total - 1, 1), (total - total // 2, total // 2)}, reverse=True)


def side_latencies(target, draft, context, lengths, split, total: int, repeats: int) -> dict:
    """L(n) and t_d at the split and at all threads; the split's sides each run in a thread of their own."""
    with ThreadPoolExecutor(1) as pool:  # the drafter's numbers come from a worker thread, as in PEARL
        t_d = pool.submit(forward_seconds, draft, context, 1, split[1], repeats).result()
    out = {"split": list(split), "total_threads": total,
           "L_split_s": {n: forward_seconds(target, context, n, split[0], repeats) for n in lengths},
           "t_draft_split_s": t_d,
           "L_full_s": {n: forward_seconds(target, context, n, total, repeats) for n in lengths},
           "t_draft_full_s": forward_seconds(draft, context, 1, total, repeats)}
    out["c"] = out["L_split_s"][1] / t_d
    torch.set_num_threads(total)
    return out


@torch.inference_mode()
def _job(fw, n_tokens: int, passes: int, threads: int, start=None) -> tuple[float, float]:
    """`passes` forwards of n_tokens each after the prefilled context of `fw` (the engine's context_forwards),
    cut back after; (start, end). start: a threading.Barrier both sides pass first, so that neither times
    the other's setup."""
    set_thread_count(threads)
    C = fw.context_length
    xs = torch.randint(3, fw.vocab_size - 1, (passes, 1, n_tokens))
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    for i in range(passes):
        fw.forward(xs[i], torch.arange(C, C + n_tokens)[None] + i * n_tokens)
    t1 = time.perf_counter()
    fw.reset()
    return t0, t1


def split_check(target, draft, context, gamma: int, split, repeats: int) -> dict:
    """The target's gamma-token forward (caller's thread) and the drafter's gamma forwards (worker):
    alone, one after the other, and at the same time. A real split: together ~ max(alone)."""
    import threading

    tside, dside = context_forwards(target, context), context_forwards(draft, context)
    rows = {"target": [], "draft": [], "serial": [], "together": []}
    with ThreadPoolExecutor(1) as pool:
        draft_job = lambda b=None: _job(dside, 1, gamma, split[1], b)  # noqa: E731
        target_job = lambda b=None: _job(tside, gamma, 1, split[0], b)  # noqa: E731
        pool.submit(draft_job).result(), target_job()  # warm-up
        for _ in range(repeats):
            t, d = target_job(), pool.submit(draft_job).result()
            rows["target"].append(t[1] - t[0])
            rows["draft"].append(d[1] - d[0])
            rows["serial"].append(t[1] - t[0] + d[1] - d[0])
            barrier = threading.Barrier(2)
            f = pool.submit(draft_job, barrier)
            t = target_job(barrier)
            d = f.result()
            rows["together"].append(max(t[1], d[1]) - min(t[0], d[0]))
    med = {k: statistics.median(v) for k, v in rows.items()}
    from planner.pearl import eta_from_times

    med["eta"] = eta_from_times(med["target"], med["draft"], med["together"])
    med["together_over_serial"] = med["together"] / med["serial"]
    med["gamma"] = gamma
    return med
