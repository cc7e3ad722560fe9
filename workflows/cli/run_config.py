"""How `planner decode` runs a plan, resolved once from the plan's recorded settings and the user's
flags, and passed down as one object (nothing is written back into the argparse namespace).

    run = resolve_run(args, tree, spec)       # a RunConfig; one line on stderr says what came from the plan
    run.guesser, run.threads, run.matmul_profile, run.pearl, run.decode
    job = decode_job(run, engine, guesser, tree, batched)   # what the library decodes with: job.plan, job.decoding

A plan autotune raced records what it was raced with (planner/plan_settings.py): the engine, the
threads (or that they were the cores a busy machine left free), the profile whose CPU matmul paths
ran, the guesser's files (each checked against its recorded checksum: a missing or changed file is
a one-line error), the verification rule under sampling, and for PEARL its window and thread split.
A flag the user gives overrides the recorded setting and the line says so.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from decoder.config import DecodeConfig
from planner.engines import EngineKind
from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from planner.sampling import Sampling


@dataclass(frozen=True)
class PearlRun:
    gamma: int  # tokens drafted per round
    threads: tuple[int, int] | None = None  # (target, drafter) CPU threads the race measured it at
    serial: bool = False  # the two jobs one after the other (same output)


@dataclass(frozen=True)
class RunConfig:
    engine: EngineKind
    plan: str | None  # the tree file that decodes (None: a guesser's own chain, PEARL's window)
    guesser: str  # KIND[:DIR]
    threads: int | None
    matmul_profile: str | None  # engines with CPU matmul paths: the profile whose paths run
    pearl: PearlRun | None
    mtad: object  # planner.mtad.MTADSettings, or None
    decode: DecodeConfig
    from_plan: tuple[str, ...] = ()  # settings taken from the plan
    overridden: tuple[str, ...] = ()  # flags that replaced a recorded setting

    @property
    def plain(self) -> bool:
        """A plain decision (the plan's guesser guesses nothing): the engine's fastest plain decoding."""
        return not guesser_kind(self.guesser.partition(":")[0]).guesses

    def line(self) -> str | None:
        if not self.from_plan and not self.overridden:
            return None
        said = f"decoding as raced: {', '.join(self.from_plan)}" if self.from_plan else "decoding"
        return said + (f" ({'; '.join(self.overridden)})" if self.overridden else " (flags override)")


def add_strategy_arguments(p) -> None:
    """`planner decode`'s flags for the strategies other than a plan's steps, resolved below."""
    p.add_argument("--mtad", default=None, metavar="W,GAMMA,TAU",
                   help="MTAD (not lossless above temperature 0): the --guesser draft model beam-samples W beams of "
                        "GAMMA tokens, the target accepts the longest prefix whose joint ratio p~/q~ >= TAU in [0, 1]; "
                        "the warp is --temperature/--top-k/--top-p (the paper: --top-k 20 --top-p 0.9); the summary "
                        "adds perplexity and distinct-n")
    p.add_argument("--max-perplexity-ratio", type=float, default=None, metavar="R",
                   help="with --mtad and --compare-plain: flag whether perplexity <= R x plain sampling's")
    p.add_argument("--pearl", action="store_true",
                   help="PEARL (with --guesser draft[:DIR]): the drafter drafts while the target verifies, each in "
                        "its own thread with half of --threads (or its own CUDA stream); lossless")
    p.add_argument("--gamma", type=int, default=4,
                   help="with --pearl: the window, tokens drafted per round (default 4)")
    p.add_argument("--pearl-serial", action="store_true",
                   help="with --pearl: run the two jobs one after the other (same output), booking max(draft, verify)")


def resolve_run(args, tree, spec: EngineKind, default_guesser: str) -> RunConfig:
    """The run: the plan's recorded settings, each replaced by the flag that names it."""
    from planner.plan_settings import plan_settings

    got = _Resolved(args)
    raced = plan_settings(tree.settings, args.plan).raced_with if tree is not None else None
    plan_dir = Path(args.plan).parent if args.plan else Path(".")
    if raced is not None:
        got.profile(raced, plan_dir, spec)
        got.threads(raced)
        got.verify(tree)
    guesser = got.guesser(tree, raced, plan_dir) or default_guesser
    pearl, plan = _pearl(args, tree, guesser)
    if pearl is not None and not args.guesser:
        guesser = got.pearl_drafter(tree, guesser)
    mtad = _mtad(args, guesser, plan)
    if pearl is not None:
        _check_pearl(args, guesser, pearl, plan, got.verify_rule)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, got.verify_rule, args.eps, args.delta)
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, layout=args.layout)
    return RunConfig(spec, plan, guesser, got.thread_count, got.matmul_profile, pearl, mtad, cfg,
                     tuple(got.notes), tuple(got.overrides))


class _Resolved:
    """The settings as they are being resolved, with what came from the plan and what a flag overrode."""

    def __init__(self, args):
        self.args = args
        self.notes: list[str] = []
        self.overrides: list[str] = []
        self.matmul_profile = args.profile
        self.thread_count = args.threads
        self.verify_rule = args.verify

    def profile(self, raced, plan_dir: Path, spec: EngineKind) -> None:
        if raced.profile is None or not spec.caps.matmul_paths:
            return
        if self.args.profile is not None:
            self.overrides.append(f"--profile {self.args.profile} instead of the raced matmul paths")
            return
        self.matmul_profile = str(raced.profile.check(plan_dir, self.args.plan, "the profile (matmul paths)"))
        self.notes.append(f"matmul paths of {self.matmul_profile}")

    def threads(self, raced) -> None:
        if self.args.threads is not None:
            if raced.threads is not None and self.args.threads != raced.threads:
                self.overrides.append(f"--threads {self.args.threads} instead of the raced {raced.threads}")
            return
        if raced.free_cores:
            import torch

            from profiler.load import free_threads

            self.thread_count, _ = free_threads(torch.get_num_threads(), 0.3)
            self.notes.append(f"{self.thread_count} threads (the cores free now; raced on the {raced.threads} a busy "
                              "machine left)")
        elif raced.threads is not None:
            self.thread_count = raced.threads
            self.notes.append(f"{self.thread_count} threads")

    def verify(self, tree) -> None:
        a = self.args
        recorded = tree.settings.get("verify")
        if a.verify == "auto" and a.temperature > 0 and recorded == "coupled" and a.batch_size == 1:
            self.verify_rule = "coupled"
            self.notes.append("coupled sampling (plain sampling's text with the same --seed)")
        elif a.verify != "auto" and a.temperature > 0 and recorded in ("coupled", "lossless") and a.verify != recorded:
            self.overrides.append(f"--verify {a.verify} instead of the raced {recorded}")

    def guesser(self, tree, raced, plan_dir: Path) -> str | None:
        """--guesser, else the guesser the plan was made for (autotune writes it), as KIND[:DIR]: the files
        raced with (checked), else the recorded directory."""
        from workflows.cli.inputs import drafter_guesser

        drafted = drafter_guesser(self.args)  # --drafter DIR: the head, alone or in the --guesser hybrid named
        if drafted:
            return drafted
        if self.args.guesser:
            return self.args.guesser
        if tree is None or not isinstance(tree.settings.get("guesser"), str):
            return None
        kind = tree.settings["guesser"]
        where = None
        if raced is not None and raced.guesser is not None:
            where = str(raced.guesser.check(plan_dir, self.args.plan, "the guesser's files"))
            self.notes.append(f"guesser files {where}")
        where = where or tree.provenance.get("guesser_dir")
        return f"{kind}:{where}" if isinstance(where, str) and guesser_kind(kind).files is not None else kind

    def pearl_drafter(self, tree, guesser: str) -> str:
        """A plan autotune chose for PEARL drafts with the guesser that has PEARL's files and the one loop."""
        from planner.guessers import kinds

        own = guesser_kind(guesser.partition(":")[0])
        drafter = next(k.name for k in kinds(hybrids=False) if k.files == own.files and k.loop is None and k.autotune)
        where = guesser.partition(":")[2] or tree.provenance.get("guesser_dir")
        self.notes.append(f"PEARL with gamma {tree.settings['pearl']['gamma']}")
        return f"{drafter}:{where}" if isinstance(where, str) else drafter


def _pearl(args, tree, guesser: str) -> tuple[PearlRun | None, str | None]:
    """--pearl, or a plan autotune chose for PEARL (its tree is the draft chain, which is not a plan PEARL
    takes): (its window and thread split, the plan that decodes)."""
    from planner.plan_settings import plan_settings

    if args.pearl:
        return PearlRun(args.gamma, None, args.pearl_serial), args.plan
    if tree is None or args.guesser:
        return None, args.plan
    run = plan_settings(tree.settings, args.plan)
    if run.pearl is None or guesser_kind(run.guesser).loop is None:
        return None, args.plan
    return PearlRun(run.pearl.gamma, run.pearl.threads, args.pearl_serial), None


def _draft_lm(guesser: str) -> bool:
    """--pearl and --mtad draft with a draft LM: a guesser kind whose files are the draft LM's."""
    k = guesser_kind(guesser.partition(":")[0])
    return k.files == "draft_lm" and not k.hybrid


def _check_pearl(args, guesser: str, pearl: PearlRun, plan: str | None, rule: str) -> None:
    """--pearl: a draft model, a chain of --gamma, batch size 1, lossless."""
    if not _draft_lm(guesser) or args.mtad:
        raise UserError(f"--pearl: needs --guesser draft[:DIR] (a draft model) and no --mtad, got {guesser}")
    if plan or args.batch_size != 1 or rule in ("typical", "coupled") or pearl.gamma < 1:
        raise UserError("--pearl: drafts a chain of --gamma >= 1 tokens for one prompt at a time, losslessly (the "
                        "recursive-rejection rule); drop --plan, --batch-size and --verify typical/coupled")


def _mtad(args, guesser: str, plan: str | None):
    """--mtad W,GAMMA,TAU: a draft model, no plan, batch size 1, its own verification rule."""
    from planner.mtad import MTADSettings

    settings = MTADSettings.parse(args.mtad) if args.mtad else None
    ratio = args.max_perplexity_ratio
    if settings is None:
        if ratio is not None:
            raise UserError("--max-perplexity-ratio: needs --mtad")
        return None
    if not _draft_lm(guesser):
        raise UserError(f"--mtad: needs --guesser draft[:DIR] (a draft model), got {guesser}")
    if plan:
        raise UserError("--mtad: drafts a chain of GAMMA tokens; drop --plan")
    if args.batch_size != 1 or args.verify != "auto":
        raise UserError("--mtad: decodes at --batch-size 1 with its own joint acceptance rule (no --verify)")
    if ratio is not None and not (ratio > 0 and args.compare_plain):
        raise UserError("--max-perplexity-ratio: expected a number > 0, with --compare-plain (the reference perplexity)")
    return settings


@dataclass
class Job:
    """What decoding the prompts takes, resolved once from the run configuration: the same two things the
    Python API's generate takes (decoder/api.py: a strategy and a DecodeConfig), the guesser the strategy
    decodes with (for the run's records) and the step lengths the timed runs use."""

    plan: object  # a decoder/loop.py Strategy: a plan's Steps, plain decoding's fastest way, PEARL's rounds
    decoding: DecodeConfig
    guesser: object  # decoder/guesser.py's protocol (MTAD's joint-rule guesser for --mtad)
    lengths: set[int]  # step input lengths (warmed up first when speed is compared)
    plain: object  # plain decoding's strategy, to compare with: the engine's fastest (one prompt), the loop's (a batch)


def decode_job(run: RunConfig, engine, guesser, tree, batched: bool) -> Job:
    """The strategy the library decodes with, resolved as decoder/loop.py resolves generate's arguments:
    PEARL's rounds with the draft guesser's drafter; MTAD's guesser on that drafter, its proposals carrying
    the joint rule; a plain decision's fastest plain decoding; else the plan's tree with its guesser."""
    from decoder.loop import plain, resolve
    from workflows.cli.run_records import step_lengths

    baseline = plain(engine, run.decode, batched)
    if run.pearl is not None:
        from decoder.guessers.pearl import Pearl

        p = run.pearl
        pearl = Pearl(guesser.drafter, p.gamma, p.threads, concurrent=not p.serial)
        return Job(pearl, run.decode, guesser, {1, p.gamma}, baseline)
    if run.mtad is not None:
        from decoder.guessers.mtad import MTADGuesser

        m = run.mtad
        guesser = MTADGuesser(guesser.drafter, m.width, m.gamma, guesser.label, tau_acc=m.tau_acc)
    lengths = set(step_lengths(guesser, tree, engine)["real"].values()) | {1}
    if run.plain:
        return Job(baseline, run.decode, guesser, lengths, baseline)
    return Job(resolve(engine, tree, guesser, run.decode, batched), run.decode, guesser, lengths, baseline)


def say(run: RunConfig, quiet: bool) -> None:
    line = run.line()
    if line and not quiet:
        print(line, file=sys.stderr)
