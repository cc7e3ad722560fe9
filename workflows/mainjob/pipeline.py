"""The main job: profile this machine, measure acceptance, plan, race the plans by decoding, write the winner.

    from workflows.mainjob.pipeline import AutotuneSettings, autotune
    summary = autotune(AutotuneSettings())                      # SmolLM2-135M and its shipped guessers, hf engine
    summary = autotune(AutotuneSettings(engine="llama.cpp"))    # the same pipeline in llama.cpp

One pipeline for every engine: what differs is data (the engine kind's defaults: race length,
rounds, budget, the largest forward, the profile's contexts, planner/engines.py) and capabilities
(the guessers it can run, PEARL where it lends its torch modules, CPU matmul paths). A short
pipeline of named phases, each announced with the time left (one `Budget`, workflows/mainjob/runs.py):
  1 profile     this machine's L(n) (and the CPU matmul paths)              workflows/mainjob/measure.py
  2 acceptance  one decode per prompt, shared by every guesser (profiler.teacher_forced; sampled with
                the user's temperature, top-k and top-p: profiler.sampled)
  3 plan        every size of every (guesser, method), per-step trees, hybrids   workflows/mainjob/candidates.py
  4 PEARL       each side's latency at its share of the cores, and their overlap
  5 race        the finalists against the engine's fastest plain decoding      workflows/mainjob/race.py
  6 write       trees, rows, RUN/chosen.json, summary, report                   workflows/mainjob/write.py
The decision is by measurement (workflows/mainjob/choose.py): the plan measured fastest beyond the
noise, else plain decoding. Everything goes into the run folder (`RUN/chosen.json` is the decision,
a plan `planner decode --plan` takes, plain decoding included); no file outside it is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from planner.engines import DEFAULT, EngineKind
from planner.engines import kind as engine_kind
from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from planner.guessers import kinds as guesser_kinds
from planner.jsonio import atomic_write_json
from workflows.cli.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts, shipped
from workflows.mainjob.candidates import METHODS, finalists, plan_phase
from workflows.mainjob.measure import acceptance_phase, pearl_phase, profile_phase
from workflows.mainjob.predict import prediction_phase
from workflows.mainjob.race import race_phase
from workflows.mainjob.runs import Budget, Clock, Run, default_out, shown
from workflows.mainjob.write import format_table, report_phase, write_phase

# the kinds autotune can race: a registered guesser of its own (no hybrid: those are built from these)
GUESSERS = tuple(k.name for k in guesser_kinds(hybrids=False) if k.autotune and k.loop is None)
PEARL_DRAFTER = next(k for k in guesser_kinds() if k.loop is not None)  # the kind with its own two-job loop
ENGINE_DEFAULTED = ("decode_tokens", "rounds", "budget_minutes", "decode_prompts", "turns", "max_input_length",
                    "profile_budget_s")  # None in the settings: the engine kind's default


@dataclass
class AutotuneSettings:
    engine: str = DEFAULT  # the target engine (planner/engines.py)
    model: str = "smollm2-135m"
    guessers: tuple[str, ...] = ("auto",)  # auto: every registered kind autotune races whose files ship (and lookup)
    guesser_dirs: dict = field(default_factory=dict)  # kind -> directory, instead of the shipped one
    device: str | None = None
    dtype: str | None = None
    out: str | None = None  # run folder; default runs/<date>-<device>-<model>
    questions: str = str(DEFAULT_QUESTIONS)
    accept_prompts: int = engine_kind(DEFAULT).defaults.accept_prompts  # held-out prompts to measure acceptance on
    decode_prompts: int | None = None  # other held-out prompts the plans race on (None: the engine's default)
    turns: int | None = None  # prompts per held-out question: its first turn, then its follow-up after an answer
    accept_tokens: int = 64  # greedy tokens per prompt when measuring acceptance
    decode_tokens: int | None = None  # new tokens per prompt when decoding
    max_input_length: int | None = None  # largest forward pass planned and profiled
    context_length: int = 128  # cache length the profile is taken at (a typical prompt + answer here)
    methods: tuple[str, ...] = METHODS  # ppd guesser's tree families
    finalists: int = 10  # (guesser, method) families whose best predicted plan races
    neighbours: int = 1  # sizes either side of the best predicted plan that also race
    sweep: int = 0  # extra sizes of the best predicted (guesser, method) spread over its range
    rounds: int | None = None  # repeats of each (plan, prompt) run; the median counts
    budget_minutes: float | None = None  # the whole run, model loading to report
    threads: int | None = None  # CPU threads (default: the library's choice, the cores free on a busy machine)
    n_ctx: int | None = None  # engines with a fixed context: at least this many cells (default: sized to the run)
    profile: str | None = None  # reuse a profile file instead of measuring
    accept: str | None = None  # reuse a ppd acceptance file instead of measuring
    profile_budget_s: float | None = None  # at most; and at most a fifth of the budget
    report: bool = True
    progress: bool = True
    seed: int = 0
    # the user's sampling settings: acceptance is measured, plans are sized and the race decodes under them
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    verify: str = "auto"  # auto: greedy at temperature 0, lossless above; coupled (decoder/noise.py); typical: Medusa's,
    #                       not distribution-exact. `planner autotune` passes the engine's own default under sampling

    def resolved(self) -> "AutotuneSettings":
        """These settings with the engine kind's defaults where they say None."""
        spec = self.kind
        d = spec.defaults
        fill = {name: getattr(d, name) for name in ENGINE_DEFAULTED if getattr(self, name) is None}
        fill["finalists"] = min(self.finalists, d.max_finalists)
        return replace(self, **fill)

    @property
    def kind(self) -> EngineKind:
        return engine_kind(self.engine)

    @property
    def sampling(self):
        from planner.sampling import Sampling

        return Sampling(self.temperature, self.top_k, self.top_p, self.verify)

    @property
    def budget(self) -> Budget:
        return Budget(total_s=self.budget_minutes * 60.0, profile_max_s=self.profile_budget_s)

    @property
    def context_lengths(self) -> tuple[int, ...]:
        """The profile's contexts: the one plans are priced at first, then the engine's other defaults."""
        rest = tuple(c for c in self.kind.defaults.context_lengths[1:] if c != self.context_length)
        return (self.context_length, *rest)


def autotune(s: AutotuneSettings) -> dict:
    """Profile, measure acceptance, plan, race the plans against plain decoding, write; returns the summary."""
    s = s.resolved()
    run = _open_run(s)
    try:
        return _pipeline(run)
    finally:
        run.engine.close()


def _pipeline(run: Run) -> dict:
    s = run.settings
    accept_texts, race_texts = held_out_prompts(s.questions, s.accept_prompts, s.decode_prompts, s.turns)
    accept_ids, race_ids = encode_prompts(run.tokenizer, accept_texts), encode_prompts(run.tokenizer, race_texts)
    run.engine.reserve(max(int(t.numel()) for t in accept_ids + race_ids) + max(s.accept_tokens, s.decode_tokens)
                       + s.max_input_length)
    profiled = profile_phase(run)
    accepts = acceptance_phase(run, accept_ids, profiled.profile)
    candidates = plan_phase(run, accepts, profiled.profile)
    drafter = _pearl_drafter(accepts) if _pearl_fits(run) else None
    pearl = pearl_phase(run, drafter, accepts, profiled.profile, accept_ids[0]) if drafter else None
    candidates += pearl["candidates"] if pearl else []
    racing = prediction_phase(run, finalists(candidates, s.finalists, s.neighbours, s.sweep), profiled.profile)
    race, outputs, decision = race_phase(run, race_ids, racing, profiled.profile)
    summary = write_phase(run, racing, race, outputs, decision, profiled, accepts, race_ids)
    if pearl:
        summary["pearl"] = {k: v for k, v in pearl.items() if k != "candidates"}
    summary.update(_other_engines(run, race_ids, summary))
    _finish(run, summary)
    run.say(format_table(summary))
    if s.report:
        report_phase(run, summary, profiled, accepts)
    _finish(run, summary)
    run.say(f"run folder: {shown(run.out_dir)}  ({summary['wall_s']:.0f} s); decision: {shown(run.out_dir / 'chosen.json')}")
    return summary


COMPARE_PROMPTS = 4  # race prompts other engines' stock plain decoding is timed on (a comparison, not a decision)


def _other_engines(run: Run, race_ids: list, summary: dict) -> dict:
    """Every other registered engine that `compares` (llama.cpp): its library's own plain decoding of the
    same model on the first race prompts plain decoding ran, against this engine's plain decoding of the
    same ones, prefill included, so a user sees which engine is faster on this machine. Keyed
    "<engine>_plain" (llama.cpp: "llama_cpp_plain"); a reason instead when it cannot run."""
    from workflows.mainjob.compare import stock_plain_report

    by = (summary.get("plain") or {}).get("by_prompt") or {}
    ids = sorted(int(p) for p in by)[:COMPARE_PROMPTS]
    out = {}
    for other in (k for k in _registered() if k.compares and k.name != run.engine.caps.name):
        key = f"{other.name.replace('.', '_')}_plain"
        if not ids:
            out[key] = {"skipped": "plain decoding timed no race prompt"}
            continue
        tps = sum(by[str(p)]["tokens"] for p in ids) / max(sum(by[str(p)]["seconds"] for p in ids), 1e-9)
        rep = stock_plain_report(other, run.settings, [race_ids[p] for p in ids], tps)
        out[key] = rep
        if rep.get("tokens_per_s"):
            run.say(f"      {other.name} plain decoding of the same model on the race prompts: {rep['tokens_per_s']:.1f} "
                    f"tokens/s ({rep['vs_plain']:.2f}x this engine's plain); plan for it: planner autotune --engine "
                    f"{other.name}")
        else:
            run.say(f"      {other.name} plain decoding not compared: {rep['skipped']}")
    return out


def _registered():
    from planner.engines import kinds

    return kinds()


def _finish(run: Run, summary: dict) -> None:
    summary["wall_s"] = run.clock.elapsed()
    atomic_write_json(run.out_dir / "summary.json", summary)


def _pearl_fits(run: Run) -> bool:
    """PEARL runs the target's torch model beside the draft LM's, each on its own cores: the engine must
    lend its modules, and on the one core a busy machine leaves free the two sides would take turns
    (and the race would not count its loaded runs), so then it is not measured."""
    if not run.engine.caps.torch_modules:
        return False
    import torch

    if not run.free_cores or torch.get_num_threads() >= 2:
        return True
    run.say("      PEARL not measured: it runs the target and the draft LM on their own cores, and one core is free")
    return False


def _pearl_drafter(accepts: dict) -> str | None:
    """The measured guesser PEARL drafts with (the one with PEARL's files), if it was measured."""
    return next((k for k in accepts if guesser_kind(k).files == PEARL_DRAFTER.files and not guesser_kind(k).members
                 and guesser_kind(k).samples), None)


def _open_run(s: AutotuneSettings) -> Run:
    from decoder.engines.registry import EngineRequest, open_engine

    say = partial(print, flush=True) if s.progress else (lambda *a, **k: None)  # progress shows when piped too
    budget = s.budget
    clock = Clock(budget.total_s, say)
    threads, free = _threads(s, say)
    say(f"loading {s.model} with the {s.engine} engine")
    engine = open_engine(s.engine, EngineRequest(model=s.model, device=s.device, dtype=s.dtype, threads=threads,
                                                 context=s.n_ctx, progress=s.progress))
    if engine.tokenizer is None:
        raise UserError(f"--model {s.model}: no tokenizer files found; autotune decodes text prompts")
    guessers = _load_guessers(s, engine)
    out_dir = Path(s.out) if s.out else default_out(engine.device.type, engine.model_name, s.engine)
    out_dir.mkdir(parents=True, exist_ok=True)
    return Run(s, engine, guessers, out_dir, say, clock, budget, free_cores=free)


def _threads(s: AutotuneSettings, say) -> tuple[int | None, bool]:
    """--threads, else on a busy CPU machine the cores other processes leave free (profiler.load.free_threads):
    (threads, True) when that cut them (chosen.json says so, and `planner decode` then takes the cores
    free when it starts)."""
    from profiler.load import free_threads
    from profiler.machine import cores

    if s.threads or (s.device or "cpu") != "cpu":
        return s.threads, False
    machine = cores()
    threads, others = free_threads(machine)
    if threads == machine:
        return None, False
    say(f"other processes keep {others:.1f} cores busy: measuring on {threads} of {machine} threads "
        "(--threads overrides; the plan decodes on the cores free when it runs)")
    return threads, True


# the sizes autotune loads each kind at: ranks a plan may use per node, and a chain's depth
LOAD_SIZES = {"top_k": 4, "depth": 6}


def _load_guessers(s: AutotuneSettings, engine) -> dict:
    """Every guesser to compare: the ones asked for (auto: every kind autotune races whose files ship
    for the model and that the engine can run, and the ones that need no files)."""
    from decoder.engine import lacking
    from decoder.guessers.registry import LoadRequest, load_guesser, needs

    auto = "auto" in s.guessers
    chosen = GUESSERS if auto else s.guessers
    bad = [k for k in chosen if k not in GUESSERS]
    if bad:
        raise UserError(f"--guessers: expected a subset of {', '.join(GUESSERS)} (or auto), got {', '.join(bad)}")
    out = {}
    for name in chosen:
        spec = guesser_kind(name)
        if auto and lacking(engine.caps, needs(spec)):
            continue  # the engine cannot run it (the registry refuses it when it is asked for by name)
        path = s.guesser_dirs.get(name) or (str(shipped(engine.model_name, spec.files) or "") if spec.files else "")
        if spec.files and not path:
            if auto and not spec.needs_embeddings:
                continue  # nothing ships for this model: compare the others
            raise UserError(f"--guessers {name}: no {spec.files} ships for model {engine.model_name}; give its directory")
        top_k = LOAD_SIZES["top_k"] if spec.samples else None  # a draft LM's ranks cost its passes; others: their files'

        out[name] = load_guesser(name, LoadRequest(engine, path or None, top_k=top_k, depth=LOAD_SIZES["depth"],
                                                   label=path or name))
    if not out:
        raise UserError(f"--engine {s.engine}: none of the guessers {', '.join(chosen)} runs on it")
    return out
