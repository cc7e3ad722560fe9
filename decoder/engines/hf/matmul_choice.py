"""Choosing the CPU matmul path of every Linear weight shape at every row count, by measurement.

Two stages, both on the model's own weights:
1. isolated: per distinct weight shape, per candidate path (decoder/engines/hf/cpu_paths.py) and row count M,
   the time of one call. One sample runs the path over EVERY Linear of that shape in turn (30
   layers' weights, say), so the weights stream from memory as in a forward pass; a shape whose
   weights fit in the last-level cache gets a cache flush before each sample (a lone 3.5 MB weight
   timed in a loop sits in L3 and reads 2-3x faster than it ever does in the model). Samples are
   taken in shuffled rounds (drift spreads over all paths); per-call time = sample / modules.
   Per shape the choice prefers fewer extra weight copies: the smallest set of layouts whose best
   path is within `tolerance` of the overall best at every M.
2. whole model: the forward pass the profiler times (n tree tokens after a C-token cache), with
   the chosen paths and with F.linear, interleaved pairs; at any M where the chosen paths do not
   make the whole forward faster (median of the paired ratios), every shape goes back to F.linear.
Rows are batch-1 input lengths here (M = n); the table applies to any batch x n = M.
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from decoder.engines.hf.cpu_paths import (
    install_paths,
    installed_bytes,
    linears,
    make_layout,
    path_available,
    path_fn,
    remove_paths,
    set_paths_enabled,
)
from decoder.torch_ops.forward import kv
from planner.matmul_paths import MATMUL_PATHS, MatmulPathTable, matmul_paths_from_json
from planner.order import coarse_to_fine

STAND_IN_BRANCHING = 4  # the profiler's stand-in tree (profiler.measure.TREE_BRANCHING): node i under (i-1)//4
LAYOUT_SETS = ((), ("t",), ("onednn",), ("t", "onednn"))  # extra copies, fewest first
FLUSH_BYTES = 64 << 20  # more than this CPU's 32 MB L3
TOLERANCE = 0.03


def tree_input(n: int, context_length: int, vocab: int, dtype, gen) -> dict:
    """The profiler's forward inputs at n tokens (its stand-in tree after a context), batch 1, CPU."""
    from decoder.torch_ops.forward import tree_attention_mask
    from planner.tree import ancestor_matrix, tree_depths

    parents = [-1] + [(i - 1) // STAND_IN_BRANCHING for i in range(1, n)]
    depth = torch.tensor(tree_depths(parents), dtype=torch.long)
    return {"input_ids": torch.randint(0, vocab, (1, n), generator=gen), "position_ids": (context_length + depth)[None],
            "attention_mask": tree_attention_mask(ancestor_matrix(parents), context_length, dtype, "cpu")}


def candidate_paths(shape: tuple[int, int], device, dtype) -> list[str]:
    out = [p for p in MATMUL_PATHS if path_available(p, device, dtype)]
    if shape[0] < 4 * 4096:  # chunking only splits very tall weights (the LM head)
        out = [p for p in out if p != "chunked"]
    return out


def _shape_groups(model) -> dict[tuple[int, int], list[torch.nn.Linear]]:
    groups: dict[tuple[int, int], list] = {}
    seen = set()
    for _, m in linears(model):
        if m.weight.data_ptr() in seen:
            continue
        seen.add(m.weight.data_ptr())
        groups.setdefault((m.out_features, m.in_features), []).append(m)
    return groups


class _Shape:
    """One weight shape's modules, their candidate paths (as callables) and the samples taken."""

    def __init__(self, shape, modules, paths):
        self.shape, self.modules, self.paths = shape, modules, paths
        nbytes = sum(m.weight.numel() * m.weight.element_size() for m in modules)
        self.flush = nbytes < FLUSH_BYTES
        self.fns = {}
        for p in paths:
            self.fns[p] = [path_fn(p, m.weight, m.bias, make_layout(m.weight, p)) for m in modules]
        self.samples: dict[tuple[str, int], list[float]] = {}

    def sample(self, path: str, M: int, x: torch.Tensor, sink: torch.Tensor) -> None:
        if self.flush:
            sink.add_(1.0)  # untimed: evicts this shape's weights from the caches
        fns = self.fns[path]
        t0 = time.perf_counter()
        for fn in fns:
            fn(x)
        self.samples.setdefault((path, M), []).append((time.perf_counter() - t0) / len(fns))

    def best(self, path: str, M: int) -> float | None:
        """The minimum, in fact: other processes on the machine only ever add time to a sample."""
        s = self.samples.get((path, M))
        return min(s) if s else None


def _choose(sh: _Shape, rows: list[int], tolerance: float) -> tuple[list[str], list[str]]:
    """(fastest path per M, chosen path per M with the fewest extra layouts within tolerance)."""
    med = {(p, M): sh.best(p, M) for p in sh.paths for M in rows}
    fastest, chosen = [], []
    for M in rows:
        timed = [(med[(p, M)], p) for p in sh.paths if med[(p, M)] is not None]
        fastest.append(min(timed)[1] if timed else "linear")
    for layouts in LAYOUT_SETS:
        allowed = [p for p in sh.paths if p in ("linear", "chunked") or p in layouts]
        picks, ok = [], True
        for M, best in zip(rows, fastest):
            timed = [(med[(p, M)], p) for p in allowed if med[(p, M)] is not None]
            if not timed:
                picks.append("linear")
                continue
            t, p = min(timed)
            ok &= med[(best, M)] is None or t <= med[(best, M)] * (1 + tolerance)
            picks.append(p)
        if ok:
            chosen = picks
            break
    return fastest, chosen or fastest


@torch.inference_mode()
def measure_isolated(model, rows: list[int], deadline: float, repeats: int, seed: int, tick=None) -> list[_Shape]:
    p = next(model.parameters())
    shapes = [_Shape(s, ms, candidate_paths(s, p.device, p.dtype)) for s, ms in _shape_groups(model).items()]
    gen = torch.Generator().manual_seed(seed)
    xs = {(sh.shape[1], M): torch.randn(1, M, sh.shape[1], generator=gen, dtype=p.dtype) for sh in shapes for M in rows}
    sink = torch.zeros(FLUSH_BYTES // 4)
    jobs = [(sh, path, M) for sh in shapes for path in sh.paths for M in rows]
    rng = random.Random(seed)
    for r in range(repeats):
        # round one visits rows coarse to fine, so a budget cut short still spans the rows
        order = {M: i for i, M in enumerate(coarse_to_fine(rows))}
        rng.shuffle(jobs)
        if r == 0:
            jobs.sort(key=lambda j: order[j[2]])
        for sh, path, M in jobs:
            if time.time() > deadline:
                return shapes
            if r == 0:  # warm-up just before the first sample: a kernel's first call at a new shape is slow
                sh.fns[path][0](xs[(sh.shape[1], M)])
            sh.sample(path, M, xs[(sh.shape[1], M)], sink)
            if tick:
                tick()
    return shapes


def _forward_once(model, cache, prefix, x) -> float:
    for layer, (k, v) in zip(cache.layers, prefix):
        layer.keys, layer.values = k, v
    t0 = time.perf_counter()
    model(**x, **kv(cache), use_cache=True)
    return time.perf_counter() - t0


@torch.inference_mode()
def validate_whole_model(model, rows: list[int], context_length: int, deadline: float, repeats: int, seed: int,
                         tick=None) -> dict:
    """Whole forward at n = M tokens after `context_length`, F.linear vs the installed paths, interleaved."""
    from decoder.torch_ops.forward import prefill
    p = next(model.parameters())
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    cache = prefill(model, torch.randint(0, vocab, (1, context_length), generator=gen)).cache
    prefix = [(layer.keys, layer.values) for layer in cache.layers]
    inputs = {M: tree_input(M, context_length, vocab, p.dtype, gen) for M in rows}
    times = {M: {"default": [], "chosen": []} for M in rows}
    for M in rows:  # warm both variants at every shape
        for on in (False, True):
            set_paths_enabled(model, on)
            _forward_once(model, cache, prefix, inputs[M])
    rng = random.Random(seed)
    order = list(rows)
    for r in range(repeats):
        rng.shuffle(order)
        for M in order:
            if r > 0 and time.time() > deadline:  # round one always completes: two forwards per row
                break
            first = rng.random() < 0.5
            for on in (first, not first):
                set_paths_enabled(model, on)
                times[M]["chosen" if on else "default"].append(_forward_once(model, cache, prefix, inputs[M]))
            if tick:
                tick()
    set_paths_enabled(model, True)
    for layer, (k, v) in zip(cache.layers, prefix):
        layer.keys, layer.values = k, v
    out = {"rows": rows, "default_s": [], "chosen_s": [], "ratio": [], "kept": [], "repeats": []}
    for M in rows:
        d, c = times[M]["default"], times[M]["chosen"]
        ratio = statistics.median(b / a for a, b in zip(d, c)) if d else 1.0
        out["default_s"].append(statistics.median(d) if d else None)
        out["chosen_s"].append(statistics.median(c) if c else None)
        out["ratio"].append(ratio)
        out["kept"].append(bool(d) and ratio < 1.0)  # unmeasured rows keep F.linear
        out["repeats"].append(len(d))
    return out


def choose_matmul_paths(model, rows: list[int], context_length: int = 256, time_budget_s: float = 15.0,
                        repeats: int = 5, tolerance: float = TOLERANCE, seed: int = 0, progress: bool = False,
                        validate: bool = True) -> dict:
    """Measure, choose, validate; returns the profile's "matmul_paths" object (planner/matmul_paths.py)
    and leaves the chosen paths installed on the model. CPU only (elsewhere: every shape "linear")."""
    from tqdm import tqdm

    t_start = time.time()
    p = next(model.parameters())
    rows = sorted({int(M) for M in rows})
    remove_paths(model)
    bar = tqdm(total=None, disable=not progress, desc="matmul paths", unit="sample", leave=False)
    shapes = measure_isolated(model, rows, t_start + 0.6 * time_budget_s, repeats, seed, bar.update)
    entries = []
    for sh in shapes:
        fastest, chosen = _choose(sh, rows, tolerance)
        entries.append({"out_features": sh.shape[0], "in_features": sh.shape[1], "modules": len(sh.modules),
                        "paths": chosen, "fastest_isolated": fastest,
                        "best_s": {path: [sh.best(path, M) for M in rows] for path in sh.paths}})
    del shapes
    obj = {"version": 1, "rows": rows, "shapes": entries, "device": p.device.type,
           "dtype": {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(p.dtype),
           "threads": torch.get_num_threads(), "tolerance": tolerance}
    table = matmul_paths_from_json(obj)
    install_paths(model, table)
    if validate and table.installs_anything():
        whole = validate_whole_model(model, rows, context_length, t_start + time_budget_s, repeats, seed, bar.update)
        obj["whole_model"] = whole
        for e in entries:
            e["paths"] = [path if keep else "linear" for path, keep in zip(e["paths"], whole["kept"])]
        table = matmul_paths_from_json(obj)
        install_paths(model, table)
    bar.close()
    obj["extra_bytes"] = installed_bytes(model)
    obj["weight_bytes"] = sum(m.weight.numel() * m.weight.element_size() for ms in _shape_groups(model).values()
                              for m in ms)
    obj["wall_s"] = round(time.time() - t_start, 3)
    return obj


def as_table(obj: dict) -> MatmulPathTable:
    return matmul_paths_from_json(obj)
