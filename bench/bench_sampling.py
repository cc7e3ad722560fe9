"""Fast when users sample: plans tuned for the user's temperature / top-k / top-p against transformers.

    python bench/bench_sampling.py                     # the committed runs: greedy-tuned and sampling-tuned plans
    python bench/bench_sampling.py --smoke             # the toy model, seconds
    python bench/bench_sampling.py --llama-plan runs/llama-t0.7-p0.9/chosen.json   # with a llama.cpp sampled plan

Two settings users pick, T = 0.7 with top-p 0.9 and T = 1.0 with top-k 50, on benchmark prompts no
tuning step reads (training.splits.bench_prompts: hand-written two-turn chats, answered turn by turn,
and rewrite requests over pasted text), through the model's chat template. Per setting, on the same
prompt ids, interleaved in a shuffled order per (prompt, repeat) after a warm-up, each (prompt,
repeat) with one seed all contenders share:
  generate            transformers' model.generate(do_sample=True) with the same temperature, top_k
                      (0 where top-k is off: transformers' own default would cut at 50) and top_p
  plain loop          this project's plain sampling loop (decoder.generate with PlainGuesser)
  greedy-tuned plan   the plan `planner autotune` chose for greedy decoding, decoding sampled
  sampling-tuned      the plan `planner autotune --temperature T --top-k K --top-p P` chose, with the rule
                      it was raced with (coupled by default: then also
  plain loop, coupled this project's plain loop with coupled draws, whose text a coupled plan must emit,
                      and the greedy-tuned plan coupled, on the same text as the sampling-tuned plan)
and, when llama-cpp-python is installed and the model's GGUF is found (the same weights, Q4_1), the same
settings in llama.cpp:
  llama.cpp generate  llama-cpp-python's own sampling (Llama.generate, seeded per (prompt, repeat)); its
                      sampler chain is top-k, top-p, then temperature, not transformers' temperature,
                      top-k, top-p: at top-p < 1 and T != 1 it keeps another set of tokens (a speed row)
  llama.cpp plain loop  this project's plain sampling loop on the llama.cpp engine
  llama.cpp plan      the plan `planner autotune --engine llama.cpp --temperature ...` chose (--llama-plan,
                      matched to a setting by the sampling it records; a setting without one skips the row)
Outputs of the recursive-rejection rule differ per contender (each samples with its own draws; its
exactness is the distribution tests', tests/test_sampling_rules.py); a coupled plan's outputs are
compared with the coupled plain loop's, token for token. Reported: tokens/s (tokens over seconds, the
median over repeats per prompt), the per-prompt speedup over generate (geometric mean of
tokens-per-second ratios, since sampled answers end at different lengths; with the llama.cpp rows also
over llama.cpp generate) and the mean accepted candidates per step; and the sampling-tuned plan against
each greedy-tuned row paired by prompt, with the sign-flip interval over prompts. This project's loops run the matmul
paths of the profile the sampling-tuned
plan was made with; transformers runs stock. Writes bench/results/sampling.{json,md} (--out) with the machine and load.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch
from bench_main_job import load_plan
from common import Results, bench_main, load_avg, machine, open_hf, sample_load

from planner.errors import UserError
from planner.sampling import Sampling, describe, record, recorded

SETTINGS = {"t0.7-p0.9": Sampling(0.7, 0, 0.9), "t1.0-k50": Sampling(1.0, 50, 1.0)}
REPORTS = ROOT / "reports"
GREEDY_RUN = REPORTS / "autotune-quiet-cpu-smollm2-135m"  # the quiet main job the README quotes
SAMPLED_RUNS = {"t0.7-p0.9": REPORTS / "sampling-autotune-cpu-smollm2-135m-t0.7-p0.9",
                "t1.0-k50": REPORTS / "sampling-autotune-cpu-smollm2-135m-t1.0-k50"}


def build_prompts(engine, tokenizer, n_chat: int, n_repeat: int, first_answer_tokens: int) -> list[tuple[str, torch.Tensor]]:
    """(group, prompt ids): chats whose first turn the engine answers greedily (its stock generation), then
    the second turn; rewrites."""
    from training.splits import bench_prompts

    out = []
    for bp in bench_prompts("chat", n_chat) + bench_prompts("repeat", n_repeat):
        msgs: list[dict] = []
        for i, turn in enumerate(bp.turns):
            msgs.append({"role": "user", "content": turn.strip()})
            ids = _template(tokenizer, msgs)
            if i + 1 < len(bp.turns):
                answer, _ = engine.stock_generate(ids, first_answer_tokens)
                msgs.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
        out.append((bp.group, ids))
    return out


def _template(tokenizer, msgs: list[dict]) -> torch.Tensor:
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]


def contenders(engine, plans: dict, s: Sampling, n: int) -> dict:
    """name -> fn(ids, seed) -> (new token ids, accepted per step or None). transformers' generate(do_sample=True)
    is the engine's stock generation (stock F.linear); this project's loops run the engine's matmul paths."""
    from decoder import Pearl, PlainGuesser, generate

    warp = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}

    def hf(ids, seed):
        return engine.stock_generate(ids, n, s, seed)[0], None

    def plain(ids, seed):
        out = generate(engine, ids, None, PlainGuesser(), max_new_tokens=n, phase_times=False, seed=seed, **warp)
        return out.tokens.tolist(), out.stats.accepted

    def plain_coupled(ids, seed):
        out = generate(engine, ids, None, PlainGuesser(), max_new_tokens=n, phase_times=False, seed=seed, verify_rule="coupled", **warp)
        return out.tokens.tolist(), out.stats.accepted

    def plan_fn(tree, guesser, rule=None):
        rule = rule or ("coupled" if tree.settings.get("verify") == "coupled" else "auto")  # the rule it was raced with

        def run(ids, seed):
            if guesser is None:
                out = generate(engine, ids, None, PlainGuesser(), max_new_tokens=n, phase_times=False, seed=seed, **warp)
            elif tree.settings.get("guesser") == "pearl":
                pearl = Pearl(guesser.drafter, int(tree.settings["pearl"]["gamma"]), threads=(1, 1))
                out = generate(engine, ids, pearl, max_new_tokens=n, seed=seed, **warp)
                return out.tokens.tolist(), None
            else:
                out = generate(engine, ids, plan=tree, guesser=guesser, max_new_tokens=n, phase_times=False, seed=seed,
                               verify_rule=rule, **warp)
            return out.tokens.tolist(), out.stats.accepted
        return run

    runs = {"generate": hf, "plain loop": plain}
    if any(tree.settings.get("verify") == "coupled" for tree, _ in plans.values()):
        runs[COUPLED_PLAIN] = plain_coupled
    runs.update({name: plan_fn(tree, g) for name, (tree, g) in plans.items()})
    if COUPLED_PLAIN in runs:  # every plan on plain sampling's own text too: same-text comparisons
        runs.update({f"{name}, coupled": plan_fn(tree, g, "coupled") for name, (tree, g) in plans.items()
                     if g is not None and tree.settings.get("verify") != "coupled"
                     and tree.settings.get("guesser") != "pearl"})
    return runs


LLAMA_BASE = "llama.cpp generate"
COUPLED_PLAIN = "plain loop, coupled"  # plain sampling with decoder/noise.py's draws: a coupled plan's own text


@dataclass
class LlamaSide:
    """The llama.cpp contenders' engine (its stock generation is llama-cpp-python's own Llama) and the plan
    per setting."""

    engine: object
    plans: dict = field(default_factory=dict)  # setting -> (label, tree, guesser or None)
    weights: str = "the model's Q4_1 GGUF in llama.cpp (transformers runs the fp32 weights converted from it)"


def llama_contenders(side: LlamaSide, key: str, s: Sampling, n: int) -> dict:
    """name -> fn(ids, seed) -> (new token ids, accepted per step or None), as `contenders`. llama.cpp's
    rows keep torch on one thread: its pool spins against llama.cpp's (docs/llama-cpp.md)."""
    from decoder.guesser import PlainGuesser
    from decoder.loop import generate

    warp = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}

    def one_torch_thread(fn):
        def run(ids, seed):
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return fn(ids, seed)
            finally:
                torch.set_num_threads(before)
        return run

    def stock(ids, seed):
        return side.engine.stock_generate(ids, n, s, seed)[0], None

    def loop(tree, guesser):
        def run(ids, seed):
            out = generate(side.engine, ids, plan=tree if guesser else None, guesser=guesser or PlainGuesser(),
                           max_new_tokens=n, phase_times=False, seed=seed, **warp)
            return out.tokens.tolist(), out.stats.accepted
        return run

    runs = {LLAMA_BASE: stock, "llama.cpp plain loop": loop(None, None)}
    if key in side.plans:
        _, tree, guesser = side.plans[key]
        runs["llama.cpp plan"] = loop(tree, guesser)
    return {name: one_torch_thread(fn) for name, fn in runs.items()}


def measure(runs: dict, prompts: list, repeats: int, seed: int, progress: bool) -> dict:
    """Per contender, per prompt: the median tokens/s over repeats, tokens, seconds and accepted per step."""
    rng = random.Random(seed)
    for fn in runs.values():  # warm-up: every contender's shapes once
        fn(prompts[0][1], seed)
    rates = {k: [[] for _ in prompts] for k in runs}
    texts: dict = {k: {} for k in runs}
    tokens = {k: 0 for k in runs}
    seconds = {k: 0.0 for k in runs}
    accepted: dict = {k: [] for k in runs}
    for r in range(repeats):
        for p, (_, ids) in enumerate(prompts):
            order = list(runs)
            rng.shuffle(order)
            s = seed + 1000 * r + p  # one seed per (prompt, repeat), shared by every contender
            for name in order:
                t0 = time.perf_counter()
                toks, acc = runs[name](ids, s)
                dt = time.perf_counter() - t0
                rates[name][p].append(len(toks) / dt)
                texts[name][(r, p)] = list(toks)
                tokens[name] += len(toks)
                seconds[name] += dt
                if acc is not None:
                    accepted[name].extend(acc)
            sample_load()
            if progress:
                print(f"  repeat {r + 1}/{repeats}, prompt {p + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    ref = texts.get(COUPLED_PLAIN)
    return {k: {"rates": [statistics.median(x) for x in rates[k]], "tokens": tokens[k], "seconds": seconds[k],
                "accepted": accepted[k],
                "same_text_as_plain_coupled": None if ref is None else sum(texts[k][i] == ref[i] for i in ref)}
            for k in runs}


def warper_costs(engine, prompts, s: Sampling, rows: int = 64, repeats: int = 5) -> dict:
    """Per sampled token, the bookkeeping around the forward: transformers' warpers (temperature,
    top-k, top-p: a sort of the vocabulary) and torch.multinomial, against decoder.verify's
    probabilities (the top-p cut among the top tokens) and its inverse-CDF draw; median seconds per
    row over `rows` real logits rows, interleaved, after a warm-up. transformers' warpers are the
    library's own code, timed as they are (the hf engine's stock machinery, decoder/engines/hf/stock.py)."""
    from decoder.engines.hf.stock import stock_sampler
    from decoder.verify import draw, probabilities

    ids = prompts[0][1]
    logits = engine.teacher_forced(ids).logits[-rows:].float()  # [rows, V] the model's own distributions
    theirs = stock_sampler(s)
    gen = torch.Generator().manual_seed(0)

    def ours(row):
        return draw(probabilities(row, s), gen)

    times: dict = {"transformers warpers + multinomial": [], "decoder.verify probabilities + draw": []}
    fns = dict(zip(times, (theirs, ours)))
    for fn in fns.values():
        fn(logits[0])
    for _ in range(repeats):
        for name in random.sample(list(fns), len(fns)):
            t0 = time.perf_counter()
            for row in logits:
                fns[name](row)
            times[name].append((time.perf_counter() - t0) / rows)
    return {k: statistics.median(v) for k, v in times.items()}


def summarise(prompts, got: dict) -> dict:
    base = got["generate"]["rates"]
    out = {}
    for name, g in got.items():
        ups = [r / b for r, b in zip(g["rates"], base)]
        if LLAMA_BASE in got:
            vs_llama = _geo([r / b for r, b in zip(g["rates"], got[LLAMA_BASE]["rates"])])
        kinds: dict = {}
        for (kind, _), u in zip(prompts, ups):
            kinds.setdefault(kind, []).append(u)
        acc = g["accepted"]
        out[name] = {"tokens_per_s": g["tokens"] / g["seconds"], "tokens": g["tokens"], "seconds": g["seconds"],
                     "speedup_vs_generate": _geo(ups), "min_speedup": min(ups), "max_speedup": max(ups),
                     "per_prompt_speedup": ups, "by_kind": {k: _geo(v) for k, v in kinds.items()},
                     "mean_accepted": statistics.fmean(acc) if acc else None, "steps": len(acc) or None,
                     "same_text_as_plain_coupled": g.get("same_text_as_plain_coupled")}
        if LLAMA_BASE in got:
            out[name]["speedup_vs_llama_cpp_generate"] = vs_llama
    return out


def paired(got: dict, plan: str = "sampling-tuned") -> dict:
    """The sampling-tuned plan against each greedy-tuned row, prompt by prompt: the geometric mean of
    its per-prompt tokens/s ratio (medians over repeats, the runs interleaved) with the interval that
    inverts the sign-flip test over prompts (workflows.mainjob.signflip, as the race's confirmation)."""
    from workflows.mainjob.signflip import interval, sign_flip_p

    out = {}
    for other in [k for k in got if k.startswith("greedy-tuned plan")]:
        logs = [math.log(a / b) for a, b in zip(got[plan]["rates"], got[other]["rates"])]
        up = interval(logs)
        out[other] = {**up.to_json(), "p_faster": sign_flip_p(logs), "faster_on": sum(x > 0 for x in logs)}
    return out


def _geo(xs) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [(f"# Sampled decoding against transformers' generate(do_sample=True) ({doc['model']}, {m['cpu']}, "
              f"{m['cores']} cores, torch {m['torch']}, {m['torch_threads']} threads)"), "",
             (f"{len(doc['prompts'])} benchmark prompts no tuning step reads ({', '.join(doc['kinds'])}), "
              f"{doc['max_new_tokens']} new tokens, median of {doc['repeats']} interleaved repeats per prompt, one seed "
              "per (prompt, repeat) shared by every contender. Plans: greedy-tuned "
              f"`{doc['greedy_plan']}`; sampling-tuned per setting below. `{doc.get('command', '')}`"), ""]
    for block in doc["settings"].values():
        costs = "; ".join(f"{k} {v * 1e3:.2f} ms" for k, v in block["per_token_warp_and_draw_s"].items())
        llama = LLAMA_BASE in block["results"]
        lines += [f"## {block['label']} (load {block['load_avg_1m']} -> {block['load_avg_1m_after']})", "",
                  (f"sampling-tuned plan: `{block['sampled_plan']}` ({block['sampled_plan_label']}); greedy-tuned "
                   f"plan: {block['greedy_plan_label']}. Warping and drawing one token: {costs}."), "",
                  "| contender | tokens/s | speedup vs generate (geo-mean) | min | max | "
                  + " | ".join(doc["kinds"]) + " | accepted per step |" + (" x llama.cpp generate |" if llama else ""),
                  "|---|---|---|---|---|" + "---|" * len(doc["kinds"]) + "---|" + ("---|" if llama else "")]
        for name, r in block["results"].items():
            acc = "-" if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f}"
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_generate']:.2f}x | {r['min_speedup']:.2f} | "
                         f"{r['max_speedup']:.2f} | " + " | ".join(f"{r['by_kind'].get(k, float('nan')):.2f}x"
                                                                  for k in doc["kinds"]) + f" | {acc} |"
                         + (f" {r['speedup_vs_llama_cpp_generate']:.2f}x |" if llama else ""))
        same = {k: r["same_text_as_plain_coupled"] for k, r in block["results"].items()
                if r.get("same_text_as_plain_coupled") is not None}
        if same:
            runs = doc["repeats"] * len(doc["prompts"])
            lines += ["", "Outputs identical to the coupled plain loop's (decoder/noise.py; one seed per (prompt, repeat)): "
                      + ", ".join(f"{k} {v}/{runs}" for k, v in same.items()) + "."]
        for other, v in block.get("paired", {}).items():
            span = (f"[{v['lo']:.3f}, {v['hi']:.3f}] ({v['level']:.0%} sign-flip interval over {v['prompts']} prompts)"
                    if v["lo"] is not None else f"(no interval: {v['prompts']} prompts are too few)")
            lines += ["", (f"sampling-tuned against {other}, paired by prompt: {v['mean']:.3f}x {span}, faster on "
                           f"{v['faster_on']} of {v['prompts']}, one-sided p = {v['p_faster']:.3f}.")]
        notes = block.get("llama_notes", [])
        lines += [""] + [f"{note}." for note in notes] + ([""] if notes else [])
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--greedy-plan", default=str(GREEDY_RUN / "chosen.json"), help="the plan autotune chose greedily")
    p.add_argument("--sampled-plan", action="append", default=None, metavar="SETTING=FILE",
                   help=f"the plan tuned for SETTING ({', '.join(SETTINGS)}); default: the committed runs'")
    p.add_argument("--settings", default=",".join(SETTINGS), help="which settings to run, comma-separated")
    p.add_argument("--profile", default=None, help="matmul paths for this project's loops (default: the profile the "
                                                   "first sampling-tuned plan was made with)")
    p.add_argument("--chat-prompts", type=int, default=6)
    p.add_argument("--repeat-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-plan", action="append", default=[], metavar="FILE",
                   help="a chosen.json of `planner autotune --engine llama.cpp --temperature ...` (repeatable): the "
                        "'llama.cpp plan' row of the setting it records")
    p.add_argument("--no-llama", action="store_true", help="leave out the llama.cpp rows")
    p.add_argument("--smoke", action="store_true", help="the toy model, 1 + 1 prompts, 8 tokens, 1 repeat, plain plans "
                                                        "(llama.cpp: the model's GGUF, a lookup chain as its plan)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sampling"), help="writes OUT.json and OUT.md")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    return bench_main("bench_sampling", parser(), run, argv)


@dataclass(frozen=True)
class Sizes:
    """What one run measures: the flags, or --smoke's toy-model seconds."""

    keys: list[str]  # the settings run
    model: str
    chat_prompts: int
    repeat_prompts: int
    max_new_tokens: int
    repeats: int


def sizes(a) -> Sizes:
    keys = [s.strip() for s in a.settings.split(",") if s.strip()]
    if not keys or any(s not in SETTINGS for s in keys):
        raise UserError(f"--settings: expected a comma-separated subset of {', '.join(SETTINGS)}")
    z = Sizes(keys, "builtin", 1, 1, 8, 1) if a.smoke else Sizes(keys, a.model, a.chat_prompts, a.repeat_prompts,
                                                                   a.max_new_tokens, a.repeats)
    if not (1 <= z.max_new_tokens <= 2048 and 1 <= z.repeats <= 50 and 0 <= z.chat_prompts <= 24
            and 0 <= z.repeat_prompts <= 64 and z.chat_prompts + z.repeat_prompts >= 1):
        raise UserError("--max-new-tokens 1..2048, --repeats 1..50, --chat-prompts 0..24, --repeat-prompts 0..64 (one at least)")
    return z


def _plans(a, keys: list[str], engine) -> tuple[dict, dict]:
    """(greedy plan, {setting: sampled plan}) as (path, (tree, guesser)) pairs."""
    sampled = {k: str(v / "chosen.json") for k, v in SAMPLED_RUNS.items()}
    for spec in a.sampled_plan or []:
        key, sep, path = spec.partition("=")
        if not sep or key not in SETTINGS:
            raise UserError(f"--sampled-plan {spec}: expected SETTING=FILE with SETTING one of {', '.join(SETTINGS)}")
        sampled[key] = path
    for path in [a.greedy_plan] + [sampled[k] for k in keys]:
        if not Path(path).is_file():
            raise UserError(f"{path}: no such plan (run planner autotune, or give --greedy-plan / --sampled-plan)")
    return (a.greedy_plan, load_plan(a.greedy_plan, engine)), {k: (sampled[k], load_plan(sampled[k], engine)) for k in keys}


def _lookup_chain():
    from planner.tree import MEDUSA, Tree, TreeState

    return Tree(MEDUSA, [TreeState(0, [(0,), (0, 0)], 1.0, 3)], 1.0, settings={"guesser": "lookup"})


def _smoke_plans():
    """The toy model: a lookup chain as the greedy plan, plain decoding as the sampled one (seconds, no runs)."""
    from decoder.guessers.lookup import PromptLookupGuesser
    from planner.tree import MEDUSA, Tree, TreeState

    plain = Tree(MEDUSA, [TreeState(0, [], 1.0, 1)], 1.0, settings={"guesser": "plain"})
    return ("lookup chain", (_lookup_chain(), PromptLookupGuesser(2))), {k: ("plain", (plain, None)) for k in SETTINGS}


def _llama_side(a, keys: list[str]) -> LlamaSide | None:
    """llama.cpp's engine, its own Llama and the plans, or None (with the reason printed) when
    llama-cpp-python or the model's GGUF is missing, or --no-llama."""
    from decoder.engines.registry import EngineRequest, open_engine

    if a.no_llama:
        return None
    before = torch.get_num_threads()
    try:
        engine = open_engine("llama.cpp", EngineRequest(model="smollm2-135m", threads=a.threads, context=4096,
                                                        progress=False, install=False))
    except UserError as e:
        print(f"bench_sampling: llama.cpp rows skipped: {e}", file=sys.stderr)
        return None
    finally:  # the engine keeps torch on one thread for itself (LlamaEngine); the hf rows run on the machine's
        torch.set_num_threads(before)
    side = LlamaSide(engine)
    if a.smoke:
        from decoder.guessers.lookup import PromptLookupGuesser

        side.plans = {k: ("lookup chain", _lookup_chain(), PromptLookupGuesser(2)) for k in keys}
        side.weights = ("SmolLM2's GGUF in llama.cpp on the toy model's prompt ids (a smoke run: the code paths, "
                        "not speeds)")
        return side
    for path in a.llama_plan:
        key, plan = _llama_plan(path, engine)
        if key in keys:
            side.plans[key] = plan
    return side


def _llama_plan(path: str, engine) -> tuple[str, tuple]:
    """(setting, (label, tree, guesser or None)) of a llama.cpp plan: the setting whose sampling it records."""
    from decoder.guessers.registry import LoadRequest, load_guesser
    from planner.engines import DEFAULT
    from planner.tree import load_tree

    tree = load_tree(path)
    if (tree.engine or DEFAULT) != engine.caps.name:
        raise UserError(f"--llama-plan {path}: made for the {tree.engine or DEFAULT} engine, not {engine.caps.name}")
    rec = recorded(tree.settings) or record(Sampling())
    key = next((k for k, s in SETTINGS.items() if record(s) == rec), None)
    if key is None:
        raise UserError(f"--llama-plan {path}: tuned for {describe(rec)}, none of the settings benchmarked "
                        f"({'; '.join(f'{k}: {describe(record(s))}' for k, s in SETTINGS.items())})")
    kind = tree.settings.get("guesser", "plain")
    guesser = None if kind == "plain" else load_guesser(kind, LoadRequest(engine, depth=8))
    return key, (f"{path} ({kind} {tree.method})" if guesser else f"{path} (plain decoding)", tree, guesser)


def _llama_notes(side: LlamaSide | None, key: str) -> list[str]:
    if side is None:
        return []
    notes = [f"llama.cpp rows: {side.weights}; llama.cpp generate samples with llama.cpp's own chain, top-k, top-p, "
             "then temperature, where transformers and this project apply temperature first: at top-p < 1 and T != 1 "
             "its kept set differs"]
    if key in side.plans:
        notes.append(f"llama.cpp plan: {side.plans[key][0]}")
    else:
        notes.append(f"llama.cpp plan: skipped, no --llama-plan tuned for {describe(record(SETTINGS[key]))} "
                     "(planner autotune --engine llama.cpp with these settings writes one)")
    return notes


def _profile_of(plan_path: str) -> str | None:
    """The profile a plan was made with (its provenance, else its run folder's profile.json)."""
    from planner.tree import load_tree

    if not Path(plan_path).is_file():
        return None
    rec = load_tree(plan_path).provenance.get("profile")
    for cand in ([rec] if isinstance(rec, str) else []) + [str(Path(plan_path).parent / "profile.json")]:
        if Path(cand).is_file():
            return cand
    return None


def _label(tree, guesser) -> str:
    if guesser is None:
        return "plain decoding"
    return f"{tree.settings.get('guesser')} {tree.method}"


def run(a) -> Results:
    z = sizes(a)
    engine = open_hf(z.model, threads=a.threads)
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None) is None:  # the toy model: its own "USER: ... ASSISTANT:" format
        tok.chat_template = ("{% for m in messages %}{{ m['role'].upper() }}: {{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    greedy, sampled = _smoke_plans() if a.smoke else _plans(a, z.keys, engine)
    llama = _llama_side(a, z.keys)
    profile = a.profile or next(filter(None, (_profile_of(p) for p, _ in list(sampled.values()) + [greedy])), None)
    if profile:
        engine.use_matmul_paths(profile)
    doc = {"model": engine.model_name, "greedy_plan": greedy[0], "profile": profile, "machine": machine(),
           "command": "python3 bench/bench_sampling.py " + " ".join(sys.argv[1:]),
           "max_new_tokens": z.max_new_tokens, "repeats": z.repeats, "seed": a.seed, "settings": {}}
    with torch.inference_mode():
        prompts = build_prompts(engine, tok, z.chat_prompts, z.repeat_prompts, 16 if a.smoke else 64)
        for key in z.keys:
            s = SETTINGS[key]
            load0 = load_avg()
            plans = {"greedy-tuned plan": greedy[1], "sampling-tuned": sampled[key][1]}
            runs = contenders(engine, plans, s, z.max_new_tokens)
            if llama is not None:
                runs.update(llama_contenders(llama, key, s, z.max_new_tokens))
            notes = _llama_notes(llama, key)
            for note in notes[1:]:
                print(f"bench_sampling: {note}", file=sys.stderr)
            got = measure(runs, prompts, z.repeats, a.seed, not a.no_progress)
            costs = warper_costs(engine, prompts, s)
            doc["settings"][key] = {"label": describe(record(s)), "sampling": record(s), "sampled_plan": sampled[key][0],
                                    "per_token_warp_and_draw_s": costs,
                                    "sampled_plan_label": _label(*sampled[key][1]),
                                    "greedy_plan_label": _label(*greedy[1]), "load_avg_1m": load0,
                                    "load_avg_1m_after": load_avg(),
                                    "results": summarise(prompts, got), "paired": paired(got), "llama_notes": notes}
    doc["kinds"] = sorted({k for k, _ in prompts})
    doc["prompts"] = [{"kind": k, "length": int(i.numel())} for k, i in prompts]
    out = Path(a.out)
    md = markdown(doc)
    return Results({out.with_suffix(".json"): doc, out.with_suffix(".md"): md}, md)


if __name__ == "__main__":
    sys.exit(main())
