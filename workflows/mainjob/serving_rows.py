"""A contender's row at one level of the serving race, and what it says against vLLM plain: the row built
from its rounds (level_row), the row of a level it was not raced at because it runs vLLM's plain path there
(plain_path_row), and the rules ahead (beats_plain) and behind (behind_plain). workflows/mainjob/serving_race.py
decides each level from these rows; the decision rules are workflows/mainjob/serving_decision.py's.
"""
from __future__ import annotations

import numpy as np

from profiler.load_generator import percentile

TIE = 0.98  # tokens/s over plain's below which a level is behind plain whatever the interval says


def plain_path_row(plain: dict) -> dict:
    """A contender's row at a level it runs vLLM's plain path and was not raced: plain's tokens/s, no requests
    of its own, resolved (more passes would race plain against itself)."""
    return {"plain_path": True, "output_tokens_per_s": plain["output_tokens_per_s"], "requests": 0, "sent": 0,
            "output_tokens": 0, "mismatches": 0, "paired": None, "accepted": 0, "drafted": 0, "drafts": 0,
            "mean_acceptance_length": None, "tpot_p50_s": None, "tpot_p99_s": None, "ttft_p50_s": None,
            "timed_out": 0, "failed": 0, "servers": 0, "step_p50_s": None, "steps": 0, "tokens_per_s_rounds": []}


def level_row(rounds: list[dict]) -> dict:
    """One contender's report row at a level over its rounds: output tokens/s (the median over rounds),
    time per output token and to the first token, vLLM's draft counters, requests, and its verification
    steps counted as the acceptance records count them (the larger of two lower bounds)."""
    from profiler.serving_metrics import SpecDecodeCounters
    from profiler.vllm_accept import decode_steps

    res = [r["result"] for r in rounds]
    total = SpecDecodeCounters()
    for c in (r["counters"] for r in rounds if r.get("counters") is not None):  # each round's own reading
        total = SpecDecodeCounters(total.drafts + c.drafts, total.draft_tokens + c.draft_tokens,
                                   total.accepted_tokens + c.accepted_tokens, (), total.speculating or c.speculating)
    done = [x for r in res for x in r.completed]
    tpot = [x.tpot_s for x in done if x.tpot_s is not None]
    return {"output_tokens_per_s": float(np.median([r.output_tokens_per_s for r in res])),
            "tokens_per_s_rounds": [round(r.output_tokens_per_s, 3) for r in res],
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "ttft_p50_s": percentile([x.ttft_s for x in done if x.ttft_s is not None], 50),
            "timed_out": sum(r.timed_out for r in res), "failed": sum(len(r.records) - len(r.completed) for r in res),
            "accepted": total.accepted_tokens, "drafted": total.draft_tokens, "drafts": total.drafts,
            "mean_acceptance_length": total.mean_acceptance_length if total.speculating else None,
            "requests": len(done), "sent": sum(len(r.records) for r in res),
            "output_tokens": sum(r.output_tokens for r in res), "servers": len({r.get("server") for r in rounds}),
            "step_p50_s": percentile([r.step_p50_s for r in res if r.step_p50_s is not None], 50),
            "steps": decode_steps(done, total)["steps"]}


def beats_plain(row: dict) -> bool:
    """A contender's row at a level is ahead of plain: the paired interval over requests lies above 1,
    no greedy answer changed, and the level's output tokens/s is above plain's too (per-request
    seconds per token weigh every request alike; the level's throughput waits for its slowest one,
    and at 16 requests the two were seen to disagree: interval above 1, 0.85x tokens/s)."""
    paired = row.get("paired") or {}
    return (row.get("mismatches") == 0 and (paired.get("lo") or 0.0) > 1.0
            and (row.get("vs_plain") or 0.0) > 1.0)


def behind_plain(row: dict | None) -> bool:
    """A contender's row at a level is behind plain: no row (it did not run there), a greedy answer
    changed, the paired interval lies below 1, or the level's tokens/s is under TIE x plain's. A plain-path
    row (K = 0 with the plugin, not raced) is plain: not behind."""
    if not row:
        return True
    if row.get("plain_path"):
        return False
    hi = (row.get("paired") or {}).get("hi")
    return row.get("mismatches") != 0 or (hi if hi is not None else 0.0) < 1.0 or (row.get("vs_plain") or 0.0) < TIE
