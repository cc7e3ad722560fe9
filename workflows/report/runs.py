"""`planner report`'s figures of one run: an autotune run's predicted against measured rows, a
tree drawn node by node, and an Optuna study's history and parameters (optuna loads inside)."""
from __future__ import annotations

import math

import numpy as np

from planner.errors import UserError
from planner.tree import Tree
from workflows.report.figures import Section, _plt


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
                               "identical_to_plain_sampling", "chosen", "tree")})
    fig.suptitle("The planner's prediction against real decoding (point labels: input length)")
    fig.tight_layout()
    caption = f"From {label}. Points on the dashed line are predicted exactly."
    if summary.get("identical_to_plain_sampling") is not None:  # coupled sampling (decoder/noise.py)
        caption += f" Output identical to plain sampling with the same seed: {summary['identical_to_plain_sampling']}."
    elif "identical_to_greedy" in summary:
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

    from workflows.tune.storage import open_storage

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


