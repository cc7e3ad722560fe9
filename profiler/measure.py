"""Timing an engine's forward pass: n new tokens after a context of C tokens, at every input length.

    profile = profile_engine(engine, ProfileSpec(input_lengths=[1, 2, 4, 8], context_lengths=(128,)))

One sample = reset the engine's cache to the same C-token context (untimed), then one forward of n
tokens (timed) through `engine.forward_timer`: a tree (node i under (i - 1) // branching) on engines
that score trees, a chain on the others, exactly the pass decoding runs each step. Clocks are not
assumed stable: the first round visits lengths coarse to fine (ends, then midpoints: a budget that
runs out early still leaves the range covered, planner/order.py), every later round visits the
unfinished lengths in a fresh random order, so drift spreads over all lengths instead of bending the
curve. A length is done when the 95 % interval of its median (order statistics) is within
`target_rel_ci` of the median, or at `max_repeats`; each series stops at its share of the budget.
Before the lengths: an engine with caps.matmul_paths chooses each Linear's CPU matmul path (kept
installed, so L(n) is timed with them), and the decoder's own per-step work is measured
(profiler/overhead.py). The file's top level (what planner.profile reads) is the first series: batch
size 1 at the first context; "series" keeps every batch size there, "shapes" every context.
"""
from __future__ import annotations

import datetime
import math
import platform
import random
import subprocess
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from decoder.engine import TimerSpec, is_oom
from decoder.engines.registry import as_engine
from planner.errors import UserError
from planner.order import coarse_to_fine
from profiler.fit import fit_latency
from profiler.lengths import DEFAULT_LENGTHS_SPEC, default_input_lengths, parse_lengths  # noqa: F401 (re-exported)
from profiler.machine import cores, cpu_name, load_avg


@dataclass(frozen=True)
class ProfileSpec:
    """What to measure and how long. Defaults are `planner profile`'s."""

    input_lengths: tuple[int, ...]
    context_lengths: tuple[int, ...] = (256,)  # the first is the profile's own (what plans price steps at)
    batch_sizes: tuple[int, ...] = (1,)
    time_budget_s: float | None = None  # timing L(n); None: 15 s on the CPU, 120 s on a GPU
    layout: str = "padded"  # batch rows: "padded" (b rectangular rows) or "packed" (one row, EMS-SD)
    cuda_graphs: bool = False
    min_repeats: int = 5
    max_repeats: int = 50
    target_rel_ci: float = 0.02
    warmup: int = 1
    seed: int = 0
    overhead: bool = True  # also the decoder's own per-step work outside the forward (the cost model adds it)
    matmul_paths: str = "auto"  # engines with caps.matmul_paths on the CPU: "auto" chooses them first, "off" F.linear
    matmul_budget_s: float | None = None  # None: the time budget
    matmul_max_rows: int = 16
    deadline: float | None = None  # a time.time() by which the whole profile ends (L(n) never under half its budget)
    progress: bool = True


def profile_engine(engine, spec: ProfileSpec) -> dict:
    """Measure forward latency at every input length, batch size and context; returns the profile JSON
    object. Out of memory at a length drops it and all longer ones for that series; Ctrl-C stops
    measuring. In both cases the points measured so far are returned and "incomplete" says where it
    stopped (Ctrl-C before any point re-raises KeyboardInterrupt)."""
    check_spec(engine, spec)
    budget = spec.time_budget_s or (120.0 if engine.device.type == "cuda" else 15.0)
    paths = _matmul_paths(engine, spec, spec.matmul_budget_s or budget)  # before L(n): its budget starts after
    per_step = None
    if spec.overhead and spec.batch_sizes[0] == 1:
        from profiler.overhead import measure_overhead

        per_step = measure_overhead(engine, max(spec.input_lengths))
    budget = _left_for_lengths(budget, spec.deadline)
    st = _open(engine, spec, budget)
    load_start = load_avg()
    series, interrupted = _measure_all(st, budget)
    stopped = _stops(series, interrupted, spec)
    out = _measured(series, stopped, interrupted, spec)
    settings = dict(batch_sizes=list(spec.batch_sizes), input_lengths_requested=st.lengths, time_budget_s=budget,
                    min_repeats=spec.min_repeats, max_repeats=spec.max_repeats, target_rel_ci=spec.target_rel_ci,
                    warmup=spec.warmup, cuda_graphs=spec.cuda_graphs, seed=spec.seed,
                    load_avg_1m=[load_start, load_avg()])
    result = _profile_json(st, out, settings) | ({"matmul_paths": paths} if paths else {})
    if per_step is not None:
        result["decoder_overhead"] = per_step
    return _mark_incomplete(result, series, stopped)


def profile_model(target, input_lengths, **settings) -> dict:
    """`profile_engine` for a bare transformers model (or a loaded one): ProfileSpec's fields as keywords,
    with context_length for a single context and batch_sizes as any sequence."""
    if "context_length" in settings:
        settings["context_lengths"] = (int(settings.pop("context_length")),)
    if "batch_sizes" in settings:
        settings["batch_sizes"] = tuple(int(b) for b in settings["batch_sizes"])
    return profile_engine(as_engine(target), ProfileSpec(tuple(int(n) for n in input_lengths), **settings))


def check_spec(engine, spec: ProfileSpec) -> None:
    """A one-line error, before anything is timed, for what the spec asks that the engine cannot do."""
    if spec.layout not in ("padded", "packed"):
        raise UserError(f"--layout: expected padded or packed, got {spec.layout!r}")
    if spec.matmul_paths not in ("auto", "off"):
        raise UserError(f"--matmul-paths: expected auto or off, got {spec.matmul_paths!r}")
    if spec.cuda_graphs and engine.device.type != "cuda":
        raise UserError("--cuda-graphs: needs a CUDA device")
    if spec.layout == "packed" and spec.cuda_graphs:
        raise UserError("--layout packed: not with --cuda-graphs (per-sequence attention loops on the host)")
    if max(spec.batch_sizes) > 1 and not engine.caps.batches:
        raise UserError(f"--batch-sizes: the {engine.caps.name} engine decodes one sequence at a time")
    if any(C < 1 for C in spec.context_lengths):
        raise UserError(f"--context-length: must be at least 1, got {min(spec.context_lengths)}")
    engine.check_lengths(sorted(set(spec.input_lengths)), max(spec.context_lengths), max(spec.batch_sizes))


def _matmul_paths(engine, spec: ProfileSpec, budget_s: float) -> dict | None:
    """Engines with CPU matmul paths (caps.matmul_paths): with "auto" on the CPU, each Linear's fastest
    path per row count up to matmul_max_rows, measured and left installed, so L(n) is timed with them
    and the profile describes what decoding runs; otherwise F.linear everywhere."""
    if not engine.caps.matmul_paths:
        return None
    rows = sorted({int(n) for n in spec.input_lengths if int(n) <= spec.matmul_max_rows})
    if spec.matmul_paths == "off" or engine.device.type != "cpu" or not rows:
        engine.use_matmul_paths(None)
        return None
    return engine.choose_matmul_paths(rows, spec.context_lengths[0], budget_s, seed=spec.seed, progress=spec.progress)


def _left_for_lengths(time_budget_s: float, deadline: float | None) -> float:
    """L(n)'s budget: what the deadline leaves, never under half its own share."""
    if deadline is None:
        return time_budget_s
    return max(0.5 * time_budget_s, min(time_budget_s, deadline - time.time()))


@dataclass
class _Settings:
    """One profiling run's fixed inputs and shared state (clock, random sources, progress)."""

    engine: object
    spec: ProfileSpec
    lengths: list[int]
    rng: random.Random
    timer: Timer
    t_start: float
    bar: object
    n_samples: int = 0
    description: str = ""  # the timed input, as the engine's timer describes it

    @property
    def tree(self) -> bool:
        return bool(self.engine.caps.trees)

    def tick(self, label: str) -> None:
        self.n_samples += 1
        self.bar.update(min(time.time() - self.t_start, self.bar.total) - self.bar.n)
        self.bar.set_postfix_str(f"{label}, {self.n_samples} samples", refresh=False)


def _open(engine, spec: ProfileSpec, budget_s: float) -> _Settings:
    from tqdm import tqdm

    # a time-based bar: the run is bounded by the budget, and how many samples a length needs is unknown
    bar = tqdm(total=round(budget_s, 1), disable=not spec.progress, dynamic_ncols=True,
               bar_format="{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s budget{postfix}")
    return _Settings(engine, spec, sorted(set(int(n) for n in spec.input_lengths)), random.Random(spec.seed),
                     Timer(engine.device), time.time(), bar)


def _measure_all(st: _Settings, budget_s: float) -> tuple[list[Series], bool]:
    """Every (context, batch size) in turn, each with an equal share of what is left; Ctrl-C stops."""
    runs = [(C, b) for C in st.spec.context_lengths for b in st.spec.batch_sizes]
    series: list[Series] = []
    try:
        for i, (C, b) in enumerate(runs):
            s = Series(b, C)
            series.append(s)
            _measure_series(st, s, time.time() + (budget_s - (time.time() - st.t_start)) / (len(runs) - i))
    except KeyboardInterrupt:
        return series, True
    finally:
        st.bar.close()
    return series, False


def _measure_series(st: _Settings, s: Series, deadline: float) -> None:
    """Every length of one (context, batch size): round one coarse to fine, then shuffled rounds until
    each length's median is tight enough or the deadline passes."""
    spec = st.spec
    ts = TimerSpec(s.context_length, s.batch_size, tree=st.tree, packed=spec.layout == "packed",
                   cuda_graphs=spec.cuda_graphs, seed=st.rng.randrange(2**31))
    try:
        timer = _guarded(lambda: st.engine.forward_timer(ts))
    except _OutOfMemory:
        s.stopped = {"reason": "out of memory", "batch_size": s.batch_size, "input_length": 0, "at": "prefill"}
        _free(st.engine.device)
        return
    st.description = timer.description
    label = f"b={s.batch_size}{' packed' if ts.packed else ''} C={s.context_length}"
    st.bar.set_description(f"profiling {label}")
    try:
        active = _first_round(st, s, timer, deadline, label)
        _later_rounds(st, s, timer, active, deadline, label)
    finally:
        timer.close()
        del timer
        _free(st.engine.device)


def _measured(series: list[Series], stopped: list[dict], interrupted: bool, spec: ProfileSpec) -> list[dict]:
    """The measured series; nothing for the first one means no profile (Ctrl-C re-raises)."""
    out = [j for j in (s.to_json() for s in series) if j is not None]
    first = (spec.context_lengths[0], spec.batch_sizes[0])
    if not out or (out[0]["context_length"], out[0]["batch_size"]) != first:
        if interrupted:
            raise KeyboardInterrupt
        stop = stopped[0] if stopped else {}
        raise UserError(
            f"out of memory at input length {stop.get('input_length')} (batch size {stop.get('batch_size')}, context "
            f"{first[0]}); nothing measured for the first batch size, so no profile written"
        )
    return out


def _stops(series: list[Series], interrupted: bool, spec: ProfileSpec) -> list[dict]:
    stopped = [s.stopped for s in series if s.stopped]
    if interrupted:
        done_b = {s.batch_size for s in series}
        stopped.append({"reason": "interrupted", "batch_size": series[-1].batch_size if series else spec.batch_sizes[0],
                        "not_started_batch_sizes": [b for b in spec.batch_sizes if b not in done_b]})
    return stopped


def _mark_incomplete(result: dict, series: list[Series], stopped: list[dict]) -> dict:
    if stopped:
        result["incomplete"] = stopped
    unmeasured = {s.batch_size: s.unmeasured for s in series if s.unmeasured}
    if unmeasured:
        result["unmeasured_input_lengths"] = {str(b): ns for b, ns in unmeasured.items()}
    return result


def median_rel_ci(samples: list[float]) -> float:
    """Half-width of a distribution-free 95% CI of the median, relative to the median.

    With r sorted samples the CI runs from order statistic k to r-1-k, k = floor((r - 1.96 sqrt r)/2).
    """
    r = len(samples)
    if r < 2:
        return math.inf
    x = sorted(samples)
    k = max(0, int((r - 1.96 * math.sqrt(r)) / 2))
    med = float(np.median(x))
    return (x[r - 1 - k] - x[k]) / (2 * med) if med > 0 else math.inf


class Timer:
    """Seconds spent in fn(): CUDA events on GPU (device time between the two events, which includes
    any wait for kernel launches, as a decoding step has), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass
class Series:
    batch_size: int
    context_length: int = 0
    samples: dict[int, list[float]] = field(default_factory=dict)  # n -> seconds
    stopped: dict | None = None  # {"reason", "input_length", ...} when cut short
    unmeasured: list[int] = field(default_factory=list)  # lengths the time budget did not reach

    def to_json(self) -> dict | None:
        ns = sorted(n for n, s in self.samples.items() if s)
        if not ns:
            return None
        med = [float(np.median(self.samples[n])) for n in ns]
        reps = [len(self.samples[n]) for n in ns]
        return {
            "batch_size": self.batch_size,
            "context_length": self.context_length,
            "input_lengths": ns,
            "latency_s": med,
            "p10_s": [float(np.percentile(self.samples[n], 10)) for n in ns],
            "p90_s": [float(np.percentile(self.samples[n], 90)) for n in ns],
            "repeats": reps,
            "median_rel_ci95": [min(median_rel_ci(self.samples[n]), 1e9) for n in ns],
            "fit": fit_latency(ns, med, reps),
        }


class _OutOfMemory(Exception):
    pass


def _guarded(fn):
    """Run fn(); an out-of-memory error becomes _OutOfMemory, anything else propagates."""
    try:
        return fn()
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
        if not is_oom(e):
            raise
        raise _OutOfMemory from None


def _drop_from(st: _Settings, s: Series, timer, n: int, *queues: list[int]) -> None:
    """Out of memory at n: lengths from n up that have no sample yet are dropped; measured ones are kept."""
    timer.drop(n)
    _free(st.engine.device)
    if s.stopped is None or n < s.stopped["input_length"]:
        s.stopped = {"reason": "out of memory", "batch_size": s.batch_size, "input_length": n}
    for q in queues:
        q[:] = [m for m in q if m < n]


def _first_round(st: _Settings, s: Series, timer, deadline: float, label: str) -> list[int]:
    """Coarse to fine (ends, then midpoints): if the budget runs out here the measured lengths still
    span the range. Each length is warmed up just before its first sample. Returns the lengths measured."""
    todo = coarse_to_fine(st.lengths)
    active: list[int] = []
    while todo:
        if len(s.samples) >= 2 and time.time() > deadline:
            break
        n = todo.pop(0)
        try:
            _guarded(lambda: timer.warm(n, st.spec.warmup))
            s.samples[n] = [_guarded(lambda: st.timer(timer.sample(n)))]
            st.tick(label)
        except _OutOfMemory:
            _drop_from(st, s, timer, n, todo, active)
            continue
        active.append(n)
    if todo:
        s.unmeasured = sorted(todo)
    return active


def _later_rounds(st: _Settings, s: Series, timer, active: list[int], deadline: float, label: str) -> None:
    """Unfinished lengths in a fresh random order each round, until done or out of time."""
    while active:
        st.rng.shuffle(active)
        for n in list(active):
            if time.time() > deadline or n not in active:
                break
            try:
                s.samples[n].append(_guarded(lambda: st.timer(timer.sample(n))))
                st.tick(label)
            except _OutOfMemory:
                _drop_from(st, s, timer, n, active)
        done = [n for n in active if len(s.samples[n]) >= st.spec.max_repeats
                or (len(s.samples[n]) >= st.spec.min_repeats and median_rel_ci(s.samples[n]) <= st.spec.target_rel_ci)]
        if time.time() > deadline:
            done = list(active)
        for n in done:
            active.remove(n)


def _profile_json(st: _Settings, out: list[dict], settings: dict) -> dict:
    """The first series at the top level; every batch size at the first context in "series"; with more
    than one context, every series in "shapes"."""
    engine, first = st.engine, out[0]
    result = {k: first[k] for k in ("input_lengths", "latency_s", "p10_s", "p90_s", "repeats", "fit")}
    record = engine.record()
    shape = "tree" if st.tree else "chain"
    result.update(record)
    result.update({
        "batch_size": first["batch_size"],
        "series": [{k: v for k, v in s.items() if k != "context_length"} for s in out
                   if s["context_length"] == first["context_length"]],
        "device": engine.device.type,
        "device_name": device_name(engine.device),
        "context_length": first["context_length"],
        "layout": st.spec.layout,
        "shape": shape,
        "versions": versions(engine),
        "threads": engine.caps.threads if engine.caps.threads is not None else torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": settings | {
            "timer": "cuda_events" if engine.device.type == "cuda" else "perf_counter",
            "order": "first round coarse to fine (ends, then midpoints), later rounds shuffled over unfinished lengths",
            shape: st.description,
            "context_lengths": list(st.spec.context_lengths),
            "cpu_count": cores(),
        } | ({"attn_implementation": record["attention"]} if "attention" in record else {}),
        "wall_s": round(time.time() - st.t_start, 3),
    })
    if len(st.spec.context_lengths) > 1:
        result["shapes"] = [{"shape": shape, **s} for s in out]
    return result


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def versions(engine) -> dict:
    """Python, numpy, the engine's libraries, and on CUDA the toolkit and the driver."""
    v = {"python": platform.python_version(), "numpy": np.__version__, **engine.versions()}
    if engine.device.type == "cuda":
        v["cuda"] = torch.version.cuda
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            v["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            v["driver"] = None
    return v


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def warm_up_shapes(target, prompts: list[torch.Tensor], input_lengths) -> None:
    """One untimed pass at every shape a timed decoding run will meet: each prompt's prefill and a
    step of every input length (the first forward at a new shape can cost many times a warm one on
    the CPU), so that no timing pays a first-call cost. target: an engine or a model."""
    engine = as_engine(target)
    gen = torch.Generator().manual_seed(0)
    lengths = sorted({int(p.numel()) for p in prompts})
    if not lengths:
        return
    for T in lengths:
        engine.start(torch.randint(0, engine.vocab_size, (max(T, 2),), generator=gen).to(engine.device))
    timer = engine.forward_timer(TimerSpec(max(lengths[-1] - 1, 1), tree=bool(engine.caps.trees)))
    try:
        for n in sorted({int(n) for n in input_lengths}):
            timer.warm(n, 1)
    finally:
        timer.close()
