"""What the main job's phases share: the run (model, engine, guessers, run folder), its clock, and
one `Budget` that holds every time budget of the run."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "runs"  # where run folders go by default
LATEST = "latest"  # runs/latest: the newest finished run folder (a relative symlink)
PHASES = 6


@dataclass(frozen=True)
class Budget:
    """Every time budget of one autotune run, in one place (seconds unless a share)."""

    total_s: float = 240.0  # the whole run, model loading to report (--budget)
    profile_max_s: float = 45.0  # profiling at most this long (--profile-budget) ...
    profile_share: float = 0.2  # ... and at most this share of the whole run
    matmul_share: float = 0.35  # of the profiling time (CPU): choosing each Linear's matmul path; the rest times L(n)
    acceptance_share: float = 0.35  # of the time left when acceptance starts (the race needs the rest) ...
    # ... but never fewer prompts than this: acceptance and calibration do not depend on the machine's
    # load, only their time does, so a busy machine takes longer rather than plan from 2 prompts (a
    # run with one core busy did, and decided differently from the quiet run)
    accept_prompts_min: int = 6
    report_reserve_s: float = 12.0  # writing the run folder and drawing the report, kept out of the race
    # the engine's own generate and other engines' stock plain decoding of a few race prompts (comparisons),
    # kept out too
    compare_s: float = 25.0

    @property
    def after_race_s(self) -> float:
        """What the run does after the race: it is kept out of the race's deadline."""
        return self.report_reserve_s + self.compare_s

    @property
    def profile_s(self) -> float:
        return min(self.profile_max_s, self.profile_share * self.total_s)


@dataclass
class Clock:
    """Elapsed time against the budget, and one progress line per phase with the time left."""

    budget_s: float
    say: object
    t0: float = field(default_factory=time.time)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def phase(self, k: int, text: str, eta_s: float) -> None:
        self.say(f"[{k}/{PHASES}] {text}  ({self.elapsed():.0f} s in; about {max(eta_s, 0):.0f} s left, "
                 f"budget {self.budget_s / 60:.1f} min)")


@dataclass
class Run:
    """One autotune run: what every phase reads."""

    settings: object  # workflows.mainjob.pipeline.AutotuneSettings, the engine's defaults filled in
    engine: object  # the target engine every phase reaches the model through (decoder/engine.py)
    guessers: dict  # kind -> guesser (decoder/guessers/registry.py)
    out_dir: Path
    say: object  # print, or a no-op when quiet
    clock: Clock
    budget: Budget
    replays: list | None = None  # the shared greedy decode's teachers (profiler.replay.Teacher), per prompt
    free_cores: bool = False  # the engine's threads were cut to the cores other processes left free

    @property
    def device(self) -> str:
        return self.engine.device.type

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name


def shown(path) -> str:
    """Paths under the working directory are recorded relative to it, so a run folder can be moved or committed."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def default_out(device: str, model_name: str, engine: str | None = None) -> Path:
    """runs/<date>-<device>-<model>, with the engine's name for any but the default engine."""
    from planner.engines import DEFAULT

    stamp = time.strftime("%Y%m%d-%H%M%S")
    tag = "" if engine in (None, DEFAULT) else f"-{engine}"
    return REPO / "runs" / f"{stamp}-{device}{tag}-{model_name}"


def mark_latest(out_dir: Path) -> Path | None:
    """Point runs/latest at `out_dir` once its chosen.json is written, so `runs/latest/chosen.json` is
    always the newest decision. Only for run folders directly in runs/ (one written elsewhere with --out,
    a test's temporary one, leaves it alone). The link is relative (the repository can move) and replaced
    atomically; a `latest` that is not a symlink (a folder or file someone made) is never replaced.
    Returns the link, or None when it was left alone."""
    out_dir = Path(out_dir).resolve()
    runs = out_dir.parent
    if runs != RUNS.resolve():
        return None
    link = runs / LATEST
    if link.exists() and not link.is_symlink():
        return None
    tmp = runs / f".{LATEST}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(out_dir.name, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:  # a file system without symlinks: the run folder's own path still names the decision
        tmp.unlink(missing_ok=True)
        return None
    return link


def decision_line(out_dir: Path, latest: Path | None) -> str:
    """Where the decision is, as the main job prints it: the run folder's chosen.json, and the stable path."""
    import os.path

    line = f"decision: {shown(Path(out_dir) / 'chosen.json')}"
    if latest is not None:  # not resolved: the point is the link's own path
        line += f" (and {os.path.relpath(latest / 'chosen.json')}, the newest run's)"
    return line
