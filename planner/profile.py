"""Latency profiles as the planner reads them: L(n), forward latency at n new tokens.

The profiler writes a richer file (see profiler/ and the README); the planner needs only
  {"input_lengths": [...], "latency_s": [...]}
and, when present, the fitted model {"fit": {"kind": "piecewise_linear",
"input_lengths": [...], "latency_s": [...]}} which it prefers over the raw medians.
A file measured at several batch sizes lists them in "series" (`load_batch_profiles`);
`load_profile` reads the top level, which the profiler fills with the first series.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from planner.errors import UserError
from planner.jsonio import read_json
from planner.matmul_paths import check_matmul_paths

DECREASE_TOLERANCE = 0.05  # measured medians may dip by noise; a profile that falls by more is wrong
RAW_MIN_REPEATS = 8  # a measured median of at least this many runs is used as it is, not the fit's value
PAD_GAIN = 0.02  # pad a forward to a longer length only when that length was measured this much cheaper


@dataclass(frozen=True)
class Overhead:
    """The decoder's own work per step outside the forward pass: fixed_s + per_token_s * n."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0

    def __call__(self, n):
        out = self.fixed_s + self.per_token_s * np.asarray(n, dtype=np.float64)
        return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True)
class LatencyProfile:
    input_lengths: np.ndarray  # [M] int, strictly increasing
    latency_s: np.ndarray  # [M] float, seconds per forward pass, non-decreasing
    source: dict = field(default_factory=dict)
    overhead: Overhead = Overhead()  # measured by the profiler ("decoder_overhead"); 0 when absent
    pad_to: dict = field(default_factory=dict)  # {n: m}: a forward of n tokens runs padded to m, measured cheaper

    @property
    def max_input_length(self) -> int:
        return int(self.input_lengths[-1])

    def latency(self, n) -> np.ndarray | float:
        """Piecewise-linear interpolation; refuses lengths outside the measured range."""
        n_arr = np.asarray(n, dtype=np.float64)
        lo, hi = self.input_lengths[0], self.input_lengths[-1]
        if np.any(n_arr < lo) or np.any(n_arr > hi):
            bad = n_arr[(n_arr < lo) | (n_arr > hi)].ravel()[0]
            raise UserError(
                f"{self.source.get('file', 'profile')}: input length {int(bad)} outside the profiled range {lo}..{hi}"
            )
        out = np.interp(n_arr, self.input_lengths, self.latency_s)
        return float(out) if np.ndim(out) == 0 else out


def _numbers(obj, label: str, field_name: str, integer: bool = False) -> np.ndarray:
    if not isinstance(obj, list) or not obj:
        raise UserError(f"{label}: field '{field_name}' must be a non-empty list of numbers")
    for i, x in enumerate(obj):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise UserError(f"{label}: field '{field_name}[{i}]' must be a number, got {x!r}")
        if integer and (x != int(x) or x < 1):
            raise UserError(f"{label}: field '{field_name}[{i}]' must be a positive integer, got {x!r}")
        if not integer and x <= 0:
            raise UserError(f"{label}: field '{field_name}[{i}]' must be positive, got {x!r}")
    return np.asarray(obj, dtype=np.int64 if integer else np.float64)


def profile_from_json(data, label: str = "profile", source: dict | None = None,
                      field_prefix: str = "") -> LatencyProfile:
    """field_prefix names where `data` sits in its file (e.g. "series[2].") for error messages."""
    if not isinstance(data, dict):
        where = f"field '{field_prefix.rstrip('.')}' must be" if field_prefix else "expected"
        raise UserError(f"{label}: {where} a JSON object with 'input_lengths' and 'latency_s'")
    body = data.get("fit") if isinstance(data.get("fit"), dict) else data
    prefix = field_prefix + ("fit." if body is not data else "")
    for key in ("input_lengths", "latency_s"):
        if key not in body:
            raise UserError(f"{label}: missing field '{prefix}{key}'")
    n = _numbers(body["input_lengths"], label, prefix + "input_lengths", integer=True)
    lat = _numbers(body["latency_s"], label, prefix + "latency_s")
    if len(n) != len(lat):
        raise UserError(f"{label}: '{prefix}input_lengths' and '{prefix}latency_s' differ in length")
    if np.any(np.diff(n) <= 0):
        raise UserError(f"{label}: field '{prefix}input_lengths' must be strictly increasing")
    lat = _non_decreasing(n, lat, label, prefix)
    pad: dict[int, int] = {}
    if body is not data and data.get("batch_size", 1) == 1:
        lat, pad = _padded(data, n, lat)
    src = dict(source or {})
    src.setdefault("file", label)
    for k in ("device", "model", "dtype", "context_length", "batch_size", "engine"):
        if k in data:
            src[k] = data[k]
    if isinstance(data.get("simulated"), dict):  # computed, not measured: every plan made from it says so
        src["simulated"] = data["simulated"]
    return LatencyProfile(n, lat, src, _overhead(data.get("decoder_overhead"), label, field_prefix), pad)


def _padded(data: dict, n: np.ndarray, fit: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
    """The cost of n tokens when a forward may be padded to a longer, cheaper length.

    The fit is monotone (isotonic), which on a CPU averages away real dips: SmolLM2 on this
    2-core EPYC measured L(3) = 83 ms and L(5) = 57 ms with 20 runs each, while the fit gave both
    66. Where the raw median has RAW_MIN_REPEATS runs it is used as measured; a length n then costs
    the cheapest measured length m >= n, and the plan records the padding (n -> m) for the decoder,
    which appends m - n tokens that nothing reads (decoder.loop). A batch-1 decoder pads; batch
    series keep the fit."""
    raw_n, raw_lat, reps = data.get("input_lengths"), data.get("latency_s"), data.get("repeats")
    if not (isinstance(raw_n, list) and isinstance(raw_lat, list) and isinstance(reps, list)
            and len(raw_n) == len(raw_lat) == len(reps) == len(n) and list(raw_n) == n.tolist()):
        return fit, {}
    try:
        measured = np.asarray(raw_lat, dtype=np.float64)
        enough = np.asarray(reps, dtype=np.float64) >= RAW_MIN_REPEATS
    except (TypeError, ValueError):
        return fit, {}
    if not np.all(np.isfinite(measured)) or np.any(measured <= 0):
        return fit, {}
    own = np.where(enough, measured, fit)
    cost, pad = own.copy(), {}
    for i in range(len(n)):
        j = i + int(np.argmin(own[i:]))
        if j != i and own[j] < own[i] * (1 - PAD_GAIN):
            cost[i], pad[int(n[i])] = own[j], int(n[j])
    return np.maximum.accumulate(cost), pad


def _non_decreasing(n: np.ndarray, lat: np.ndarray, label: str, prefix: str) -> np.ndarray:
    """A forward pass over more tokens is never faster: dips within the noise tolerance are
    levelled (running maximum, as the profiler's isotonic fit does); a real decrease is an error
    (it would make big trees look free)."""
    peak = np.maximum.accumulate(lat)
    bad = np.nonzero(lat < peak * (1 - DECREASE_TOLERANCE))[0]
    if len(bad):
        i = int(bad[0])
        j = int(np.argmax(lat[:i] >= peak[i]))
        raise UserError(f"{label}: field '{prefix}latency_s[{i}]' = {lat[i]:.6g} s at input length {n[i]} is "
                        f"below {lat[j]:.6g} s at input length {n[j]}: latency must not decrease with input length")
    return peak


def _overhead(obj, label: str, field_prefix: str = "") -> Overhead:
    if obj is None:
        return Overhead()
    if not isinstance(obj, dict):
        raise UserError(f"{label}: field '{field_prefix}decoder_overhead' must be an object with 'fixed_s' and 'per_token_s'")
    vals = {}
    for key in ("fixed_s", "per_token_s"):
        x = obj.get(key)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            raise UserError(f"{label}: field '{field_prefix}decoder_overhead.{key}' must be a number >= 0, got {x!r}")
        vals[key] = float(x)
    return Overhead(**vals)


def load_profile(path: str) -> LatencyProfile:
    data = read_json(path)
    check_matmul_paths(data, str(path))
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return profile_from_json(data, label=str(path), source={"file": str(path), "sha256": digest})


# Fields of a profiler file that describe every series (the series themselves carry only their numbers).
SHARED_FIELDS = ("device", "model", "dtype", "context_length", "simulated")


def load_batch_profiles(path) -> dict[int, LatencyProfile]:
    """One LatencyProfile per batch size, sorted by batch size.

    A profiler file measured at several batch sizes keeps each one as an entry of the list
    "series" ({"batch_size", "input_lengths", "latency_s", "fit"}); L_b(n) is then the forward
    latency of b rows of n new tokens each. A file without "series" is one profile, at its own
    "batch_size" (default 1). The file's "decoder_overhead" (measured at batch size 1) applies
    to every series that has none of its own: a lower bound at larger batch sizes.
    """
    data = read_json(path)
    label = str(path)
    check_matmul_paths(data, label)
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    source = {"file": label, "sha256": digest}
    if not isinstance(data, dict):
        raise UserError(f"{label}: expected a JSON object (a latency profile)")
    series = data.get("series")
    if series is None:
        b = _batch_size(data.get("batch_size", 1), label, "batch_size")
        return {b: profile_from_json(dict(data, batch_size=b), label=label, source=source)}
    if not isinstance(series, list) or not series:
        raise UserError(f"{label}: field 'series' must be a non-empty list of per-batch-size profiles")
    _overhead(data.get("decoder_overhead"), label)  # a bad shared field is named where it is
    out: dict[int, LatencyProfile] = {}
    for i, entry in enumerate(series):
        f = f"series[{i}]"
        if not isinstance(entry, dict):
            raise UserError(f"{label}: field '{f}' must be an object with 'batch_size', 'input_lengths' and 'latency_s'")
        if "batch_size" not in entry:
            raise UserError(f"{label}: missing field '{f}.batch_size'")
        b = _batch_size(entry["batch_size"], label, f"{f}.batch_size")
        if b in out:
            raise UserError(f"{label}: field '{f}.batch_size' repeats batch size {b}")
        merged = {k: data[k] for k in SHARED_FIELDS + ("decoder_overhead",) if k in data}
        merged.update(entry)
        out[b] = profile_from_json(merged, label=label, source=source, field_prefix=f + ".")
    return dict(sorted(out.items()))


def _batch_size(x, label: str, field_name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise UserError(f"{label}: field '{field_name}' must be an integer >= 1, got {x!r}")
    return x
