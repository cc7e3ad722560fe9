"""Planning for a serving engine: the draft length per concurrency level with the most output tokens/s.

    from planner.serving import plan_method, schedule_ranges
    plan = plan_method("ngram", accept_record, profiles_by_batch, levels=[1, 4, 16], max_k=8, draft_s={})
    schedule_ranges(plan["per_level"], [1, 4, 16])   # [[1, 3, 4], [4, 15, 2], [16, 256, 0]]

The engine verifies chains (vLLM). With b requests running, each drafting k tokens a step, a step
costs the engine's measured step at (b, 1 + k) scored tokens per sequence plus the drafting, and
yields E[tau](k) = 1 + sum_d prod_{i<=d} a_i tokens per request (a_i: the acceptance at distance i
given every earlier one accepted), so the level's output is b E[tau](k) / step(b, k) tokens/s. A
lookup proposer drafts only in a share r of the steps (where the text matches), so its steps are
priced as the mixture r step(b, 1 + k) + (1 - r) step(b, 1). Served, a request's time is its
decoding steps plus everything else (its prefill, its first token, the ramp-up and the tail), and
speculation shortens only the steps: plain's pass through the server measures both parts at every
level (served_level), and a draft adds the profile's price for scoring it to plain's served step.
Every k is priced (exact under the model); with r = 1 and no served costs the choice is the project's
chain planner's (planner/batch.py plan_chain_schedule), which tests/test_serving_autotune.py checks.
Numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the project's vLLM plugin: its switch and the proposers it gives a schedule, defined once there
from planner.vllm_plugin import PLUGIN_ENV, PLUGIN_SCHEDULES  # noqa: F401  (serving modules import them from here)

MAX_CONCURRENCY = 256  # the schedule's last range ends here (vLLM takes the last range beyond it anyway)


def schedulable(method: str | None, plugin: bool = False) -> bool:
    """The proposer takes a per-batch-size schedule in vLLM: ngram and draft_model always (planner/export.py
    SCHEDULE_METHODS), suffix and medusa only with the plugin (without it they assert one draft length, and
    the worker died at the first batch size whose K differed)."""
    from planner.export import SCHEDULE_METHODS

    return method in SCHEDULE_METHODS["vllm"] or (plugin and method in PLUGIN_SCHEDULES)


def check_levels(levels, flag: str) -> None:
    """Concurrency levels: increasing integers in 1..MAX_CONCURRENCY, or a one-line error naming the flag."""
    from planner.errors import UserError

    if not levels or any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_CONCURRENCY
                         for c in levels) or list(levels) != sorted(set(levels)):
        raise UserError(f"{flag}: expected increasing integers in 1..{MAX_CONCURRENCY}, got "
                        f"{','.join(map(str, levels))}")


def chain_rate(accuracy: np.ndarray, k: int) -> float:
    """Expected tokens per verification step of a chain of k drafts: 1 + sum_d prod_{i<=d} a_i."""
    a = np.asarray(accuracy, dtype=np.float64).reshape(-1)[:k]
    return 1.0 + float(np.cumprod(a).sum()) if k else 1.0


def drafting(record: dict, label: str = "acceptance") -> tuple[np.ndarray, float]:
    """(prefix[d-1] = P(the first d drafts accepted | the step drafted), the share of steps that draft).
    A lookup proposer (ngram, suffix) drafts only where the text matches; a step without a draft costs
    a plain step, so pricing every step as a k-token draft would overcharge it. vLLM's own counters give
    both (accepted per position over drafts, drafts over steps); without them: every step drafts, with
    the per-distance acceptance of the record."""
    from planner.accept import from_entry

    v = record.get("vllm") or {}
    per, rate = v.get("per_draft"), v.get("draft_rate")
    if isinstance(per, list) and per and isinstance(rate, (int, float)) and 0 < rate <= 1:
        prefix = np.minimum.accumulate(np.clip(np.asarray(per, dtype=np.float64), 0.0, 1.0))
        return prefix, float(rate)
    return np.cumprod(from_entry(record, label).accuracy[:, 0]), 1.0


def drafted_per_step(record: dict) -> float | None:
    """Tokens a drafting step sent, on average, at the record's draft length (vLLM's counters: draft tokens
    over drafts), where it is below that length: a proposer that stops where it is unsure (suffix decoding
    drafts by its confidence, up to its length) has each step scored at what it sent, not at k. None where
    the proposer sends k every time (ngram, a drafter model) or the counters are missing."""
    v = record.get("vllm") or {}
    drafts, tokens, k = v.get("drafts"), v.get("draft_tokens"), v.get("draft_length")
    if not all(isinstance(x, (int, float)) and x > 0 for x in (drafts, tokens, k)):
        return None
    sent = float(tokens) / float(drafts)
    return sent if sent < 0.95 * float(k) else None


@dataclass(frozen=True)
class ServedLevel:
    """What plain's pass through the server measured at one concurrency level: a request's time splits
    into its decoding steps and everything else (its prefill, its first token, the ramp-up and the tail
    when fewer requests run), and speculation shortens only the first part."""

    decode_step_s: float  # seconds per step of a decoding request (LoadResult.step_p50_s): the served forward
    request_s: float  # seconds per request outside its decoding steps, at this concurrency
    decode_tokens: float  # output tokens per request after its first


def served_level(batch_size: int, output_tokens_per_s: float, requests: int, output_tokens: int,
                 step_s: float | None) -> ServedLevel | None:
    """plain's ServedLevel from its pass: n requests at concurrency b take n / b waves of request_s plus
    N - 1 decoding steps each (N output tokens per request, the first with the prefill), so
    request_s = b N / tokens/s - (N - 1) step. `step_s`: the served step, the median gap between a
    request's successive chunks (LoadResult.step_p50_s). None where the pass has no such step."""
    if not step_s or step_s <= 0 or requests <= 0 or output_tokens <= requests or output_tokens_per_s <= 0:
        return None
    per_request = output_tokens / requests
    return ServedLevel(decode_step_s=step_s, decode_tokens=per_request - 1,
                       request_s=max(0.0, batch_size * per_request / output_tokens_per_s - (per_request - 1) * step_s))


def priced_step(prefix, profile, batch_size: int, k: int, draft_s: float = 0.0, passes: str = "one",
                rate: float = 1.0, overhead_s: float = 0.0, served: ServedLevel | None = None,
                sent: float | None = None) -> tuple[float, float]:
    """(E[tau], E[step]) of one request at `batch_size` running: E[tau] = 1 + rate sum_{d<=k} prefix_d
    tokens a step, the proposer drafting k tokens in a share `rate` of the steps. A drafting step costs
    the plain step plus the profile's price for scoring k more tokens, (b, 1 + k) - (b, 1), plus the
    drafting. The plain step: plain's served step where `served` is given, else the profile's plus the
    server's cost per step (`overhead_s`, server_overhead). `sent` (drafted_per_step): a proposer that sends
    fewer than k tokens is scored on min(k, sent) [D: E[min(L, k)] <= min(E[L], k), so for k below the
    measured length this prices a step at most what it costs]."""
    step = served.decode_step_s if served is not None else float(profile.latency(1)) + overhead_s
    if k == 0:
        return 1.0, step
    tokens = 1.0 + rate * float(np.sum(np.asarray(prefix, dtype=np.float64)[:k]))
    plain = served.decode_step_s if served is not None else None
    scored = min(float(k), sent) if sent else k
    scoring = scoring_price(profile, scored, plain) + draft_s * (k if passes == "depth" else 1)
    return tokens, step + rate * scoring


def scoring_price(profile, k: float, served_step_s: float | None = None) -> float:
    """The profile's price for scoring k more tokens a sequence, L(b, 1 + k) - L(b, 1), never below 0.
    L(b, 1) comes from vLLM's plain engine and L(b, 1 + k) from its speculative one, measured one after
    the other. A server's step carries the engine's and more, so plain's served step (`served_step_s`)
    below the profiled plain step means the plain engine ran in a slow spell (served / profiled was
    1.01-1.30 in one run here, 0.71-0.81 in the next, whose plain engine measured 97 ms a step at one
    request against 54 before while its speculative engine matched the earlier run's); the served step
    then stands in for L(b, 1), or every short draft would be priced at nothing."""
    plain = float(profile.latency(1))
    if served_step_s is not None and 0 < served_step_s < plain:
        plain = served_step_s
    return max(0.0, float(profile.latency(1 + k)) - plain)


def predicted_tokens_per_s(prefix, profile, batch_size: int, k: int, draft_s: float = 0.0,
                           passes: str = "one", rate: float = 1.0, overhead_s: float = 0.0,
                           served: ServedLevel | None = None, sent: float | None = None) -> float:
    """Output tokens/s of `batch_size` running requests, each gaining E[tau] tokens per E[step]
    (priced_step). With `served` (plain's pass at this level) each request also pays its request_s,
    which speculation does not shorten: b (1 + D) / (request_s + D E[step] / E[tau]), D its tokens after
    the first; without it, b E[tau] / E[step]."""
    tokens, step = priced_step(prefix, profile, batch_size, k, draft_s, passes, rate, overhead_s, served, sent)
    if served is None:
        return batch_size * tokens / step
    d = served.decode_tokens
    return batch_size * (1.0 + d) / (served.request_s + d * step / tokens)


def server_overhead(profiles: dict, plain_tokens_per_s: dict[int, float], levels) -> dict[int, float]:
    """Seconds per step the serving engine spends beyond the profiled forward at each level: b over plain's
    measured output tokens/s (one token per request per step) less the profile's plain step. The server
    schedules, streams and detokenises on the same cores, so its step is the profile's plus this; a plain
    run through the server is what measures it. Never below 0 (noise, not a faster server)."""
    out = {}
    for b in levels:
        measured = plain_tokens_per_s.get(b)
        out[b] = max(0.0, b / measured - float(profiles[b].latency(1))) if measured and measured > 0 else 0.0
    return out


def plan_method(method: str, record: dict, profiles: dict, levels, max_k: int, draft_s: dict[int, float],
                schedulable: bool = True, overhead_s: dict[int, float] | None = None,
                off_ratio: float = 1.0, served: dict | None = None) -> dict:
    """The best draft length per level (every k in 0..max_k priced, the most tokens/s) and the best fixed
    one (geometric mean over the levels), with predictions. With every step drafting (rate 1) this is the
    chain planner's choice (planner/batch.py plan_chain_schedule; tests/test_serving_autotune.py).
    schedulable=False: the engine's proposer takes one draft length, so the plan is the best fixed one.
    overhead_s: the server's own seconds per step at each level (server_overhead), 0 where absent.
    off_ratio: tokens/s of k = 0 inside a schedule over plain's (an engine that keeps its speculative path
    there: EngineDefaults.schedule_off_ratio); a schedule predicted below plain over the levels is plain.
    served: level -> plain's ServedLevel there (served_level); where given it replaces overhead_s."""
    overhead_s, served = overhead_s or {}, served or {}
    prefix, rate = drafting(record, f"accept-{method}")
    k_max = min(max_k, prefix.size)
    passes = record.get("guesser", {}).get("draft_passes", "one")
    sent = drafted_per_step(record)

    def rate_at(b: int, k: int) -> float:
        return predicted_tokens_per_s(prefix, profiles[b], b, k, draft_s.get(b, 0.0), passes, rate,
                                      overhead_s.get(b, 0.0), served.get(b), sent)

    def priced(b: int, k: int) -> dict:
        tokens, step = priced_step(prefix, profiles[b], b, k, draft_s.get(b, 0.0), passes, rate,
                                   overhead_s.get(b, 0.0), served.get(b), sent)
        return {"tokens_per_step": tokens, "step_s": step}

    def in_schedule(b: int, k: int) -> float:
        return rate_at(b, k) if k else rate_at(b, 0) * off_ratio

    plain = {b: rate_at(b, 0) for b in levels}
    per_level = {b: max(range(k_max + 1), key=lambda k, b=b: in_schedule(b, k)) for b in levels}
    predicted = {b: in_schedule(b, per_level[b]) for b in levels}
    if not any(per_level.values()) or float(np.mean(np.log([predicted[b] / plain[b] for b in levels]))) <= 0:
        per_level, predicted = {b: 0 for b in levels}, dict(plain)  # no speculative config at all: plain itself
    fixed = {k: [rate_at(b, k) for b in levels] for k in range(1, k_max + 1)}
    best_k = max(fixed, key=lambda k: float(np.mean(np.log(fixed[k]))))
    if not schedulable:
        per_level = {b: best_k for b in levels}
        predicted = {b: rate_at(b, best_k) for b in levels}
    priced_levels = {b: priced(b, per_level[b]) for b in levels}
    return {"method": method, "per_level": per_level, "predicted": predicted,
            "plain_predicted": plain, "best_fixed": best_k, "off_ratio": off_ratio,
            "fixed_predicted": dict(zip(levels, fixed[best_k])), "draft_rate": rate,
            "tokens_per_step": {b: p["tokens_per_step"] for b, p in priced_levels.items()}, "draft_s": draft_s,
            "priced": priced_levels, "fixed_priced": {b: priced(b, best_k) for b in levels},
            "schedulable": schedulable, "overhead_s": overhead_s, "drafted_per_step": sent,
            "served": {b: vars(v) for b, v in served.items()}}


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


def draft_costs(record: dict, profiles: dict, levels, served: dict | None = None) -> dict[int, float]:
    """Seconds per draft pass of a drafter model at each level, from its acceptance run (which runs alone),
    the same at every level [D: a draft pass grows with the batch like the target's fixed cost does not;
    measured at one level only]. Where the run timed its streams and plain's served levels are given: its
    served step (LoadResult.step_p50_s) less plain's served step at its concurrency (interpolated between
    the levels) less the profile's price for scoring its k drafts, per pass; so the per-request time plain's
    split already prices is not charged again. Otherwise the load's wall time over its decoding steps less
    the profile's step at that batch and draft length, per pass. Both from the record's timed pass alone
    (`timed_steps`: a sampled record counts further passes, untimed)."""
    v = record.get("vllm") or {}
    c, k = int(v.get("concurrency") or 1), int(v.get("draft_length") or 1)
    steps, wall = float(v.get("timed_steps") or v.get("steps") or 0), float(v.get("load_wall_s") or 0)
    profile = profiles[min(profiles, key=lambda x: abs(x - c))]
    spec = v.get("step_p50_s")
    if spec and served:
        lv = sorted(served)
        plain = float(np.interp(c, lv, [served[b].decode_step_s for b in lv]))
        return {b: max(0.0, (float(spec) - plain - scoring_price(profile, k, plain)) / k) for b in levels}
    if steps <= 0 or wall <= 0:
        return {b: 0.0 for b in levels}
    step = wall * min(c, int(v.get("requests") or c)) / steps
    per_pass = max(0.0, (step - float(profile.latency(1 + k))) / k)
    return {b: per_pass for b in levels}
