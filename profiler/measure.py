"""Timing the decoder's forward pass: n tree tokens over a KV cache of C tokens.

One sample = crop the cache back to C tokens (untimed), then one `decoder.engines.hf.forward.tree_forward`
of n tokens with a tree-shaped 4D mask and explicit position ids (timed), exactly the pass the
decoder runs each step. Clocks are not assumed stable: the first round visits lengths coarse to
fine (ends, then midpoints, so a budget that runs out early still leaves the range covered), and
every later round visits the unfinished lengths in a fresh random order, so drift spreads over all
lengths instead of bending the curve. A length is done
when the 95% confidence interval of its median (order statistics) is within `target_rel_ci` of
the median, or at `max_repeats`; the whole run stops at `time_budget_s`.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import random
import subprocess
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from decoder.engines.hf.engine import HFEngine
from decoder.engines.hf.timer import (  # noqa: F401 (TreeInput, Runner, make_tree_input: re-exported for tests)
    TREE_BRANCHING,
    HFForwardTimer,
    Runner,
    TreeInput,
    is_oom,
    make_tree_input,
    pack_cache,
    packed_input,
)
from planner.errors import UserError
from profiler.fit import fit_latency
from profiler.lengths import DEFAULT_LENGTHS_SPEC, default_input_lengths, parse_lengths  # noqa: F401 (re-exported)
from decoder.engines.hf.load import LoadedModel, config_hash, dtype_name

def check_lengths(input_lengths: list[int], context_length: int, max_positions: int | None, model=None,
                  batch_size: int = 1, device=None) -> None:
    """Every length must fit the model's positions and, with `model`, this machine's memory."""
    if context_length < 1:
        raise UserError(f"--context-length: must be at least 1, got {context_length}")
    if max_positions is not None and context_length + max(input_lengths) > max_positions:
        raise UserError(
            f"--input-lengths: length {max(input_lengths)} exceeds the model's maximum position "
            f"(context {context_length} + {max(input_lengths)} > max_position_embeddings {max_positions}; "
            f"longest allowed {max_positions - context_length})"
        )
    if model is not None:
        need = forward_bytes(model, max(input_lengths), context_length, batch_size)
        free = available_bytes(torch.device(device) if device is not None else next(model.parameters()).device)
        if free is not None and need > 0.8 * free:
            raise UserError(f"--input-lengths/--context-length/--batch-size: a forward over {max(input_lengths)} tokens "
                            f"after {context_length} at batch {batch_size} needs about {need / 2**30:.1f} GiB, "
                            f"{free / 2**30:.1f} GiB are free")


def forward_bytes(model, n: int, context_length: int, batch_size: int = 1) -> int:
    """Rough peak memory of one forward over n new tokens: fp32 logits, the KV cache, activations."""
    cfg = model.config.get_text_config()
    item = next(model.parameters()).element_size()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = 2 * cfg.num_hidden_layers * (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim * item
    logits = n * cfg.vocab_size * 4
    activations = n * (cfg.hidden_size * 8 + getattr(cfg, "intermediate_size", 4 * cfg.hidden_size) * 3) * item
    scores = heads * n * (context_length + n) * 4  # one layer's attention scores at a time
    return batch_size * (logits + (context_length + n) * kv + activations + scores)


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device (CPU: MemAvailable), None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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


def coarse_to_fine(m: int) -> list[int]:
    """Indices 0..m-1: last, first, then midpoints level by level (breadth-first bisection)."""
    order = [m - 1, 0][: min(m, 2)]
    level = [(0, m - 1)]
    while level:
        nxt = []
        for lo, hi in level:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                order.append(mid)
                nxt += [(lo, mid), (mid, hi)]
        level = nxt
    return order


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
            "input_lengths": ns,
            "latency_s": med,
            "p10_s": [float(np.percentile(self.samples[n], 10)) for n in ns],
            "p90_s": [float(np.percentile(self.samples[n], 90)) for n in ns],
            "repeats": reps,
            "median_rel_ci95": [min(median_rel_ci(self.samples[n]), 1e9) for n in ns],
            "fit": fit_latency(ns, med, reps),
        }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions(device: torch.device) -> dict:
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
         "numpy": np.__version__}
    if device.type == "cuda":
        v["cuda"] = torch.version.cuda
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            v["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            v["driver"] = None
    return v


@dataclass
class _Settings:
    """One profiling run's fixed inputs and shared state (clock, random sources, progress)."""

    hf: object
    device: torch.device
    lengths: list[int]
    context_length: int
    cuda_graphs: bool
    min_repeats: int
    max_repeats: int
    target_rel_ci: float
    warmup: int
    dtype: torch.dtype
    vocab: int
    gen: torch.Generator
    rng: random.Random
    timer: Timer
    t_start: float
    bar: object
    layout: str = "padded"  # batch rows ("padded": b rectangular rows) or one packed row (EMS-SD)
    n_samples: int = 0
    engine: object = None  # the engine whose forward_timer is timed (decoder/engine.py)

    def tick(self, b: int) -> None:
        self.n_samples += 1
        self.bar.update(min(time.time() - self.t_start, self.bar.total) - self.bar.n)
        self.bar.set_postfix_str(f"batch {b}, {self.n_samples} samples", refresh=False)


def profile_model(
    model,
    input_lengths: list[int],
    context_length: int = 256,
    batch_sizes=(1,),
    device=None,
    time_budget_s: float | None = None,
    cuda_graphs: bool = False,
    progress: bool = True,
    min_repeats: int = 5,
    max_repeats: int = 50,
    target_rel_ci: float = 0.02,
    warmup: int = 1,
    seed: int = 0,
    overhead: bool = True,
    layout: str = "padded",
    matmul_paths: str = "auto", matmul_budget_s: float | None = None, matmul_max_rows: int = 16,
    deadline: float | None = None,
) -> dict:
    """Measure forward latency at every input length and batch size; returns the profile JSON object.

    `model` is a LoadedModel or a bare transformers model. overhead: also measure the decoder's
    own per-step work outside the forward pass (profiler/overhead.py), which the cost model adds;
    layout: batch rows "padded" (rectangular) or "packed" (one row, EMS-SD); matmul_paths: `_matmul_paths`.
    deadline (a time.time() value): the whole profile ends by then, L(n) taking what the matmul paths
    and the overhead left of it (never less than half its budget): the main job's phases each keep
    their share of one budget, and the paths' installation and the overhead's new shapes overran it.
    Out of memory at a length drops that
    length and all longer ones for that batch size; Ctrl-C stops measuring. In both cases the
    points measured so far are returned and "incomplete" says where it stopped (Ctrl-C before any
    point re-raises KeyboardInterrupt).
    """
    loaded = model if isinstance(model, LoadedModel) else None
    hf = loaded.model if loaded else model
    device = torch.device(device) if device is not None else next(hf.parameters()).device
    if time_budget_s is None:
        time_budget_s = 120.0 if device.type == "cuda" else 15.0
    paths = _matmul_paths(hf, device, input_lengths, context_length, matmul_paths, matmul_budget_s or time_budget_s,
                          matmul_max_rows, seed, progress)  # before _open: L(n)'s budget starts after
    per_step = _overhead(hf, input_lengths) if overhead and int(batch_sizes[0]) == 1 else None
    time_budget_s = _left_for_lengths(time_budget_s, deadline)
    st = _open(hf, device, input_lengths, context_length, cuda_graphs, min_repeats, max_repeats, target_rel_ci,
               warmup, seed, time_budget_s, progress)
    attn_before = getattr(hf.config, "_attn_implementation", None)
    st.layout = _layout(hf, layout, cuda_graphs)
    lengths = st.lengths
    batch_sizes = [int(b) for b in batch_sizes]
    load_start = _load()
    series, interrupted = _measure_batches(st, batch_sizes, time_budget_s)
    stopped = _stops(series, batch_sizes, interrupted)
    out_series = _measured(series, batch_sizes, stopped, interrupted, context_length)
    settings = dict(batch_sizes=batch_sizes, input_lengths_requested=lengths, time_budget_s=time_budget_s,
                    min_repeats=min_repeats, max_repeats=max_repeats, target_rel_ci=target_rel_ci, warmup=warmup,
                    cuda_graphs=cuda_graphs, seed=seed, load_avg_1m=[load_start, _load()])
    if getattr(hf.config, "_attn_implementation", None) != attn_before:
        hf.set_attn_implementation(attn_before)  # the packed layout switched it for the measurement
    result = _profile_json(st, loaded, out_series, settings) | ({"matmul_paths": paths} if paths else {})
    if per_step is not None:
        result["decoder_overhead"] = per_step
    return _mark_incomplete(result, series, stopped)


def _measure_batches(st: _Settings, batch_sizes: list[int], time_budget_s: float) -> tuple[list[Series], bool]:
    """Every batch size in turn, each with an equal share of what is left; Ctrl-C stops (interrupted True)."""
    series: list[Series] = []
    try:
        for bi, b in enumerate(batch_sizes):
            s = Series(b)
            series.append(s)
            _measure_batch(st, s, time.time() + (time_budget_s - (time.time() - st.t_start)) / (len(batch_sizes) - bi))
    except KeyboardInterrupt:
        return series, True
    finally:
        st.bar.close()
    return series, False


def _matmul_paths(hf, device, input_lengths, context_length, mode, budget_s, max_rows, seed, progress) -> dict | None:
    """mode "auto" (CPU): first choose each Linear's matmul path per row count up to `max_rows`
    (decoder/engines/hf/matmul_choice.py, within budget_s, default the time budget) and leave them installed,
    so L(n) is timed with them and the profile describes what decoding runs
    (decoder.engines.hf.cpu_paths.use_profile_paths installs the same table from the file); "off": F.linear."""
    if mode not in ("auto", "off"):
        raise UserError(f"--matmul-paths: expected auto or off, got {mode!r}")
    rows = sorted({int(n) for n in input_lengths if int(n) <= max_rows})
    if mode == "off" or device.type != "cpu" or not rows:
        from decoder.engines.hf.cpu_paths import remove_paths

        remove_paths(hf)
        return None
    from decoder.engines.hf.matmul_choice import choose_matmul_paths

    return choose_matmul_paths(hf, rows, context_length, budget_s, seed=seed, progress=progress)


def _measured(series: list[Series], batch_sizes: list[int], stopped: list[dict], interrupted: bool,
              context_length: int) -> list[dict]:
    """The measured series; nothing for the first batch size means no profile (Ctrl-C re-raises)."""
    out = [j for j in (s.to_json() for s in series) if j is not None]
    if not out or out[0]["batch_size"] != batch_sizes[0]:
        if interrupted:
            raise KeyboardInterrupt
        stop = stopped[0] if stopped else {}
        raise UserError(
            f"out of memory at input length {stop.get('input_length')} (batch size {stop.get('batch_size')}, context "
            f"{context_length}); nothing measured for the first batch size, so no profile written"
        )
    return out


def _overhead(hf, input_lengths) -> dict:
    """The decoder's per-step work, measured before L(n) with the paths installed, so that a
    deadline leaves L(n) exactly the rest."""
    from profiler.overhead import measure_overhead

    return measure_overhead(hf, max(int(n) for n in input_lengths))


def _left_for_lengths(time_budget_s: float, deadline: float | None) -> float:
    """L(n)'s budget: what the deadline leaves, never under half its own share."""
    if deadline is None:
        return time_budget_s
    return max(0.5 * time_budget_s, min(time_budget_s, deadline - time.time()))


def _mark_incomplete(result: dict, series: list[Series], stopped: list[dict]) -> dict:
    if stopped:
        result["incomplete"] = stopped
    unmeasured = {s.batch_size: s.unmeasured for s in series if s.unmeasured}
    if unmeasured:
        result["unmeasured_input_lengths"] = {str(b): ns for b, ns in unmeasured.items()}
    return result


def _open(hf, device, input_lengths, context_length, cuda_graphs, min_repeats, max_repeats, target_rel_ci, warmup,
          seed, time_budget_s, progress) -> _Settings:
    from tqdm import tqdm

    if cuda_graphs and device.type != "cuda":
        raise UserError("--cuda-graphs: needs a CUDA device")
    lengths = sorted(set(int(n) for n in input_lengths))
    check_lengths(lengths, context_length, getattr(hf.config, "max_position_embeddings", None), hf, 1, device)
    # Time-based bar: the run is bounded by the budget, and how many samples a length needs is unknown.
    bar = tqdm(total=round(time_budget_s, 1), disable=not progress, dynamic_ncols=True,
               bar_format="{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s budget{postfix}")
    return _Settings(hf, device, lengths, context_length, cuda_graphs, min_repeats, max_repeats, target_rel_ci, warmup,
                     next(hf.parameters()).dtype, hf.config.get_text_config().vocab_size,
                     torch.Generator().manual_seed(seed), random.Random(seed), Timer(device), time.time(), bar,
                     engine=HFEngine(hf))


def _layout(hf, layout: str, cuda_graphs: bool) -> str:
    """padded: b rectangular rows (L_b(n) as the vanilla batch runs it); packed: one row of b
    sequences with per-sequence attention, as decoder.batch's EMS-SD layout runs it."""
    if layout not in ("padded", "packed"):
        raise UserError(f"--layout: expected padded or packed, got {layout!r}")
    if layout == "packed":
        if cuda_graphs:
            raise UserError("--layout packed: not with --cuda-graphs (per-sequence attention loops on the host)")
        from decoder.engines.hf.batch import enable_packed_attention

        enable_packed_attention(hf)
    return layout


def _stops(series: list[Series], batch_sizes: list[int], interrupted: bool) -> list[dict]:
    stopped = [s.stopped for s in series if s.stopped]
    if interrupted:
        done_b = {s.batch_size for s in series}
        stopped.append({"reason": "interrupted", "batch_size": series[-1].batch_size if series else batch_sizes[0],
                        "not_started_batch_sizes": [b for b in batch_sizes if b not in done_b]})
    return stopped


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


def _measure_batch(st: _Settings, s: Series, deadline: float) -> None:
    """Every length at one batch size: round one coarse to fine, then shuffled rounds until each
    length's median is tight enough or the deadline passes."""
    b = s.batch_size
    try:
        timer = _guarded(lambda: st.engine.forward_timer(st.context_length, b, packed=st.layout == "packed",
                                                         cuda_graphs=st.cuda_graphs, seed=st.rng.randrange(2**31)))
    except _OutOfMemory:
        s.stopped = {"reason": "out of memory", "batch_size": b, "input_length": 0, "at": "prefill"}
        _free(st.device)
        return
    st.bar.set_description(f"profiling b={b}{' packed' if st.layout == 'packed' else ''}")
    active = _first_round(st, s, timer, deadline)
    _later_rounds(st, s, timer, active, deadline)
    del timer
    _free(st.device)


def _drop_from(st: _Settings, s: Series, timer, n: int, *queues: list[int]) -> None:
    """Out of memory at n: lengths from n up that have no sample yet are dropped; measured ones are kept."""
    timer.drop(n)
    _free(st.device)
    if s.stopped is None or n < s.stopped["input_length"]:
        s.stopped = {"reason": "out of memory", "batch_size": s.batch_size, "input_length": n}
    for q in queues:
        q[:] = [m for m in q if m < n]


def _first_round(st: _Settings, s: Series, timer, deadline: float) -> list[int]:
    """Coarse to fine (ends, then midpoints): if the budget runs out here the measured lengths still
    span the range. Each length is warmed up just before its first sample. Returns the lengths measured."""
    todo = [st.lengths[i] for i in coarse_to_fine(len(st.lengths))]
    active: list[int] = []
    while todo:
        if len(s.samples) >= 2 and time.time() > deadline:
            break
        n = todo.pop(0)
        try:
            _guarded(lambda: timer.warm(n, st.warmup))
            s.samples[n] = [_guarded(lambda: st.timer(timer.sample(n)))]
            st.tick(s.batch_size)
        except _OutOfMemory:
            _drop_from(st, s, timer, n, todo, active)
            continue
        active.append(n)
    if todo:
        s.unmeasured = sorted(todo)
    return active


def _later_rounds(st: _Settings, s: Series, timer, active: list[int], deadline: float) -> None:
    """Unfinished lengths in a fresh random order each round, until done or out of time."""
    while active:
        st.rng.shuffle(active)
        for n in list(active):
            if time.time() > deadline or n not in active:
                break
            try:
                s.samples[n].append(_guarded(lambda: st.timer(timer.sample(n))))
                st.tick(s.batch_size)
            except _OutOfMemory:
                _drop_from(st, s, timer, n, active)
        done = [n for n in active if len(s.samples[n]) >= st.max_repeats
                or (len(s.samples[n]) >= st.min_repeats and median_rel_ci(s.samples[n]) <= st.target_rel_ci)]
        if time.time() > deadline:
            done = list(active)
        for n in done:
            active.remove(n)


def _profile_json(st: _Settings, loaded, out_series: list[dict], settings: dict) -> dict:
    first = out_series[0]
    result = {k: first[k] for k in ("input_lengths", "latency_s", "p10_s", "p90_s", "repeats", "fit")}
    cfg = st.hf.config
    result.update({
        "batch_size": first["batch_size"],
        "series": out_series,
        "device": st.device.type,
        "device_name": _device_name(st.device),
        "model": loaded.name if loaded else (getattr(cfg, "_name_or_path", "") or cfg.model_type),
        "model_source": loaded.source if loaded else None,
        "has_weights": loaded.has_weights if loaded else None,
        "config_hash": loaded.config_hash if loaded else config_hash(cfg),
        "dtype": dtype_name(st.dtype),
        "context_length": st.context_length,
        "layout": st.layout,
        "versions": _versions(st.device),
        "threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": settings | {
            "timer": "cuda_events" if st.device.type == "cuda" else "perf_counter",
            "order": "first round coarse to fine (ends, then midpoints), later rounds shuffled over unfinished lengths",
            "tree": f"node i under node (i-1)//{TREE_BRANCHING}; position ids = context_length + depth",
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
            "cpu_count": os.cpu_count(),
        },
        "wall_s": round(time.time() - st.t_start, 3),
    })
    return result


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def warm_up_shapes(target, prompts: list[torch.Tensor], input_lengths) -> None:
    """One untimed pass at every shape a timed decoding run will meet: each prompt's prefill and a
    tree step of every input length (the first forward at a new shape can cost many times a
    warm one on the CPU), so that no timing pays a first-call cost. target: an engine or a model."""
    from decoder.engines.hf.engine import as_engine

    engine = as_engine(target)
    gen = torch.Generator().manual_seed(0)
    lengths = sorted({int(p.numel()) for p in prompts})
    if not lengths:
        return
    for T in lengths:
        engine.start(torch.randint(0, engine.vocab_size, (max(T, 2),), generator=gen).to(engine.device))
    timer = engine.forward_timer(max(lengths[-1] - 1, 1))
    for n in sorted({int(n) for n in input_lengths}):
        timer.warm(n, 1)
