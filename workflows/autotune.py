"""The main job: profile this machine, measure acceptance, plan trees, verify them by decoding, report.

    from workflows.autotune import AutotuneSettings, autotune
    summary = autotune(AutotuneSettings())          # the built-in model on the best device

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
from planner.cost import Guessing, input_lengths, mean_input_length, predict
from planner.errors import UserError
from planner.jsonio import atomic_write_json
from planner.plan import plan
from planner.profile import LatencyProfile, load_profile
from planner.tree import Tree, save_tree
from workflows.inputs import DEFAULT_QUESTIONS, encode_prompts, held_out_prompts

REPO = Path(__file__).resolve().parents[1]
BUILTIN_PROMPT_TOKENS = REPO / "models" / "builtin" / "prompt_tokens"
METHODS = ("ppd", "medusa", "sequoia")


@dataclass
class AutotuneSettings:
    model: str = "builtin"
    prompt_tokens: str | None = None  # a PromptTokens directory; default: the built-in model's
    device: str | None = None
    dtype: str | None = None
    out: str | None = None  # run folder; default runs/<date>-<device>-<model>
    questions: str = str(DEFAULT_QUESTIONS)
    accept_prompts: int = 8  # held-out prompts to measure acceptance on
    decode_prompts: int = 8  # other held-out prompts to decode
    accept_tokens: int = 96  # greedy tokens per prompt when measuring acceptance
    decode_tokens: int = 64  # new tokens per prompt when decoding
    max_input_length: int = 64  # largest forward pass planned and profiled
    context_length: int = 128  # cache length the profile is taken at (a typical prompt + answer here)
    methods: tuple[str, ...] = METHODS
    neighbours: int = 2  # sizes either side of the chosen one that are also decoded
    rounds: int = 3  # decoding repeats; each (plan, prompt) time is the median
    threads: int | None = None  # CPU threads for torch (default: torch's choice)
    profile: str | None = None  # reuse a profile file instead of measuring
    accept: str | None = None  # reuse an acceptance file instead of measuring
    profile_budget_s: float = 40.0
    trees_dir: str = str(REPO / "trees")
    report: bool = True
    progress: bool = True


@dataclass
class Candidate:
    """One plan the autotune considers: its tree and the model's prediction for this machine."""

    method: str
    tree: Tree
    size: int  # candidates (medusa/sequoia) or planned input length (ppd)
    input_length: float  # real forward length in the decoder (amortised over states for ppd)
    predicted_tokens_per_step: float
    predicted_speedup: float
    variant: str = ""  # ppd: "shared budget" (the paper's) or "per-state budgets" (hardware-aware)
    measured: dict = field(default_factory=dict)


# ------------------------------------------------------------------ planning


def real_input_length(tree: Tree, ensemble: int) -> float:
    """Tokens in the decoder's forward pass with prompt-token guessers, amortised over states."""
    return mean_input_length(tree, Guessing(prompt_tokens=True, ensemble=ensemble))


def plan_candidates(method: str, accept: Acceptance, profile: LatencyProfile, prompt_tokens: int, ensemble: int,
                    max_input_length: int) -> list[Candidate]:
    """Every size of `method` whose real forward pass fits `max_input_length`, with its prediction."""
    out = []
    if method == "ppd":
        # The paper's shared budget gives a real size sweep (every state spends up to n tokens);
        # the planner's hardware-aware tree (each state spends what the latency curve says pays)
        # is one more plan, usually equal in speed to the best of the sweep or better.
        sized = [(n, plan("ppd", accept, input_length=n, prompt_tokens=prompt_tokens), "shared budget")
                 for n in range(1 + prompt_tokens, max_input_length + 1)]
        auto = plan("ppd", accept, profile=profile, prompt_tokens=prompt_tokens, max_input_length=max_input_length,
                    guessing=Guessing(prompt_tokens=True, ensemble=ensemble))
        sized.append((auto.max_input_length, auto, "per-state budgets"))
        seen = set()
        for n, tree, variant in sized:
            sig = _signature(tree)
            if sig in seen or max(input_lengths(tree, Guessing(prompt_tokens=True, ensemble=ensemble))) > max_input_length:
                continue
            seen.add(sig)
            out.append(_candidate(method, tree, n, profile, ensemble, variant))
        return out
    depth = min(prompt_tokens, accept.max_depth or prompt_tokens)
    for size in range(1, max_input_length):
        tree = plan(method, accept, size=size, max_depth=depth)
        if real_input_length(tree, ensemble) > max_input_length:
            break
        out.append(_candidate(method, tree, size, profile, ensemble))
    return out


def _signature(tree: Tree) -> tuple:
    return tuple((st.state, tuple(st.nodes), tuple(st.prompt_tokens or ())) for st in tree.states)


def _candidate(method, tree, size, profile, ensemble, variant="") -> Candidate:
    pred = predict(tree, profile, Guessing(prompt_tokens=True, ensemble=ensemble))
    tree.predicted_speedup = pred.speedup
    return Candidate(method, tree, size, real_input_length(tree, ensemble), pred.tokens_per_step, pred.speedup, variant)


def pick(candidates: list[Candidate], neighbours: int) -> tuple[Candidate, list[Candidate]]:
    """The best predicted candidate overall, plus: the best of every other method and the
    `neighbours` sizes either side of the chosen one in its own method (to check the choice)."""
    best = max(candidates, key=lambda c: c.predicted_speedup)
    same = sorted((c for c in candidates if c.method == best.method), key=lambda c: (c.input_length, c.size))
    i = same.index(best)
    chosen_and_near = same[max(0, i - neighbours): i + neighbours + 1]
    step = max(1, len(same) // 8)  # and a coarse sweep of the chosen method, to see the curve's shape
    sweep = same[::step]
    others = []
    for m in dict.fromkeys(c.method for c in candidates):
        if m != best.method:
            others.append(max((c for c in candidates if c.method == m), key=lambda c: c.predicted_speedup))
    tried = list({id(c): c for c in chosen_and_near + sweep + others}.values())
    tried.sort(key=lambda c: (c.method != best.method, c.method, c.size))
    return best, tried


# ------------------------------------------------------------------ measuring


def measure_decoding(model, prompts, plans: list[Candidate | None], guesser, max_new_tokens: int, rounds: int = 2,
                     progress: bool = True) -> list[dict]:
    """Decode every prompt with every plan (None: plain decoding), interleaved.

    Plans run in a shuffled order per prompt and round, so a slow spell of the machine (clock
    changes, another process) spreads over all of them instead of biasing one; each (plan, prompt)
    time is the median over rounds. Returns per plan: tokens, steps, seconds, outputs.
    """
    import random

    from tqdm import tqdm

    from decoder import generate, generate_plain

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
                else:
                    out = generate(model, ids, plan=plans[i].tree, guesser=guesser, max_new_tokens=max_new_tokens,
                                   phase_times=False)
                times[i][p].append(time.perf_counter() - t0)
                if r == 0:
                    results[i]["tokens"] += int(out.tokens.numel())
                    results[i]["steps"] += int(out.steps)
                    results[i]["outputs"].append(out.tokens.cpu())
                    results[i]["states"] += [st for st in out.stats.states if st >= 0]  # -1: bootstrap step
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
    guesser: object  # PromptTokens
    tokenizer: object
    device: str
    out_dir: Path
    say: object  # print, or a no-op when quiet

    @property
    def model(self):
        return self.loaded.model


def autotune(s: AutotuneSettings) -> dict:
    """Profile, measure acceptance, plan every method, decode, write; returns the summary."""
    t_start = time.time()
    run = _open_run(s)
    accept_texts, decode_texts = held_out_prompts(s.questions, s.accept_prompts, s.decode_prompts)
    accept_ids, decode_ids = encode_prompts(run.tokenizer, accept_texts), encode_prompts(run.tokenizer, decode_texts)
    profile_path, profile = _profile_phase(run)
    accept_path, accept = _acceptance_phase(run, accept_ids)
    candidates = _plan_phase(run, accept, profile)
    chosen, tried = pick(candidates, s.neighbours)
    plain, identical = _decode_phase(run, decode_ids, tried, chosen)
    summary = _write_phase(run, chosen, tried, plain, identical, profile_path, accept_path)
    summary["wall_s"] = time.time() - t_start
    atomic_write_json(run.out_dir / "summary.json", summary)
    run.say(format_table(summary))
    if s.report:
        _report_phase(run, summary, profile_path, accept_path)
    run.say(f"run folder: {run.out_dir}  ({summary['wall_s']:.0f} s)")
    return summary


def _open_run(s: AutotuneSettings) -> _Run:
    import torch
    from transformers import AutoTokenizer

    from decoder import PromptTokens
    from profiler.models import default_device, load_model

    if s.threads:
        torch.set_num_threads(s.threads)
    device = s.device or default_device()
    loaded = load_model(s.model, device=device, dtype=s.dtype)
    pt_dir = s.prompt_tokens or (str(BUILTIN_PROMPT_TOKENS) if s.model == "builtin" else None)
    if pt_dir is None:
        raise UserError("--prompt-tokens: needed with --model other than builtin (train them with `planner train-prompts`)")
    guesser = PromptTokens.load(pt_dir, model=loaded.model)
    guesser.source_dir = pt_dir
    if loaded.tokenizer_dir is None:
        raise UserError(f"--model {s.model}: no tokenizer files found; autotune decodes text prompts")
    tokenizer = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    out_dir = Path(s.out) if s.out else _default_out(device, loaded.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    say = print if s.progress else (lambda *a, **k: None)
    return _Run(s, loaded, guesser, tokenizer, device, out_dir, say)


def _profile_phase(run: _Run) -> tuple[Path, LatencyProfile]:
    from profiler.measure import profile_model

    s = run.settings
    if s.profile:
        path = Path(s.profile)
    else:
        run.say(f"[1/5] profiling {run.loaded.name} on {run.device}: input lengths 1..{s.max_input_length}, "
                f"context {s.context_length}")
        prof = profile_model(run.loaded, list(range(1, s.max_input_length + 1)), context_length=s.context_length,
                             time_budget_s=s.profile_budget_s, progress=s.progress)
        path = atomic_write_json(run.out_dir / "profile.json", prof)
    profile = load_profile(str(path))
    if profile.max_input_length < s.max_input_length:
        raise UserError(f"{path}: profiled up to {profile.max_input_length} tokens, --max-input-length is {s.max_input_length}")
    return path, profile


def _acceptance_phase(run: _Run, accept_ids: list) -> tuple[Path, Acceptance]:
    from profiler.acceptance import measure_accuracy

    s = run.settings
    if s.accept:
        path = Path(s.accept)
    else:
        run.say(f"[2/5] measuring acceptance of {run.guesser.num_prompt_tokens} prompt tokens on {len(accept_ids)} "
                "held-out prompts")
        acc = measure_accuracy(run.model, run.guesser, accept_ids, max_new_tokens=s.accept_tokens, progress=s.progress)
        acc["source"] = (f"planner autotune: {run.loaded.name}, prompt tokens {run.guesser.source_dir}, "
                         f"{len(accept_ids)} held-out MT-bench prompts")
        path = atomic_write_json(run.out_dir / "accept.json", acc)
    return path, load_acceptance(str(path))


def _plan_phase(run: _Run, accept: Acceptance, profile: LatencyProfile) -> list[Candidate]:
    s = run.settings
    P, E = run.guesser.num_prompt_tokens, run.guesser.ensemble
    run.say(f"[3/5] planning {', '.join(s.methods)} up to input length {s.max_input_length}")
    candidates = []
    for m in s.methods:
        candidates += plan_candidates(m, accept, profile, P, E, s.max_input_length)
    if not candidates:
        raise UserError(f"--max-input-length {s.max_input_length}: no plan fits (prompt tokens need {1 + P * E})")
    return candidates


def _decode_phase(run: _Run, decode_ids: list, tried: list[Candidate], chosen: Candidate) -> tuple[dict, bool]:
    """Plain decoding and every plan tried, interleaved; every output must equal plain greedy decoding
    (in bf16 a difference at a near tie of the target's top two logits is reported apart: profiler.compare)."""
    from profiler.compare import classify, summarize
    from profiler.measure import warm_up_shapes

    s = run.settings
    run.say(f"[4/5] decoding {len(decode_ids)} held-out prompts x {s.decode_tokens} tokens: plain + {len(tried)} plans, "
            f"{s.rounds} rounds")
    warm_up_shapes(run.model, decode_ids, _step_lengths(run, tried))
    results = measure_decoding(run.model, decode_ids, [None] + tried, run.guesser, s.decode_tokens, s.rounds, s.progress)
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
        layouts = run.guesser.layouts(c.tree, w.dtype, w.device)
        lengths |= {b.input_length for b in layouts.states.values()} | {layouts.bootstrap.input_length}
    return lengths


def _row(c: Candidate, path: Path) -> dict:
    return {
        "method": c.method, "variant": c.variant, "size": c.size, "input_length": round(c.input_length, 3),
        "planned_input_length": c.tree.max_input_length,
        "predicted_tokens_per_step": c.predicted_tokens_per_step,
        "measured_tokens_per_step": c.measured["tokens_per_step"],
        "predicted_speedup": c.predicted_speedup, "measured_speedup": c.measured["speedup"],
        "measured_tokens_per_s": c.measured["tokens_per_s"],
        "identical_to_greedy": c.measured["identical_to_greedy"], "near_ties": c.measured["near_ties"],
        "mismatches": c.measured["mismatches"], "chosen": False, "tree": _shown(path),
        "state_frequencies": c.measured["state_frequencies"],
    }


def _write_phase(run: _Run, chosen: Candidate, tried: list[Candidate], plain: dict, identical: bool,
                 profile_path: Path, accept_path: Path) -> dict:
    """Every tried tree into the run folder, the chosen one into trees/, and the summary."""
    from profiler.models import dtype_name

    s = run.settings
    rows = []
    for c in tried:
        path = run.out_dir / "trees" / f"{c.method}-{c.size}{'-auto' if c.variant == 'per-state budgets' else ''}.json"
        c.tree.provenance.update({"accept": _shown(accept_path), "profile": _shown(profile_path),
                                  "autotune": _shown(run.out_dir)})
        save_tree(c.tree, path)
        rows.append(_row(c, path) | {"chosen": c is chosen})
    chosen_path = Path(s.trees_dir) / f"autotune-{run.device}-{run.loaded.name}.json"
    save_tree(chosen.tree, chosen_path)
    by_measured = sorted(tried, key=lambda c: -c.measured["speedup"])
    best = by_measured[0]
    return {
        "chosen": _shown(chosen_path),
        "chosen_method": chosen.method,
        "chosen_size": chosen.size,
        "identical_to_greedy": identical,  # no mismatch (near ties, if any, are counted per row)
        "plain": {"tokens": plain["tokens"], "seconds": plain["seconds"], "tokens_per_s": plain["tokens_per_s"]},
        "prediction_error": chosen.measured["tokens_per_step"] / chosen.predicted_tokens_per_step - 1,
        "best_measured": {"method": best.method, "size": best.size, "measured_speedup": best.measured["speedup"]},
        "chosen_measured_rank": by_measured.index(chosen) + 1,  # 1 = the chosen plan was also measured fastest
        "chosen_measured_vs_best": chosen.measured["speedup"] / best.measured["speedup"],
        "rows": rows,
        "profile": _shown(profile_path),
        "accept": _shown(accept_path),
        "model": run.loaded.name,
        "device": run.device,
        "dtype": dtype_name(next(run.model.parameters()).dtype),
        "prompt_tokens": {"dir": _shown(run.guesser.source_dir), "P": run.guesser.num_prompt_tokens,
                          "E": run.guesser.ensemble},
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()},
        "wall_s": None,
    }


def _report_phase(run: _Run, summary: dict, profile_path: Path, accept_path: Path) -> None:
    from workflows.report import write_report

    index = write_report(run.out_dir / "report", profiles=[str(profile_path)], accepts=[str(accept_path)],
                         trees=[summary["chosen"]], run_dir=str(run.out_dir))
    summary["report"] = _shown(index)
    atomic_write_json(run.out_dir / "summary.json", summary)
    run.say(f"report: {index}")


def format_table(summary: dict) -> str:
    head = f"{'method':8} {'size':>5} {'n_real':>7} {'tok/step pred':>13} {'meas':>6} {'speedup pred':>12} {'meas':>6}  same"
    lines = [head, "-" * len(head)]
    for r in summary["rows"]:
        mark = " *" if r["chosen"] else ""
        method = r["method"] + ("+" if r.get("variant") == "per-state budgets" else "")
        lines.append(
            f"{method:8} {r['size']:>5} {r['input_length']:>7.1f} {r['predicted_tokens_per_step']:>13.2f} "
            f"{r['measured_tokens_per_step']:>6.2f} {r['predicted_speedup']:>12.2f} {r['measured_speedup']:>6.2f}  "
            f"{'yes' if r['identical_to_greedy'] else 'NO'}{mark}"
        )
    p = summary["plain"]
    lines.append(f"plain decoding: {p['tokens_per_s']:.1f} tokens/s; * = chosen ({summary['chosen']}); "
                 f"outputs identical to greedy: {summary['identical_to_greedy']}")
    lines.append("ppd+ = per-state budgets chosen against the latency profile; ppd = the paper's shared budget; "
                 f"chosen plan's measured rank: {summary['chosen_measured_rank']} of {len(summary['rows'])} "
                 f"({summary['chosen_measured_vs_best']:.2f}x of the best measured)")
    return "\n".join(lines)
