"""The acceptance of vLLM's own proposers (ngram, suffix, draft_model), measured in vLLM's server.

    from profiler.vllm_accept import measure_methods
    records = measure_methods(engine, ["ngram", "suffix"], requests, draft_length=8, concurrency=4)
    records["ngram"]["accuracy"]   # [[a_1], ..., [a_K]]: planner/accept.py's format, one rank per distance

One server per method (decoder/engines/vllm/server.py) with a fixed draft length K; the requests go
through the load generator (profiler/load_generator.py) at a fixed concurrency, and the
speculative-decoding counters of vLLM's `/metrics` page (profiler/serving_metrics.py) are read before
and after: drafts, drafted and accepted tokens, accepted tokens per draft position.

vLLM verifies chains, and counts a draft position as accepted only when every position before it was
(its `num_accepted_tokens_per_pos[i]` counts steps that accepted more than i tokens). The chain's
per-distance rank-0 accuracy that the planner's product model multiplies (planner/batch.py
chain_acceptance, plan_chain_schedule) is then

    a_1 = accepted[0] / steps,    a_{i+1} = accepted[i] / accepted[i-1]

that is P(position i accepted | position i-1 accepted), and a_1 ... a_d = accepted[d-1] / steps: the
product is the measured share of steps that accepted at least d tokens, so 1 + sum of the products is
the measured tokens per step. `steps` counts every verification step of the requests, also those in
which the proposer drafted nothing (vLLM counts only steps with a draft in `num_drafts`; its own
per-position rate accepted[i] / drafts is kept as `vllm.per_draft`): a step without a draft is a step
in which the chain gained nothing, as the project's own lookup measurement counts it. vLLM exports no
per-step count, so it is recovered from the streams: each request's first token comes from its
prefill and each later step adds 1 + its accepted tokens, so steps = output tokens - requests -
accepted tokens; and each step's tokens arrive in one streamed chunk, so steps >= chunks - requests.
Both are lower bounds (the first because a request's last step may accept drafts past its end, which
vLLM counts and then cuts; the second because a slow client may receive two steps in one chunk), and
the larger is taken (both are kept). A row past a position nothing reached is 0, which changes no
prediction. The raw counts are kept as provenance (`counts`, `totals`, `vllm`).

Under --temperature / --top-k / --top-p every request is sampled (request i with seed + i) and vLLM's
lossless rejection sampler decides; the record says so under "sampling". Drafting cost is not
measured here: vLLM's step time includes it (a vLLM profile with the method on measures it).
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from planner.errors import UserError
from planner.sampling import record as sampling_record
from profiler.load_generator import LoadResult, RequestRecord, run_load
from profiler.serving_metrics import SpecDecodeCounters, fetch_spec_decode
from profiler.workload import Request

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "medusa")  # vLLM's proposers this measures (its spelling)
MODEL_METHODS = frozenset({"draft_model", "eagle", "eagle3", "medusa"})  # the ones that load a drafter's folder
DEFAULT_METHODS = ("ngram", "suffix", "draft_model")  # measured when none is named (a head's method joins with its folder)


DEFAULT_DRAFT_LENGTH = 8
MAX_DRAFT_LENGTH = 24  # suffix decoding's default tree depth; longer drafts say nothing more here
NGRAM_LOOKUP = (1, 3)  # prompt_lookup_min/max: the n-grams the project's own lookup is measured with
DRAFT_PASSES = {"ngram": "one", "suffix": "one", "draft_model": "depth", "eagle": "depth", "eagle3": "depth",
                "medusa": "one"}  # planner.cost.Guessing's draft_passes
LEARNS = ("suffix",)  # proposers that also draft from earlier requests' answers (suffix's global tree)
MAX_PASSES = 16  # sampled passes over the requests: past this a longer workload says more than more draws
REQUEST_TIMEOUT_S = 900.0


def default_methods(model: str, draft: str | None = None, head: str | None = None) -> tuple[str, ...]:
    """The proposers measured and raced when none is named: ngram and suffix, draft_model where a draft LM is
    given or ships for `model`, and the method of a head given or shipped for it (its layout's: eagle, eagle3,
    medusa)."""
    from decoder.engines.models import shipped
    from decoder.guessers.heads import serving_method

    out = ["ngram", "suffix"]
    if draft is not None or shipped(model, "draft_lm") is not None:
        out.append("draft_model")
    head = head_folder(model, head)
    if head is not None:
        out.append(serving_method(head))
    return tuple(out)


def head_folder(model: str, given: str | None) -> str | None:
    """The head a serving run measures: `given` (--drafter), else the EAGLE head shipped for `model`, else None."""
    if given is not None:
        return given
    from decoder.engines.models import shipped

    found = shipped(model, "eagle3")
    return None if found is None else str(found)


def drafter_of(method: str, draft_model) -> str | Path | None:
    """The folder `method` loads: `draft_model` is one folder for every method that loads one, or a mapping
    method -> folder (a run that measures a draft LM and a head)."""
    return draft_model.get(method) if isinstance(draft_model, dict) else draft_model


def speculative_config(method: str, k: int, draft_model=None) -> dict:
    """vLLM's --speculative-config for `method` drafting K tokens (suffix: at most K); draft_model: the drafter's
    folder (draft_model, eagle, eagle3, medusa), or a mapping method -> folder."""
    if method not in METHODS:
        raise UserError(f"--method {method}: expected one of {', '.join(METHODS)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_LENGTH:
        raise UserError(f"--max-depth: expected an integer in 1..{MAX_DRAFT_LENGTH}, got {k!r}")
    cfg = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        cfg.update(prompt_lookup_min=NGRAM_LOOKUP[0], prompt_lookup_max=NGRAM_LOOKUP[1])
    elif method in MODEL_METHODS:
        folder = drafter_of(method, draft_model)
        if folder is None:
            flag = "--draft-model DIR" if method == "draft_model" else "--drafter DIR (the head's folder)"
            raise UserError(f"--method {method} needs its drafter's folder ({flag})")
        cfg["model"] = str(folder)
    return cfg


def check_methods(methods: Sequence[str], python: Path) -> None:
    """One line for a method vLLM's environment cannot run, before any server starts."""
    for m in methods:
        if m not in METHODS:
            raise UserError(f"--method {m}: expected one of {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise UserError(f"--method: {','.join(methods)} names a method twice")
    if "suffix" in methods and not _has_module(python, "arctic_inference"):
        raise UserError("--method suffix: vLLM's suffix decoding needs arctic-inference in the vLLM environment "
                        "(run bash scripts/setup_vllm.sh)")


def _has_module(python: Path, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(python), "-c", code], capture_output=True, check=False).returncode == 0


def sampled_requests(requests: Sequence[Request], s, seed: int = 0, seeded: bool = True) -> list[Request]:
    """The requests under the user's settings: greedy (temperature 0), or sampled with request i
    seeded seed + i (`seeded` False: no seed, vLLM's own generator). These fields replace any the
    workload carries."""
    rec = sampling_record(s)
    out = []
    for i, r in enumerate(requests):
        extras = {k: v for k, v in r.extras.items() if k not in ("temperature", "top_p", "top_k", "seed")}
        extras["temperature"] = rec["temperature"]
        if rec["temperature"] > 0:
            if seeded:
                extras["seed"] = seed + i
            if rec["top_k"]:
                extras["top_k"] = rec["top_k"]
            if rec["top_p"] < 1:
                extras["top_p"] = rec["top_p"]
        out.append(replace(r, extras=extras))
    return out


# ---------------------------------------------------------------------------------------------- counts -> acceptance

def decode_steps(done: Sequence[RequestRecord], counters: SpecDecodeCounters) -> dict:
    """Verification steps of completed requests (see the module docstring; one pass's or several under
    one counter reading): both lower bounds and the larger, never fewer than the steps vLLM counted a
    draft in."""
    by_tokens = sum(r.output_tokens for r in done) - len(done) - int(counters.accepted_tokens)
    by_chunks = sum(max(len(set(r.token_times_s)) - 1, 0) for r in done)
    return {"steps": int(max(by_tokens, by_chunks, counters.drafts)), "steps_by_tokens": int(by_tokens),
            "steps_by_chunks": int(by_chunks)}


def chain_rows(accepted_per_position: Sequence[float], steps: float, k: int) -> tuple[list, list, list]:
    """(accuracy [K][1], counts [K][1], totals [K]) of a chain from vLLM's accepted counts per position:
    a_1 = accepted[0] / steps, a_{i+1} = accepted[i] / accepted[i-1] (0 where the total is 0)."""
    acc = [float(a) for a in accepted_per_position][:k]
    acc += [0.0] * (k - len(acc))
    totals = [float(steps)] + acc[:-1]
    if any(a > t + 1e-9 for a, t in zip(acc, totals)):
        raise UserError(f"vLLM's counters are inconsistent: accepted per position {acc} over {steps:g} steps "
                        "(a later position accepted more often than an earlier one)")
    rows = [[min(a / t, 1.0) if t > 0 else 0.0] for a, t in zip(acc, totals)]
    return rows, [[round(a)] for a in acc], [round(t) for t in totals]


def acceptance_record(method: str, k: int, counters: SpecDecodeCounters, result: LoadResult, config: dict,
                      s, model: str, engine: str, timed: tuple[LoadResult, SpecDecodeCounters] | None = None) -> dict:
    """The acceptance record (planner/accept.py format) of one method from one level's counters (or several
    passes' under one reading, `result` holding every pass's requests). `timed`: the one pass whose time the
    record keeps (its load and counters; default the whole `result`): a drafter's pass is priced from its
    served step (planner/serving.py draft_costs), which later passes at another concurrency would change."""
    steps = decode_steps(result.completed, counters)
    if steps["steps"] <= 0:
        raise UserError(f"--method {method}: no decoding step was measured (every answer ended at its first "
                        "token); raise --max-new-tokens")
    rows, counts, totals = chain_rows(counters.accepted_per_position, steps["steps"], k)
    drafts = counters.drafts
    done = result.completed
    return {
        "accuracy": rows, "counts": counts, "totals": totals, "conditional": True,
        "positions": steps["steps"], "prompts": len(done), "model": model, "engine": engine,
        "guesser": {"kind": f"vllm:{method}", "method": method, "prompt_tokens": False, "ensemble": 1, "top_k": 1,
                    "draft_passes": DRAFT_PASSES[method]},
        "sampling": sampling_record(s),
        "vllm": {
            "speculative_config": config, "draft_length": k,
            "drafts": drafts, "draft_tokens": counters.draft_tokens, "accepted_tokens": counters.accepted_tokens,
            "accepted_per_position": list(counters.accepted_per_position), **steps,
            "draft_rate": drafts / steps["steps"],
            "per_draft": list(counters.acceptance_per_position),
            "mean_acceptance_length": counters.mean_acceptance_length,
            "tokens_per_step": 1 + counters.accepted_tokens / steps["steps"],
            **_timing(*(timed or (result, counters))), "passes": 1, "counted_requests": len(result.records),
        },
    }


def _timing(result: LoadResult, counters: SpecDecodeCounters) -> dict:
    """The timed pass: its concurrency, requests, wall time and served step, and its own decoding steps."""
    return {"concurrency": result.concurrency, "requests": len(result.records), "output_tokens": result.output_tokens,
            "load_wall_s": result.wall_s, "output_tokens_per_s": result.output_tokens_per_s,
            "step_p50_s": result.step_p50_s, "timed_steps": decode_steps(result.completed, counters)["steps"]}


# ---------------------------------------------------------------------------------------------- measuring

def measure_method(engine, method: str, requests: Sequence[Request], s, draft_length: int = DEFAULT_DRAFT_LENGTH,
                   concurrency: int = 4, draft_model: str | Path | dict | None = None,
                   timeout_s: float = REQUEST_TIMEOUT_S, say: Callable[[str], None] | None = None,
                   server=None, launch_next=None, more: Sequence[Sequence[Request]] = (),
                   more_concurrency: int | None = None, forget: bool = False) -> dict:
    """One server of `engine` (decoder/engines/vllm/open.py) with `method`; its acceptance record.
    `server`: that server made (or launched) already; `launch_next`: a server launched once this one
    is up, before its requests (measure_methods; the caller stops it). `more`: further passes on the same
    server (other draws of the requests), counted, not timed, at `more_concurrency` (default `concurrency`),
    each from an empty prefix cache and, with `forget` (the plugin's reset), without suffix decoding's
    cached answers of the passes before."""
    say = say or (lambda line: None)
    config = speculative_config(method, draft_length, draft_model)
    t0 = time.perf_counter()
    say(f"{method}: vLLM with {config}")
    with server or engine.server(speculative_config=config) as server:
        started = time.perf_counter() - t0
        if launch_next is not None:
            launch_next.launch()
        before = fetch_spec_decode(server.url)
        say(f"{method}: {len(requests)} requests at concurrency {concurrency}")
        timed = run_load(server.url, server.served_model_name, requests, concurrency, timeout_s)  # Ctrl-C: stops
        timed_counters = fetch_spec_decode(server.url) - before
        _check_failures(method, timed)
        results, more_c = [timed], more_concurrency or concurrency
        for i, reqs in enumerate(more, 2):
            server.reset_prefix_cache(forget_answers=forget)
            say(f"{method}: pass {i} of {1 + len(more)}, {len(reqs)} requests at concurrency {more_c}")
            results.append(run_load(server.url, server.served_model_name, reqs, more_c, timeout_s))
            _check_failures(method, results[-1])
        counters = fetch_spec_decode(server.url) - before if more else timed_counters
    if not counters.speculating:
        raise UserError(f"--method {method}: vLLM exposes no speculative-decoding counters (it did not speculate)")
    every = LoadResult(timed.concurrency, sum(r.wall_s for r in results), [x for r in results for x in r.records])
    rec = acceptance_record(method, draft_length, counters, every, config, s, engine.model_name, engine.caps.name,
                            timed=(timed, timed_counters))
    rec["vllm"]["passes"] = len(results)
    rec["vllm"]["server_start_s"] = started  # the wait for it: less where it started during another load
    rec["wall_s"] = time.perf_counter() - t0
    v = rec["vllm"]
    say(f"{method}: accepted {v['accepted_tokens']:g} of {v['draft_tokens']:g} drafted over {v['steps']} steps "
        f"({v['tokens_per_step']:.2f} tokens/step) in {rec['wall_s']:.0f} s")
    return rec


def _check_failures(method: str, result: LoadResult) -> None:
    failed = [r for r in result.records if not r.ok]
    if failed:
        raise UserError(f"--method {method}: {len(failed)} of {len(result.records)} requests failed "
                        f"(request {failed[0].index}: {failed[0].error}); nothing written")


def measure_methods(engine, methods: Sequence[str], requests: Sequence[Request], s, seed: int = 0,
                    draft_length: int = DEFAULT_DRAFT_LENGTH, concurrency: int = 4,
                    draft_model: str | Path | dict | None = None, timeout_s: float = REQUEST_TIMEOUT_S,
                    say: Callable[[str], None] | None = None, plugin: bool = False,
                    drafter_concurrency: int | None = None, passes: int = 1) -> dict[str, dict]:
    """method -> its acceptance record, one server each, in order; the same (sampled) requests for all.
    `plugin`: the servers run with the project's vLLM plugin, which on vLLM 0.32's CPU build is what makes
    sampled verification use the requests' temperature and top-p (docs/vllm.md); greedy counts are the same.
    `drafter_concurrency`: a drafter model's load (one pass per drafted token, timed for planner/serving.py
    draft_costs) runs at this concurrency instead, where its passes are priced; the counts do not depend on it.
    `passes` (sampled only): the requests are sent that many times, pass p with seeds seed + p n + i, and
    every pass counts: one draw of 16 answers of 32 tokens measured suffix at 1.30-1.70 tokens a step on this
    CPU, by seed. Passes after the first run at `concurrency`, untimed; a proposer that learns from answers
    (suffix) takes them only where a reset makes it forget (the plugin), else one pass."""
    if not requests:
        raise UserError("no requests to measure acceptance on")
    drafter_c = concurrency if drafter_concurrency is None else drafter_concurrency
    for c in (concurrency, drafter_c):
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 1024:
            raise UserError(f"--concurrency: expected an integer in 1..1024, got {c!r}")
    if isinstance(passes, bool) or not isinstance(passes, int) or not 1 <= passes <= MAX_PASSES:
        raise UserError(f"--passes: expected an integer in 1..{MAX_PASSES}, got {passes!r}")
    if passes > 1 and s.temperature <= 0:
        raise UserError(f"--passes {passes}: greedy answers repeat, so one pass measures them; more need "
                        "--temperature above 0")
    say = say or (lambda line: None)
    configs = {m: speculative_config(m, draft_length, draft_model) for m in methods}  # all checked first
    draws = [sampled_requests(requests, s, seed + p * len(requests)) for p in range(passes)]
    out: dict[str, dict] = {}
    ahead = None  # the next method's server, launched while this method's requests run
    try:
        for m, after in zip(methods, list(methods[1:]) + [None]):
            server, ahead = ahead or engine.server(speculative_config=configs[m], plugin=plugin), None
            # a start is mostly imports on one core, and acceptance counts do not depend on timing, so the
            # next server starts during this load; a drafter's load is timed (draft_costs), so it runs alone
            if after is not None and DRAFT_PASSES[m] != "depth":
                ahead = engine.server(speculative_config=configs[after], plugin=plugin)
            c = drafter_c if DRAFT_PASSES[m] == "depth" else concurrency
            more = draws[1:] if plugin or m not in LEARNS else []
            if len(more) < passes - 1:
                say(f"{m}: one pass, not {passes}: without the plugin a reset leaves its cached answers, which a "
                    "repeated request would draft from")
            out[m] = measure_method(engine, m, draws[0], s, draft_length, c, draft_model, timeout_s, say,
                                    server=server, launch_next=ahead, more=more, more_concurrency=concurrency,
                                    forget=plugin and m in LEARNS)
            out[m]["vllm"]["plugin"] = plugin
    finally:
        if ahead is not None:
            ahead.stop()
    return out


def progress_line(line: str) -> None:
    print(f"planner accept (vllm): {line}", file=sys.stderr, flush=True)
