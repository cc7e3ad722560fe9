"""The main job: profile this machine, measure acceptance, plan, race the plans by decoding, write the winner.

    from workflows.mainjob.pipeline import AutotuneSettings, autotune
    summary = autotune(AutotuneSettings())          # SmolLM2-135M and its shipped guessers, best device

A short pipeline of named phases, each announced with the time left (one `Budget`, workflows/mainjob/runs.py,
holds every time budget):
  1 profile     this machine's L(n) and matmul paths            workflows/mainjob/measure.py
  2 acceptance  one decode per prompt, shared by every guesser (profiler.teacher_forced; sampled with
                the user's temperature, top-k and top-p: profiler.sampled)
  3 plan        every size of every (guesser, method), per-step trees, hybrids   workflows/mainjob/candidates.py
  4 PEARL       each side's latency at its share of the cores, and their overlap
  5 race        the finalists against plain decoding on other held-out prompts   workflows/mainjob/race.py
  6 write       trees, rows, RUN/chosen.json, summary, report                   workflows/mainjob/write.py
The decision is by measurement (workflows/mainjob/choose.py): the plan measured fastest beyond the noise,
else plain decoding. Everything goes into the run folder (`RUN/chosen.json` is the decision, a plan
`planner decode --plan` takes, plain decoding included); no file outside it is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from planner.guessers import kinds as guesser_kinds
from planner.jsonio import atomic_write_json
from workflows.mainjob.measure import acceptance_phase, pearl_phase, profile_phase
from workflows.mainjob.predict import prediction_phase
from workflows.mainjob.write import format_table, report_phase, write_phase
from workflows.mainjob.candidates import METHODS, finalists, plan_phase
from workflows.cli.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts, shipped
from workflows.mainjob.race import race_phase
from workflows.mainjob.runs import Budget, Clock, Run, default_out, shown

# the kinds autotune can race: a registered guesser of its own (no hybrid: those are built from these)
GUESSERS = tuple(k.name for k in guesser_kinds(hybrids=False) if k.autotune and k.loop is None)
PEARL_DRAFTER = next(k for k in guesser_kinds() if k.loop is not None)  # the kind with its own two-job loop


@dataclass
class AutotuneSettings:
    model: str = "smollm2-135m"
    guessers: tuple[str, ...] = ("auto",)  # auto: every registered kind autotune races whose files ship (and lookup)
    guesser_dirs: dict = field(default_factory=dict)  # kind -> directory, instead of the shipped one
    device: str | None = None
    dtype: str | None = None
    out: str | None = None  # run folder; default runs/<date>-<device>-<model>
    questions: str = str(DEFAULT_QUESTIONS)
    accept_prompts: int = 8  # held-out prompts to measure acceptance on
    decode_prompts: int = 16  # other held-out prompts the plans race on
    turns: int = 2  # prompts per held-out question: its first turn, then its follow-up after an answer
    accept_tokens: int = 64  # greedy tokens per prompt when measuring acceptance
    decode_tokens: int = 32  # new tokens per prompt when decoding
    max_input_length: int = 64  # largest forward pass planned and profiled
    context_length: int = 128  # cache length the profile is taken at (a typical prompt + answer here)
    methods: tuple[str, ...] = METHODS  # ppd guesser's tree families
    finalists: int = 10  # (guesser, method) families whose best predicted plan races
    neighbours: int = 1  # sizes either side of the best predicted plan that also race
    sweep: int = 0  # extra sizes of the best predicted (guesser, method) spread over its range
    rounds: int = 1  # repeats of each (plan, prompt) run; the median counts
    budget_minutes: float = 4.0  # the whole run, model loading to report
    threads: int | None = None  # CPU threads for torch (default: torch's choice)
    profile: str | None = None  # reuse a profile file instead of measuring
    accept: str | None = None  # reuse a ppd acceptance file instead of measuring
    profile_budget_s: float = 45.0  # at most; and at most a fifth of the budget
    report: bool = True
    progress: bool = True
    seed: int = 0
    # the user's sampling settings: acceptance is measured, plans are sized and the race decodes under them
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    verify: str = "auto"  # auto: greedy at temperature 0, lossless above; coupled (decoder/noise.py); typical: Medusa's, not distribution-exact

    @property
    def sampling(self):
        from planner.sampling import Sampling

        return Sampling(self.temperature, self.top_k, self.top_p, self.verify)

    @property
    def budget(self) -> Budget:
        return Budget(total_s=self.budget_minutes * 60.0, profile_max_s=self.profile_budget_s)



def autotune(s: AutotuneSettings) -> dict:
    """Profile, measure acceptance, plan, race the plans against plain decoding, write; returns the summary."""
    run = _open_run(s)
    accept_texts, race_texts = held_out_prompts(s.questions, s.accept_prompts, s.decode_prompts, s.turns)
    accept_ids, race_ids = encode_prompts(run.tokenizer, accept_texts), encode_prompts(run.tokenizer, race_texts)
    profiled = profile_phase(run)
    accepts = acceptance_phase(run, accept_ids, profiled.profile)
    candidates = plan_phase(run, accepts, profiled.profile)
    drafter = _pearl_drafter(accepts) if _pearl_fits(run) else None
    pearl = pearl_phase(run, drafter, accepts, profiled.profile, accept_ids[0]) if drafter else None
    candidates += pearl["candidates"] if pearl else []
    racing = prediction_phase(run, finalists(candidates, s.finalists, s.neighbours, s.sweep), profiled.profile)
    race, outputs, decision = race_phase(run, race_ids, racing, profiled.profile)
    summary = write_phase(run, racing, race, outputs, decision, profiled, accepts)
    if pearl:
        summary["pearl"] = {k: v for k, v in pearl.items() if k != "candidates"}
    summary["llama_cpp_plain"] = _llama_plain(run, race_ids, summary)
    _finish(run, summary)
    run.say(format_table(summary))
    if s.report:
        report_phase(run, summary, profiled, accepts)
    _finish(run, summary)
    run.say(f"run folder: {shown(run.out_dir)}  ({summary['wall_s']:.0f} s); decision: {shown(run.out_dir / 'chosen.json')}")
    return summary


LLAMA_PROMPTS = 4  # race prompts llama.cpp's plain decoding is timed on (a comparison, not a decision: Budget.llama_plain_s)


def _llama_plain(run: Run, race_ids: list, summary: dict) -> dict:
    """llama.cpp plain decoding of the model's own GGUF on the first race prompts plain decoding ran,
    against this engine's plain decoding of the same prompts (workflows/cli/llama_target.py)."""
    from workflows.cli.llama_target import llama_plain_report

    by = (summary.get("plain") or {}).get("by_prompt") or {}
    ids = sorted(int(p) for p in by)[:LLAMA_PROMPTS]
    if not ids:
        return {"skipped": "plain decoding timed no race prompt"}
    hf_tps = sum(by[str(p)]["tokens"] for p in ids) / max(sum(by[str(p)]["seconds"] for p in ids), 1e-9)
    rep = llama_plain_report(run.loaded.name, [race_ids[p] for p in ids], run.settings.decode_tokens, hf_tps,
                             run.settings.threads)
    if rep.get("tokens_per_s"):
        run.say(f"      llama.cpp plain decoding of the same GGUF on the race prompts: {rep['tokens_per_s']:.1f} tokens/s "
                f"({rep['vs_hf_plain']:.2f}x this engine's plain); plan for it: planner autotune --engine llama.cpp")
    return rep


def _finish(run: Run, summary: dict) -> None:
    summary["wall_s"] = run.clock.elapsed()
    atomic_write_json(run.out_dir / "summary.json", summary)


def _pearl_fits(run: Run) -> bool:
    """PEARL overlaps two jobs on their own cores: on the one core a busy machine leaves free the two
    sides would take turns (and the race would not count its loaded runs), so it is not measured."""
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
    import torch
    from transformers import AutoTokenizer

    from decoder.engines.hf.engine import HFEngine
    from decoder.engines.hf.load import default_device, load_model

    say = partial(print, flush=True) if s.progress else (lambda *a, **k: None)  # progress shows when piped too
    budget = s.budget
    clock = Clock(budget.total_s, say)
    if s.threads:
        torch.set_num_threads(s.threads)
    device = s.device or default_device()
    free = device == "cpu" and not s.threads and _free_cores(say)
    say(f"loading {s.model} on {device}")
    loaded = load_model(s.model, device=device, dtype=s.dtype)
    if loaded.tokenizer_dir is None:
        raise UserError(f"--model {s.model}: no tokenizer files found; autotune decodes text prompts")
    engine = HFEngine(loaded.model)
    guessers = _load_guessers(s, loaded, engine)
    tokenizer = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    out_dir = Path(s.out) if s.out else default_out(device, loaded.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    return Run(s, loaded, engine, guessers, tokenizer, device, out_dir, say, clock, budget, free_cores=free)


def _free_cores(say) -> bool:
    """With no --threads, measure on the cores other processes leave free (profiler.load.free_threads):
    True when that cut torch's threads (chosen.json says so, and `planner decode` then takes the
    cores free when it starts)."""
    import torch

    from profiler.load import free_threads

    machine = torch.get_num_threads()
    threads, others = free_threads(machine)
    if threads == machine:
        return False
    torch.set_num_threads(threads)
    say(f"other processes keep {others:.1f} cores busy: measuring on {threads} of {machine} threads "
        "(--threads overrides; the plan decodes on the cores free when it runs)")
    return True


# the sizes autotune loads each kind at: ranks a plan may use per node, and a chain's depth
LOAD_SIZES = {"top_k": 4, "depth": 6}


def _load_guessers(s: AutotuneSettings, loaded, engine) -> dict:
    """Every guesser to compare: the ones asked for (auto: every kind autotune races whose files ship
    for the model, and the ones that need none)."""
    from decoder.guessers.registry import LoadRequest, load_guesser

    auto = "auto" in s.guessers
    chosen = GUESSERS if auto else s.guessers
    bad = [k for k in chosen if k not in GUESSERS]
    if bad:
        raise UserError(f"--guessers: expected a subset of {', '.join(GUESSERS)} (or auto), got {', '.join(bad)}")
    out = {}
    for name in chosen:
        spec = guesser_kind(name)
        path = s.guesser_dirs.get(name) or (str(shipped(loaded.name, spec.files) or "") if spec.files else "")
        if spec.files and not path:
            if auto and not spec.needs_embeddings:
                continue  # nothing ships for this model: compare the others
            raise UserError(f"--guessers {name}: no {spec.files} ships for model {loaded.name}; give its directory")
        top_k = LOAD_SIZES["top_k"] if spec.samples else None  # a draft LM's ranks cost its passes; others: their files'

        out[name] = load_guesser(name, LoadRequest(engine, path or None, top_k=top_k, depth=LOAD_SIZES["depth"],
                                                   label=path or name))
    return out
