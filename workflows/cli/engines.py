"""`--engine` on every command that runs a model, and opening the engine once, here, at the
command-line boundary; everything after takes the engine and asks its capabilities.

    add_engine_argument(parser)                 # --engine {the registry's names}, --n-ctx
    spec = engine_kind(args, plan)              # the EngineKind: --engine, else the plan's, else hf
    refuse_options(spec, {"--device": args.device is not None, ...})   # one line for an option it has no use for
    engine = open_from_args(args, spec, context=1024)
"""
from __future__ import annotations

import argparse
import sys

from planner.engines import DEFAULT, EngineKind, kind, kinds, names
from planner.errors import UserError


def add_engine_argument(p: argparse.ArgumentParser, extra: tuple[str, ...] = ()) -> None:
    listed = "; ".join(f"{k.name}: {k.summary.split(':')[0]}" for k in kinds())
    p.add_argument("--engine", default=None, choices=names() + list(extra),
                   help=f"the target engine (default {DEFAULT}; a plan's own engine when --plan names one): {listed}"
                        + ("; with --simulate: graphs or eager" if extra else ""))
    p.add_argument("--n-ctx", type=int, default=None, metavar="N",
                   help="engines with a fixed context (llama.cpp): at least N cells (default: sized to the run's "
                        "longest prompt + new tokens + step, grown when needed)")


def engine_kind(args, plan=None) -> EngineKind:
    """The engine to run: --engine, else the plan's, else the default; a contradiction is an error."""
    asked = getattr(args, "engine", None)
    planned = getattr(plan, "engine", None) if plan is not None else None
    if asked and planned and asked != planned:
        raise UserError(f"--engine {asked}: the plan {getattr(args, 'plan', '')} was made for the {planned} engine "
                        f"(its profile); decode it there, or plan again from a {asked} profile")
    return kind(asked or planned or DEFAULT)


def refuse_options(spec: EngineKind, given: dict[str, bool]) -> None:
    """One line naming the first option given that the engine has no use for, and why."""
    for option, on in given.items():
        why = spec.why_not(option)
        if on and why:
            raise UserError(f"{option}: not with --engine {spec.name} ({why})")


def open_from_args(args, spec: EngineKind, context: int | None = None, weights: bool = True,
                   progress: bool | None = None, busy: bool | None = None, threads: int | None = None, say=None,
                   server_ok: bool = False):
    """The engine on --model, --device, --dtype, --threads (or `threads`, resolved from a plan), --n-ctx.
    busy (default: the kind's spinning_threads): on a machine busier than its cores and without
    threads, one thread, said in a note once the engine is open (a refusal comes first, alone);
    say: where the note goes (default stderr; a caller with checks of its own collects it).
    server_ok: the command has a path for serving engines (EngineKind.protocol SERVING); others refuse them here."""
    from decoder.engines.registry import EngineRequest, open_engine
    from planner.engines import SERVING

    if spec.protocol == SERVING and not server_ok:
        command = getattr(args, "command", None) or "this command"
        raise UserError(f"--engine {spec.name}: planner {command} steps a model in this process, and {spec.name} is a "
                        "server; it is profiled, measured and raced by planner profile, accept and autotune")

    n_ctx = getattr(args, "n_ctx", None)
    if n_ctx is not None and not 256 <= n_ctx <= 131072:
        raise UserError(f"--n-ctx: expected an integer in 256..131072, got {n_ctx}")
    if progress is None:
        progress = not getattr(args, "no_progress", False)
    threads = threads if threads is not None else getattr(args, "threads", None)
    note = None
    if threads is None and (spec.defaults.spinning_threads if busy is None else busy):
        threads, note = busy_threads(spec)
    request = EngineRequest(model=getattr(args, "model", None), device=getattr(args, "device", None),
                            dtype=getattr(args, "dtype", None), threads=threads,
                            context=max(context or 0, n_ctx or 0) or None, weights=weights,
                            quant=getattr(args, "quant", None) or "Q4_K", progress=progress)
    engine = open_engine(spec.name, request)
    if note:
        (say or (lambda line: print(line, file=sys.stderr)))(note)
    return engine


def busy_threads(spec: EngineKind) -> tuple[int | None, str | None]:
    """(threads, a note): on a machine busier than its cores, 1, because threads that spin at every
    barrier (llama.cpp's, torch's) turn a 2-thread forward into 10-20x its quiet time (1 thread: 2-3x);
    otherwise the library's own choice."""
    from profiler.machine import cores, load_avg

    load, n = load_avg(), cores()
    if load is None or not (load > n > 1):
        return None, None
    return 1, (f"note: the machine is busy (load {load:.1f} on {n} cores): --engine {spec.name} runs 1 thread "
               "(pass --threads to choose); timings will be noisy")
