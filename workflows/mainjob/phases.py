"""The one place that picks the main job's phases for an engine: by its protocol (planner/engines.py
`EngineKind.protocol`, read from the engine kind's caps), a step or a serving implementation of each.

    phases = phases_for(kind("vllm"))
    run = phases.open(settings); phases.profile(run); ...; summary = phases.write(run); phases.close(run)

workflows/mainjob/pipeline.py runs them in order; `planner profile` and `planner accept` pick their own
serving or step path by the same protocol.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.engines import SERVING, STEP, EngineKind


@dataclass(frozen=True)
class Phases:
    """One implementation of the main job's named phases; `open` makes the run every other phase takes."""

    protocol: str
    open: Callable
    profile: Callable
    accept: Callable
    plan: Callable
    race: Callable
    confirm: Callable
    write: Callable[..., dict]
    close: Callable


def _step() -> Phases:
    from workflows.mainjob import step

    return Phases(STEP, step.open_run, step.profile, step.accept, step.plan, step.race, step.confirm, step.write,
                  step.close)


def _serving() -> Phases:
    from workflows.mainjob import serving

    return Phases(SERVING, serving.open_run, serving.profile, serving.accept, serving.plan, serving.race,
                  serving.confirm_phase, serving.write, lambda run: None)


IMPLEMENTATIONS = {STEP: _step, SERVING: _serving}


def phases_for(kind: EngineKind) -> Phases:
    """The phases for an engine kind, chosen once from its protocol."""
    return IMPLEMENTATIONS[kind.protocol]()
