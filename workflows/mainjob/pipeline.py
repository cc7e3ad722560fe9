"""The main job: one pipeline of named phases for every engine.

    from workflows.mainjob.pipeline import AutotuneSettings, autotune
    summary = autotune(AutotuneSettings())                      # SmolLM2-135M and its shipped guessers, hf engine
    summary = autotune(AutotuneSettings(engine="llama.cpp"))    # the same pipeline in llama.cpp
    summary = autotune(ServingSettings(concurrency=(1, 4, 16))) # vLLM: workflows/mainjob/serving.py

  profile   what a step (a forward, or a served step by batch size and draft length) costs on this machine
  accept    what each guesser or proposer gets accepted, on held-out prompts
  plan      every candidate priced by the one cost model; the finalists
  race      the finalists against the engine's own plain decoding, measured
  confirm   the decision measured as it will be deployed
  write     the decision (RUN/chosen.json), the rest of the run folder, the report

Two engine protocols stand behind the phases: a step engine (decoder/engine.py's Engine, stepped in this
process: workflows/mainjob/step.py) and a serving engine (decoder/serving.py's ServingEngine, a server per
config measured through its HTTP API: workflows/mainjob/serving.py). workflows/mainjob/phases.py picks one
implementation of every phase, once, from the engine kind's protocol (planner/engines.py). Within a protocol
what differs between engines is data (the engine kind's defaults) and capabilities (caps). The decision is
by measurement: the plan measured fastest beyond the noise, else plain decoding. Everything goes into the
run folder; no file outside it is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from planner.engines import DEFAULT, EngineKind
from planner.engines import kind as engine_kind
from workflows.cli.inputs import DEFAULT_QUESTIONS
from workflows.mainjob.candidates import METHODS
from workflows.mainjob.runs import Budget
from workflows.mainjob.step import GUESSERS, PEARL_DRAFTER  # noqa: F401 (the CLI's)

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


def autotune(s) -> dict:
    """Every phase of the engine's protocol, in order (AutotuneSettings: a step engine; ServingSettings:
    a serving engine); returns the summary. The engine is closed whatever happens."""
    from workflows.mainjob.phases import phases_for

    phases = phases_for(s.kind)
    run = phases.open(s)
    try:
        phases.profile(run)
        phases.accept(run)
        phases.plan(run)
        phases.race(run)
        phases.confirm(run)
        return phases.write(run)
    finally:
        phases.close(run)
