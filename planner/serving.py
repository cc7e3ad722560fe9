"""Planning for a serving engine: the draft length per concurrency level with the most output tokens/s.

    from planner.serving import plan_method, schedule_ranges
    plan = plan_method("ngram", accept_record, profiles_by_batch, levels=[1, 4, 16], max_k=8, draft_s={})
    schedule_ranges(plan["per_level"], [1, 4, 16])   # [[1, 3, 4], [4, 15, 2], [16, 256, 0]]

The engine verifies chains (vLLM). With b requests running, each drafting k tokens a step, a step
costs the engine's measured step at (b, 1 + k) scored tokens per sequence plus the drafting, and
yields E[tau](k) = 1 + sum_d prod_{i<=d} a_i tokens per request (a_i: the acceptance at distance i
given every earlier one accepted), so the level's output is b E[tau](k) / step(b, k) tokens/s. The
best k per level is planned with planner/batch.py plan_chain_schedule (the project's chain planner
on the profile measured at that batch size) and checked against this closed form by
tests/test_serving_autotune.py. Numpy only.
"""
from __future__ import annotations

import numpy as np

MAX_CONCURRENCY = 256  # the schedule's last range ends here (vLLM takes the last range beyond it anyway)



def chain_rate(accuracy: np.ndarray, k: int) -> float:
    """Expected tokens per verification step of a chain of k drafts: 1 + sum_d prod_{i<=d} a_i."""
    a = np.asarray(accuracy, dtype=np.float64).reshape(-1)[:k]
    return 1.0 + float(np.cumprod(a).sum()) if k else 1.0


def predicted_tokens_per_s(accuracy, profile, batch_size: int, k: int, draft_s: float = 0.0,
                           passes: str = "one") -> float:
    """Output tokens/s of `batch_size` running requests drafting k each step: b E[tau] / step(b, k)."""
    step = float(profile.latency(1 + k)) + (0.0 if k == 0 else draft_s * (k if passes == "depth" else 1))
    return batch_size * chain_rate(accuracy, k) / step


def plan_method(method: str, record: dict, profiles: dict, levels, max_k: int, draft_s: dict[int, float]) -> dict:
    """The best draft length per level (plan_chain_schedule, per level with its own drafting cost) and
    the best fixed one (geometric mean of predicted tokens/s over the levels), with predictions."""
    from planner.accept import from_entry
    from planner.batch import plan_chain_schedule
    from planner.cost import Guessing

    accept = from_entry(record, f"accept-{method}")
    acc = accept.accuracy[:, 0]
    k_max = min(max_k, acc.size)
    passes = record.get("guesser", {}).get("draft_passes", "one")
    per_level, predicted = {}, {}
    for b in levels:
        g = Guessing(draft_s=draft_s.get(b, 0.0), draft_passes=passes)
        entry = plan_chain_schedule(accept, {b: profiles[b]}, [b], g, max_depth=k_max)[0]
        k = 0 if entry.tree is None else entry.tree.depth
        per_level[b] = k
        predicted[b] = predicted_tokens_per_s(acc, profiles[b], b, k, draft_s.get(b, 0.0), passes)
    fixed = {k: [predicted_tokens_per_s(acc, profiles[b], b, k, draft_s.get(b, 0.0), passes) for b in levels]
             for k in range(1, k_max + 1)}
    best_k = max(fixed, key=lambda k: float(np.mean(np.log(fixed[k]))))
    plain = {b: predicted_tokens_per_s(acc, profiles[b], b, 0) for b in levels}
    return {"method": method, "per_level": per_level, "predicted": predicted, "plain_predicted": plain,
            "best_fixed": best_k, "fixed_predicted": dict(zip(levels, fixed[best_k])),
            "tokens_per_step": {b: chain_rate(acc, per_level[b]) for b in levels}, "draft_s": draft_s}


def schedule_ranges(per_level: dict[int, int], levels) -> list[list[int]]:
    """vLLM's num_speculative_tokens_per_batch_size: level c_i covers [c_i, c_{i+1} - 1], the first from 1,
    the last up to MAX_CONCURRENCY; equal neighbours merged."""
    out: list[list[int]] = []
    for i, c in enumerate(levels):
        lo = 1 if i == 0 else c
        hi = levels[i + 1] - 1 if i + 1 < len(levels) else MAX_CONCURRENCY
        if out and out[-1][2] == per_level[c]:
            out[-1][1] = hi
        else:
            out.append([lo, hi, per_level[c]])
    return out


def draft_costs(record: dict, profiles: dict, levels) -> dict[int, float]:
    """Seconds per draft pass of a drafter model at each level, from its acceptance run: the engine's
    mean step there (the load's wall time over its decoding steps, every slot busy) less the profile's
    step at that batch and draft length, per drafted position; the same at every level [D: a draft
    pass grows with the batch like the target's fixed cost does not; measured at one level only]."""
    v = record.get("vllm") or {}
    c, k = int(v.get("concurrency") or 1), int(v.get("draft_length") or 1)
    steps, wall = float(v.get("steps") or 0), float(v.get("load_wall_s") or 0)
    b = min(profiles, key=lambda x: abs(x - c))
    if steps <= 0 or wall <= 0:
        return {lv: 0.0 for lv in levels}
    step = wall * min(c, int(v.get("requests") or c)) / steps
    per_pass = max(0.0, (step - float(profiles[b].latency(1 + k))) / k)
    return {lv: per_pass for lv in levels}
