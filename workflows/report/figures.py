"""`planner report`'s curve figures: latency against input length, tokens per step and speedup
against tree size, and the reliability diagram of calibrated acceptance. Each takes loaded inputs
and returns a Section (the figure and the numbers behind it); matplotlib (Agg) loads inside.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.errors import UserError
from planner.profile import LatencyProfile
from planner.tree import CHAIN, MEDUSA, PPD, Tree

MAX_TABLE_ROWS = 80


@dataclass
class Section:
    title: str
    image: str  # PNG file name inside the report directory
    caption: str
    table: list[dict] = field(default_factory=list)
    figure: Any = None  # matplotlib Figure until saved


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@dataclass
class ProfileInput:
    profile: LatencyProfile
    label: str
    raw: dict  # the whole profiler file: medians, p10/p90, fit



def fig_latency(profiles: list[ProfileInput]) -> Section:
    """Forward latency versus input length, all profiles overlaid (raw medians, p10-p90 band, fit)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    table = []
    for i, p in enumerate(profiles):
        color = f"C{i}"
        raw = p.raw
        if isinstance(raw.get("input_lengths"), list) and isinstance(raw.get("latency_s"), list):
            n = np.asarray(raw["input_lengths"], dtype=float)
            lat = np.asarray(raw["latency_s"], dtype=float) * 1e3
            ax.plot(n, lat, "o", ms=3.5, color=color, label=f"{p.label} (median)")
            if isinstance(raw.get("p10_s"), list) and isinstance(raw.get("p90_s"), list) and len(raw["p10_s"]) == len(n):
                ax.fill_between(n, np.asarray(raw["p10_s"]) * 1e3, np.asarray(raw["p90_s"]) * 1e3,
                                color=color, alpha=0.18, lw=0, label=f"{p.label} (p10-p90)")
        prof = p.profile
        ax.plot(prof.input_lengths, prof.latency_s * 1e3, "-", color=color, lw=1.6,
                label=f"{p.label} ({'fit' if isinstance(raw.get('fit'), dict) else 'interpolated'})")
        for n_, l_ in zip(prof.input_lengths.tolist(), prof.latency_s.tolist()):
            table.append({"profile": p.label, "input_length": n_, "latency_ms": round(l_ * 1e3, 4),
                          "relative_to_L(1)": round(l_ / prof.latency(int(prof.input_lengths[0])), 3)})
    ax.set_xlabel("input length (tokens per forward pass)")
    ax.set_ylabel("forward latency (ms)")
    ax.set_title("Forward-pass latency versus input length")
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return Section("Latency versus input length", "latency.png",
                   "Median forward latency of the target model per input length, one line per profile. "
                   "The planner reads the line (fit when present).", table, fig)


def _length_grid(max_length: int) -> list[int]:
    small = list(range(2, min(max_length, 16) + 1))
    return sorted(set(small + list(range(16, max_length + 1, 4)) + [max_length]))


def _ppd_prompt_tokens(accept) -> int:
    from workflows.tune.search import PLAN_DEFAULT_PROMPT_TOKENS

    d = accept.max_depth
    return PLAN_DEFAULT_PROMPT_TOKENS if d is None else min(PLAN_DEFAULT_PROMPT_TOKENS, d)


def _plan_at_length(method: str, accept, n: int) -> Tree:
    """The planner's best tree whose forward pass has n tokens (medusa/sequoia: n - 1 candidates; chain:
    n - 1 rank-0 guesses, as the main job races a drafter's or lookup's chains)."""
    from planner.plan import plan

    if method == PPD:
        return plan(PPD, accept, input_length=n, prompt_tokens=_ppd_prompt_tokens(accept))
    if method == CHAIN:
        return _chain(accept, n - 1)
    return plan(method, accept, size=n - 1)


def _chain(accept, depth: int) -> Tree:
    from workflows.mainjob.candidates import chain_tree

    if not 1 <= depth <= (accept.max_depth or depth):
        raise UserError(f"{accept.label}: no chain of {depth} guesses (its statistics reach depth {accept.max_depth})")
    return chain_tree(accept, depth)


def _best_with_curve(method: str, accept, profile: LatencyProfile, max_size: int) -> Tree:
    """The planner's best tree of `method` for `profile`, with its size curve (a chain: every depth)."""
    from planner.cost import default_guessing, predict
    from planner.plan import plan

    if method == PPD:
        return plan(PPD, accept, profile=profile, max_size=max_size, prompt_tokens=_ppd_prompt_tokens(accept),
                    max_input_length=min(max_size + 1, profile.max_input_length))
    if method != CHAIN:
        return plan(method, accept, profile=profile, max_size=max_size)
    g = default_guessing(MEDUSA, accept)
    deepest = min(accept.max_depth or max_size, max_size, profile.max_input_length - 1)
    curve = []
    for d in range(1, deepest + 1):
        pred = predict(_chain(accept, d), profile, g)
        curve.append({"input_length": d + 1, "expected_tokens_per_step": pred.tokens_per_step,
                      "latency_s": pred.step_latency_s, "predicted_speedup": pred.speedup})
    if not curve:
        raise UserError(f"{accept.label}: no chain fits the profile's input lengths")
    best = max(curve, key=lambda r: r["predicted_speedup"])
    tree = _chain(accept, best["input_length"] - 1)
    tree.predicted_speedup, tree.size_curve = best["predicted_speedup"], curve
    return tree


def fig_tokens_per_step(sources: list, max_size: int = 64) -> Section:
    """Expected tokens per step versus tree size (input length) for each method, on each acceptance file."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    table = []
    k = 0
    for src in sources:
        for method in src.methods:
            xs, ys = [], []
            for n in _length_grid(max_size + 1):
                try:
                    tree = _plan_at_length(method, src.accept, n)
                except UserError:
                    continue
                xs.append(n)
                ys.append(tree.expected_tokens_per_step)
                table.append({"acceptance": src.label, "method": method, "input_length": n,
                              "candidates": max(len(st.nodes) for st in tree.states),
                              "expected_tokens_per_step": round(tree.expected_tokens_per_step, 4)})
            if xs:
                ax.plot(xs, ys, "-o", ms=2.5, color=f"C{k}", label=f"{method} on {_short(src.label)}")
                k += 1
    ax.set_xlabel("tree size: input length (tokens per forward pass, root + candidates + prompt tokens)")
    ax.set_ylabel("expected tokens per step")
    ax.set_title("Expected tokens per step versus tree size (independence model)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return Section("Expected tokens per step versus tree size", "tokens_per_step.png",
                   "Hardware-independent: the planner's best tree of each input length and its expected tokens "
                   "per decoding step (PPD: amortised over its states, P = 3 prompt tokens). The root counts as 1.",
                   table, fig)


def _short(label: str) -> str:
    return label.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class PlanMark:
    """A plan the run raced, drawn on the speedup figure of its guesser's acceptance: where the planner put it
    and what decoding measured."""

    label: str
    guesser: str  # the kind whose acceptance it was planned on (a hybrid's: its drafter's)
    input_length: float  # tokens per forward pass (a per-step plan's: the mean)
    predicted_speedup: float
    measured_speedup: float | None
    role: str = "the run's choice"


SPEEDUP_TITLE = "Predicted speedup versus tree size (each family's best tree starred)"


def fig_speedup(sources: list, profiles: list[ProfileInput], max_size: int = 64, marks: tuple = ()) -> Section:
    """Predicted speedup versus tree size, one line per machine, the best tree starred (PPD fig. 8b); `marks`
    (PlanMark) on the panels of their guesser's acceptance: the run's chosen plan, predicted and measured."""
    import textwrap

    plt = _plt()
    pairs = [(s, m) for s in sources for m in s.methods]
    width = max(7.5, 5.4 * len(pairs))  # one panel alone still holds the title
    fig, axes = plt.subplots(1, len(pairs), figsize=(width, 5.0), squeeze=False, layout="constrained")
    table = []
    for ax, (src, method) in zip(axes[0], pairs):
        for i, p in enumerate(profiles):
            try:
                tree = _best_with_curve(method, src.accept, p.profile, max_size)
            except UserError as e:
                ax.text(0.5, 0.5 - 0.08 * i, textwrap.fill(f"{p.label}: {e}", 50), transform=ax.transAxes,
                        ha="center", fontsize=7)
                continue
            table += _speedup_curve(ax, tree, src, method, p, i)
        for m in marks:
            if m.guesser == _guesser_of(src):
                table.append(_draw_mark(ax, m, src, method))
        ax.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("tree size: input length (tokens per forward pass)")
        ax.set_ylabel("predicted speedup over plain decoding (x)")
        ax.set_title(textwrap.fill(f"{method} on {_short(src.label)}", 60), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(SPEEDUP_TITLE, int(width * 11)), fontsize=11)
    return Section("Predicted speedup versus tree size", "speedup.png",
                   "speedup = expected tokens per step x L(1) / step latency, with L from each profile (the PPD "
                   "paper's figure 8b for these profiles). Lines: the best tree at each shared input length; star: "
                   "the tree `planner plan` chooses (PPD with per-state budgets may sit above the line, its states "
                   "using different lengths; drawn at its largest); diamond and circle: the plan the run chose, "
                   "as predicted and as measured against plain decoding"
                   + ("; a hybrid's plan (prompt lookup and a drafter, a tree chosen every step) takes lookup's "
                      "guesses too, so it can sit above its drafter's curves." if marks else "."), table, fig)


def _speedup_curve(ax, tree: Tree, src, method: str, p: ProfileInput, i: int) -> list[dict]:
    curve = [r for r in (tree.size_curve or []) if r["input_length"] >= 2]
    ax.plot([r["input_length"] for r in curve], [r["predicted_speedup"] for r in curve], "-", color=f"C{i}",
            lw=1.5, label=p.label)
    n_best = tree.max_input_length
    ax.plot([n_best], [tree.predicted_speedup], "*", ms=14, color=f"C{i}", mec="k",
            label=f"best {method}: input length {n_best}, {tree.predicted_speedup:.2f}x")
    rows = [{"acceptance": src.label, "method": method, "profile": p.label, "input_length": int(r["input_length"]),
             "expected_tokens_per_step": round(r["expected_tokens_per_step"], 4),
             "latency_ms": round(r["latency_s"] * 1e3, 4), "predicted_speedup": round(r["predicted_speedup"], 4)}
            for r in curve]
    rows.append({"acceptance": src.label, "method": method, "profile": p.label, "input_length": n_best,
                 "expected_tokens_per_step": round(tree.expected_tokens_per_step, 4),
                 "predicted_speedup": round(tree.predicted_speedup, 4), "chosen": True,
                 "construction": tree.settings.get("construction", "")})
    return rows


def _guesser_of(src) -> str | None:
    record = src.accept.source.get("guesser")
    return record.get("kind") if isinstance(record, dict) else None


def _draw_mark(ax, m: PlanMark, src, method: str) -> dict:
    ax.plot([m.input_length], [m.predicted_speedup], "D", ms=9, color="crimson", mec="k",
            label=f"{m.role}, {m.label}: predicted {m.predicted_speedup:.2f}x")
    if m.measured_speedup is not None:
        ax.plot([m.input_length] * 2, [m.predicted_speedup, m.measured_speedup], "-", color="crimson", lw=0.8)
        ax.plot([m.input_length], [m.measured_speedup], "o", ms=9, mfc="none", mec="crimson", mew=2,
                label=f"measured {m.measured_speedup:.2f}x")
    return {"acceptance": src.label, "method": method, "plan": m.label, "input_length": round(m.input_length, 3),
            "predicted_speedup": round(m.predicted_speedup, 4), "marked": m.role,
            "measured_speedup": None if m.measured_speedup is None else round(m.measured_speedup, 4)}


def fig_reliability(sources: list) -> Section:
    """Calibration (planner accept --calibrate): predicted against realised acceptance per cell,
    each cell scored by the map fitted on the other half of the prompts; marker area ~ observations."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.8, 5.2))
    table = []
    for k, src in enumerate(sources):
        cal = src.accept.source["calibration"]
        rel = [r for r in cal.reliability if isinstance(r, dict) and r.get("n")]
        if not rel:
            continue
        ax.scatter([r["predicted"] for r in rel], [r["realised"] for r in rel], s=[8 + 2 * r["n"] ** 0.8 for r in rel],
                   color=f"C{k}", alpha=0.6, label=f"{_short(src.label)} ({cal.signal})")
        n = sum(r["n"] for r in rel)
        ece = sum(r["n"] * abs(r["predicted"] - r["realised"]) for r in rel) / n
        table.append({"acceptance": src.label, "signal": cal.signal, "cells": len(rel), "observations": n,
                      "expected_calibration_error": round(ece, 4)})
    ax.plot([0, 1], [0, 1], "--", color="gray", lw=0.8, label="realised = predicted")
    ax.set_xlabel("predicted P(accepted | parent accepted)")
    ax.set_ylabel("realised rate (held-out half)")
    ax.set_title("Reliability of the calibrated maps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    caption = ("One point per (depth bin, signal bin) cell; the map is fitted on one half of the prompts and scored on "
               "the other (2-fold). Expected calibration error: the observation-weighted mean |predicted - realised|.")
    return Section("Calibration: predicted versus realised acceptance", "reliability.png", caption, table, fig)


