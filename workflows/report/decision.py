"""The front of a main job's report: what it decided, that decision's measured speed against plain decoding
and against the engine's own generation, and the race, before any figure.

    facts = decision_facts(summary)          # from RUN/summary.json; report.json keeps it
    html = decision_html(facts)              # the page's first section
    mark = chosen_mark(summary)              # the chosen plan on its guesser's speedup figure

Only measured numbers: the decision's speedup is the race's confirmation (or selection) against plain decoding
as raced; against `generate` it is that speedup itself where plain decoding is the engine's own generation
(llama.cpp, vLLM), else composed with plain decoding's ratio to `generate` timed in the same run, and said so.
"""
from __future__ import annotations

import html

from planner.errors import UserError
from planner.tree import DYNAMIC
from workflows.report.figures import PlanMark

PLAIN = "plain"


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _guesser(summary: dict) -> str:
    d = summary.get("decision") or {}
    return str(d.get("guesser") or summary.get("chosen_guesser") or PLAIN)


def figure_guesser(summary: dict) -> str | None:
    """The guesser whose acceptance the speedup figure shows: the chosen one's (a hybrid: its drafter, whose
    acceptance plans its trees); a plain decision: the best measured plan's, the one that came closest."""
    from planner.guessers import kind

    name = _guesser(summary)
    if name == PLAIN:
        best = next((r for r in _rows(summary) if r.get("label") == (summary.get("best_measured") or {}).get("label")),
                    None)
        name = str(best["guesser"]) if best and best.get("guesser") else None
    if name is None:
        return None
    try:
        spec = kind(name)
    except UserError:
        return None
    return spec.members[-1] if spec.members else spec.name


def _rows(summary: dict) -> list[dict]:
    rows = summary.get("rows")
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def chosen_mark(summary: dict) -> PlanMark | None:
    """The chosen plan (a plain decision: the best measured one) where the planner put it and as measured."""
    d = summary.get("decision") or {}
    chosen = next((r for r in _rows(summary) if r.get("chosen") is True), None)
    if chosen is None:
        best = (summary.get("best_measured") or {}).get("label")
        chosen = next((r for r in _rows(summary) if r.get("label") == best), None)
    guesser = figure_guesser(summary)
    if chosen is None or guesser is None:
        return None
    length, predicted = _num(chosen.get("input_length")), _num(chosen.get("predicted_speedup"))
    if chosen.get("method") == DYNAMIC and _num(chosen.get("size")) is not None:
        length = _num(chosen["size"]) + 1  # per-step trees: drawn at the largest forward they may take
    if length is None or predicted is None:
        return None
    measured = _num((d.get("measured_speedup") or {}).get("mean")) if chosen.get("chosen") else None
    if measured is None:
        measured = _num(chosen.get("measured_speedup"))
    role = "the run's choice" if chosen.get("chosen") else "the closest plan (plain decoding chosen)"
    return PlanMark(str(chosen.get("label")), guesser, length, predicted, measured, role)


def decision_facts(summary: dict) -> dict:
    """What the page's first section says, as data (report.json keeps it; tests read it)."""
    from planner.engines import kind as engine_kind

    d = summary.get("decision") or {}
    ms = d.get("measured_speedup") or {}
    engine = str(summary.get("engine") or "hf")
    try:
        spec = engine_kind(engine)
        stock, stock_plain = spec.stock, spec.caps.stock_plain
    except UserError:
        stock, stock_plain = "the engine's own generation", False
    speedup = _num(ms.get("mean"))
    facts = {"choice": str(d.get("choice") or PLAIN), "guesser": _guesser(summary), "reason": d.get("reason"),
             "chosen_file": summary.get("chosen"), "engine": engine, "model": summary.get("model"),
             "speedup_vs_plain": speedup, "interval": [_num(ms.get("lo")), _num(ms.get("hi"))],
             "prompts": ms.get("prompts"), "level": ms.get("level"), "p_value": _num(d.get("p_value")),
             "predicted_speedup": _num(d.get("predicted_speedup")),
             "plain_tokens_per_s": _num((summary.get("plain") or {}).get("tokens_per_s")),
             "identical_to_greedy": summary.get("identical_to_greedy"), "generate": stock}
    facts.update(_against_generate(summary, speedup, stock, stock_plain))
    facts["other_engines"] = {str(v.get("engine") or k[: -len("_plain")]): v for k, v in summary.items()
                              if k.endswith("_plain") and isinstance(v, dict) and _num(v.get("tokens_per_s"))}
    return facts


def _against_generate(summary: dict, speedup: float | None, stock: str, stock_plain: bool) -> dict:
    if stock_plain:
        return {"speedup_vs_generate": speedup, "vs_generate_how": f"plain decoding in the race is {stock} itself"}
    g = summary.get("generate") or {}
    ratio, tps = _num(g.get("plain_vs_generate")), _num(g.get("tokens_per_s"))
    if ratio is None or tps is None or speedup is None:
        return {"speedup_vs_generate": None,
                "vs_generate_how": g.get("skipped") or f"{stock} was not timed in this run (bench/bench_main_job.py "
                                                       "--run RUN races the decision against it)"}
    return {"speedup_vs_generate": speedup * ratio, "generate_tokens_per_s": tps, "plain_vs_generate": ratio,
            "vs_generate_how": f"composed: {speedup:.2f}x plain decoding, and plain decoding {ratio:.2f}x {stock} "
                               f"({tps:.1f} tokens/s) on the first {g.get('prompts', '?')} race prompts, in this run"}


def _x(v, spec: str = ".2f", suffix: str = "x") -> str:
    return "-" if v is None else f"{format(v, spec)}{suffix}"


def decision_html(f: dict) -> str:
    """The page's first section: the decision, its speed, the race table."""
    e = html.escape
    plain = f["choice"] == PLAIN
    head = "<b>plain decoding</b> (no plan measured faster)" if plain else \
        f"<b>{e(f['choice'])}</b> (guesser {e(f['guesser'])})"
    lo, hi = f["interval"]
    iv = f" [{lo:.2f}, {hi:.2f}] ({f['level']:.0%} interval)" if lo is not None and hi is not None and \
        isinstance(f.get("level"), (int, float)) and not plain else ""
    p = f", p = {f['p_value']:.2g}" if f["p_value"] is not None else ""
    tps = _x(f["plain_tokens_per_s"], ".1f", "")
    parts = ["<section id='decision'><h2>Decision</h2>",
             f"<p>Chosen: {head} &mdash; <code>{e(str(f['chosen_file'] or 'chosen.json'))}</code>, the plan "
             "<code>planner decode --plan</code> and <code>decoder.api.load_plan</code> take.</p>",
             f"<p>Plain decoding: {tps} tokens/s on the race prompts.</p>" if plain else
             f"<p>Measured: <b>{_x(f['speedup_vs_plain'])} plain decoding</b>{iv}{p} on {e(str(f['prompts']))} "
             f"prompts; predicted {_x(f['predicted_speedup'])}. Plain decoding: {tps} tokens/s.</p>",
             f"<p>Against {e(f['generate'])}: <b>{_x(f['speedup_vs_generate'])}</b> ({e(f['vs_generate_how'])}).</p>"]
    for name, o in f["other_engines"].items():
        parts.append(f"<p>{e(name)}'s own plain decoding of the same model: {o['tokens_per_s']:.1f} tokens/s "
                     f"({_x(_num(o.get('vs_plain')))} this engine's plain decoding; "
                     f"<code>planner autotune --engine {e(name)}</code> plans for it).</p>")
    if f["reason"]:
        parts.append(f"<p>Why: {e(str(f['reason']))}</p>")
    if f["identical_to_greedy"] is not None:
        parts.append(f"<p>Every raced plan's output identical to plain greedy decoding's: "
                     f"{e(str(f['identical_to_greedy']))}.</p>")
    parts.append("</section>")
    return "\n".join(parts)


RACE_COLUMNS = ("plan", "predicted", "measured", "interval", "tokens/step predicted", "tokens/step measured",
                "tokens/s", "note")


def race_table(summary: dict) -> list[dict]:
    """One row per raced plan, plain decoding first: the race as it was measured."""
    plain = summary.get("plain") or {}
    out = [{"plan": "plain decoding", "predicted": 1.0, "measured": 1.0, "interval": "",
            "tokens/step predicted": 1.0, "tokens/step measured": 1.0,
            "tokens/s": _num(plain.get("tokens_per_s")), "note": "the baseline"}]
    for r in _rows(summary):
        iv = r.get("measured_interval") or {}
        note = "CHOSEN" if r.get("chosen") else (str(r.get("dropped") or "").split(":")[0] or "")
        if r.get("identical_to_greedy") is False or r.get("identical_to_plain_sampling") is False:
            note = "OUTPUT DIFFERS"
        out.append({"plan": r.get("label"), "predicted": _num(r.get("predicted_speedup")),
                    "measured": _num(r.get("measured_speedup")),
                    "interval": f"[{iv['lo']:.2f}, {iv['hi']:.2f}]" if _num(iv.get("lo")) is not None else "",
                    "tokens/step predicted": _num(r.get("predicted_tokens_per_step")),
                    "tokens/step measured": _num(r.get("measured_tokens_per_step")),
                    "tokens/s": _num(r.get("measured_tokens_per_s")), "note": note})
    return out
