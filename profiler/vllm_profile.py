"""vLLM's own step time against batch size and draft length: `planner profile --engine vllm`.

    spec = ServingProfileSpec(draft_lengths=(0, 2, 4), batch_sizes=(1, 4), time_budget_s=200)
    check_spec(spec)                         # one-line UserError before anything starts
    profile = profile_serving(engine, spec)  # engine: decoder.engines.vllm.open.VllmEngine

Two worker processes in vLLM's environment (decoder/engines/vllm/steps_worker.py, which says how a
step is priced at any K without a real proposer): vLLM plain for K = 0, then one speculative engine
for every K >= 1 (and, last unless speculative_k0 is off, K = 0 in that engine: what a schedule's K = 0
range costs). Here their
lines are checked as they arrive, vLLM's draft counters included (K drafted tokens per draft, a
draft per sequence per counted step), and assembled into the project's latency profile: one series
per batch size, input length 1 + K, latency the median step (planner/profile.py's
load_batch_profiles, then planner/batch.py's plan_chain_schedule, plan a draft length per batch size
from it). Inside the speculative engine the draft lengths run coarse to fine (the ends first), so a
budget cut short still spans the range. The budget covers the whole run, engine starts included;
Ctrl-C or a failing engine keeps what was measured and says so in "incomplete".
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from decoder.engines.vllm.server import failure_reason, stop_group, watch_group
from planner.errors import UserError
from planner.vllm_plugin import PLUGIN_ENV
from planner.order import coarse_to_fine
from profiler.fit import fit_latency
from profiler.machine import cores, cpu_name, load_avgs, vector_extensions

WORKER = Path(__file__).resolve().parents[1] / "decoder" / "engines" / "vllm" / "steps_worker.py"
DRAFT_LENGTHS = (0, 1, 2, 3, 4, 6, 8)
BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_BUDGET_S = 360.0  # two engine starts of 40-50 s on a 2-core CPU and about 40 points
MAX_DRAFT_LENGTH = 32
MAX_BATCH_SIZE = 256
MAX_MODEL_LEN = 2048
START_GUESS_S = 50.0  # an engine's import and start, before one has been timed here
MIN_MEASURE_S = 5.0  # an engine is started only with at least this long left for measuring after its start
KILL_GRACE_S = 60.0  # past its deadline, a worker finishing a point or shutting down is stopped
TAIL_STEPS = 4  # decode steps a point takes beyond the counted ones (steps_worker.TAIL_STEPS)
POLL_S = 0.2
PREFILL_WEIGHT = 2.0  # an engine's prefill of every prompt, in points of one K at every batch size
PLAIN, SPECULATIVE = "plain", "speculative"


@dataclass(frozen=True)
class ServingProfileSpec:
    """What to measure and how long; the defaults are `planner profile --engine vllm`'s."""

    draft_lengths: tuple[int, ...] = DRAFT_LENGTHS  # K; the profile's input length is 1 + K
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    prompt_length: int = 256  # tokens in each sequence's KV cache before its first step (and one marker)
    time_budget_s: float = DEFAULT_BUDGET_S  # the whole run, engine starts included
    warmup_steps: int = 2  # counted steps dropped at each point (first use of its shapes)
    repeats: int = 5
    steps_per_repeat: int = 2
    seed: int = 0
    progress: bool = True
    # K = 0 in the speculative engine too: what a schedule's K = 0 range costs (for the reader; the planner
    # prices K = 0 on plain's points), so the serving main job, short of time, leaves it out
    speculative_k0: bool = True
    # the requests' sampling: a sampled step verifies each draft under the request's temperature and top-p over
    # the whole vocabulary at every drafted position, work a greedy step does not do (the sampled main job's
    # served steps at K = 8 ran 13-29 ms above a greedy profile's price at one request)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    plugin: bool = False  # the project's vLLM plugin in the workers: sampled verification is right only with it

    @property
    def steps_needed(self) -> int:
        return self.warmup_steps + self.repeats * self.steps_per_repeat


@dataclass(frozen=True)
class StepPoint:
    """One measured (engine, K, b): the median of `repeat_s`, each the mean of steps_per_repeat engine steps."""

    engine: str  # PLAIN or SPECULATIVE
    draft_length: int
    batch_size: int
    step_s: float
    repeat_s: tuple[float, ...]
    steps: int  # engine steps in the repeats
    full_steps: int  # steps that decoded every sequence, warm-up included
    other_steps: int  # decoding steps that did not (the first decode step, the finish)
    context_mean: float  # mean KV length per sequence over the counted steps
    wall_s: float
    drafts: int  # vLLM's counters over the point: a sequence's draft in a step, and the tokens drafted
    drafted: int

    @property
    def input_length(self) -> int:
        return 1 + self.draft_length

    def to_json(self) -> dict:
        return {"engine": self.engine, "draft_length": self.draft_length, "batch_size": self.batch_size,
                "input_length": self.input_length, "step_s": self.step_s, "repeat_s": list(self.repeat_s),
                "steps": self.steps, "full_steps": self.full_steps, "other_steps": self.other_steps,
                "context_mean": round(self.context_mean, 1), "wall_s": round(self.wall_s, 3),
                "drafts": self.drafts, "drafted": self.drafted}


@dataclass
class WorkerResult:
    """What one worker process (one engine) gave, and why it stopped early if it did."""

    engine: str
    start_s: float | None = None  # vLLM's engine construction, as the worker timed it
    ready_s: float | None = None  # from starting the process to a ready engine (import included)
    vllm: str | None = None
    points: list[StepPoint] = field(default_factory=list)
    unmeasured: list[dict] = field(default_factory=list)  # {"draft_length", "batch_size", "reason"}
    error: str | None = None  # the worker failed or was stopped: one line, with vLLM's reason
    done: bool = False
    interrupted: bool = False  # Ctrl-C: the worker was stopped, its points so far kept


# ---------------------------------------------------------------------------------------------- checks


def check_spec(spec: ServingProfileSpec) -> None:
    """One line for a spec that cannot run, before any engine starts."""
    ks, bs = spec.draft_lengths, spec.batch_sizes
    if not ks or any(not _int(k) or not 0 <= k <= MAX_DRAFT_LENGTH for k in ks) or len(set(ks)) != len(ks):
        raise UserError(f"--input-lengths: draft lengths 1 + K with K in 0..{MAX_DRAFT_LENGTH}, each once, "
                        f"got K = {list(ks)}")
    if not bs or any(not _int(b) or not 1 <= b <= MAX_BATCH_SIZE for b in bs) or len(set(bs)) != len(bs):
        raise UserError(f"--batch-sizes: expected distinct integers in 1..{MAX_BATCH_SIZE}, got {list(bs)}")
    for name, v in (("repeats", spec.repeats), ("steps_per_repeat", spec.steps_per_repeat),
                    ("prompt_length", spec.prompt_length)):
        if not _int(v) or v < 1:
            raise UserError(f"{name}: expected a positive integer, got {v!r}")
    if not _int(spec.warmup_steps) or spec.warmup_steps < 0:
        raise UserError(f"warmup_steps: expected an integer >= 0, got {spec.warmup_steps!r}")
    if not math.isfinite(spec.time_budget_s) or spec.time_budget_s <= 0:
        raise UserError(f"--time-budget: expected a positive number of seconds, got {spec.time_budget_s}")
    if not (_number(spec.temperature) and 0.0 <= spec.temperature <= 100.0):
        raise UserError(f"--temperature: expected a number in 0..100, got {spec.temperature!r}")
    if not (_number(spec.top_p) and 0.0 < spec.top_p <= 1.0):
        raise UserError(f"--top-p: expected a number in (0, 1], got {spec.top_p!r}")
    if not _int(spec.top_k) or spec.top_k < 0:
        raise UserError(f"--top-k: expected an integer >= 0, got {spec.top_k!r}")
    room = MAX_MODEL_LEN - (1 + spec.steps_needed + TAIL_STEPS + max(ks) + 1)  # marker, decoded, drafts
    if spec.prompt_length > room:
        raise UserError(f"--context-length {spec.prompt_length}: the sequences would outgrow vLLM's "
                        f"{MAX_MODEL_LEN}-token model length here; at most {room}")


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_event(line: str, request: dict) -> dict:
    """One line of a worker's output, checked against what it was asked (and vLLM's draft counters
    against K); ValueError says what is wrong."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg})") from None
    if not isinstance(obj, dict) or obj.get("event") not in ("ready", "point", "unmeasured", "done"):
        raise ValueError("expected an object with 'event' ready, point, unmeasured or done")
    if obj["event"] == "done":
        return obj
    if obj["event"] == "ready":
        if not _number(obj.get("start_s")) or obj["start_s"] < 0:
            raise ValueError("'start_s' must be a number >= 0")
        return obj
    k, b = obj.get("draft_length"), obj.get("batch_size")
    if not _int(k) or k not in request["draft_lengths"]:
        raise ValueError(f"'draft_length' {k!r} was not asked of this engine")
    if not _int(b) or b not in request["batch_sizes"]:
        raise ValueError(f"'batch_size' {b!r} was not asked for")
    if obj["event"] == "unmeasured":
        if not isinstance(obj.get("reason"), str):
            raise ValueError("'reason' must be a string")
        return obj
    reps = obj.get("repeat_s")
    if not isinstance(reps, list) or not reps or not all(_number(r) and r > 0 for r in reps):
        raise ValueError("'repeat_s' must be a non-empty list of positive numbers")
    for key in ("step_s", "context_mean", "wall_s"):
        if not _number(obj.get(key)) or obj[key] <= 0:
            raise ValueError(f"'{key}' must be a positive number")
    for key in ("steps", "full_steps", "other_steps", "drafts", "drafted"):
        if not _int(obj.get(key)) or obj[key] < 0:
            raise ValueError(f"'{key}' must be an integer >= 0")
    if obj["steps"] < 1:
        raise ValueError("'steps' must be at least 1")
    _check_drafts(obj, request)
    return obj


def _check_drafts(obj: dict, request: dict) -> None:
    """The scored length, from vLLM's own counters: K tokens in every draft, a draft for every
    sequence in every counted step (a point aborted at the deadline may miss its last step's count).
    vLLM 0.32 admits a request whose prompt is all in the prefix cache but one token like a decode
    step padded to the engine's largest K (the scheduler's "pad new decode requests"); the prompts
    here share their prefix across points, so each sequence may add one such draft."""
    k, b, drafts, drafted = obj["draft_length"], obj["batch_size"], obj["drafts"], obj["drafted"]
    k_max = max(request["draft_lengths"])
    pads = 0
    if not request["speculative"]:
        if drafted or drafts:
            raise ValueError(f"K={k} b={b}: vLLM drafted {drafted} tokens without a speculative config")
        return
    if k < k_max and (drafted - k * drafts) % (k_max - k) == 0:
        pads = (drafted - k * drafts) // (k_max - k)
    if drafted != k * (drafts - pads) + k_max * pads or not 0 <= pads <= b:
        raise ValueError(f"K={k} b={b}: vLLM drafted {drafted} tokens in {drafts} drafts, not {k} in each")
    if k and drafts - pads < b * obj["full_steps"] - (b if obj.get("aborted") else 0):
        raise ValueError(f"K={k} b={b}: vLLM counted {drafts - pads} drafts in {obj['full_steps']} steps of {b} "
                         "sequences: some steps scored fewer than 1 + K tokens")


def _point(engine: str, obj: dict) -> StepPoint:
    return StepPoint(engine, obj["draft_length"], obj["batch_size"], float(obj["step_s"]),
                     tuple(map(float, obj["repeat_s"])), obj["steps"], obj["full_steps"], obj["other_steps"],
                     float(obj["context_mean"]), float(obj["wall_s"]), obj["drafts"], obj["drafted"])


# ---------------------------------------------------------------------------------------------- one worker


def _request(engine, spec: ServingProfileSpec, speculative: bool, ks: list[int], deadline: float) -> dict:
    return {"model": str(engine.model_dir), "speculative": speculative, "draft_lengths": ks,
            "batch_sizes": coarse_to_fine(sorted(spec.batch_sizes)), "prompt_length": spec.prompt_length,
            "warmup_steps": spec.warmup_steps, "repeats": spec.repeats, "steps_per_repeat": spec.steps_per_repeat,
            "deadline": deadline, "seed": spec.seed, "max_model_len": MAX_MODEL_LEN,
            "temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k, "plugin": spec.plugin}


WORKER_GRACE_S = 10.0  # SIGTERM to SIGKILL: after "done" vLLM's own shutdown adds nothing worth waiting for


def run_worker(python: Path, request: dict, kill_at: float, say: Callable[[str], None],
               worker: Path = WORKER) -> WorkerResult:
    """Run one worker to its end (or `kill_at`, a time.time()); its process group never outlives this
    call, Ctrl-C included. Lines are checked as they arrive; a bad one stops the worker."""
    result = WorkerResult(SPECULATIVE if request["speculative"] else PLAIN)
    tmp = Path(tempfile.mkdtemp(prefix=f"tree-planner-vllm-steps-{result.engine}-"))
    req_path, out_path, log_path = tmp / "request.json", tmp / "out.jsonl", tmp / "worker.log"
    req_path.write_text(json.dumps(request))
    out_path.write_text("")
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", **os.environ}
    if request.get("plugin"):  # it refuses the stub proposer for itself; its fix of sampled verification still acts
        env[PLUGIN_ENV] = "1"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(python), str(worker), str(req_path), str(out_path)], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    watchdog = watch_group(proc.pid, WORKER_GRACE_S)
    seen, t0 = 0, time.time()
    try:
        while True:
            rc = proc.poll()
            seen = _read_new(out_path, seen, request, result, say)
            if result.ready_s is None and result.start_s is not None:
                result.ready_s = time.time() - t0
            if result.done or result.error:
                break
            if rc is not None:
                result.error = f"exited with code {rc}: {failure_reason(log_path)}"
                break
            if time.time() > kill_at:
                result.error = "did not finish within its share of the time budget; stopped"
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        stop_group(proc, WORKER_GRACE_S, watchdog)
    if result.error:
        result.error += f" (log: {log_path})"
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _read_new(path: Path, seen: int, request: dict, result: WorkerResult, say: Callable[[str], None]) -> int:
    """Handle the complete lines past byte `seen`; returns the new offset."""
    with open(path, "rb") as f:
        f.seek(seen)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = parse_event(line, request)
        except ValueError as e:
            result.error = f"output line '{line[:80]}': {e}"
            break
        _handle(obj, result, say)
    return seen + end


def _handle(obj: dict, result: WorkerResult, say: Callable[[str], None]) -> None:
    if obj["event"] == "ready":
        result.start_s, result.vllm = float(obj["start_s"]), obj.get("vllm")
        say(f"  vLLM {result.engine}: engine ready in {obj['start_s']:.1f} s")
    elif obj["event"] == "point":
        p = _point(result.engine, obj)
        result.points.append(p)
        say(f"  K={p.draft_length} b={p.batch_size}: {p.step_s * 1e3:.1f} ms per step ({p.steps} steps, "
            f"context {p.context_mean:.0f}{', ' + result.engine + ' engine' if p.draft_length == 0 else ''})")
    elif obj["event"] == "unmeasured":
        result.unmeasured.append({k: obj[k] for k in ("draft_length", "batch_size", "reason")})
        say(f"  K={obj['draft_length']} b={obj['batch_size']}: unmeasured ({obj['reason']})")
    else:
        result.done = True


# ---------------------------------------------------------------------------------------------- the profile


def _plan(spec: ServingProfileSpec) -> list[tuple[bool, list[int], float]]:
    """(speculative, the Ks in measuring order, a weight for sharing the budget) per engine to start."""
    drafts = coarse_to_fine(sorted(k for k in spec.draft_lengths if k > 0))
    plain = 0 in spec.draft_lengths
    out = [(False, [0], 1.0 + PREFILL_WEIGHT)] if plain else []
    if drafts:
        # the cost of a point grows with the tokens it scores; K = 0 in this engine comes last
        k0 = plain and spec.speculative_k0
        out.append((True, drafts + ([0] if k0 else []), sum(1.0 + k / 4 for k in drafts) + k0 + PREFILL_WEIGHT))
    return out


def profile_serving(engine, spec: ServingProfileSpec, say: Callable[[str], None] | None = None,
                    worker: Path = WORKER) -> dict:
    """Measure every (K, b) within the budget and return the profile dict (planner/profile.py's format).
    Ctrl-C and a failing worker stop the run: what was measured is returned, with "incomplete"; with
    nothing measured, Ctrl-C propagates and a failure is a UserError."""
    check_spec(spec)
    say = say or ((lambda line: print(line, file=sys.stderr, flush=True)) if spec.progress else (lambda line: None))
    t0, load_before = time.time(), load_avgs()
    end = t0 + spec.time_budget_s
    plan = _plan(spec)
    results: list[WorkerResult] = []
    incomplete: list[dict] = []
    try:
        for j, (speculative, ks, weight) in enumerate(plan):
            starts = [r.ready_s for r in results if r.ready_s is not None]
            start_s = max(starts) if starts else START_GUESS_S
            left = end - time.time()
            later = len(plan) - j - 1
            # this engine's share of the time left after every remaining start, never below the minimum
            measure_s = max(MIN_MEASURE_S, (left - (later + 1) * start_s) * weight / sum(w for _, _, w in plan[j:]))
            if left < start_s + MIN_MEASURE_S:
                incomplete += [{"reason": "time budget", "draft_length": k, "engine": _name(speculative)} for k in ks]
                say(f"time budget: vLLM {_name(speculative)} not started ({left:.0f} s left, an engine start "
                    f"takes about {start_s:.0f} s)")
                continue
            deadline = end if not later else time.time() + start_s + measure_s
            say(f"vLLM {_name(speculative)} (K = {', '.join(map(str, ks))}; until {deadline - t0:.0f} s of "
                f"{spec.time_budget_s:.0f}): starting")
            r = run_worker(engine.python, _request(engine, spec, speculative, ks, deadline),
                           deadline + KILL_GRACE_S, say, worker)
            results.append(r)
            incomplete += [dict(u, engine=r.engine) for u in r.unmeasured]
            if r.interrupted:
                raise KeyboardInterrupt
            if r.error:
                if not any(x.points for x in results):
                    raise UserError(f"vLLM {r.engine} worker {r.error}")
                incomplete.append({"reason": "worker failed", "engine": r.engine, "error": r.error})
                say(f"vLLM {r.engine} worker {r.error}")
                break
    except KeyboardInterrupt:
        if not any(x.points for x in results):
            raise
        incomplete.append({"reason": "interrupted"})
    if not _profiled(results):
        why = "; ".join(f"K={i.get('draft_length', '-')} b={i.get('batch_size', '-')}: {i['reason']}"
                        for i in incomplete[:3]) or "no worker ran"
        raise UserError(f"no step measured within --time-budget {spec.time_budget_s:g} s: {why}")
    return assemble(engine, spec, results, incomplete, {"t0": t0, "load_before": load_before})


def _name(speculative: bool) -> str:
    return SPECULATIVE if speculative else PLAIN


def _profiled(results: list[WorkerResult]) -> list[StepPoint]:
    """The points the profile's series are made of: K = 0 from vLLM plain, K >= 1 from the speculative engine."""
    return [p for r in results for p in r.points if (p.draft_length == 0) == (p.engine == PLAIN)]


def _series(b: int, points: list[StepPoint]) -> dict:
    pts = sorted(points, key=lambda p: p.draft_length)
    ns = [p.input_length for p in pts]
    lat = [p.step_s for p in pts]
    reps = [len(p.repeat_s) for p in pts]
    return {"batch_size": b, "input_lengths": ns, "latency_s": lat,
            "p10_s": [float(np.percentile(p.repeat_s, 10)) for p in pts],
            "p90_s": [float(np.percentile(p.repeat_s, 90)) for p in pts],
            "repeats": reps, "draft_lengths": [p.draft_length for p in pts], "steps": [p.steps for p in pts],
            "context_mean": [round(p.context_mean, 1) for p in pts], "fit": fit_latency(ns, lat, reps)}


def assemble(engine, spec: ServingProfileSpec, results: list[WorkerResult], incomplete: list[dict],
             run: dict) -> dict:
    points = _profiled(results)
    series = [_series(b, [p for p in points if p.batch_size == b]) for b in sorted({p.batch_size for p in points})]
    first = series[0]
    profile = {k: first[k] for k in ("input_lengths", "latency_s", "p10_s", "p90_s", "repeats", "fit")}
    every = sorted((p for r in results for p in r.points), key=lambda p: (p.batch_size, p.draft_length, p.engine))
    profile.update({
        "batch_size": first["batch_size"], "series": series, "engine": "vllm", "model": engine.model_name,
        "model_dir": str(engine.model_dir), "dtype": "fp32", "device": "cpu", "device_name": cpu_name(),
        "context_length": spec.prompt_length, "layout": "packed", "shape": "chain",
        "points": [p.to_json() for p in every],
        "engine_start_s": {r.engine: round(r.ready_s, 2) for r in results if r.ready_s is not None},
        "machine": {"cpu": cpu_name(), "vector_extensions": vector_extensions(), "cores": cores(),
                    "load_avg_before": run["load_before"], "load_avg_after": load_avgs()},
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "vllm": next((r.vllm for r in results if r.vllm), None)},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "command": "planner " + " ".join(sys.argv[1:]),  # the subcommand that profiled: profile or autotune
            "draft_lengths": sorted(spec.draft_lengths), "batch_sizes": sorted(spec.batch_sizes),
            "time_budget_s": spec.time_budget_s, "warmup_steps": spec.warmup_steps, "repeats": spec.repeats,
            "steps_per_repeat": spec.steps_per_repeat, "seed": spec.seed, "max_model_len": MAX_MODEL_LEN,
            "sampling": {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k},
            "plugin": spec.plugin,
            "method": "vLLM's offline engine (fp32, eager, VLLM_CPU_KVCACHE_SPACE=2): plain for K = 0; for K >= 1 "
                      "one engine with num_speculative_tokens = the largest K and a custom_class proposer that "
                      "drafts the K marked in each prompt, drafts the model rejects (every K scores 1 + K tokens "
                      "per sequence and gains one); a step counts when all b sequences decoded in it and in the "
                      "step before; latency = median over repeats of the mean time between those steps' outputs; "
                      "drafted tokens checked against K with vLLM's counters",
            "timer": "perf_counter between llm_engine.step() returns",
        },
        "wall_s": round(time.time() - run["t0"], 3),
    })
    if incomplete:
        profile["incomplete"] = incomplete
    return profile


def table_lines(profile: dict) -> list[str]:
    """Step ms by K (rows) and batch size (columns), for the terminal; K = 0 in the speculative engine last."""
    rows: dict[str, dict[int, float]] = {}
    for p in profile["points"]:
        k = p["draft_length"]
        label = f"K={k:<2} n={k + 1:<2}" if (k == 0) == (p.get("engine", PLAIN) == PLAIN) else "K=0 spec."
        rows.setdefault(label, {})[p["batch_size"]] = p["step_s"]
    bs = sorted({b for r in rows.values() for b in r})
    order = sorted(rows, key=lambda s: (s.startswith("K=0 spec"), int(s.split()[0][2:].rstrip(".") or 0)))
    lines = ["step ms  " + "".join(f"{'b=' + str(b):>9}" for b in bs)]
    for label in order:
        lines.append(f"{label:<9}" + "".join(f"{rows[label][b] * 1e3:9.1f}" if b in rows[label] else f"{'-':>9}"
                                             for b in bs))
    return lines
