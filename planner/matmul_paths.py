"""The profile's "matmul_paths": which CPU matmul path each weight shape runs at each row count.

Written by `planner profile` (decoder/engines/hf/matmul_choice.py), installed by decoder/engines/hf/cpu_paths.py.
Schema (version 1; fields marked * are required):

  "matmul_paths": {
    "version": 1, *
    "rows": [1, 2, ..., 16], *          M = batch x input length, strictly increasing
    "shapes": [ *                       one entry per distinct Linear weight shape
      {"out_features": 49152, *, "in_features": 576, *,
       "modules": 1,                    how many Linears of the model have this shape
       "paths": ["t", "t", "onednn", ...], *   the installed path at each rows entry
       "fastest_isolated": [...],       the per-shape winner before the whole-model check
       "best_s": {"linear": [...], ...}}  fastest sample per call, per rows entry (isolated)
    ],
    "whole_model": {"rows": [...], "default_s": [...], "chosen_s": [...], "kept": [true, ...]},
    "device": "cpu", "dtype": "fp32", "threads": 2,
    "extra_bytes": 123456,              memory of the extra weight layouts the paths need
    "wall_s": 12.3
  }

A path name is one of MATMUL_PATHS; "linear" is the model's own F.linear. Rows not listed run
"linear". A profile without the key loads as before (no paths). numpy/stdlib only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.errors import UserError
from planner.jsonio import read_json

MATMUL_PATHS = ("linear", "t", "onednn", "chunked")
MAX_ROWS = 65536


@dataclass(frozen=True)
class MatmulPathTable:
    rows: tuple[int, ...]
    shapes: dict  # (out_features, in_features) -> {rows M: path}
    dtype: str | None = None
    extra_bytes: int = 0
    source: dict = field(default_factory=dict)

    def paths_for(self, shape: tuple[int, int]) -> dict[int, str]:
        return self.shapes.get(tuple(shape), {})

    def installs_anything(self) -> bool:
        return any(p != "linear" for by in self.shapes.values() for p in by.values())


def _int(x, label: str, f: str, lo: int = 1, hi: int = 2**40) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise UserError(f"{label}: field '{f}' must be an integer in {lo}..{hi}, got {x!r}")
    return x


def matmul_paths_from_json(obj, label: str = "profile") -> MatmulPathTable:
    f = "matmul_paths"
    if not isinstance(obj, dict):
        raise UserError(f"{label}: field '{f}' must be an object with 'version', 'rows' and 'shapes'")
    if obj.get("version") != 1:
        raise UserError(f"{label}: field '{f}.version' must be 1, got {obj.get('version')!r}")
    rows = obj.get("rows")
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{label}: field '{f}.rows' must be a non-empty list of row counts")
    rows = [_int(r, label, f"{f}.rows[{i}]", 1, MAX_ROWS) for i, r in enumerate(rows)]
    if any(b <= a for a, b in zip(rows, rows[1:])):
        raise UserError(f"{label}: field '{f}.rows' must be strictly increasing")
    shapes = obj.get("shapes")
    if not isinstance(shapes, list):
        raise UserError(f"{label}: field '{f}.shapes' must be a list of per-shape entries")
    table: dict[tuple[int, int], dict[int, str]] = {}
    for i, s in enumerate(shapes):
        g = f"{f}.shapes[{i}]"
        if not isinstance(s, dict):
            raise UserError(f"{label}: field '{g}' must be an object with 'out_features', 'in_features' and 'paths'")
        shape = (_int(s.get("out_features"), label, g + ".out_features"), _int(s.get("in_features"), label, g + ".in_features"))
        if shape in table:
            raise UserError(f"{label}: field '{g}' repeats the shape {shape[0]} x {shape[1]}")
        paths = s.get("paths")
        if not isinstance(paths, list) or len(paths) != len(rows):
            raise UserError(f"{label}: field '{g}.paths' must be a list of {len(rows)} path names (one per rows entry)")
        for j, p in enumerate(paths):
            if p not in MATMUL_PATHS:
                raise UserError(f"{label}: field '{g}.paths[{j}]' must be one of {', '.join(MATMUL_PATHS)}, got {p!r}")
        for k, v in (s.get("best_s") or {}).items():
            if k not in MATMUL_PATHS or not isinstance(v, list) or not all(
                    x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0)
                    for x in v):
                raise UserError(f"{label}: field '{g}.best_s.{k}' must be a known path with a list of seconds")
        table[shape] = dict(zip(rows, paths))
    dtype = obj.get("dtype")
    if dtype is not None and dtype not in ("fp32", "fp16", "bf16"):
        raise UserError(f"{label}: field '{f}.dtype' must be fp32, fp16 or bf16, got {dtype!r}")
    extra = _int(obj.get("extra_bytes", 0), label, f"{f}.extra_bytes", 0)
    return MatmulPathTable(tuple(rows), table, dtype, extra, {"file": label})


def check_matmul_paths(data, label: str) -> None:
    """Validate the key when a profile file has it (called by planner.profile's loaders)."""
    if isinstance(data, dict) and data.get("matmul_paths") is not None:
        matmul_paths_from_json(data["matmul_paths"], label)


def load_matmul_paths(path) -> MatmulPathTable | None:
    """The table in a profile file, or None when the file has none (older profiles)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object (a latency profile)")
    if data.get("matmul_paths") is None:
        return None
    table = matmul_paths_from_json(data["matmul_paths"], str(path))
    if table.dtype is None and isinstance(data.get("dtype"), str):
        table = MatmulPathTable(table.rows, table.shapes, data["dtype"], table.extra_bytes, table.source)
    return table
