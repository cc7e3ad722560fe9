"""The main job's phases on a step engine (decoder/engine.py's Engine, stepped in this process: hf,
llama.cpp). workflows/mainjob/pipeline.py runs them in order; what differs between step engines is data
(the engine kind's defaults, planner/engines.py) and capabilities (the guessers it runs, PEARL where it lends
its torch modules, CPU matmul paths):

  profile   this machine's L(n) (and the CPU matmul paths)                     workflows/mainjob/measure.py
  accept    one decode per prompt, shared by every guesser (profiler.teacher_forced; sampled with the
            user's temperature, top-k and top-p: profiler.sampled)
  plan      every size of every (guesser, method), per-step trees, hybrids; PEARL's side latencies;
            the finalists' predictions by replay                                workflows/mainjob/candidates.py
  race      the finalists against the engine's fastest plain decoding: the selection, then its winner's
            confirmation against plain on other prompts (sign-flip test)     workflows/mainjob/race.py
  confirm   the decision beside the other engines' own plain decoding of the same prompts
  write     trees, rows, RUN/chosen.json, summary, report                        workflows/mainjob/write.py
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from planner.guessers import kinds as guesser_kinds
from planner.jsonio import atomic_write_json
from workflows.cli.inputs import encode_prompts, held_out_prompts, shipped
from workflows.mainjob.candidates import finalists, plan_phase
from workflows.mainjob.choose import PLAIN
from workflows.mainjob.measure import acceptance_phase, pearl_phase, profile_phase
from workflows.mainjob.predict import prediction_phase
from workflows.mainjob.race import race_phase
from workflows.mainjob.runs import Budget, Clock, Run, default_out, shown
from workflows.mainjob.write import format_table, report_phase, write_phase

# the kinds autotune can race: a registered guesser of its own (no hybrid: those are built from these)
GUESSERS = tuple(k.name for k in guesser_kinds(hybrids=False) if k.autotune and k.loop is None)
PEARL_DRAFTER = next(k for k in guesser_kinds() if k.loop is not None)  # the kind with its own two-job loop


@dataclass
class StepRun:
    """One step-engine run: the shared Run every phase module reads, and what each phase leaves for the next."""

    run: Run
    accept_ids: list
    race_ids: list
    profiled: object = None  # measure.Profiled: the profile and its file
    accepts: dict | None = None  # guesser kind -> its acceptance (measure.Measured)
    racing: list | None = None  # the finalists, predicted
    pearl: dict | None = None  # PEARL's side latencies and thread split, where measured
    race: object = None  # choose.Race
    outputs: object = None  # race._Outputs
    decision: object = None  # choose.Decision
    compared: dict | None = None  # "<engine>_plain": other engines' stock plain decoding


def open_run(s) -> StepRun:
    """The engine, the guessers, the run folder, and the held-out prompts (room reserved for the longest)."""
    s = s.resolved()
    run = _open_run(s)
    try:
        accept_texts, race_texts = held_out_prompts(s.questions, s.accept_prompts, s.decode_prompts, s.turns)
        accept_ids, race_ids = encode_prompts(run.tokenizer, accept_texts), encode_prompts(run.tokenizer, race_texts)
        run.engine.reserve(max(int(t.numel()) for t in accept_ids + race_ids) + max(s.accept_tokens, s.decode_tokens)
                           + s.max_input_length)
    except BaseException:
        run.engine.close()
        raise
    return StepRun(run, accept_ids, race_ids)


def profile(sr: StepRun) -> None:
    sr.profiled = profile_phase(sr.run)


def accept(sr: StepRun) -> None:
    sr.accepts = acceptance_phase(sr.run, sr.accept_ids, sr.profiled.profile)


def plan(sr: StepRun) -> None:
    """Every candidate plan, PEARL's where it runs, and the finalists' predictions."""
    run, s, profile_ = sr.run, sr.run.settings, sr.profiled.profile
    candidates = plan_phase(run, sr.accepts, profile_)
    drafter = _pearl_drafter(sr.accepts) if _pearl_fits(run) else None
    sr.pearl = pearl_phase(run, drafter, sr.accepts, profile_, sr.accept_ids[0]) if drafter else None
    candidates += sr.pearl["candidates"] if sr.pearl else []
    sr.racing = prediction_phase(run, finalists(candidates, s.finalists, s.neighbours, s.sweep), profile_)


def race(sr: StepRun) -> None:
    sr.race, sr.outputs, sr.decision = race_phase(sr.run, sr.race_ids, sr.racing, sr.profiled.profile)


def confirm(sr: StepRun) -> None:
    """The confirmation's test ran in the race; here the decision's plain decoding beside the other
    engines' own (a comparison a user reads, not a decision)."""
    sr.compared = _other_engines(sr.run, sr.race_ids, sr.race, sr.outputs)


def write(sr: StepRun) -> dict:
    run = sr.run
    summary = write_phase(run, sr.racing, sr.race, sr.outputs, sr.decision, sr.profiled, sr.accepts, sr.race_ids)
    if sr.pearl:
        summary["pearl"] = {k: v for k, v in sr.pearl.items() if k != "candidates"}
    summary.update(sr.compared or {})
    _finish(run, summary)
    run.say(format_table(summary))
    if run.settings.report:
        report_phase(run, summary, sr.profiled, sr.accepts)
    _finish(run, summary)
    run.say(f"run folder: {shown(run.out_dir)}  ({summary['wall_s']:.0f} s); decision: {shown(run.out_dir / 'chosen.json')}")
    return summary


def close(sr: StepRun) -> None:
    sr.run.engine.close()


COMPARE_PROMPTS = 4  # race prompts other engines' stock plain decoding is timed on (a comparison, not a decision)


def _other_engines(run: Run, race_ids: list, race, outputs) -> dict:
    """Every other registered engine that `compares` (llama.cpp): its library's own plain decoding of the
    same model on the first race prompts plain decoding ran, against this engine's plain decoding of the
    same ones, prefill included, so a user sees which engine is faster on this machine. Keyed
    "<engine>_plain" (llama.cpp: "llama_cpp_plain"); a reason instead when it cannot run."""
    from workflows.mainjob.compare import stock_plain_report

    seconds = race.plain.seconds
    ids = sorted(seconds)[:COMPARE_PROMPTS]
    out = {}
    for other in (k for k in _registered() if k.compares and k.name != run.engine.caps.name):
        key = f"{other.name.replace('.', '_')}_plain"
        if not ids:
            out[key] = {"skipped": "plain decoding timed no race prompt"}
            continue
        tps = sum(int(outputs.tokens[PLAIN][p].numel()) for p in ids) / max(sum(seconds[p] for p in ids), 1e-9)
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


def _open_run(s) -> Run:
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


def _threads(s, say) -> tuple[int | None, bool]:
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


def _load_guessers(s, engine) -> dict:
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
