"""Figures and one index.html from profiles, acceptance statistics, trees, an autotune run and an
Optuna study (`planner report`, and the last step of `planner autotune`).

Each figure function takes loaded inputs and returns a Section: the figure plus the numbers
behind it, which index.html shows as a table under the picture. Figures are drawn only when the
inputs allow them. matplotlib (Agg) and optuna are imported inside functions.
"""
from __future__ import annotations

import html
from pathlib import Path

from planner.errors import UserError
from planner.jsonio import atomic_write_bytes, atomic_write_json, read_json
from planner.profile import LatencyProfile, load_profile
from planner.simulate import describe, simulated_of
from planner.tree import Tree, load_tree
from workflows.report.figures import (  # noqa: F401 (Section: the figures' type, re-exported)
    MAX_TABLE_ROWS,
    ProfileInput,
    Section,
    _plt,
    fig_latency,
    fig_reliability,
    fig_speedup,
    fig_tokens_per_step,
)
from workflows.report.runs import _layout, fig_run, fig_study, fig_tree, load_study, study_rows  # noqa: F401 (_layout: tests)

DEFAULT_TITLE = "Tree planner report"

# ---------------------------------------------------------------------------------------------
# inputs


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


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        v = f"{v:.4g}"
    return html.escape(str(v))


def table_html(rows: list[dict]) -> str:
    """<table> of dict rows, the columns in order of first appearance."""
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    return ("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>\n"
            + "\n".join("<tr>" + "".join(f"<td>{_cell(row.get(c, ''))}</td>" for c in cols) + "</tr>" for row in rows)
            + "</table>")


def render_html(sections: list[Section], title: str, notes: list[str], lead: str = "") -> str:
    """The page: the title, `lead` (a run's decision), the notes, then every figure with its numbers."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}"
        "img{max-width:100%;border:1px solid #ddd}table{border-collapse:collapse;font-size:12px;margin:0.5em 0 2em}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#f2f2f2}"
        "details{margin-bottom:2em}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if lead:
        parts.append(lead)
    if notes:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    if sections:
        parts.append("<h2>Figures</h2>" if lead else "")
        parts.append("<ol>" + "".join(f"<li><a href='#s{i}'>{html.escape(s.title)}</a></li>"
                                      for i, s in enumerate(sections)) + "</ol>")
    for i, s in enumerate(sections):
        parts.append(f"<h2 id='s{i}'>{html.escape(s.title)}</h2><p>{html.escape(s.caption)}</p>")
        parts.append(f"<img src='{html.escape(s.image)}' alt='{html.escape(s.title)}'>")
        if s.table:
            cut = len(s.table) > MAX_TABLE_ROWS
            more = f" (first {MAX_TABLE_ROWS} of {len(s.table)}; all in report.json)" if cut else ""
            parts.append(f"<details open><summary>numbers behind the figure{more}</summary>"
                         f"{table_html(s.table[:MAX_TABLE_ROWS])}</details>")
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
    """An acceptance spec string, a workflows.tune.search.Source, or an Acceptance (methods guessed from its label)."""
    from planner.accept import Acceptance
    from workflows.tune.search import Source, guess_methods, parse_accept_spec

    if isinstance(a, Source):
        return a
    if isinstance(a, Acceptance):
        return Source(a.label, a, guess_methods(a, a.label))
    return parse_accept_spec(str(a))


def write_report(out_dir, profiles=(), accepts=(), trees=(), run_dir=None, storage=None, study_name=None,
                 *, max_size: int = 64, title: str | None = None) -> Path:
    """Draw what the inputs allow into out_dir; returns the path of index.html.

    profiles: profile files (or LatencyProfile); accepts: acceptance specs '[METHOD[/eE]=]FILE[:NAME]'
    (or workflows.tune.search.Source, or Acceptance); trees: tree files (or Tree); run_dir: an autotune directory with
    summary.json; storage/study_name: an Optuna study.
    """
    out_dir = Path(out_dir)
    title = title or DEFAULT_TITLE
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
    lead, facts, marks = _run_front(summary)

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
            add(fig_speedup(sources, profs, max_size, marks))
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

    if facts is not None:  # a run's page: the decision first, then the figures that explain it
        sections.sort(key=_run_order)
        if title == DEFAULT_TITLE:
            title = f"Main job: {facts['model']} on the {facts['engine']} engine"
    inputs = {"profiles": [p.profile.source.get("file", p.label) for p in profs], "accepts": [s.label for s in sources],
              "trees": [str(s) if not isinstance(s, Tree) else "(in memory)" for s, _ in loaded_trees],
              "run_dir": None if run_dir is None else str(run_dir), "storage": storage,
              "study_name": None if study is None else study.study_name}
    atomic_write_json(out_dir / "report.json", {
        "inputs": inputs, "notes": notes, "decision": facts,
        "sections": [{"title": s.title, "image": s.image, "caption": s.caption, "table": s.table} for s in sections],
    })
    index = out_dir / "index.html"
    atomic_write_bytes(index, render_html(sections, title, notes, lead).encode())
    return index


# a run's figures in the order that explains its decision: the chosen guesser's speedup curve with the
# chosen plan on it, the chosen tree, predicted against measured, then the inputs (latency, acceptance)
RUN_ORDER = ("speedup.png", "tree_", "run.png", "latency.png", "tokens_per_step.png", "reliability.png")


def _run_order(section: Section) -> int:
    return next((i for i, p in enumerate(RUN_ORDER) if section.image.startswith(p)), len(RUN_ORDER))


def _run_front(summary: dict | None) -> tuple[str, dict | None, tuple]:
    """A main job's summary: (the page's first section, its facts, the chosen plan's mark on the speedup
    figure); anything else: nothing."""
    if summary is None or not isinstance(summary.get("decision"), dict) or "choice" not in summary["decision"]:
        return "", None, ()
    from workflows.report.decision import chosen_mark, decision_facts, decision_html, race_table

    facts = decision_facts(summary)
    lead = (decision_html(facts) + "\n<h3>The race</h3>\n<p>Every finalist against plain decoding, measured on the "
            "same prompts (selection stage; the chosen plan also on its confirmation prompts above).</p>\n"
            + table_html(race_table(summary)))
    mark = chosen_mark(summary)
    return lead, facts, (mark,) if mark is not None else ()
