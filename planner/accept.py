"""Acceptance statistics: the guesser's per-distance, per-rank accuracies.

Two JSON forms (see docs/algorithms.md, section 'Acceptance statistics'):
  {"accuracy": [[a_1_0, a_1_1, ...], [a_2_0, ...], ...]}   row d is distance d+1 beyond the root
  {"positional": [p_0, p_1, ...]}                            the same row at every distance
A collection file maps names to such entries; `FILE:NAME` picks one.
An optional "calibration" (written by `planner accept --calibrate`, schema in planner/dynamic.py and
trees/schema.json $defs.calibration) maps the guesser's live signal to acceptance for dynamic plans.
Extra fields (counts, source, ...) are kept as provenance and otherwise ignored.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from planner.errors import UserError
from planner.jsonio import read_json

ROW_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Acceptance:
    """accuracy[d, r]: probability that the rank-r guess at distance d+1 is the right token."""

    accuracy: np.ndarray  # [D, K] float64
    positional: bool = False  # True: one row valid at every distance (unbounded depth)
    source: dict = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return self.accuracy.shape[1]

    @property
    def max_depth(self) -> int | None:
        """Deepest distance the statistics cover; None when positional (any depth)."""
        return None if self.positional else self.accuracy.shape[0]

    def rows(self, depth: int) -> np.ndarray:
        """[depth, K] accuracies for distances 1..depth."""
        if self.positional:
            return np.repeat(self.accuracy[:1], depth, axis=0)
        if depth > self.accuracy.shape[0]:
            raise UserError(
                f"{self.label}: acceptance covers distances 1..{self.accuracy.shape[0]}, depth {depth} asked"
            )
        return self.accuracy[:depth]

    @property
    def label(self) -> str:
        return self.source.get("label", "acceptance")

    def provenance(self) -> dict:
        """Where the acceptance came from, as JSON: a calibration is named by its signal (a dynamic
        plan carries the table itself, in its spec)."""
        out = dict(self.source)
        if out.get("calibration") is not None:
            out["calibration"] = {"signal": out["calibration"].signal}
        return out

    def to_json(self) -> dict:
        key = "positional" if self.positional else "accuracy"
        value = self.accuracy[0].tolist() if self.positional else self.accuracy.tolist()
        return {key: value}


def from_entry(entry, label: str = "acceptance", source: dict | None = None) -> Acceptance:
    """Validate one entry ({"accuracy": ...} or {"positional": ...}) and build an Acceptance."""
    if not isinstance(entry, dict):
        raise UserError(f"{label}: expected an object with 'accuracy' or 'positional'")
    has_acc, has_pos = "accuracy" in entry, "positional" in entry
    if has_acc == has_pos:
        raise UserError(f"{label}: expected exactly one of the fields 'accuracy' or 'positional'")
    key = "accuracy" if has_acc else "positional"
    rows = entry[key] if has_acc else [entry[key]]
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{label}: field '{key}' must be a non-empty list")
    for d, row in enumerate(rows):
        name = f"{key}[{d}]" if has_acc else key
        if not isinstance(row, list) or not row:
            raise UserError(f"{label}: field '{name}' must be a non-empty list of numbers")
        for r, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise UserError(f"{label}: field '{name}[{r}]' must be a number, got {x!r}")
            if not 0.0 <= x <= 1.0:
                raise UserError(f"{label}: field '{name}[{r}]' = {x} is outside [0, 1]")
        total = float(sum(row))
        if total > 1.0 + ROW_SUM_TOLERANCE:
            raise UserError(f"{label}: field '{name}' sums to {total:.4f}, expected at most 1")
    # Real matrices are ragged (the PPD authors' Vicuna-13B rows have 10, 10 and 5 ranks): a rank a
    # row does not list has probability 0.
    width = max(len(row) for row in rows)
    matrix = np.zeros((len(rows), width))
    for d, row in enumerate(rows):
        matrix[d, : len(row)] = row
    # Rows within the tolerance above 1 are rounding: scale them to 1, so that no path probability
    # exceeds its parent's and every downstream model stays a probability model.
    sums = matrix.sum(axis=1, keepdims=True)
    matrix = np.where(sums > 1.0, matrix / np.maximum(sums, 1.0), matrix)
    src = dict(source or {})
    src.setdefault("label", label)
    for k in ("source", "kind"):
        if k in entry and isinstance(entry[k], str):
            src[k] = entry[k]
    if isinstance(entry.get("guesser"), dict):  # how the measured guesser feeds trees (planner.cost.Guessing)
        src["guesser"] = dict(entry["guesser"])
    if isinstance(entry.get("sampling"), dict):  # measured under sampling (profiler/sampled.py): the settings
        src["sampling"] = dict(entry["sampling"])
    if entry.get("calibration") is not None:  # live signal -> acceptance (planner/dynamic.py); older files have none
        from planner.dynamic import calibration_from_json

        src["calibration"] = calibration_from_json(entry["calibration"], label)
    return Acceptance(matrix, positional=has_pos, source=src)


def _split_spec(spec: str) -> tuple[str, str | None]:
    """'FILE' or 'FILE:NAME'. A colon belongs to the path when the whole spec is a file."""
    if ":" in spec and not os.path.exists(spec):
        path, name = spec.rsplit(":", 1)
        return path, name
    return spec, None


def load_acceptance(spec: str) -> Acceptance:
    path, name = _split_spec(spec)
    data = read_json(path)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    source = {"file": str(path), "sha256": digest}
    if name is not None:
        if not isinstance(data, dict) or name not in data or name.startswith("_"):
            names = sorted(k for k in data if not k.startswith("_")) if isinstance(data, dict) else []
            raise UserError(f"{path}: no entry named '{name}' (entries: {', '.join(names) or 'none'})")
        source["name"] = name
        return from_entry(data[name], label=f"{path}:{name}", source=source)
    if isinstance(data, dict) and ("accuracy" in data or "positional" in data):
        return from_entry(data, label=str(path), source=source)
    if isinstance(data, dict):
        names = sorted(k for k in data if not k.startswith("_"))
        raise UserError(f"{path}: a collection file; pick an entry with {path}:NAME (entries: {', '.join(names)})")
    raise UserError(f"{path}: expected a JSON object with 'accuracy' or 'positional'")
