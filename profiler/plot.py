"""Latency versus input length: median points, p10-p90 band, fitted model; one colour per batch size."""
from __future__ import annotations

import io

from planner.jsonio import atomic_write_bytes


def plot_profile(profile: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for s in profile.get("series") or [dict(profile, batch_size=profile.get("batch_size", 1))]:
        n = s["input_lengths"]
        ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
        label = f"batch {s['batch_size']}"
        ax.fill_between(n, ms(s["p10_s"]), ms(s["p90_s"]), alpha=0.25, linewidth=0)
        color = ax.collections[-1].get_facecolor()[0][:3]
        ax.plot(n, ms(s["latency_s"]), "o", ms=2.5, color=color, label=f"{label}: median (band p10-p90)")
        ax.plot(s["fit"]["input_lengths"], ms(s["fit"]["latency_s"]), "-", lw=1.2, color=color, label=f"{label}: fit")
    _matmul_paths(ax, profile.get("matmul_paths"))
    ax.set_xlabel("input length n (new tokens per forward pass)")
    ax.set_ylabel("forward latency (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{profile.get('model')} on {profile.get('device_name')}\n"
        f"{profile.get('dtype')}, context {profile.get('context_length')}, threads {profile.get('threads')}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _matmul_paths(ax, mp: dict | None) -> None:
    """The matmul-paths check (decoder/engines/hf/matmul_choice.py): the whole forward with F.linear only and
    with the chosen paths at each n, and which n run their own paths."""
    w = (mp or {}).get("whole_model")
    if not w:
        return
    pts = [(n, d, c) for n, d, c in zip(w["rows"], w["default_s"], w["chosen_s"]) if d is not None and c is not None]
    if not pts:
        return
    n, d, c = zip(*pts)
    ax.plot(n, [x * 1e3 for x in d], "x", ms=4, color="0.4", label="F.linear only (matmul-paths check)")
    ax.plot(n, [x * 1e3 for x in c], "+", ms=5, color="C3", label="chosen matmul paths (same check)")
    kept = [r for r, k in zip(w["rows"], w["kept"]) if k]
    ax.text(0.99, 0.02, f"own matmul paths at n = {_ranges(kept) or 'none'}; extra weight layouts "
            f"{mp.get('extra_bytes', 0) / 2**20:.0f} MiB", transform=ax.transAxes, ha="right", fontsize=7)


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(f"{xs[i]}" if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)
