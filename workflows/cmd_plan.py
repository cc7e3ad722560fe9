"""`planner plan METHOD`: acceptance statistics (+ latency profile) -> tree file."""
from __future__ import annotations

import argparse
import datetime
import math
import sys

DESCRIPTION = """\
Plan candidate trees from acceptance statistics, optionally for a measured latency profile.

methods:
  medusa   best tree of --size candidates for deterministic guesses (Medusa heads, prompt
           tokens): the N most likely rank paths, exact, found best-first.
  sequoia  best tree with contiguous sibling ranks (sampled drafts, Sequoia/SpecInfer): exact
           dynamic programme over (size, depth).
  ppd      PPD dynamic sparse trees: one tree per state (prompt tokens on the last accepted
           node), prompt tokens per node; paper construction improved by policy iteration.

acceptance (--accept): a JSON file {"accuracy": [[...], ...]} (row d = distance d+1, entry r =
probability that the rank-r guess is right) or {"positional": [...]} (same row at every
distance), or FILE:NAME to pick entry NAME of a collection such as
../shared/data/published_acceptance.json.

profile (--profile): {"input_lengths": [...], "latency_s": [...]} or a profiler output file
(its "fit" is used). Without --size (ppd: --input-length) the size maximising predicted
speedup = tau * L(1) / step latency is chosen and the curve is stored as "size_curve".
"""

EPILOG = """\
examples:
  planner plan medusa --accept ../shared/data/published_acceptance.json:medusa-vicuna-7b --size 63 -o trees/medusa.json
  planner plan sequoia --accept acc.json --size 128 --max-depth 10 -o trees/sequoia.json
  planner plan ppd --accept ../shared/data/published_acceptance.json:ppd-vicuna-7b --input-length 120 -o trees/ppd.json
  planner plan ppd --accept ...:ppd-vicuna-7b --profile profiles/a100.json -o trees/ppd-a100.json

The output follows trees/schema.json: "expected_tokens_per_step" is the amortised tau under the
independence model, "states" holds one tree per state ("nodes" are rank paths, parents first).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("method", choices=("medusa", "sequoia", "ppd"), help="tree family to plan")
    p.add_argument("--accept", required=True, metavar="FILE[:NAME]", help="acceptance statistics (see above)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the tree JSON here (atomically); without it the JSON goes to stdout")
    g = p.add_argument_group("size")
    g.add_argument("--size", type=int, metavar="N",
                   help="medusa/sequoia: number of candidates (input length = N + 1)")
    g.add_argument("--max-depth", type=int, metavar="D",
                   help="medusa/sequoia: deepest candidate (default: the acceptance's rows; "
                        "positional: 8)")
    g.add_argument("--input-length", type=int, metavar="N",
                   help="ppd: tokens per forward pass in every state, root + candidates + all prompt "
                        "tokens (state 0 holds at most 1 + P); with --profile and per-state budgets "
                        "an upper bound per state")
    g.add_argument("--prompt-tokens", type=int, default=3, metavar="P",
                   help="ppd: prompt tokens per node at most (default 3); needs acceptance rows 1..P")
    h = p.add_argument_group("hardware-aware choice")
    h.add_argument("--profile", metavar="FILE", help="latency profile L(n) of the target model on this machine")
    h.add_argument("--max-size", type=int, default=64, metavar="N",
                   help="medusa/sequoia: largest size tried without --size (default 64)")
    h.add_argument("--max-input-length", type=int, metavar="N",
                   help="ppd: largest input length tried without --input-length (default: the profile's)")
    h.add_argument("--guesser", default="auto", choices=GUESSERS,
                   help="how the guesser feeds the tree, for the cost of a step: heads (the tree's tokens only, e.g. "
                        "Medusa heads), prompt-tokens (PPD: static trees carry depth prompt tokens on every node), "
                        "draft (a draft model: one pass per tree level), parallelspec (one drafter pass per step); "
                        "auto: what the acceptance file records, else prompt-tokens for ppd or a ppd-named file")
    h.add_argument("--ensemble", type=int, default=None, metavar="E",
                   help="input tokens per prompt token (PPD ensemble; default from the acceptance file, else 1)")
    h.add_argument("--draft-latency", type=float, default=None, metavar="S",
                   help="seconds per drafter pass, paid per tree level (draft) or once per step (parallelspec)")
    h.add_argument("--time-budget", type=float, default=30.0, metavar="S",
                   help="ppd: seconds for the size sweep with --profile (coarse to fine; default 30)")
    x = p.add_argument_group("ppd construction")
    x.add_argument("--paper", action="store_true",
                   help="the PPD paper's heuristic only (no policy iteration, one shared budget)")
    x.add_argument("--shared-budget", action="store_true",
                   help="with --profile: same input length in every state (no per-state budgets)")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary and no progress bar on stderr")


def run(args) -> int:
    from planner.accept import load_acceptance
    from planner.errors import UserError
    from planner.jsonio import atomic_write_json, writable_target
    from planner.plan import plan
    from planner.profile import load_profile
    from planner.tree import validate_tree

    if args.output:
        writable_target(args.output)  # before minutes of planning, not after
    accept = load_acceptance(args.accept)
    profile = load_profile(args.profile) if args.profile else None
    if not (math.isfinite(args.time_budget) and args.time_budget > 0):
        raise UserError(f"--time-budget: expected a positive number of seconds, got {args.time_budget}")
    guessing = _guessing(args, accept)
    for name in ("size", "max_depth", "input_length", "prompt_tokens", "max_size", "max_input_length"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    progress = None
    if not args.quiet and profile is not None:
        from tqdm import tqdm

        def progress(it, **kw):
            return tqdm(it, leave=False, file=sys.stderr, **kw)

    tree = plan(
        args.method, accept, size=args.size, max_depth=args.max_depth, input_length=args.input_length,
        prompt_tokens=args.prompt_tokens, profile=profile, max_size=args.max_size,
        max_input_length=args.max_input_length, improved=not args.paper,
        per_state_budgets=not args.shared_budget, guessing=guessing, time_budget_s=args.time_budget,
        progress=progress,
    )
    tree.provenance["command"] = "planner plan " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["plan"] else sys.argv[1:])
    tree.provenance["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tree.provenance["tool"] = "tree-planner " + _version()
    label = args.output or "<stdout>"
    validate_tree(tree, label)
    if args.output:
        atomic_write_json(args.output, tree.to_json())
    else:
        import json

        print(json.dumps(tree.to_json(), indent=1))
    if not args.quiet:
        print(summary(tree, label), file=sys.stderr)
    return 0


GUESSERS = ("auto", "heads", "prompt-tokens", "draft", "parallelspec")


def _guessing(args, accept):
    from planner.cost import default_guessing

    fields = {"ensemble": args.ensemble, "draft_s": args.draft_latency}
    if args.guesser != "auto":
        fields["prompt_tokens"] = args.guesser == "prompt-tokens"
        fields["draft_passes"] = "one" if args.guesser == "parallelspec" else "depth"
    return default_guessing(args.method, accept, **fields)


def _version() -> str:
    from planner import __version__

    return __version__


def summary(tree, label: str) -> str:
    parts = [f"{tree.method}: tau {tree.expected_tokens_per_step:.4f} tokens/step"]
    if tree.method == "ppd":
        per = ", ".join(
            f"s{st.state}: n={st.input_length} c={len(st.nodes)} pi={st.stationary_probability:.3f}" for st in tree.states
        )
        parts.append(per)
    else:
        parts.append(f"{len(tree.states[0].nodes)} candidates, depth {tree.depth}, input length {tree.max_input_length}")
    if tree.predicted_speedup is not None:
        parts.append(f"predicted speedup {tree.predicted_speedup:.3f}x")
    return f"wrote {label}: " + "; ".join(parts)
