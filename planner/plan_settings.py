"""What the decoder reads from a plan file's `settings` at run time, typed and validated on load.

    run = plan_settings(tree.settings, "runs/x/chosen.json")   # PlanSettings, or a one-line UserError
    run.guesser, run.pad_to, run.pearl, run.raced_with

A plan's `settings` also records how it was planned (predictions, the decision's reason, tune's
trial...): those are for people and reports, and stay a free dict. The fields below are a runtime
contract (trees/schema.json, "settings"): the guesser kind the plan was made for, the padded input
lengths the profile measured cheaper, PEARL's window and thread split, and what the plan was raced
with (engine, threads, the profile whose matmul paths ran, the guesser's files, each by a path
relative to the plan file's folder and a checksum), so `planner decode --plan` reproduces the
configuration that won the race with no other flag. Older files without them still load.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from planner.errors import UserError


def engines() -> list[str]:
    """The target engines a plan can name: the registry's (planner/engines.py); absent: the default."""
    from planner.engines import names

    return names()


MAX_PAD = 4096


@dataclass(frozen=True)
class FileRef:
    """A file or directory a plan depends on: its path relative to the plan's folder, and a checksum."""

    path: str
    sha256: str

    def to_json(self) -> dict:
        return {"path": self.path, "sha256": self.sha256}

    def resolve(self, plan_dir: Path) -> Path:
        p = Path(self.path)
        return p if p.is_absolute() else plan_dir / p

    def check(self, plan_dir: Path, label: str, what: str) -> Path:
        """The referenced path, or a one-line error when it is missing or changed since the plan was written."""
        p = self.resolve(plan_dir)
        if not p.exists():
            raise UserError(f"{label}: {what} {self.path} (relative to the plan's folder) is missing; "
                            f"restore it, or override it with a flag")
        got = digest(p)
        if got != self.sha256:
            raise UserError(f"{label}: {what} {self.path} changed since the plan was raced (sha256 {got[:12]}, "
                            f"recorded {self.sha256[:12]}); re-run autotune, or override it with a flag")
        return p


def digest(path: Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (relative names and bytes, sorted)."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(str(f.relative_to(path)).encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    else:
        h.update(path.read_bytes())
    return h.hexdigest()


def file_ref(path, plan_dir) -> FileRef:
    """A reference to `path` as seen from the plan's folder (relative where it can be)."""
    path, plan_dir = Path(path).resolve(), Path(plan_dir).resolve()
    try:
        rel = path.relative_to(plan_dir)
    except ValueError:
        import os

        rel = Path(os.path.relpath(path, plan_dir))
    return FileRef(rel.as_posix(), digest(path))


@dataclass(frozen=True)
class RacedWith:
    """The configuration a plan was measured with in the race."""

    engine: str = "hf"  # the registry's name of the engine it raced in (planner/engines.py)
    threads: int | None = None  # CPU threads the target computed with
    profile: FileRef | None = None  # the profile whose matmul paths the hf engine ran (CPU); None: F.linear
    guesser: FileRef | None = None  # the guesser's files (None: a guesser without files)
    free_cores: bool = False  # threads were the cores free of other processes: decode on the cores free then

    def to_json(self) -> dict:
        d: dict = {"engine": self.engine, "threads": self.threads}
        if self.free_cores:
            d["free_cores"] = True
        if self.profile is not None:
            d["profile"] = self.profile.to_json()
        if self.guesser is not None:
            d["guesser"] = self.guesser.to_json()
        return d


@dataclass(frozen=True)
class Pearl:
    gamma: int
    threads: tuple[int, int] | None = None  # (target, drafter) CPU threads the race measured it at


@dataclass(frozen=True)
class PlanSettings:
    guesser: str | None = None  # the guesser kind the plan was made for (planner/guessers.py)
    pad_to: dict[int, int] = field(default_factory=dict)  # run n-input steps at m inputs (planner.profile)
    pearl: Pearl | None = None
    raced_with: RacedWith | None = None


def _int(x, lo: int, hi: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _ref(obj, label: str, f: str) -> FileRef | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("path"), str) or not isinstance(obj.get("sha256"), str) \
            or len(obj["sha256"]) != 64:
        raise UserError(f"{label}: field 'settings.{f}' must be an object with 'path' and 'sha256' (64 hex digits)")
    return FileRef(obj["path"], obj["sha256"])


def _raced_with(obj, label: str) -> RacedWith | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise UserError(f"{label}: field 'settings.raced_with' must be an object")
    engine = obj.get("engine", "hf")
    if engine not in engines():
        raise UserError(f"{label}: field 'settings.raced_with.engine' is {engine!r}, expected one of {', '.join(engines())}")
    threads = obj.get("threads")
    if threads is not None and not _int(threads, 1, 4096):
        raise UserError(f"{label}: field 'settings.raced_with.threads' must be an integer in 1..4096, got {threads!r}")
    free = obj.get("free_cores", False)
    if not isinstance(free, bool):
        raise UserError(f"{label}: field 'settings.raced_with.free_cores' must be true or false, got {free!r}")
    return RacedWith(engine, threads, _ref(obj.get("profile"), label, "raced_with.profile"),
                     _ref(obj.get("guesser"), label, "raced_with.guesser"), free)


def _pearl(obj, label: str) -> Pearl | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or not _int(obj.get("gamma"), 1, 64):
        raise UserError(f"{label}: field 'settings.pearl.gamma' must be an integer in 1..64")
    t = obj.get("threads")
    if t is not None and not (isinstance(t, list) and len(t) == 2 and all(_int(x, 1, 4096) for x in t)):
        raise UserError(f"{label}: settings.pearl.threads: expected [target, drafter] threads >= 1 (at most 4096), got {t!r}")
    return Pearl(obj["gamma"], tuple(t) if t is not None else None)


def plan_settings(settings: dict | None, label: str = "plan") -> PlanSettings:
    """The runtime fields of a plan's settings, checked; anything else in settings is a record."""
    s = settings or {}
    if not isinstance(s, dict):
        raise UserError(f"{label}: field 'settings' must be an object")
    guesser = s.get("guesser")
    if guesser is not None:
        from planner.guessers import names

        if guesser not in names():
            raise UserError(f"{label}: field 'settings.guesser' is {guesser!r}, expected one of {', '.join(names())}")
    pad = s.get("pad_to") or {}
    if not isinstance(pad, dict):
        raise UserError(f"{label}: field 'settings.pad_to' must map input lengths to longer ones")
    pad_to = {}
    for k, v in pad.items():
        try:
            n = int(k)
        except (TypeError, ValueError):
            n = -1
        if not (_int(n, 1, MAX_PAD) and _int(v, n, MAX_PAD)):
            raise UserError(f"{label}: field 'settings.pad_to' maps {k!r} to {v!r}; expected n -> m, "
                            f"integers with 1 <= n <= m <= {MAX_PAD}")
        pad_to[n] = v
    return PlanSettings(guesser, pad_to, _pearl(s.get("pearl"), label), _raced_with(s.get("raced_with"), label))
