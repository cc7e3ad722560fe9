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
  dynamic  a tree chosen at every step (docs/dynamic-trees.md): --accept [KIND=]FILE once per
           guesser (twice for a hybrid: lookup and a drafter), --profile for the step cost at every
           size (without: every size costs the same), --max-size, --max-depth.

acceptance (--accept): a JSON file {"accuracy": [[...], ...]} (row d = distance d+1, entry r =
probability that the rank-r guess is right) or {"positional": [...]} (same row at every
distance), or FILE:NAME to pick entry NAME of a collection such as
../shared/data/published_acceptance.json.

profile (--profile): {"input_lengths": [...], "latency_s": [...]} or a profiler output file
(its "fit" is used). Without --size (ppd: --input-length) the size maximising predicted
speedup = tau * L(1) / step latency is chosen and the curve is stored as "size_curve".

batch sizes (--batch-sizes 1,2,4,8 with a profile measured at those batch sizes, its "series"):
one plan per batch size, for b sequences decoded together, the best tree on L_b (or none where
plain decoding is predicted fastest); neighbours with the same tree merge into ranges, written
as the tree file's "schedule" (the top-level tree stays the batch-size-1 plan). --layout packed
(default): EMS-SD, no padding, each sequence advances by its own accepted length; padded:
inputs padded to the longest tree and every KV row advanced by the batch maximum.
"""

EPILOG = """\
examples:
  planner plan medusa --accept ../shared/data/published_acceptance.json:medusa-vicuna-7b --size 63 -o trees/medusa.json
  planner plan sequoia --accept acc.json --size 128 --max-depth 10 -o trees/sequoia.json
  planner plan ppd --accept ../shared/data/published_acceptance.json:ppd-vicuna-7b --input-length 120 -o trees/ppd.json
  planner plan ppd --accept ...:ppd-vicuna-7b --profile profiles/a100.json -o trees/ppd-a100.json
  planner plan medusa --accept ...:medusa-vicuna-7b --profile profiles/a100-b1-16.json --batch-sizes 1,2,4,8,16 -o trees/medusa-batched.json
  planner plan dynamic --accept acc-lookup.json --accept acc-ps.json --profile profile.json --max-size 16 -o dyn.json

The output follows trees/schema.json: "expected_tokens_per_step" is the amortised tau under the
independence model, "states" holds one tree per state ("nodes" are rank paths, parents first).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("method", choices=("medusa", "sequoia", "ppd", "dynamic"), help="tree family to plan")
    p.add_argument("--accept", required=True, action="append", metavar="FILE[:NAME]",
                   help="acceptance statistics (see above); dynamic: [KIND=]FILE, twice for a hybrid (lookup and a "
                        "drafter); a file from `planner accept --calibrate` brings its calibration")
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
    b = p.add_argument_group("batch sizes (EMS-SD)")
    b.add_argument("--batch-sizes", metavar="B1,B2,...",
                   help="plan per batch size with --profile's series for these batch sizes; writes a schedule")
    b.add_argument("--layout", choices=LAYOUT_CHOICES, default=None,
                   help="packed (default: no padding, EMS-SD) or padded (inputs to the longest tree, KV by the "
                        "batch maximum)")
    b.add_argument("--kv-latency", type=float, default=None, metavar="S",
                   help="padded: seconds per step per KV position per row, to price the padded KV cache "
                        "(default 0: not priced, the profile measures one context length)")
    b.add_argument("--new-tokens", type=int, default=None, metavar="G",
                   help="padded: tokens generated per sequence, for the KV growth (default 128)")
    x = p.add_argument_group("ppd construction")
    x.add_argument("--paper", action="store_true",
                   help="the PPD paper's heuristic only (no policy iteration, one shared budget)")
    x.add_argument("--shared-budget", action="store_true",
                   help="with --profile: same input length in every state (no per-state budgets)")
    from workflows.cli.sampling import add_sampling_arguments

    add_sampling_arguments(p.add_argument_group("sampling"), "plan for decoding")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary and no progress bar on stderr")


def run(args) -> int:
    from planner.accept import load_acceptance
    from planner.errors import UserError
    from planner.jsonio import atomic_write_json, writable_target
    from planner.plan import plan
    from planner.profile import load_batch_profiles, load_profile
    from planner.tree import validate_tree

    if args.output:
        writable_target(args.output)  # before minutes of planning, not after
    from workflows.cli.sampling import sampling_from_args

    sampling_from_args(args)  # the sampling options checked before planning
    if args.method == "dynamic":
        return _run_dynamic(args)
    if len(args.accept) > 1:
        raise UserError(f"--accept: {args.method} plans take one acceptance file (two only for a dynamic hybrid)")
    batch_sizes = _batch_options(args)
    accept = load_acceptance(args.accept[0])
    _check_measured_for(args, [accept])
    profile = load_profile(args.profile) if args.profile and batch_sizes is None else None
    profiles = load_batch_profiles(args.profile) if batch_sizes is not None else None
    if not (math.isfinite(args.time_budget) and args.time_budget > 0):
        raise UserError(f"--time-budget: expected a positive number of seconds, got {args.time_budget}")
    guessing = _guessing(args, accept)
    for name in ("size", "max_depth", "input_length", "prompt_tokens", "max_size", "max_input_length"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    progress = None
    if not args.quiet and (profile is not None or profiles is not None):
        from tqdm import tqdm

        def progress(it, **kw):
            return tqdm(it, leave=False, file=sys.stderr, **kw)

    kwargs = dict(size=args.size, max_depth=args.max_depth, input_length=args.input_length,
                  prompt_tokens=args.prompt_tokens, max_size=args.max_size, max_input_length=args.max_input_length,
                  improved=not args.paper, per_state_budgets=not args.shared_budget, time_budget_s=args.time_budget,
                  progress=progress)
    if batch_sizes is None:
        tree = plan(args.method, accept, profile=profile, guessing=guessing, **kwargs)
    else:
        tree = _plan_batched(args, accept, profiles, batch_sizes, guessing, kwargs)
    _record_sampling(args, tree)
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
    for note in tree.settings.get("notes", []):
        print(f"planner plan: note: {note}", file=sys.stderr)  # said even with -q: the plan differs from the ask
    if not args.quiet:
        print(summary(tree, label), file=sys.stderr)
        for line in schedule_lines(tree):
            print(line, file=sys.stderr)
    return 0


def _run_dynamic(args) -> int:
    """planner plan dynamic: the size limit, the step cost at every input length, the guessers' maps."""
    from planner.accept import load_acceptance
    from planner.dynamic import dynamic_kinds
    from planner.dynamic_plan import plan_dynamic
    from planner.errors import UserError
    from planner.jsonio import atomic_write_json
    from planner.profile import load_profile

    for name in ("size", "input_length", "batch_sizes"):
        if getattr(args, name) is not None:
            raise UserError(f"--{name.replace('_', '-')}: a dynamic plan chooses its size every step (give --max-size)")
    pairs = []
    for spec in args.accept:
        kind, sep, path = spec.partition("=")
        if sep and kind in dynamic_kinds():
            pairs.append((kind, load_acceptance(path)))
        else:
            pairs.append((None, load_acceptance(spec)))
    _check_measured_for(args, [a for _, a in pairs])
    profile = load_profile(args.profile) if args.profile else None
    tree = plan_dynamic(pairs, profile, max_size=args.max_size, max_depth=args.max_depth or 8,
                        ensemble=args.ensemble or 1)
    _record_sampling(args, tree)
    tree.provenance.update({
        "command": "planner plan " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["plan"] else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tool": "tree-planner " + _version(), "accept": args.accept, "profile": args.profile})
    label = args.output or "<stdout>"
    if args.output:
        atomic_write_json(args.output, tree.to_json())
    else:
        import json

        print(json.dumps(tree.to_json(), indent=1))
    if not args.quiet:
        cal = [k for k, g in tree.dynamic.guessers.items() if g.calibration is not None]
        pred = "; ".join(f"{k}: prior alone {v['size']} candidates, {v['tokens_per_step']:.2f} tokens/step"
                         + (f", {v['speedup']:.2f}x" if args.profile else "") for k, v in tree.settings["prior_prediction"].items())
        print(f"wrote {label}: dynamic ({tree.settings['guesser']}), up to {tree.dynamic.max_size} candidates, "
              f"calibrated: {', '.join(cal) or 'none (acceptance rows as the prior)'}; "
              f"{'profiled step costs' if args.profile else 'every size costs the same (no --profile)'}; {pred}",
              file=sys.stderr)
    return 0


def _check_measured_for(args, accepts) -> None:
    """A note on stderr for each acceptance file measured under other sampling settings than the
    plan is made for (--temperature, --top-k, --top-p): its acceptance is not this plan's."""
    from workflows.cli.sampling import mismatch, sampling_from_args

    for acc in accepts:
        line = mismatch(acc.source.get("sampling"), sampling_from_args(args), f"--accept {acc.label}", "was measured under",
                        "the plan is made for {} (--temperature, --top-k, --top-p): measure acceptance under those")
        if line:
            print(f"planner plan: note: {line}", file=sys.stderr)


def _record_sampling(args, tree) -> None:
    """The settings the plan is made for, which `planner decode` compares with its own."""
    from workflows.cli.sampling import record, sampling_from_args

    tree.settings = dict(tree.settings, sampling=record(sampling_from_args(args)))


LAYOUT_CHOICES = ("packed", "padded")


def _batch_options(args) -> list[int] | None:
    """--batch-sizes as a list (None without it); the batch options need it, and it needs a profile."""
    from planner.errors import UserError
    from planner.tree import MAX_BATCH_SIZE

    if args.batch_sizes is None:
        for name in ("layout", "kv_latency", "new_tokens"):
            if getattr(args, name) is not None:
                raise UserError(f"--{name.replace('_', '-')} needs --batch-sizes")
        return None
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(not 1 <= b <= MAX_BATCH_SIZE for b in sizes):
        raise UserError(f"--batch-sizes: expected comma-separated integers in 1..{MAX_BATCH_SIZE}, got {args.batch_sizes!r}")
    if not args.profile:
        raise UserError("--batch-sizes needs --profile FILE (a latency series per batch size)")
    return sorted(set(sizes))


def _plan_batched(args, accept, profiles, batch_sizes, guessing, kwargs):
    from planner.batch import ContextCost, plan_schedule, tree_with_schedule

    layout = args.layout or "packed"
    context = ContextCost(args.kv_latency or 0.0, args.new_tokens if args.new_tokens is not None else 128)
    entries = plan_schedule(args.method, accept, profiles, batch_sizes, guessing, layout, context, **kwargs)
    tree = tree_with_schedule(entries)
    tree.settings.update(batch_sizes=batch_sizes, layout=layout)
    if layout == "padded":
        tree.settings.update(kv_latency_s=context.kv_s_per_token, new_tokens=context.new_tokens)
    return tree


def schedule_lines(tree) -> list[str]:
    """One line per batch-size range of the tree's schedule (none without one)."""
    out = []
    for i, e in enumerate(tree.schedule or []):
        lo, hi = e.batch_sizes
        span = f"{lo}+" if i == len(tree.schedule) - 1 else (f"{lo}" if lo == hi else f"{lo}-{hi}")
        if e.tree is None:
            what = "plain decoding (no speculation predicted faster)"
        else:
            what = (f"{sum(len(st.nodes) for st in e.tree.states)} candidates, depth {e.tree.depth}, "
                    f"input length {e.tree.max_input_length}, tau {e.predicted_tokens_per_step:.3f}, "
                    f"predicted speedup {e.predicted_speedup:.3f}x")
        out.append(f"  batch {span}: {what} ({e.layout})")
    return out


GUESSERS = ("auto", "heads", "prompt-tokens", "draft", "parallelspec")


def _guessing(args, accept):
    from planner.cost import default_guessing
    from planner.guessers import kind as guesser_kind
    from planner.guessers import names as guesser_names

    fields = {"ensemble": args.ensemble, "draft_s": args.draft_latency}
    if args.guesser != "auto":
        fields["prompt_tokens"] = args.guesser == "prompt-tokens"
        one = args.guesser in guesser_names() and guesser_kind(args.guesser).passes == "one"  # ParallelSpec
        fields["draft_passes"] = "one" if one else "depth"
    return default_guessing(args.method, accept, **fields)


def _version() -> str:
    from planner import __version__

    return __version__


def summary(tree, label: str) -> str:
    from planner.tree import PPD

    parts = [f"{tree.method}: tau {tree.expected_tokens_per_step:.4f} tokens/step"]
    if tree.method == PPD:
        per = ", ".join(
            f"s{st.state}: n={st.input_length} c={len(st.nodes)} pi={st.stationary_probability:.3f}" for st in tree.states
        )
        parts.append(per)
    else:
        parts.append(f"{len(tree.states[0].nodes)} candidates, depth {tree.depth}, input length {tree.max_input_length}")
    if tree.predicted_speedup is not None:
        parts.append(f"predicted speedup {tree.predicted_speedup:.3f}x")
    return f"wrote {label}: " + "; ".join(parts)
