"""The main job's decision against transformers' `model.generate`, on prompts the autotuner never saw.

    python bench/bench_main_job.py --run runs/<autotune run>          # its chosen.json
    python bench/bench_main_job.py --plan trees/x.json                 # any plan with a recorded guesser
    python bench/bench_main_job.py --smoke                             # the toy model, seconds

Prompts (none of them decoded by autotune, which sees only the first turns of the held-out
MT-bench questions): second turns of those questions after the model's own greedy first answer
(a real two-turn chat), and "summarise" / "rewrite" requests over passages of OpenWebText (answers
that repeat their input, where copying guessers shine). On the same prompt ids, interleaved in a
shuffled order per repeat after a warm-up, medians over `--repeats`:
  generate          transformers' model.generate, greedy (the baseline a user compares with)
  generate+lookup   the same with prompt_lookup_num_tokens=10 (transformers' own speculation)
  plain loop        this project's plain decoding loop (decoder.generate_plain)
  chosen            the plan (decoder.generate with its recorded guesser; PEARL; or plain)
This project's loops run the matmul paths of the run's profile (--profile; decoder/cpu_paths.py),
transformers runs stock.
Reports tokens/s per contender, per-prompt speedup over generate (geometric mean, min, max) and
whether every output equals generate's (a difference may only be a near tie, profiler.compare).
Writes bench/results/main_job.{json,md} (--out) with the machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from planner.errors import UserError  # noqa: E402

SHARED = ROOT / ".." / "shared" / "data"


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.machine())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


# ---------------------------------------------------------------------------------------------- prompts


def passages(n: int, chars: int = 700) -> list[str]:
    """OpenWebText passages (shared data), cut at a sentence end near `chars`."""
    out = []
    for line in (SHARED / "openwebtext_eval.jsonl").read_text().splitlines():
        text = json.loads(line).get("text", "").strip()
        if len(text) < chars:
            continue
        cut = text[:chars]
        out.append(cut[: cut.rfind(". ") + 1] or cut)
        if len(out) == n:
            break
    return out


REQUESTS = ("Summarise the following text in a few sentences.\n\n{}",
            "Rewrite the following text in simpler words, keeping every fact.\n\n{}")


def build_prompts(model, tokenizer, n_chat: int, n_copy: int, first_answer_tokens: int,
                  chars: int = 700) -> list[tuple[str, torch.Tensor]]:
    """(kind, prompt ids): two-turn chats on held-out questions and copy-heavy requests."""
    from workflows.inputs import DEFAULT_QUESTIONS
    from training.data import held_out_question

    rows = [json.loads(x) for x in Path(DEFAULT_QUESTIONS).read_text().splitlines() if x.strip()]
    held = [r for r in rows if held_out_question(int(r["question_id"])) and len(r["turns"]) > 1][:n_chat]
    out = []
    for r in held:
        first = tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                              tokenize=False)
        ids = tokenizer(first, return_tensors="pt", add_special_tokens=False).input_ids
        answer = model.generate(ids, max_new_tokens=first_answer_tokens, do_sample=False)[0, ids.shape[1]:]
        chat = [{"role": "user", "content": r["turns"][0]},
                {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                {"role": "user", "content": r["turns"][1]}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append(("chat turn 2", tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]))
    for i, p in enumerate(passages(n_copy, chars)):
        msg = [{"role": "user", "content": REQUESTS[i % 2].format(p)}]
        text = tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
        out.append(("summarise/rewrite", tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]))
    return out


# ---------------------------------------------------------------------------------------------- contenders


def load_plan(path: str, loaded):
    """The plan and the guesser it records (autotune writes both); None guesser for plain/PEARL."""
    from planner.tree import load_tree
    from workflows.cmd_decode import _recorded_guesser
    from workflows.inputs import make_guesser

    tree = load_tree(path)
    kind = tree.settings.get("guesser")
    if kind is None:
        raise UserError(f"{path}: the plan records no guesser (settings.guesser); autotune's plans do")
    if kind == "plain":
        return tree, None
    if kind == "pearl":
        where = tree.provenance.get("guesser_dir")
        spec = f"draft:{where}" if isinstance(where, str) else "draft"
    else:
        spec = _recorded_guesser(tree)
    args = SimpleNamespace(guesser=spec, prompt_tokens=None, random_prompt_tokens=None, ensemble=1, top_k_guesses=10)
    return tree, make_guesser(args, loaded, loaded.name)


def contenders(model, tree, guesser, n: int, eos) -> dict:
    """name -> fn(ids [T]) -> list of new token ids. transformers runs stock (F.linear in every
    Linear); this project's loops run the matmul paths the profile chose, if any are installed."""
    from decoder import generate, generate_plain
    from decoder.cpu_paths import set_paths_enabled
    from decoder.pearl import generate_pearl

    def ours(fn):
        def run(ids):
            set_paths_enabled(model, True)
            return fn(ids)
        return run

    def hf(**extra):
        def run(ids):
            set_paths_enabled(model, False)
            out = model.generate(ids[None], max_new_tokens=n, do_sample=False, eos_token_id=eos, **extra)
            return out[0, ids.numel():].tolist()
        return run

    def chosen(ids):
        if guesser is None:
            return generate_plain(model, ids, max_new_tokens=n, phase_times=False).tokens.tolist()
        if tree.settings.get("guesser") == "pearl":
            return generate_pearl(model, guesser.draft_model, ids, gamma=int(tree.settings["pearl"]["gamma"]),
                                  max_new_tokens=n, threads=(1, 1)).tokens.tolist()
        return generate(model, ids, plan=tree, guesser=guesser, max_new_tokens=n, phase_times=False).tokens.tolist()

    return {"generate": hf(), "generate+lookup": hf(prompt_lookup_num_tokens=10),
            "plain loop": ours(lambda ids: generate_plain(model, ids, max_new_tokens=n, phase_times=False).tokens.tolist()),
            "chosen": ours(chosen)}


def measure(runs: dict, prompts: list, repeats: int, seed: int = 0, progress: bool = True) -> tuple[dict, dict]:
    """Seconds [name][prompt] (median over repeats) and the first run's tokens, interleaved."""
    rng = random.Random(seed)
    times = {k: [[] for _ in prompts] for k in runs}
    tokens = {k: [None] * len(prompts) for k in runs}
    for name, fn in runs.items():  # warm-up: every contender's shapes once
        fn(prompts[0][1])
    for r in range(repeats):
        for p, (_, ids) in enumerate(prompts):
            order = list(runs)
            rng.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                out = runs[name](ids)
                times[name][p].append(time.perf_counter() - t0)
                if tokens[name][p] is None:
                    tokens[name][p] = out
            if progress:
                print(f"  repeat {r + 1}/{repeats}, prompt {p + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    return {k: [statistics.median(t) for t in v] for k, v in times.items()}, tokens


def summarise(model, prompts, secs: dict, tokens: dict) -> dict:
    from profiler.compare import classify

    base = secs["generate"]
    out = {}
    for name in secs:
        ups = [b / s for b, s in zip(base, secs[name])]
        status = [classify(model, ids, tokens["generate"][p], tokens[name][p])["status"] for p, (_, ids) in enumerate(prompts)]
        n_tok = sum(len(t) for t in tokens[name])
        out[name] = {"tokens_per_s": n_tok / sum(secs[name]), "tokens": n_tok, "seconds": sum(secs[name]),
                     "speedup_vs_generate": math.exp(statistics.fmean(math.log(u) for u in ups)),
                     "min_speedup": min(ups), "max_speedup": max(ups), "per_prompt_speedup": ups,
                     "identical": status.count("identical"), "near_ties": status.count("near_tie"),
                     "mismatches": status.count("mismatch")}
        kinds = {}
        for (kind, _), u in zip(prompts, ups):
            kinds.setdefault(kind, []).append(u)
        out[name]["by_kind"] = {k: math.exp(statistics.fmean(math.log(u) for u in v)) for k, v in kinds.items()}
    return out


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# The main job's decision vs transformers' generate ({doc['model']}, {m['cpu']}, {m['cores']} cores, "
             f"torch {m['torch']}, load {m['load_avg_1m']} -> {doc['load_avg_1m_after']})", "",
             f"Plan: `{doc['plan']}` ({doc['plan_label']}); {len(doc['prompts'])} prompts the autotuner never saw, "
             f"{doc['max_new_tokens']} new tokens, median of {doc['repeats']} interleaved repeats.", "",
             "| contender | tokens/s | speedup vs generate (geo-mean) | min | max | " + " | ".join(doc["kinds"]) +
             " | same as generate |", "|---|---|---|---|---|" + "---|" * len(doc["kinds"]) + "---|"]
    for name, r in doc["results"].items():
        same = f"{r['identical']} + {r['near_ties']} near ties" if r["near_ties"] else f"{r['identical']}"
        same += f", {r['mismatches']} DIFFER" if r["mismatches"] else ""
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_generate']:.2f}x | {r['min_speedup']:.2f} | "
                     f"{r['max_speedup']:.2f} | " + " | ".join(f"{r['by_kind'].get(k, float('nan')):.2f}x" for k in doc["kinds"])
                     + f" | {same} / {len(doc['prompts'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", help="an autotune run folder (its chosen.json)")
    src.add_argument("--plan", help="a plan file with a recorded guesser")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--profile", default=None,
                   help="the profile whose matmul paths this project's loops run (default: the run's profile.json)")
    p.add_argument("--chat-prompts", type=int, default=8)
    p.add_argument("--copy-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="the toy model, 2 + 2 prompts, 12 tokens, 1 repeat")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "main_job"), help="writes OUT.json and OUT.md")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:
        return _run(a)
    except UserError as e:
        print(f"bench_main_job: error: {e}", file=sys.stderr)
        return 2


def _run(a) -> int:
    from transformers import AutoTokenizer

    from planner.jsonio import atomic_write_json
    from profiler.models import load_model

    if a.smoke:
        a.model, a.chat_prompts, a.copy_prompts, a.max_new_tokens, a.repeats = "builtin", 2, 2, 12, 1
    if not (1 <= a.max_new_tokens <= 2048 and 1 <= a.repeats <= 50 and 0 <= a.chat_prompts <= 16
            and 0 <= a.copy_prompts <= 64 and a.chat_prompts + a.copy_prompts >= 1):
        raise UserError("--max-new-tokens 1..2048, --repeats 1..50, --chat-prompts 0..16, --copy-prompts 0..64 (one at least)")
    if a.threads:
        torch.set_num_threads(a.threads)
    plan = a.plan or (str(Path(a.run) / "chosen.json") if a.run else None)
    loaded = load_model(a.model, device="cpu")
    model = loaded.model
    tok = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    if getattr(tok, "chat_template", None) is None:  # the toy model: its own "USER: ... ASSISTANT:" format
        tok.chat_template = ("{% for m in messages %}{{ m['role'].upper() }}: {{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    tree, guesser = load_plan(plan, loaded) if plan else (None, None)
    profile = a.profile or (str(Path(a.run) / "profile.json") if a.run else None)
    if profile:
        from decoder.cpu_paths import installed_bytes, use_profile_paths

        use_profile_paths(model, profile)
        print(f"matmul paths from {profile}: {installed_bytes(model) / 2**20:.0f} MiB of extra layouts", file=sys.stderr)
    label = "plain decoding" if guesser is None else f"{tree.settings.get('guesser')} {tree.method} ({len(tree.states[0].nodes)} nodes)"
    load0 = round(os.getloadavg()[0], 2)
    with torch.inference_mode():
        prompts = build_prompts(model, tok, a.chat_prompts, a.copy_prompts, 16 if a.smoke else 64, 200 if a.smoke else 700)
        eos = model.generation_config.eos_token_id
        secs, tokens = measure(contenders(model, tree, guesser, a.max_new_tokens, eos), prompts, a.repeats,
                               progress=not a.no_progress)
        results = summarise(model, prompts, secs, tokens)
    doc = {"model": loaded.name, "plan": plan, "plan_label": label, "profile": profile, "machine": machine() | {"load_avg_1m": load0},
           "load_avg_1m_after": round(os.getloadavg()[0], 2), "max_new_tokens": a.max_new_tokens, "repeats": a.repeats,
           "kinds": sorted({k for k, _ in prompts}), "prompts": [{"kind": k, "length": int(i.numel())} for k, i in prompts],
           "results": results}
    out = Path(a.out)
    atomic_write_json(out.with_suffix(".json"), doc)
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
