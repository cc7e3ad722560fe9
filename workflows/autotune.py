"""The main job: profile this machine, measure acceptance, plan, race the plans by decoding, write the winner.

    from workflows.autotune import AutotuneSettings, autotune
    summary = autotune(AutotuneSettings())          # SmolLM2-135M and its shipped guessers, best device

Phases, each announced with the time left: 1 profile, 2 acceptance (one greedy decode per prompt
shared by every guesser: profiler.teacher_forced), 3 plan every size of every (guesser, method)
with the one cost model, 4 PEARL's side latencies, 5 race the finalists against plain decoding on
other held-out prompts (workflows.choose: paired per-prompt ratios, bootstrap intervals, clearly
slower plans leave, halving when time runs short), 6 write. The decision is by measurement: the
plan measured fastest beyond the noise, else plain decoding. Everything goes into the run folder
(`RUN/chosen.json` is the decision, a plan `planner decode --plan` takes, plain decoding included);
no file outside it is written. `--budget MINUTES` bounds the whole run.
"""
from __future__ import annotations

import sys
import time
from functools import partial
from dataclasses import asdict, dataclass, field
from pathlib import Path

from planner.accept import Acceptance, load_acceptance
from planner.errors import UserError
from planner.jsonio import atomic_write_json
from planner.profile import LatencyProfile, load_profile
from planner.tree import Tree, TreeState, save_tree
from workflows.candidates import METHODS, Candidate, drafter_candidates, finalists, pick, plan_candidates, real_input_length  # noqa: F401
from workflows.choose import MIN_PROMPTS, PLAIN, Arm, Decision, Race, decide, speedup
from workflows.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts, shipped
from workflows.race import PEARL_SPLIT, REPORT_RESERVE_S, _Outputs, _race_phase, _stages

REPO = Path(__file__).resolve().parents[1]
GUESSERS = ("ppd", "draft", "parallelspec", "chain", "lookup")
SHIPPED_KIND = {"ppd": "prompt_tokens", "draft": "draft_lm", "parallelspec": "parallelspec", "chain": "parallelspec"}
PHASES = 6


@dataclass
class AutotuneSettings:
    model: str = "smollm2-135m"
    guessers: tuple[str, ...] = ("auto",)  # auto: every guesser shipped for the model, and prompt lookup
    guesser_dirs: dict = field(default_factory=dict)  # kind -> directory, instead of the shipped one
    device: str | None = None
    dtype: str | None = None
    out: str | None = None  # run folder; default runs/<date>-<device>-<model>
    questions: str = str(DEFAULT_QUESTIONS)
    accept_prompts: int = 8  # held-out prompts to measure acceptance on
    decode_prompts: int = 8  # other held-out prompts the plans race on
    accept_tokens: int = 64  # greedy tokens per prompt when measuring acceptance
    decode_tokens: int = 40  # new tokens per prompt when decoding
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

    @property
    def prompt_tokens(self) -> str | None:
        return self.guesser_dirs.get("ppd")


# ------------------------------------------------------------------ progress and budget


@dataclass
class _Clock:
    """Elapsed time against the budget, and one progress line per phase with the time left."""

    budget_s: float
    say: object
    t0: float = field(default_factory=time.time)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def phase(self, k: int, text: str, eta_s: float) -> None:
        self.say(f"[{k}/{PHASES}] {text}  ({self.elapsed():.0f} s in; about {max(eta_s, 0):.0f} s left, "
                 f"budget {self.budget_s / 60:.1f} min)")


# ------------------------------------------------------------------ the job


def _shown(path) -> str:
    """Paths under the working directory are recorded relative to it, so a run folder can be moved or committed."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def _default_out(device: str, model_name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return REPO / "runs" / f"{stamp}-{device}-{model_name}"


@dataclass
class _Run:
    """What the phases of one autotune run share."""

    settings: AutotuneSettings
    loaded: object  # profiler.models.LoadedModel
    guessers: dict  # kind -> guesser
    tokenizer: object
    device: str
    out_dir: Path
    say: object  # print, or a no-op when quiet
    clock: _Clock

    @property
    def model(self):
        return self.loaded.model


def autotune(s: AutotuneSettings) -> dict:
    """Profile, measure acceptance, plan, race the plans against plain decoding, write; returns the summary."""
    run = _open_run(s)
    accept_texts, decode_texts = held_out_prompts(s.questions, s.accept_prompts, s.decode_prompts)
    accept_ids, decode_ids = encode_prompts(run.tokenizer, accept_texts), encode_prompts(run.tokenizer, decode_texts)
    profile_path, profile = _profile_phase(run)
    accepts = _acceptance_phase(run, accept_ids, profile)
    candidates = _plan_phase(run, accepts, profile)
    pearl = _pearl_phase(run, accepts, profile, accept_ids[0]) if "draft" in run.guessers else None
    candidates += pearl["candidates"] if pearl else []
    racing = finalists(candidates, s.finalists, s.neighbours, s.sweep)
    race, outputs = _race_phase(run, decode_ids, racing, profile)
    decision = decide(race.arms)
    summary = _write_phase(run, racing, race, outputs, decision, profile, profile_path, accepts)
    if pearl:
        summary["pearl"] = {k: v for k, v in pearl.items() if k != "candidates"}
    summary["wall_s"] = run.clock.elapsed()
    atomic_write_json(run.out_dir / "summary.json", summary)
    run.say(format_table(summary))
    if s.report:
        _report_phase(run, summary, profile_path, accepts)
    summary["wall_s"] = run.clock.elapsed()
    atomic_write_json(run.out_dir / "summary.json", summary)
    run.say(f"run folder: {_shown(run.out_dir)}  ({summary['wall_s']:.0f} s); decision: {_shown(run.out_dir / 'chosen.json')}")
    return summary


def _open_run(s: AutotuneSettings) -> _Run:
    import torch
    from transformers import AutoTokenizer

    from profiler.models import default_device, load_model

    say = partial(print, flush=True) if s.progress else (lambda *a, **k: None)  # progress shows when piped too
    clock = _Clock(s.budget_minutes * 60.0, say)
    if s.threads:
        torch.set_num_threads(s.threads)
    device = s.device or default_device()
    say(f"loading {s.model} on {device}")
    loaded = load_model(s.model, device=device, dtype=s.dtype)
    if loaded.tokenizer_dir is None:
        raise UserError(f"--model {s.model}: no tokenizer files found; autotune decodes text prompts")
    guessers = _load_guessers(s, loaded)
    tokenizer = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    out_dir = Path(s.out) if s.out else _default_out(device, loaded.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    return _Run(s, loaded, guessers, tokenizer, device, out_dir, say, clock)


def _load_guessers(s: AutotuneSettings, loaded) -> dict:
    """Every guesser to compare: the ones asked for (auto: all shipped for the model, and lookup)."""
    from decoder import DraftModelGuesser, PromptLookupGuesser, PromptTokens
    from decoder.draft import load_draft_model
    from decoder.parallel import ParallelDrafter

    kinds = GUESSERS if "auto" in s.guessers else s.guessers
    bad = [k for k in kinds if k not in GUESSERS]
    if bad:
        raise UserError(f"--guessers: expected a subset of {', '.join(GUESSERS)} (or auto), got {', '.join(bad)}")
    out = {}
    for kind in kinds:
        path = s.guesser_dirs.get(kind) or (str(shipped(loaded.name, SHIPPED_KIND[kind]) or "") if kind in SHIPPED_KIND else "")
        if kind in SHIPPED_KIND and not path:
            if "auto" in s.guessers and kind != "ppd":
                continue  # nothing ships for this model: compare the others
            raise UserError(f"--guessers {kind}: no {SHIPPED_KIND[kind]} ships for model {loaded.name}; give its directory")
        if kind == "ppd":
            g = PromptTokens.load(path, model=loaded.model)
        elif kind == "draft":
            g = DraftModelGuesser(load_draft_model(path, loaded.model), top_k=4, depth=6, label=path)
        elif kind in ("parallelspec", "chain"):
            g = ParallelDrafter.load(path, mode="chain" if kind == "chain" else "parallel")
        else:
            g = PromptLookupGuesser(num_tokens=6)
        g.source_dir = path or None
        out[kind] = g
    return out


def profile_lengths(max_n: int) -> list[int]:
    """Every length to 16, then every 2nd to 32, 4th to 64, 8th beyond (and max_n): trees are small
    more often than large, and with a fixed budget fewer points get more repeats each. A first run on
    SmolLM2 measured all 64 lengths 4 times each and read L(1) 19 % above the plain loop's step, which
    made every predicted speedup optimistic by as much."""
    out = [n for n in range(1, max_n + 1) if n <= 16 or (n <= 32 and n % 2 == 0) or (n <= 64 and n % 4 == 0)
           or n % 8 == 0]
    return out if out[-1] == max_n else out + [max_n]


def _profile_budget(s: AutotuneSettings) -> float:
    return min(s.profile_budget_s, 0.2 * s.budget_minutes * 60.0)


def _profile_phase(run: _Run) -> tuple[Path, LatencyProfile]:
    from profiler.measure import profile_model

    s = run.settings
    if s.profile:
        path = Path(s.profile)
    else:
        budget = _profile_budget(s)
        paths_s = MATMUL_SHARE * budget if run.device == "cpu" else 0.0
        run.clock.phase(1, f"profiling {run.loaded.name} on {run.device}: "
                           + (f"each Linear's fastest matmul path per input length ({paths_s:.0f} s), " if paths_s else "")
                           + f"input lengths 1..{s.max_input_length} after a {s.context_length}-token context and the "
                           f"decoder's own per-step work ({budget - paths_s:.0f} s)", run.clock.left())
        prof = profile_model(run.loaded, profile_lengths(s.max_input_length), context_length=s.context_length,
                             time_budget_s=budget - paths_s, matmul_budget_s=paths_s or None,
                             matmul_paths="auto" if paths_s else "off",
                             progress=s.progress and sys.stderr.isatty())  # bars: terminals only
        path = atomic_write_json(run.out_dir / "profile.json", prof)
    profile = load_profile(str(path))
    from planner.simulate import refuse_to_measure
    refuse_to_measure(profile, "planner autotune")  # it decodes here against the profile's predictions
    if run.device == "cpu":  # decode what was profiled: the profile's matmul paths (none: F.linear)
        from decoder.cpu_paths import use_profile_paths

        use_profile_paths(run.model, str(path))
    if profile.max_input_length < s.max_input_length:
        raise UserError(f"{path}: profiled up to {profile.max_input_length} tokens, --max-input-length is {s.max_input_length}")
    return path, profile


MATMUL_SHARE = 0.35  # of the profiling budget, for choosing the matmul paths (the rest times L(n) with them)
CHAIN_PROMPTS = 4  # the chain drafter replays depth passes per position: half the prompts, half the time
MEASURE_SHAPE = {"draft": (6, 4), "chain": (6, 4), "lookup": (6, 1)}  # (depth, width) of the comb measured


def _acceptance_eta(run: _Run, profile: LatencyProfile, prompts: int) -> float:
    """The acceptance phase's time: one greedy decode per prompt (with PPD's tokens along) and a
    few proposals per position per replayed guesser."""
    from planner.cost import step_cost

    s = run.settings
    ppd = run.guessers.get("ppd")
    n = 1 + (ppd.num_distances * ppd.ensemble if ppd is not None else 0)
    step = float(step_cost(profile, min(n, profile.max_input_length)))
    replays = sum(1 for k in run.guessers if k in ("parallelspec", "chain"))
    return prompts * s.accept_tokens * (step + 0.15 * replays * step)


def _acceptance_phase(run: _Run, accept_ids: list, profile: LatencyProfile) -> dict[str, tuple[Path, Acceptance]]:
    """Each guesser's acceptance on held-out prompts, from one shared greedy decode per prompt."""
    from profiler.teacher_forced import Continuations, greedy_continuations, replay_accuracy

    s = run.settings
    measure = {k: g for k, g in run.guessers.items() if not (k == "ppd" and s.accept)}
    out = {"ppd": (Path(s.accept), load_acceptance(s.accept))} if "ppd" in run.guessers and s.accept else {}
    if not measure:
        return out
    eta = _acceptance_eta(run, profile, len(accept_ids))
    share = 0.35 * run.clock.left()  # the race needs the rest
    if eta > share and len(accept_ids) > 2:
        keep = max(2, int(len(accept_ids) * share / eta))
        run.say(f"      the budget fits {keep} of {len(accept_ids)} acceptance prompts (predicted {eta:.0f} s for all)")
        accept_ids, eta = accept_ids[:keep], eta * keep / len(accept_ids)
    run.clock.phase(2, f"acceptance of {', '.join(measure)} on {len(accept_ids)} held-out prompts x {s.accept_tokens} "
                       "tokens (one greedy decode each, shared)", run.clock.left())
    ppd = measure.get("ppd")
    cont = greedy_continuations(run.model, accept_ids, s.accept_tokens, ppd=ppd)
    run.say(f"      greedy decode: {cont.decode_s:.0f} s (predicted {eta:.0f} s with the replays)")
    for kind, g in measure.items():
        if kind == "ppd":
            acc = cont.ppd
        else:
            depth, width = MEASURE_SHAPE.get(kind, (g.num_distances, getattr(g, "top_k", 1)))
            part = cont if kind != "chain" else Continuations(cont.prompts[:CHAIN_PROMPTS], cont.tokens[:CHAIN_PROMPTS])
            acc = replay_accuracy(run.model, g, part, depth, width)
        acc["source"] = (f"planner autotune: {run.loaded.name}, {kind} {_shown(g.source_dir) if g.source_dir else '(no model)'}, "
                         f"{len(accept_ids)} held-out prompts, {acc['positions']} positions ({acc['source']})")
        acc["guesser"]["dir"] = _shown(g.source_dir) if g.source_dir else None
        path = atomic_write_json(run.out_dir / f"accept-{kind}.json", acc)
        out[kind] = (path, load_acceptance(str(path)))
    return out


def _plan_phase(run: _Run, accepts: dict, profile: LatencyProfile) -> list[Candidate]:
    s = run.settings
    run.clock.phase(3, f"planning {', '.join(accepts)} up to input length {s.max_input_length}", run.clock.left())
    candidates = []
    for kind, (_, accept) in accepts.items():
        g = run.guessers[kind]
        if kind == "ppd":
            for m in s.methods:
                candidates += plan_candidates(m, accept, profile, g.num_prompt_tokens, g.ensemble, s.max_input_length)
        else:
            candidates += drafter_candidates(kind, accept, profile, s.max_input_length)
    candidates += _dynamic_candidates(run, accepts, profile)
    if not candidates:
        raise UserError(f"--max-input-length {s.max_input_length}: no plan fits")
    return candidates


DYNAMIC_MAX_SIZE = 15  # per-step trees up to this many candidates: inputs to 16 rows, where the matmul paths are chosen


def _dynamic_candidates(run: _Run, accepts: dict, profile: LatencyProfile) -> list[Candidate]:
    """Per-step trees (planner/dynamic.py) for every guesser, and lookup's hybrids with each drafter
    (their guesser joins run.guessers). Autotune's acceptance files carry no calibration: the
    per-distance, per-rank rows are the prior, which the session corrects online as it decodes."""
    from decoder.dynamic import HybridGuesser
    from planner.cost import padding
    from workflows.candidates import dynamic_candidates

    size = min(DYNAMIC_MAX_SIZE, run.settings.max_input_length - 1)
    kinds = [k for k in accepts]
    if "lookup" in accepts:
        for d in ("parallelspec", "draft", "chain", "ppd"):
            if d in accepts:
                kinds.append(f"lookup+{d}")
                run.guessers[f"lookup+{d}"] = HybridGuesser(run.guessers["lookup"], run.guessers[d], d)
    out = []
    for kind in kinds:
        try:
            cands = dynamic_candidates(kind, {k: accepts[k][1] for k in kind.split("+")}, profile, max_size=size)
        except UserError as e:  # a guesser the dynamic planner cannot model: the static plans still race
            run.say(f"      dynamic {kind}: skipped ({e})")
            continue
        for c in cands:
            c.tree.settings.update(padding(profile))
        out += cands
    return out




def _pearl_phase(run: _Run, accepts: dict, profile: LatencyProfile, context) -> dict:
    """PEARL needs each side's latency at its share of the cores and how much the two really
    overlap (eta): both measured here, then one candidate per gamma (workflows.candidates)."""
    import torch

    from planner.cost import plain_step
    from profiler.overlap import side_latencies, split_check
    from workflows.candidates import pearl_candidates

    total = torch.get_num_threads()
    split = PEARL_SPLIT if total >= 2 else (1, 1)
    draft = run.guessers["draft"].draft_model
    run.clock.phase(4, f"PEARL: target and draft LM at threads {split} and {total}, and their overlap", run.clock.left())
    ctx = context.to(run.model.device)
    lat = side_latencies(run.model, draft, ctx, range(1, 9), split, total, repeats=3)
    check = split_check(run.model, draft, ctx, 4, split, repeats=3)
    torch.set_num_threads(total)
    eta = max(0.0, min(1.0, check["eta"]))
    cands = pearl_candidates(accepts["draft"][1], lat, eta, plain_step(profile))
    return {"candidates": cands, "split": list(split), "latencies": lat, "split_check": check, "eta": eta}


# ------------------------------------------------------------------ writing


def state_frequencies(tree: Tree, states: list[int]) -> dict | None:
    """ppd: how often each state was visited while decoding, next to the Markov model's pi."""
    if tree.method != "ppd" or not states:
        return None
    counts = {st.state: 0 for st in tree.states}
    for s_ in states:
        counts[s_] += 1
    total = sum(counts.values())
    return {str(st.state): {"measured": counts[st.state] / total, "predicted": st.stationary_probability}
            for st in tree.states}


def plain_plan(reason: str) -> Tree:
    """The decision 'plain decoding' as a plan: one state, no candidates (`planner decode --plan` runs it)."""
    return Tree("medusa", [TreeState(0, [], 1.0, 1)], 1.0, settings={"guesser": "plain", "decision": reason})


def _measured(c: Candidate, arm: Arm, plain: Arm, outputs: _Outputs, step_s: float) -> dict:
    """A finalist's measurements next to the cost model's predictions, with the prediction errors."""
    prompts = sorted(arm.seconds)
    tokens = sum(int(outputs.tokens[arm.key][p].numel()) for p in prompts)
    steps = sum(outputs.steps[arm.key][p] for p in prompts)
    decode_s = sum(outputs.decode_s[arm.key][p] for p in prompts)
    up = speedup(arm, plain)
    tps = tokens / max(steps, 1)
    pred_step = step_s * c.predicted_tokens_per_step / max(c.predicted_speedup, 1e-9)
    meas_step = decode_s / max(steps, 1)
    return {"prompts": len(prompts), "tokens": tokens, "steps": steps,
            "measured_tokens_per_step": tps, "measured_speedup": up.mean, "measured_interval": up.to_json(),
            "predicted_step_s": pred_step, "measured_step_s": meas_step,
            "error_tokens_per_step": tps / c.predicted_tokens_per_step - 1,
            "error_step_s": meas_step / pred_step - 1, "error_speedup": c.predicted_speedup / up.mean - 1,
            "measured_tokens_per_s": tokens / max(sum(arm.seconds[p] for p in prompts), 1e-9)}


def _row(c: Candidate, arm: Arm, path: Path, measured: dict | None, states: list[int]) -> dict:
    row = {
        "guesser": c.guesser, "method": c.method, "variant": c.variant, "size": c.size, "label": c.label,
        "input_length": round(c.input_length, 3), "planned_input_length": c.tree.max_input_length,
        "draft_s": c.guessing.draft_s, "draft_passes": c.guessing.draft_passes,
        "predicted_tokens_per_step": c.predicted_tokens_per_step, "predicted_speedup": c.predicted_speedup,
        "cost_vs_plain_step": arm.cost, "dropped": arm.dropped or None, "chosen": False, "tree": _shown(path),
        "measured_tokens_per_step": None, "measured_speedup": None, "identical_to_greedy": None,
        "state_frequencies": state_frequencies(c.tree, states),
    }
    if measured:
        row.update(measured)
        row["identical_to_greedy"] = not arm.dropped.startswith("output differs")
    return row


def _write_phase(run: _Run, racing: list[Candidate], race: Race, outputs: _Outputs, decision: Decision,
                 profile: LatencyProfile, profile_path: Path, accepts: dict) -> dict:
    """Every finalist's tree and row, the decision as RUN/chosen.json, and the summary."""
    from planner.cost import plain_step
    from profiler.models import dtype_name

    run.clock.phase(6, "writing the run folder", REPORT_RESERVE_S)
    s = run.settings
    arms = {a.key: a for a in race.arms}
    rows, chosen = [], None
    for c in racing:
        name = f"{c.guesser}-{c.method}-{c.size}{'-auto' if c.variant == 'per-state budgets' else ''}{c.tag}.json"
        g = run.guessers[_measured_as(c.guesser)]
        c.tree.provenance.update({"accept": _shown(accepts[_measured_as(c.guesser)][0]), "profile": _shown(profile_path),
                                  "autotune": _shown(run.out_dir), "guesser_dir": _shown(g.source_dir) if g.source_dir else None})
        save_tree(c.tree, run.out_dir / "trees" / name)
        arm = arms[c.label]
        measured = _measured(c, arm, race.plain, outputs, plain_step(profile)) if arm.seconds else None
        rows.append(_row(c, arm, run.out_dir / "trees" / name, measured, outputs.states.get(c.label, [])))
        if c.label == decision.choice:
            chosen = c
            rows[-1]["chosen"] = True
    tree = chosen.tree if chosen else plain_plan(decision.reason)
    tree.settings = dict(tree.settings, decision=decision.reason, measured_speedup=decision.speedup.to_json())
    save_tree(tree, run.out_dir / "chosen.json")
    return _summary(run, chosen, decision, rows, race, outputs, profile_path, accepts) | {
        "dtype": dtype_name(next(run.model.parameters()).dtype)}


def _measured_as(kind: str) -> str:
    """The guesser whose acceptance and files a candidate uses (PEARL drafts with the draft LM; a
    hybrid's files are its drafter's)."""
    return "draft" if kind == "pearl" else kind.split("+")[-1]


def _summary(run: _Run, chosen: Candidate | None, decision: Decision, rows: list[dict], race: Race, outputs: _Outputs,
             profile_path: Path, accepts: dict) -> dict:
    s = run.settings
    plain = race.plain
    plain_tokens = sum(int(t.numel()) for t in outputs.tokens[PLAIN].values())
    measured = [r for r in rows if r["measured_speedup"] is not None]
    best = max(measured, key=lambda r: r["measured_speedup"], default=None)
    return {
        "chosen": _shown(run.out_dir / "chosen.json"),
        "decision": {"choice": decision.choice, "reason": decision.reason, "measured_speedup": decision.speedup.to_json(),
                     "predicted_speedup": chosen.predicted_speedup if chosen else 1.0,
                     "guesser": chosen.guesser if chosen else "plain"},
        "chosen_guesser": chosen.guesser if chosen else "plain", "chosen_method": chosen.method if chosen else "plain",
        "chosen_size": chosen.size if chosen else 0,
        "identical_to_greedy": all(r["identical_to_greedy"] is not False for r in rows),
        "plain": {"tokens": plain_tokens, "seconds": sum(plain.seconds.values()), "prompts": len(plain.seconds),
                  "tokens_per_s": plain_tokens / max(sum(plain.seconds.values()), 1e-9)},
        "prediction_error": _prediction_errors(measured, chosen),
        "best_measured": ({"label": best["label"], "measured_speedup": best["measured_speedup"]} if best else None),
        "race": {"log": race.log, "stages": len(_stages(len(plain.seconds))) if plain.seconds else 0},
        "rows": rows, "profile": _shown(profile_path),
        "accept": {k: _shown(p) for k, (p, _) in accepts.items()},
        "guessers": {k: _shown(g.source_dir) if g.source_dir else None for k, g in run.guessers.items()},
        "model": run.loaded.name, "device": run.device,
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()},
        "wall_s": None,
    }


def _prediction_errors(measured: list[dict], chosen: Candidate | None) -> dict:
    """How far the cost model was from the measurements: per row in the rows, summarised here."""
    def med_abs(key):
        vals = sorted(abs(r[key]) for r in measured)
        return vals[len(vals) // 2] if vals else None

    out = {"median_abs_tokens_per_step": med_abs("error_tokens_per_step"), "median_abs_step_s": med_abs("error_step_s"),
           "median_abs_speedup": med_abs("error_speedup"), "rows": len(measured)}
    row = next((r for r in measured if chosen is not None and r["label"] == chosen.label), None)
    if row:
        out["chosen"] = {k: row[k] for k in ("error_tokens_per_step", "error_step_s", "error_speedup")}
    return out


def _report_phase(run: _Run, summary: dict, profile_path: Path, accepts: dict) -> None:
    from workflows.report import write_report

    specs = [str(p) for k, (p, _) in accepts.items() if k == "ppd"]  # the size curves of the ppd families
    index = write_report(run.out_dir / "report", profiles=[str(profile_path)], accepts=specs,
                         trees=[summary["chosen"]], run_dir=str(run.out_dir))
    summary["report"] = _shown(index)
    run.say(f"report: {_shown(index)}")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(summary: dict) -> str:
    head = (f"{'plan':24} {'n_real':>6} {'tok/step pred':>13} {'meas':>5} {'step ms pred':>12} {'meas':>6} "
            f"{'speedup pred':>12} {'measured [95% interval]':>24}  note")
    lines = [head, "-" * len(head)]
    for r in summary["rows"]:
        iv = r.get("measured_interval")
        meas = f"{iv['mean']:.2f} [{iv['lo']:.2f}, {iv['hi']:.2f}]" if iv and iv["prompts"] >= MIN_PROMPTS else (
            _fmt(r["measured_speedup"], ".2f"))
        note = "CHOSEN" if r["chosen"] else ("out: " + r["dropped"].split(":")[0] if r["dropped"] else "")
        if r["identical_to_greedy"] is False:
            note = "OUTPUT DIFFERS"
        lines.append(
            f"{r['label']:24} {r['input_length']:>6.1f} {r['predicted_tokens_per_step']:>13.2f} "
            f"{_fmt(r['measured_tokens_per_step'], '.2f'):>5} {_fmt(r.get('predicted_step_s') and r['predicted_step_s'] * 1e3, '.1f'):>12} "
            f"{_fmt(r.get('measured_step_s') and r['measured_step_s'] * 1e3, '.1f'):>6} {r['predicted_speedup']:>12.2f} "
            f"{meas:>24}  {note}")
    p, d = summary["plain"], summary["decision"]
    ms = d["measured_speedup"]
    lines.append(f"plain decoding: {p['tokens_per_s']:.1f} tokens/s over {p['prompts']} prompts")
    lines.append(f"decision: {d['choice']} -- measured {ms['mean']:.2f}x plain"
                 + (f" [{ms['lo']:.2f}, {ms['hi']:.2f}]" if ms["prompts"] >= MIN_PROMPTS and d["choice"] != PLAIN else "")
                 + f", predicted {d['predicted_speedup']:.2f}x; {d['reason']}")
    return "\n".join(lines)
