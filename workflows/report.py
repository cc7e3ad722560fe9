"""Figures and one index.html from profiles, acceptance statistics, trees, an autotune run and an
Optuna study (`planner report`, and the last step of `planner autotune`).

Each figure function takes loaded inputs and returns a Section: the figure plus the numbers
behind it, which index.html shows as a table under the picture. Figures are drawn only when the
inputs allow them. matplotlib (Agg) and optuna are imported inside functions.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from planner.errors import UserError
from planner.jsonio import atomic_write_bytes, atomic_write_json, read_json
from planner.profile import LatencyProfile, load_profile
from planner.simulate import describe, simulated_of
from planner.tree import PPD, Tree, load_tree

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


# ---------------------------------------------------------------------------------------------
# inputs


@dataclass
class ProfileInput:
    profile: LatencyProfile
    label: str
    raw: dict  # the whole profiler file: medians, p10/p90, fit


def load_profile_input(spec: str | LatencyProfile) -> ProfileInput:
    if isinstance(spec, LatencyProfile):
        return ProfileInput(spec, _profile_label(spec.source, spec.source.get("file", "profile")), {})
    raw = read_json(spec)
    prof = load_profile(spec)
    return ProfileInput(prof, _profile_label(raw if isinstance(raw, dict) else {}, Path(spec).stem), raw)


def _profile_label(meta: dict, fallback: str) -> str:
    mark = simulated_of(meta)
    if mark is not None:  # a computed profile is never drawn as if measured
        parts = [describe(mark)] + ([str(meta["model"])] if meta.get("model") else [])
    else:
        parts = [str(meta[k]) for k in ("device", "model") if meta.get(k)]
    if meta.get("context_length"):
        parts.append(f"ctx {meta['context_length']}")
    return ", ".join(parts) if parts else str(fallback)


def _tree_label(spec, tree: Tree) -> str:
    label = Path(spec).stem if isinstance(spec, (str, Path)) else f"{tree.method} tree"
    mark = simulated_of((tree.provenance or {}).get("profile") or {})
    return f"{label} (planned on {describe(mark)})" if mark is not None else label


def simulated_notes(profs: list[ProfileInput], trees: list) -> list[str]:
    """One note per simulated profile and per tree planned on one: predictions, not measurements."""
    out = []
    for p in profs:
        if simulated_of(p.profile.source) is not None:
            out.append(f"Profile '{p.label}' is simulated (planner profile --simulate): computed for a GPU this "
                       "machine does not have, not measured; its latencies and speedups are predictions.")
    for spec, tree in trees:
        mark = simulated_of((tree.provenance or {}).get("profile") or {})
        if mark is not None:
            out.append(f"Tree '{_tree_label(spec, tree)}' was planned on a simulated profile ({describe(mark)}): "
                       "its predicted speedup is for that GPU, not measured.")
    return out


# ---------------------------------------------------------------------------------------------
# figures


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
    from workflows.tune import PLAN_DEFAULT_PROMPT_TOKENS

    d = accept.max_depth
    return PLAN_DEFAULT_PROMPT_TOKENS if d is None else min(PLAN_DEFAULT_PROMPT_TOKENS, d)


def _plan_at_length(method: str, accept, n: int) -> Tree:
    """The planner's best tree whose forward pass has n tokens (medusa/sequoia: n - 1 candidates)."""
    from planner.plan import plan

    if method == PPD:
        return plan(PPD, accept, input_length=n, prompt_tokens=_ppd_prompt_tokens(accept))
    return plan(method, accept, size=n - 1)


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


def fig_speedup(sources: list, profiles: list[ProfileInput], max_size: int = 64) -> Section:
    """Predicted speedup versus tree size, one line per machine, the chosen tree starred (PPD fig. 8b)."""
    from planner.plan import plan

    plt = _plt()
    pairs = [(s, m) for s in sources for m in s.methods]
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.4 * len(pairs), 4.6), squeeze=False)
    table = []
    for ax, (src, method) in zip(axes[0], pairs):
        for i, p in enumerate(profiles):
            try:
                kw = {"prompt_tokens": _ppd_prompt_tokens(src.accept),
                      "max_input_length": min(max_size + 1, p.profile.max_input_length)} if method == PPD else {}
                tree = plan(method, src.accept, profile=p.profile, max_size=max_size, **kw)
            except UserError as e:
                ax.text(0.5, 0.5 - 0.08 * i, f"{p.label}: {e}", transform=ax.transAxes, ha="center", fontsize=7, wrap=True)
                continue
            curve = [r for r in (tree.size_curve or []) if r["input_length"] >= 2]
            ax.plot([r["input_length"] for r in curve], [r["predicted_speedup"] for r in curve], "-", color=f"C{i}",
                    lw=1.5, label=p.label)
            n_best = tree.max_input_length
            ax.plot([n_best], [tree.predicted_speedup], "*", ms=14, color=f"C{i}", mec="k",
                    label=f"chosen: input length {n_best}, {tree.predicted_speedup:.2f}x")
            for r in curve:
                table.append({"acceptance": src.label, "method": method, "profile": p.label,
                              "input_length": int(r["input_length"]),
                              "expected_tokens_per_step": round(r["expected_tokens_per_step"], 4),
                              "latency_ms": round(r["latency_s"] * 1e3, 4),
                              "predicted_speedup": round(r["predicted_speedup"], 4)})
            table.append({"acceptance": src.label, "method": method, "profile": p.label, "input_length": n_best,
                          "expected_tokens_per_step": round(tree.expected_tokens_per_step, 4),
                          "predicted_speedup": round(tree.predicted_speedup, 4), "chosen": True,
                          "construction": tree.settings.get("construction", "")})
        ax.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("tree size: input length (tokens per forward pass)")
        ax.set_ylabel("predicted speedup over plain decoding (x)")
        ax.set_title(f"{method} on {_short(src.label)}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Predicted speedup versus tree size per machine (the planner's choice starred)")
    fig.tight_layout()
    return Section("Predicted speedup versus tree size", "speedup.png",
                   "speedup = expected tokens per step x L(1) / step latency, with L from each profile (the PPD "
                   "paper's figure 8b for these profiles). Lines: the best tree at each shared input length; star: "
                   "the tree `planner plan` chooses (PPD with per-state budgets may sit above the line, its states "
                   "using different lengths; drawn at its largest).", table, fig)


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


def study_rows(study) -> list[dict]:
    """Trials of a measured study as autotune-style rows (predicted from the profile, measured by decoding)."""
    import optuna

    rows = []
    for t in study.trials:
        a = t.user_attrs
        if t.state != optuna.trial.TrialState.COMPLETE or "measured_tokens_per_s" not in a:
            continue
        rows.append({"method": t.params.get("method"), "input_length": a.get("max_input_length"),
                     "predicted_tokens_per_step": a.get("expected_tokens_per_step"),
                     "measured_tokens_per_step": a.get("measured_tokens_per_step"),
                     "predicted_speedup": a.get("predicted_speedup"), "measured_speedup": a.get("measured_speedup"),
                     "tree": f"trial {t.number}"})
    return rows


def fig_run(summary: dict, label: str, image: str = "run.png", title: str = "Predicted versus measured (autotune run)") -> Section:
    """Predicted against measured tokens per step and speedup, one point per autotune row."""
    plt = _plt()
    rows = summary.get("rows")
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{label}: field 'rows' must be a non-empty list")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    table = []
    chosen = str(summary.get("chosen", ""))
    for j, (key, unit) in enumerate((("tokens_per_step", "tokens per step"), ("speedup", "speedup (x)"))):
        ax = axes[j]
        pts = []
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise UserError(f"{label}: field 'rows[{i}]' must be an object")
            pr, me = r.get(f"predicted_{key}"), r.get(f"measured_{key}")
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (pr, me)):
                continue
            pts.append((pr, me, r))
        methods = sorted({str(r.get("method")) for _, _, r in pts})
        for k, m in enumerate(methods):
            sel = [(p, q) for p, q, r in pts if str(r.get("method")) == m]
            ax.plot([p for p, _ in sel], [q for _, q in sel], "o", color=f"C{k}", label=m)
        for p, q, r in pts:
            tag = r.get("input_length", "")
            tag = f"{tag:.3g}" if isinstance(tag, float) else str(tag)
            if r.get("chosen") is True or (chosen and str(r.get("tree", "")) == chosen):
                ax.plot([p], [q], "*", ms=15, mfc="none", mec="k", label="chosen")
            ax.annotate(tag, (p, q), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if pts:
            lo = min(min(p, q) for p, q, _ in pts)
            hi = max(max(p, q) for p, q, _ in pts)
            pad = 0.05 * (hi - lo or 1)
            ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "--", color="gray", lw=0.8, label="measured = predicted")
        ax.set_xlabel(f"predicted {unit}")
        ax.set_ylabel(f"measured {unit}")
        ax.set_title(f"Predicted versus measured {unit}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for r in rows:
        table.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                      if k in ("method", "size", "input_length", "predicted_tokens_per_step", "measured_tokens_per_step",
                               "predicted_speedup", "measured_speedup", "measured_tokens_per_s", "identical_to_greedy",
                               "chosen", "tree")})
    fig.suptitle("The planner's prediction against real decoding (point labels: input length)")
    fig.tight_layout()
    caption = f"From {label}. Points on the dashed line are predicted exactly."
    if "identical_to_greedy" in summary:
        caption += f" Output identical to plain greedy decoding: {summary['identical_to_greedy']}."
    return Section(title, image, caption, table, fig)


def _layout(nodes: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[float, int]]:
    """x (leaves evenly spaced, parents centred over children) and depth of every node, root ()."""
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {(): []}
    for p in nodes:
        children.setdefault(p, [])
        children[p[:-1]].append(p)
    pos: dict[tuple[int, ...], tuple[float, int]] = {}
    next_x = [0.0]

    def place(u):
        kids = sorted(children[u], key=lambda c: c[-1])
        if not kids:
            pos[u] = (next_x[0], len(u))
            next_x[0] += 1.0
            return
        for c in kids:
            place(c)
        pos[u] = ((pos[kids[0]][0] + pos[kids[-1]][0]) / 2, len(u))

    place(())
    return pos


def fig_tree(tree: Tree, label: str, image: str) -> Section:
    """The tree of every state; nodes labelled by rank, prompt tokens drawn as small squares."""
    plt = _plt()
    states = sorted(tree.states, key=lambda s: s.state)
    widths = [sum(1 for p in s.nodes if not any(q[:-1] == p for q in s.nodes)) or 1 for s in states]
    depth = max(1, max(s.depth for s in states))
    fig, axes = plt.subplots(len(states), 1, figsize=(max(7.0, 0.42 * max(widths) + 1.5), 1.2 + (0.8 * depth + 1.0) * len(states)),
                             squeeze=False)
    table = []
    for ax, st in zip(axes[:, 0], states):
        pos = _layout(st.nodes)
        index = {(): 0} | {p: i + 1 for i, p in enumerate(st.nodes)}
        for p in st.nodes:
            (x0, y0), (x1, y1) = pos[p[:-1]], pos[p]
            ax.plot([x0, x1], [-y0, -y1], "-", color="0.55", lw=0.9, zorder=1)
        for p, (x, y) in pos.items():
            color = "black" if not p else f"C{(len(p) - 1) % 10}"
            ax.scatter([x], [-y], s=260, color=color, zorder=2, edgecolors="white")
            ax.text(x, -y, "R" if not p else str(p[-1]), color="white", ha="center", va="center", fontsize=8,
                    fontweight="bold", zorder=3)
            k = st.prompt_tokens[index[p]] if st.prompt_tokens else 0
            if k:  # prompt tokens: a gold box with their count, hanging below-right of the node
                ax.plot([x, x + 0.22], [-y, -y - 0.32], ":", color="goldenrod", lw=0.9, zorder=1)
                ax.text(x + 0.22, -y - 0.32, str(k), fontsize=7, ha="center", va="center", zorder=3,
                        bbox=dict(boxstyle="square,pad=0.2", fc="gold", ec="darkgoldenrod", lw=0.6))
        ax.set_xlim(min(x for x, _ in pos.values()) - 0.7, max(x for x, _ in pos.values()) + 0.9)
        ax.set_ylim(-depth - 0.6, 0.5)
        ax.set_yticks([-d for d in range(depth + 1)], [f"distance {d}" if d else "root" for d in range(depth + 1)], fontsize=7)
        ax.set_xticks([])
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
        title = f"state {st.state}: {len(st.nodes)} candidates, input length {st.input_length}, tau {st.expected_tokens:.3f}"
        if st.stationary_probability is not None:
            title += f", pi {st.stationary_probability:.3f}"
        if st.prompt_tokens:
            title += f", {sum(st.prompt_tokens)} prompt tokens"
        ax.set_title(title, fontsize=9)
        table.append({"state": st.state, "candidates": len(st.nodes), "depth": st.depth,
                      "prompt_tokens": sum(st.prompt_tokens or []), "input_length": st.input_length,
                      "expected_tokens": round(st.expected_tokens, 4),
                      "stationary_probability": None if st.stationary_probability is None else round(st.stationary_probability, 4)})
    head = f"{label}: {tree.method}, {tree.expected_tokens_per_step:.3f} tokens per step"
    if tree.predicted_speedup is not None:
        head += f", predicted speedup {tree.predicted_speedup:.2f}x"
    fig.suptitle(head + "\nnode label = rank of the guess, R = root, gold box = number of prompt tokens after the node",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.55 / fig.get_figheight()))
    return Section(f"Tree: {label}", image,
                   "One tree per decoder state; circles are candidates labelled by rank, colour by distance; "
                   "gold boxes give the number of PPD prompt tokens appended after the node.", table, fig)


def load_study(storage: str, study_name: str | None):
    import optuna

    from workflows.tune import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = open_storage(storage)
    names = [s.study_name for s in optuna.get_all_study_summaries(st)]
    if study_name is None:
        if len(names) != 1:
            raise UserError(f"--storage {storage}: holds {len(names)} studies ({', '.join(names) or 'none'}); pick one with --study-name")
        study_name = names[0]
    if study_name not in names:
        raise UserError(f"--storage {storage}: no study named '{study_name}' (studies: {', '.join(names) or 'none'})")
    return optuna.load_study(study_name=study_name, storage=st)


def fig_study(study) -> list[Section]:
    """Optimisation history (value per trial, best so far) and, with two objectives, the Pareto front."""
    import optuna

    plt = _plt()
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not done:
        raise UserError(f"study '{study.study_name}' has no completed trials")
    names = study.user_attrs.get("objective_names") or [f"objective {i}" for i in range(len(study.directions))]
    maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    xs = [t.number for t in done]
    ys = [t.values[0] for t in done]
    ref = [t for t in done if t.user_attrs.get("reference")]
    methods = sorted({str(t.params.get("method", "")) for t in done})
    for k, m in enumerate(methods):
        sel = [t for t in done if str(t.params.get("method", "")) == m]
        ax.plot([t.number for t in sel], [t.values[0] for t in sel], "o", ms=4, color=f"C{k}", alpha=0.75,
                label=f"trial: {m}" if m else "trial")
    best = np.maximum.accumulate(ys) if maximize else np.minimum.accumulate(ys)
    ax.step(xs, best, where="post", color="C3", lw=1.6, label="best so far")
    if ref:
        ax.plot([t.number for t in ref], [t.values[0] for t in ref], "D", ms=7, mfc="none", mec="k",
                label="`planner plan` point (enqueued)")
    ax.set_xlabel("trial number")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel(names[0])
    ax.set_title(f"Optuna history: study '{study.study_name}' ({len(done)} completed trials)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    table = [{"trial": t.number, **{names[i]: round(v, 5) for i, v in enumerate(t.values)},
              **{k: v for k, v in t.params.items()}} for t in sorted(done, key=lambda t: -t.values[0] if maximize else t.values[0])]
    out = [Section("Optuna history", "study_history.png",
                   f"Every completed trial's {names[0]} and the best so far; diamonds are the `planner plan` points "
                   "enqueued first, so the best is never below them. Table: trials, best first.", table, fig)]
    if len(study.directions) == 2:
        fig, ax = plt.subplots(figsize=(7.5, 4.6))
        front = {t.number for t in study.best_trials}
        other = [t for t in done if t.number not in front]
        pf = sorted((t for t in done if t.number in front), key=lambda t: t.values[1])
        ax.plot([t.values[1] for t in other], [t.values[0] for t in other], "o", ms=4, color="0.6", label="trial")
        ax.plot([t.values[1] for t in pf], [t.values[0] for t in pf], "-o", ms=6, color="C3", drawstyle="steps-post",
                label="Pareto front")
        labelled = set()
        for t in pf:
            key = (t.values[1], round(t.values[0], 6))
            if key in labelled:
                continue
            labelled.add(key)
            ax.annotate(str(t.params.get("method", "")), (t.values[1], t.values[0]), fontsize=7,
                        xytext=(4, -9), textcoords="offset points")
        ax.set_xlabel(names[1])
        ax.set_ylabel(names[0])
        ax.set_title(f"Pareto front: {names[0]} versus {names[1]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        ptable = [{"trial": t.number, names[0]: round(t.values[0], 5), names[1]: t.values[1], **t.params} for t in pf]
        out.append(Section("Pareto front", "study_pareto.png",
                           "Trials no other trial beats on both objectives (red).", ptable, fig))
    return out


# ---------------------------------------------------------------------------------------------
# the report


def _cell(v) -> str:
    if isinstance(v, float):
        v = f"{v:.4g}"
    return html.escape(str(v))


def render_html(sections: list[Section], title: str, notes: list[str]) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}"
        "img{max-width:100%;border:1px solid #ddd}table{border-collapse:collapse;font-size:12px;margin:0.5em 0 2em}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#f2f2f2}"
        "details{margin-bottom:2em}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if notes:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    parts.append("<ol>" + "".join(f"<li><a href='#s{i}'>{html.escape(s.title)}</a></li>" for i, s in enumerate(sections)) + "</ol>")
    for i, s in enumerate(sections):
        parts.append(f"<h2 id='s{i}'>{html.escape(s.title)}</h2><p>{html.escape(s.caption)}</p>")
        parts.append(f"<img src='{html.escape(s.image)}' alt='{html.escape(s.title)}'>")
        if s.table:
            cols: list[str] = []
            for row in s.table:
                cols += [c for c in row if c not in cols]
            rows = s.table[:MAX_TABLE_ROWS]
            more = f" (first {MAX_TABLE_ROWS} of {len(s.table)}; all in report.json)" if len(s.table) > MAX_TABLE_ROWS else ""
            parts.append(f"<details open><summary>numbers behind the figure{more}</summary><table><tr>"
                         + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>")
            for row in rows:
                parts.append("<tr>" + "".join(f"<td>{_cell(row.get(c, ''))}</td>" for c in cols) + "</tr>")
            parts.append("</table></details>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _save(section: Section, out_dir: Path) -> None:
    import io

    buf = io.BytesIO()
    section.figure.savefig(buf, format="png", dpi=110)
    _plt().close(section.figure)
    section.figure = None
    atomic_write_bytes(out_dir / section.image, buf.getvalue())


def _as_source(a):
    """An acceptance spec string, a workflows.tune.Source, or an Acceptance (methods guessed from its label)."""
    from planner.accept import Acceptance
    from workflows.tune import Source, guess_methods, parse_accept_spec

    if isinstance(a, Source):
        return a
    if isinstance(a, Acceptance):
        return Source(a.label, a, guess_methods(a, a.label))
    return parse_accept_spec(str(a))


def write_report(out_dir, profiles=(), accepts=(), trees=(), run_dir=None, storage=None, study_name=None,
                 *, max_size: int = 64, title: str = "Tree planner report") -> Path:
    """Draw what the inputs allow into out_dir; returns the path of index.html.

    profiles: profile files (or LatencyProfile); accepts: acceptance specs '[METHOD[/eE]=]FILE[:NAME]'
    (or workflows.tune.Source, or Acceptance); trees: tree files (or Tree); run_dir: an autotune directory with
    summary.json; storage/study_name: an Optuna study.
    """
    out_dir = Path(out_dir)
    profs = [load_profile_input(p) for p in profiles]
    sources = [_as_source(a) for a in accepts]
    loaded_trees = [(t, t if isinstance(t, Tree) else load_tree(t)) for t in trees]
    summary = None
    if run_dir is not None:
        spath = Path(run_dir) / "summary.json"
        summary = read_json(spath)
        if not isinstance(summary, dict):
            raise UserError(f"{spath}: expected a JSON object")
    study = load_study(storage, study_name) if storage else None
    if not (profs or sources or loaded_trees or summary is not None or study is not None):
        raise UserError("nothing to draw: give at least one of --profile, --accept, --tree, --run, --storage")

    out_dir.mkdir(parents=True, exist_ok=True)
    sections: list[Section] = []
    notes: list[str] = simulated_notes(profs, loaded_trees)

    def add(section_or_list):
        for s in section_or_list if isinstance(section_or_list, list) else [section_or_list]:
            _save(s, out_dir)  # save as we go: one figure in memory at a time
            sections.append(s)

    if profs:
        add(fig_latency(profs))
    if sources:
        add(fig_tokens_per_step(sources, max_size))
        calibrated = [s for s in sources if s.accept.source.get("calibration") is not None]
        if calibrated:
            add(fig_reliability(calibrated))
        if profs:
            add(fig_speedup(sources, profs, max_size))
        else:
            notes.append("No --profile: the speedup figure needs a latency profile.")
    if summary is not None:
        add(fig_run(summary, str(Path(run_dir) / "summary.json")))
    used = set()
    for spec, tree in loaded_trees:
        label = _tree_label(spec, tree)
        stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        name, k = f"tree_{stem}.png", 1
        while name in used:
            k += 1
            name = f"tree_{stem}_{k}.png"
        used.add(name)
        add(fig_tree(tree, label, name))
    if study is not None:
        add(fig_study(study))
        rows = study_rows(study)
        if any(isinstance(r["predicted_speedup"], (int, float)) for r in rows):
            add(fig_run({"rows": rows}, f"study '{study.study_name}' (objective measured, with a profile)",
                        "study_measured.png", "Predicted versus measured (tune study)"))

    inputs = {"profiles": [p.profile.source.get("file", p.label) for p in profs], "accepts": [s.label for s in sources],
              "trees": [str(s) if not isinstance(s, Tree) else "(in memory)" for s, _ in loaded_trees],
              "run_dir": None if run_dir is None else str(run_dir), "storage": storage,
              "study_name": None if study is None else study.study_name}
    atomic_write_json(out_dir / "report.json", {
        "inputs": inputs, "notes": notes,
        "sections": [{"title": s.title, "image": s.image, "caption": s.caption, "table": s.table} for s in sections],
    })
    index = out_dir / "index.html"
    atomic_write_bytes(index, render_html(sections, title, notes).encode())
    return index
