"""`planner` command line: a thin layer over the library API.

Each subcommand is a module `workflows.cmd_*` exposing `add_arguments(parser)` and
`run(args) -> int`. Those modules must import only light
dependencies at top level (no torch, optuna, matplotlib): `planner plan` has to start fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from planner.errors import UserError

# name -> (module, one-line help)
SUBCOMMANDS = {
    "plan": ("workflows.cli.cmd_plan", "plan trees (medusa, sequoia, ppd, dynamic) from acceptance statistics"),
    "profile": ("workflows.cli.cmd_profile", "measure forward latency versus input length on this machine"),
    "accept": ("workflows.cli.cmd_accept", "measure a guesser's acceptance statistics on validation prompts"),
    "decode": ("workflows.cli.cmd_decode", "decode prompts with a planned tree"),
    "train-prompts": ("workflows.cli.cmd_train_prompts", "train PPD prompt tokens by distillation from the base model"),
    "train-drafter": ("workflows.cli.cmd_train_drafter", "train a ParallelSpec drafter or a draft LM by distillation from the target"),
    "autotune": ("workflows.cli.cmd_autotune", "the main job: profile, measure, plan, verify by decoding, report"),
    "tune": ("workflows.cli.cmd_tune", "Optuna search over planner and decoder knobs"),
    "report": ("workflows.cli.cmd_report", "plots and tables from profiles, acceptance, trees and runs"),
    "export": ("workflows.cli.cmd_export", "write a plan as vLLM, SGLang, TensorRT-LLM or transformers settings"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planner", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_, description=help_)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a job scheduler's stop, `timeout`, a closed terminal): the command stops as on
    Ctrl-C, so its servers are stopped and what it finished is kept."""


TERMINATING = (signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []  # the terminating signal, also where a command caught the interrupt itself


def _terminate(signum, frame):
    for sig in TERMINATING:  # once: a second signal must not cut short the stopping of servers
        signal.signal(sig, signal.SIG_IGN)
    _received.append(signum)
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        return _run(args)
    _received.clear()
    before = {sig: signal.signal(sig, _terminate) for sig in TERMINATING}
    try:
        rc = _run(args)
        return 128 + _received[0] if _received else rc
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _run(args) -> int:
    try:
        return int(args._run(args) or 0)
    except Terminated as e:
        signum = int(e.args[0])
        print(f"planner {args.command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except UserError as e:
        print(f"planner {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"planner {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `planner plan ... | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
