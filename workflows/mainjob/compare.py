"""Other engines beside the main job: each registered engine that `compares` (planner/engines.py)
decodes a few race prompts with its library's own plain generation, on the same model and prompt ids,
so the summary says which engine is faster on this machine. A comparison, not a decision: its time is
kept out of the race (Budget.compare_s), and an engine whose library is not installed is not
installed for it (the summary says how to get it)."""
from __future__ import annotations

import time

from planner.engines import EngineKind


def stock_plain_report(other: EngineKind, s, prompts: list, plain_tokens_per_s: float | None) -> dict:
    """`other`'s stock plain decoding of `prompts` (greedy, or sampled with the run's settings), against this
    run's plain decoding."""
    from decoder.engines.registry import EngineRequest, installed, open_engine
    from planner.errors import UserError
    from profiler.machine import load_avg

    if not installed(other):
        return {"skipped": f"{other.requires} is not installed (bash scripts/setup.sh --engine {other.name})"}
    import torch

    need = max(int(p.numel()) for p in prompts) + s.decode_tokens + 1
    torch_threads = torch.get_num_threads()  # an engine may set torch's threads for its own host work
    try:
        engine = open_engine(other.name, EngineRequest(model=s.model, threads=s.threads, context=need,
                                                       progress=False, install=False))
    except UserError as e:
        return {"skipped": str(e)}
    t0 = time.time()
    try:
        engine.stock_generate(prompts[0], 8, s.sampling, s.seed)  # warm-up
        tokens = seconds = 0.0
        for i, ids in enumerate(prompts):
            toks, sec = engine.stock_generate(ids, s.decode_tokens, s.sampling, s.seed + i)
            tokens, seconds = tokens + len(toks), seconds + sec
    finally:
        engine.close()
        torch.set_num_threads(torch_threads)
    tps = tokens / seconds if seconds > 0 else None
    return {"engine": other.name, "tokens": int(tokens), "seconds": seconds, "tokens_per_s": tps,
            "threads": engine.caps.threads, "vs_plain": tps / plain_tokens_per_s if tps and plain_tokens_per_s else None,
            "load_avg_1m": load_avg(), "wall_s": time.time() - t0,
            "how": f"{other.name}'s own generation on the same model, race prompt ids, new tokens and sampling; "
                   f"`planner autotune --engine {other.name}` plans for that engine"}


def own_generate_report(engine, s, prompts: list, plain_tokens_per_s: float | None) -> dict:
    """The run's own engine's library generation (transformers' generate on the hf engine) on `prompts`, where
    plain decoding in the race is this project's loop (caps.stock_plain False): what a user would otherwise
    run, so the report can put the decision against it. On engines whose plain decoding is their library's
    generation the race measured it already (nothing to add)."""
    from planner.engines import kind as engine_kind
    from profiler.machine import load_avg

    kind = engine_kind(engine.caps.name)
    if engine.caps.stock_plain:
        return {"skipped": f"plain decoding in the race is {kind.stock} itself"}
    t0 = time.time()
    engine.stock_generate(prompts[0], 8, s.sampling, s.seed)  # warm-up
    tokens = seconds = 0.0
    for i, ids in enumerate(prompts):
        toks, sec = engine.stock_generate(ids, s.decode_tokens, s.sampling, s.seed + i)
        tokens, seconds = tokens + len(toks), seconds + sec
    tps = tokens / seconds if seconds > 0 else None
    return {"engine": kind.name, "stock": kind.stock, "prompts": len(prompts), "tokens": int(tokens),
            "seconds": seconds, "tokens_per_s": tps,
            "plain_vs_generate": plain_tokens_per_s / tps if tps and plain_tokens_per_s else None,
            "load_avg_1m": load_avg(), "wall_s": time.time() - t0,
            "how": f"{kind.stock} on the first race prompts plain decoding ran, the same new tokens and sampling"}
