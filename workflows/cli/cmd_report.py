"""`planner report`: figures and index.html from whatever inputs are given."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", action="append", default=[], metavar="FILE",
                   help="latency profile (repeat to overlay machines, models, context lengths)")
    p.add_argument("--accept", action="append", default=[], metavar="[METHOD[/eE]=]FILE[:NAME]",
                   help="acceptance statistics; METHOD (medusa, sequoia, ppd, all) says which planner to draw, "
                        "guessed from the name when absent (repeatable)")
    p.add_argument("--tree", action="append", default=[], metavar="FILE", help="tree file to draw (repeatable)")
    p.add_argument("--run", metavar="DIR", help="autotune run directory (with summary.json)")
    p.add_argument("--storage", metavar="URL", help="Optuna storage of a `planner tune` study")
    p.add_argument("--study-name", metavar="NAME", help="study in --storage (optional when it holds one)")
    p.add_argument("--max-size", type=int, default=64, help="largest tree size in the size curves (default 64)")
    p.add_argument("--title", default="Tree planner report")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (PNGs, index.html, report.json)")


def run(args) -> int:
    from planner.errors import UserError
    from workflows.report.page import write_report

    if args.max_size < 1:
        raise UserError(f"--max-size must be at least 1, got {args.max_size}")
    if args.study_name and not args.storage:
        raise UserError("--study-name needs --storage")
    index = write_report(args.out, profiles=args.profile, accepts=args.accept, trees=args.tree, run_dir=args.run,
                         storage=args.storage, study_name=args.study_name, max_size=args.max_size, title=args.title)
    print(index)
    return 0
