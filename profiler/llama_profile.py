"""`planner profile --engine llama.cpp`: L(n) of a GGUF model in llama.cpp, as the planner reads it.

The timing loop is profiler/measure.py's (first round coarse to fine, later rounds shuffled, a length
done when its median's 95 % interval is within `target_rel_ci`), over the engine's `forward_timer`:
n new tokens after a random context, every row's logits (what verification reads), as a tree (node i
under (i - 1) // 2, one sequence id per path) and as a chain (what prompt lookup runs), at each
context length (chains only for the default chain-only engine, decoder/engines/llama_cpp/engine.py). The file's
top level (what planner.profile reads) is the first shape at the first context length; "shapes" keeps every (shape, context length) series. It also
records the loop's own per-step work outside the forward ("decoder_overhead", the cost model adds it)
and the build ("llamafile": whether multi-token evaluation rounds like one-token evaluation).
"""
from __future__ import annotations

import datetime
import os
import platform
import random
import statistics
import time

import numpy as np
import torch

from planner.errors import UserError
from profiler.measure import Series, Timer, _first_round, _later_rounds, _Settings

SHAPES = ("tree", "chain")


def profile_llama(engine, input_lengths: list[int], context_lengths: list[int], time_budget_s: float = 30.0,
                  min_repeats: int = 5, max_repeats: int = 50, target_rel_ci: float = 0.02, warmup: int = 1,
                  seed: int = 0, progress: bool = True, model: dict | None = None, overhead: bool = True) -> dict:
    from tqdm import tqdm

    lengths = sorted(set(int(n) for n in input_lengths))
    if lengths[-1] > engine.max_step:
        raise UserError(f"--input-lengths: at most {engine.max_step} tokens per llama.cpp step, got {lengths[-1]}")
    for C in context_lengths:
        if C + lengths[-1] >= engine.n_ctx:
            raise UserError(f"--context-lengths: {C} + {lengths[-1]} tokens exceed the engine's n_ctx {engine.n_ctx}")
    bar = tqdm(total=round(time_budget_s, 1), disable=not progress, dynamic_ncols=True,
               bar_format="{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s budget{postfix}")
    st = _Settings(None, torch.device("cpu"), lengths, context_lengths[0], False, min_repeats, max_repeats,
                   target_rel_ci, warmup, torch.float32, engine.vocab_size, torch.Generator().manual_seed(seed),
                   random.Random(seed), Timer(torch.device("cpu")), time.time(), bar)
    load_start = _load()
    shapes_timed = SHAPES if engine.caps.trees else ("chain",)  # a chain-only engine scores chains only
    runs = [(C, shape) for C in context_lengths for shape in shapes_timed]
    shapes, interrupted = [], False
    try:
        for i, (C, shape) in enumerate(runs):
            s = Series(1)
            deadline = time.time() + (time_budget_s - (time.time() - st.t_start)) / (len(runs) - i)
            st.context_length = C
            timer = engine.forward_timer(C, 1, tree=shape == "tree", seed=st.rng.randrange(2**31))
            bar.set_description(f"llama.cpp {shape} C={C}")
            active = _first_round(st, s, timer, deadline)
            _later_rounds(st, s, timer, active, deadline)
            j = s.to_json()
            if j is not None:
                shapes.append({"shape": shape, "context_length": C, **j})
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    if not shapes:
        raise KeyboardInterrupt if interrupted else UserError("llama.cpp profile: nothing measured")
    first = shapes[0]
    result = {k: first[k] for k in ("input_lengths", "latency_s", "p10_s", "p90_s", "repeats", "fit")}
    result.update({
        "engine": "llama.cpp", "batch_size": 1,
        "series": [{k: v for k, v in first.items() if k not in ("shape", "context_length")}],
        "shapes": shapes, "device": "cpu", "device_name": _cpu_name(), "dtype": "gguf",
        "context_length": first["context_length"], "threads": engine.threads,
        **(model or {"model": engine.model_name}),
        "llama_cpp": engine.describe(),
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "llama_cpp_python": engine.describe()["llama_cpp_python"]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"input_lengths_requested": lengths, "context_lengths": list(context_lengths),
                     "time_budget_s": time_budget_s, "min_repeats": min_repeats, "max_repeats": max_repeats,
                     "target_rel_ci": target_rel_ci, "warmup": warmup, "seed": seed,
                     "load_avg_1m": [load_start, _load()], "timer": "perf_counter",
                     "tree": "node i under node (i-1)//2, one sequence id per root-to-leaf path; every row's logits",
                     "chain": "n tokens of one sequence; every row's logits", "cpu_count": os.cpu_count()},
        "wall_s": round(time.time() - st.t_start, 3),
    })
    if interrupted:
        result["incomplete"] = [{"reason": "interrupted", "batch_size": 1}]
    elif overhead:
        result["decoder_overhead"] = llama_overhead(engine, min(lengths[-1], 16))
    return result


def llama_overhead(engine, max_input_length: int = 16, steps: int = 8, seed: int = 0) -> dict:
    """The decoding loop's per-step seconds outside llama.cpp's forward (prepare, verify, cache commit,
    the guesser's commit) on chains of several lengths, fitted as fixed_s + per_token_s * n."""
    from decoder import generate
    from decoder.guesser import PlainGuesser
    from decoder.guessers.oracle import OracleGuesser
    from profiler.overhead import OUTSIDE, _chain_tree, _fit_line

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.vocab_size, (48,), generator=gen)
    plain = generate(engine, prompt, plan=None, guesser=PlainGuesser(), max_new_tokens=steps)
    points = {1: [sum(plain.stats.times[p][i] for p in OUTSIDE) for i in range(plain.steps)]}
    seq = torch.randint(0, engine.vocab_size, (48 + 4 * steps * max_input_length,), generator=gen)
    for depth in (1, 3, 7, 15):
        if depth + 1 > max_input_length:
            break
        out = generate(engine, prompt, plan=_chain_tree(depth, 1), guesser=OracleGuesser(seq, engine.vocab_size, depth),
                       max_new_tokens=steps)
        for i, n in enumerate(out.stats.input_lengths[1:], start=1):  # the bootstrap step is root-only
            points.setdefault(n, []).append(sum(out.stats.times[p][i] for p in OUTSIDE))
    lengths = sorted(points)
    seconds = [statistics.median(points[n]) for n in lengths]
    fixed, per_token = _fit_line(lengths, seconds)
    return {"fixed_s": fixed, "per_token_s": per_token, "input_lengths": lengths, "seconds": seconds,
            "method": "decoder.generate on the llama.cpp engine, chains of random guesses; prepare + verify + cache "
                      "+ guess per step, median per input length, least-squares line clamped at 0"}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None
