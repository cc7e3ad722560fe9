"""The main job: profile this machine, measure acceptance, plan trees, verify them by decoding, report.

    from workflows.autotune import AutotuneSettings, autotune
    summary = autotune(AutotuneSettings())          # SmolLM2-135M and its shipped guessers, best device

Each step writes its file into the run folder (profile.json, accept.json, trees/, summary.json,
report/), so a run can be inspected, and later steps can be re-run from earlier files
(`--profile`, `--accept`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from planner.accept import Acceptance, load_acceptance
from planner.errors import UserError
from planner.jsonio import atomic_write_json
from planner.profile import LatencyProfile, load_profile
from planner.tree import Tree, save_tree
from workflows.candidates import METHODS, Candidate, drafter_candidates, pick, plan_candidates, real_input_length  # noqa: F401
from workflows.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts, shipped

REPO = Path(__file__).resolve().parents[1]
GUESSERS = ("ppd", "draft", "parallelspec", "chain", "lookup")
SHIPPED_KIND = {"ppd": "prompt_tokens", "draft": "draft_lm", "parallelspec": "parallelspec", "chain": "parallelspec"}


@dataclass
class AutotuneSettings:
    model: str = "smollm2-135m"
    guessers: tuple[str, ...] = ("auto",)  # auto: every guesser shipped for the model, and prompt lookup
    guesser_dirs: dict = field(default_factory=dict)  # kind -> directory, instead of the shipped one
    device: str | None = None
    dtype: str | None = None
    out: str | None = None  # run folder; default runs/<date>-<device>-<model>
    questions: str = str(DEFAULT_QUESTIONS)
    accept_prompts: int = 4  # held-out prompts to measure acceptance on
    decode_prompts: int = 4  # other held-out prompts to decode
    accept_tokens: int = 64  # greedy tokens per prompt when measuring acceptance
    decode_tokens: int = 48  # new tokens per prompt when decoding
    max_input_length: int = 64  # largest forward pass planned and profiled
    context_length: int = 128  # cache length the profile is taken at (a typical prompt + answer here)
    methods: tuple[str, ...] = METHODS  # ppd guesser's tree families
    neighbours: int = 1  # sizes either side of the chosen one that are also decoded
    sweep: int = 4  # extra sizes of the chosen (guesser, method) spread over its range
    rounds: int = 2  # decoding repeats; each (plan, prompt) time is the median
    threads: int | None = None  # CPU threads for torch (default: torch's choice)
    profile: str | None = None  # reuse a profile file instead of measuring
    accept: str | None = None  # reuse a ppd acceptance file instead of measuring
    profile_budget_s: float = 60.0
    trees_dir: str = str(REPO / "trees")
    report: bool = True
    progress: bool = True

    @property
    def prompt_tokens(self) -> str | None:
        return self.guesser_dirs.get("ppd")


# ------------------------------------------------------------------ measuring


def measure_decoding(model, prompts, plans: list[Candidate | None], guessers, max_new_tokens: int, rounds: int = 2,
                     progress: bool = True) -> list[dict]:
    """Decode every prompt with every plan (None: plain decoding), interleaved.

    Plans run in a shuffled order per prompt and round, so a slow spell of the machine (clock
    changes, another process) spreads over all of them instead of biasing one; each (plan, prompt)
    time is the median over rounds. guessers: one guesser for every plan, or {kind: guesser} for
    plans that name their guesser. Returns per plan: tokens, steps, seconds, outputs.
    """
    import random

    from tqdm import tqdm

    from decoder import generate, generate_plain
    from decoder.pearl import generate_pearl

    w = model.get_input_embeddings().weight
    times = [[[] for _ in prompts] for _ in plans]
    results = [{"tokens": 0, "steps": 0, "outputs": [], "states": []} for _ in plans]
    rng = random.Random(0)
    bar = tqdm(total=rounds * len(prompts) * len(plans), desc="decode", unit="run", disable=not progress)
    for r in range(rounds):
        for p, ids in enumerate(prompts):
            ids = ids.to(w.device)
            order = list(range(len(plans)))
            rng.shuffle(order)
            for i in order:
                t0 = time.perf_counter()
                if plans[i] is None:
                    out = generate_plain(model, ids, max_new_tokens=max_new_tokens, phase_times=False)
                elif plans[i].guesser == "pearl":  # its own two-job loop, the draft LM as drafter
                    out = generate_pearl(model, guessers["draft"].draft_model, ids, gamma=plans[i].size,
                                         max_new_tokens=max_new_tokens, threads=PEARL_SPLIT)
                else:
                    g = guessers[plans[i].guesser] if isinstance(guessers, dict) else guessers
                    out = generate(model, ids, plan=plans[i].tree, guesser=g, max_new_tokens=max_new_tokens,
                                   phase_times=False)
                times[i][p].append(time.perf_counter() - t0)
                if r == 0:
                    results[i]["tokens"] += int(out.tokens.numel())
                    results[i]["steps"] += int(out.steps)
                    results[i]["outputs"].append(out.tokens.cpu())
                    results[i]["states"] += [st for st in getattr(out.stats, "states", []) if st >= 0]  # -1: bootstrap
                bar.update()
    bar.close()
    for i, res in enumerate(results):
        res["seconds"] = float(sum(statistics.median(t) for t in times[i]))
        res["tokens_per_step"] = res["tokens"] / max(res["steps"], 1)
        res["tokens_per_s"] = res["tokens"] / res["seconds"]
    return results


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

    @property
    def model(self):
        return self.loaded.model


def autotune(s: AutotuneSettings) -> dict:
    """Profile, measure every guesser's acceptance, plan every guesser's trees, decode, write; returns the summary."""
    t_start = time.time()
    run = _open_run(s)
    accept_texts, decode_texts = held_out_prompts(s.questions, s.accept_prompts, s.decode_prompts)
    accept_ids, decode_ids = encode_prompts(run.tokenizer, accept_texts), encode_prompts(run.tokenizer, decode_texts)
    profile_path, profile = _profile_phase(run)
    accepts = _acceptance_phase(run, accept_ids)
    candidates = _plan_phase(run, accepts, profile)
    pearl = _pearl_phase(run, accepts, profile, accept_ids[0]) if "draft" in run.guessers else None
    candidates += pearl["candidates"] if pearl else []
    chosen, tried = pick(candidates, s.neighbours, s.sweep)
    plain, identical = _decode_phase(run, decode_ids, tried)
    summary = _write_phase(run, chosen, tried, plain, identical, profile_path, accepts)
    if pearl:
        summary["pearl"] = {k: v for k, v in pearl.items() if k != "candidates"}
    summary["wall_s"] = time.time() - t_start
    atomic_write_json(run.out_dir / "summary.json", summary)
    run.say(format_table(summary))
    if s.report:
        _report_phase(run, summary, profile_path, accepts)
    run.say(f"run folder: {run.out_dir}  ({summary['wall_s']:.0f} s)")
    return summary


def _open_run(s: AutotuneSettings) -> _Run:
    import torch
    from transformers import AutoTokenizer

    from profiler.models import default_device, load_model

    if s.threads:
        torch.set_num_threads(s.threads)
    device = s.device or default_device()
    loaded = load_model(s.model, device=device, dtype=s.dtype)
    if loaded.tokenizer_dir is None:
        raise UserError(f"--model {s.model}: no tokenizer files found; autotune decodes text prompts")
    guessers = _load_guessers(s, loaded)
    tokenizer = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    out_dir = Path(s.out) if s.out else _default_out(device, loaded.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    say = print if s.progress else (lambda *a, **k: None)
    return _Run(s, loaded, guessers, tokenizer, device, out_dir, say)


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


def _profile_phase(run: _Run) -> tuple[Path, LatencyProfile]:
    from profiler.measure import profile_model

    s = run.settings
    if s.profile:
        path = Path(s.profile)
    else:
        run.say(f"[1/5] profiling {run.loaded.name} on {run.device}: input lengths 1..{s.max_input_length} (every one "
                f"to 16, then every 2, 4, 8), "
                f"context {s.context_length}, and the decoder's own per-step work")
        prof = profile_model(run.loaded, profile_lengths(s.max_input_length), context_length=s.context_length,
                             time_budget_s=s.profile_budget_s, progress=s.progress)
        path = atomic_write_json(run.out_dir / "profile.json", prof)
    profile = load_profile(str(path))
    from planner.simulate import refuse_to_measure
    refuse_to_measure(profile, "planner autotune")  # it decodes here against the profile's predictions
    if profile.max_input_length < s.max_input_length:
        raise UserError(f"{path}: profiled up to {profile.max_input_length} tokens, --max-input-length is {s.max_input_length}")
    return path, profile


MEASURE_SHAPE = {"draft": (6, 4), "chain": (6, 4), "lookup": (6, 1)}  # (depth, width) of the comb measured


def _acceptance_phase(run: _Run, accept_ids: list) -> dict[str, tuple[Path, Acceptance]]:
    """Each guesser's acceptance on held-out prompts (root-only decoding, its comb of guesses)."""
    from profiler.acceptance import measure_accuracy

    s = run.settings
    out = {}
    for kind, g in run.guessers.items():
        if kind == "ppd" and s.accept:
            out[kind] = (Path(s.accept), load_acceptance(s.accept))
            continue
        run.say(f"[2/5] acceptance of {kind} ({g.source_dir or 'no model'}) on {len(accept_ids)} held-out prompts")
        depth, width = MEASURE_SHAPE.get(kind, (None, None))
        acc = measure_accuracy(run.model, g, accept_ids, max_new_tokens=s.accept_tokens, progress=s.progress,
                               depth=depth, width=width)
        acc["source"] = (f"planner autotune: {run.loaded.name}, {kind} {_shown(g.source_dir) if g.source_dir else '(no model)'}, "
                         f"{len(accept_ids)} held-out prompts")
        acc["guesser"]["dir"] = _shown(g.source_dir) if g.source_dir else None
        path = atomic_write_json(run.out_dir / f"accept-{kind}.json", acc)
        out[kind] = (path, load_acceptance(str(path)))
    return out


def _plan_phase(run: _Run, accepts: dict, profile: LatencyProfile) -> list[Candidate]:
    s = run.settings
    run.say(f"[3/5] planning {', '.join(accepts)} up to input length {s.max_input_length}")
    candidates = []
    for kind, (_, accept) in accepts.items():
        g = run.guessers[kind]
        if kind == "ppd":
            for m in s.methods:
                candidates += plan_candidates(m, accept, profile, g.num_prompt_tokens, g.ensemble, s.max_input_length)
        else:
            candidates += drafter_candidates(kind, accept, profile, s.max_input_length)
    if not candidates:
        raise UserError(f"--max-input-length {s.max_input_length}: no plan fits")
    return candidates


PEARL_SPLIT = (1, 1)  # target threads, drafter threads: the two cores of this machine, one each


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
    run.say(f"[3/5] PEARL: target and draft LM at threads {split} and {total}, and their overlap")
    ctx = context.to(run.model.device)
    lat = side_latencies(run.model, draft, ctx, range(1, 9), split, total, repeats=5)
    check = split_check(run.model, draft, ctx, 4, split, repeats=3)
    torch.set_num_threads(total)
    eta = max(0.0, min(1.0, check["eta"]))
    cands = pearl_candidates(accepts["draft"][1], lat, eta, plain_step(profile))
    return {"candidates": cands, "split": list(split), "latencies": lat, "split_check": check, "eta": eta}


def _decode_phase(run: _Run, decode_ids: list, tried: list[Candidate]) -> tuple[dict, bool]:
    """Plain decoding and every plan tried, interleaved; every output must equal plain greedy decoding
    (in bf16 a difference at a near tie of the target's top two logits is reported apart: profiler.compare)."""
    from profiler.compare import classify, summarize
    from profiler.measure import warm_up_shapes

    s = run.settings
    run.say(f"[4/5] decoding {len(decode_ids)} held-out prompts x {s.decode_tokens} tokens: plain + {len(tried)} plans, "
            f"{s.rounds} rounds")
    warm_up_shapes(run.model, decode_ids, _step_lengths(run, tried))
    results = measure_decoding(run.model, decode_ids, [None] + tried, run.guessers, s.decode_tokens, s.rounds, s.progress)
    plain = results[0]
    identical = True
    for c, r in zip(tried, results[1:]):
        statuses = [classify(run.model, ids, a.tolist(), b.tolist())["status"]
                    for ids, a, b in zip(decode_ids, plain["outputs"], r["outputs"])]
        counts = summarize(statuses)
        identical &= counts["mismatches"] == 0
        c.measured = {"tokens_per_step": r["tokens_per_step"], "tokens_per_s": r["tokens_per_s"],
                      "speedup": r["tokens_per_s"] / plain["tokens_per_s"],
                      "identical_to_greedy": counts["identical"] == len(statuses), **counts,
                      "steps": r["steps"], "tokens": r["tokens"],
                      "state_frequencies": state_frequencies(c.tree, r["states"])}
    return plain, identical


def _step_lengths(run: _Run, tried: list[Candidate]) -> set[int]:
    """Every forward length the decoding phase will run: plain decoding, each plan's states and bootstrap."""
    w = run.model.get_input_embeddings().weight
    lengths = {1}
    for c in tried:
        if c.guesser == "ppd":
            layouts = run.guessers["ppd"].layouts(c.tree, w.dtype, w.device)
            lengths |= {b.input_length for b in layouts.states.values()} | {layouts.bootstrap.input_length}
        else:
            lengths.add(1 + len(c.tree.states[0].nodes))
            lengths.add(c.size)  # PEARL's post-verify forward
    return lengths


def _row(c: Candidate, path: Path) -> dict:
    return {
        "guesser": c.guesser, "method": c.method, "variant": c.variant, "size": c.size,
        "input_length": round(c.input_length, 3), "planned_input_length": c.tree.max_input_length,
        "draft_s": c.guessing.draft_s, "draft_passes": c.guessing.draft_passes,
        "predicted_tokens_per_step": c.predicted_tokens_per_step,
        "measured_tokens_per_step": c.measured["tokens_per_step"],
        "predicted_speedup": c.predicted_speedup, "measured_speedup": c.measured["speedup"],
        "measured_tokens_per_s": c.measured["tokens_per_s"],
        "identical_to_greedy": c.measured["identical_to_greedy"], "near_ties": c.measured["near_ties"],
        "mismatches": c.measured["mismatches"], "chosen": False, "tree": _shown(path),
        "state_frequencies": c.measured["state_frequencies"],
    }


def _measured_as(kind: str) -> str:
    """The guesser whose acceptance and files a candidate uses (PEARL drafts with the draft LM)."""
    return "draft" if kind == "pearl" else kind


def _write_phase(run: _Run, chosen: Candidate, tried: list[Candidate], plain: dict, identical: bool,
                 profile_path: Path, accepts: dict) -> dict:
    """Every tried tree into the run folder, the chosen one into trees/, and the summary."""
    from profiler.models import dtype_name

    s = run.settings
    rows = []
    for c in tried:
        name = f"{c.guesser}-{c.method}-{c.size}{'-auto' if c.variant == 'per-state budgets' else ''}.json"
        g = run.guessers[_measured_as(c.guesser)]
        c.tree.provenance.update({"accept": _shown(accepts[_measured_as(c.guesser)][0]), "profile": _shown(profile_path),
                                  "autotune": _shown(run.out_dir), "guesser_dir": _shown(g.source_dir) if g.source_dir else None})
        save_tree(c.tree, run.out_dir / "trees" / name)
        rows.append(_row(c, run.out_dir / "trees" / name) | {"chosen": c is chosen})
    chosen_path = Path(s.trees_dir) / f"autotune-{run.device}-{run.loaded.name}.json"
    save_tree(chosen.tree, chosen_path)
    by_measured = sorted(tried, key=lambda c: -c.measured["speedup"])
    best = by_measured[0]
    return {
        "chosen": _shown(chosen_path), "chosen_guesser": chosen.guesser, "chosen_method": chosen.method,
        "chosen_size": chosen.size, "identical_to_greedy": identical,  # no mismatch (near ties counted per row)
        "plain": {"tokens": plain["tokens"], "seconds": plain["seconds"], "tokens_per_s": plain["tokens_per_s"]},
        "prediction_error": chosen.measured["tokens_per_step"] / chosen.predicted_tokens_per_step - 1,
        "best_measured": {"guesser": best.guesser, "method": best.method, "size": best.size,
                          "measured_speedup": best.measured["speedup"]},
        "chosen_measured_rank": by_measured.index(chosen) + 1,  # 1 = the chosen plan was also measured fastest
        "chosen_measured_vs_best": chosen.measured["speedup"] / best.measured["speedup"],
        "rows": rows, "profile": _shown(profile_path),
        "accept": {k: _shown(p) for k, (p, _) in accepts.items()},
        "guessers": {k: _shown(g.source_dir) if g.source_dir else None for k, g in run.guessers.items()},
        "model": run.loaded.name, "device": run.device, "dtype": dtype_name(next(run.model.parameters()).dtype),
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()},
        "wall_s": None,
    }


def _report_phase(run: _Run, summary: dict, profile_path: Path, accepts: dict) -> None:
    from workflows.report import write_report

    specs = [str(p) for k, (p, _) in accepts.items() if k == "ppd"]  # the size curves of the ppd families
    index = write_report(run.out_dir / "report", profiles=[str(profile_path)], accepts=specs,
                         trees=[summary["chosen"]], run_dir=str(run.out_dir))
    summary["report"] = _shown(index)
    atomic_write_json(run.out_dir / "summary.json", summary)
    run.say(f"report: {index}")


def format_table(summary: dict) -> str:
    head = (f"{'guesser':12} {'method':8} {'size':>5} {'n_real':>7} {'tok/step pred':>13} {'meas':>6} "
            f"{'speedup pred':>12} {'meas':>6}  same")
    lines = [head, "-" * len(head)]
    for r in summary["rows"]:
        mark = " *" if r["chosen"] else ""
        method = r["method"] + ("+" if r.get("variant") == "per-state budgets" else "")
        same = "yes" if r["identical_to_greedy"] else ("tie" if not r.get("mismatches") else "NO")
        lines.append(
            f"{r['guesser']:12} {method:8} {r['size']:>5} {r['input_length']:>7.1f} {r['predicted_tokens_per_step']:>13.2f} "
            f"{r['measured_tokens_per_step']:>6.2f} {r['predicted_speedup']:>12.2f} {r['measured_speedup']:>6.2f}  "
            f"{same}{mark}"
        )
    p = summary["plain"]
    lines.append(f"plain decoding: {p['tokens_per_s']:.1f} tokens/s; * = chosen ({summary['chosen']}); "
                 f"outputs identical to greedy: {summary['identical_to_greedy']}")
    lines.append("ppd+ = per-state budgets chosen against the latency profile; ppd = the paper's shared budget; "
                 f"chosen plan's measured rank: {summary['chosen_measured_rank']} of {len(summary['rows'])} "
                 f"({summary['chosen_measured_vs_best']:.2f}x of the best measured)")
    return "\n".join(lines)
