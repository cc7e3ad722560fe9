"""Where guessing would win in llama.cpp on this CPU: plans and predicted speedups for model sizes without
their weights, beside SmolLM2's measured ones (predictions from measured L(n), no decoding).

    python3 -m planner profile --engine llama.cpp --model llama-3.2-1b -o profiles/cpu-llama.cpp-llama-3.2-1b-random-Q4_K.json
    python3 -m planner profile --engine llama.cpp --model llama-3-8b --input-lengths 1:4,6,8 -o profiles/cpu-llama.cpp-llama-3-8b-random-Q4_K.json
    python3 bench/llama_presets.py --profile smollm2=runs/llama/profile.json \\
        --profile llama-3.2-1b=profiles/cpu-llama.cpp-llama-3.2-1b-random-Q4_K.json \\
        --profile llama-3-8b=profiles/cpu-llama.cpp-llama-3-8b-random-Q4_K.json --lookup runs/llama/accept-lookup.json

Acceptance, each priced on every profile (chains only: llama.cpp scores chains, docs/llama-cpp.md):
  lookup (SmolLM2, measured)     prompt lookup's rank-0 rows measured in llama.cpp (--lookup)
  medusa heads (Vicuna-7B)       the published acceptance of Medusa heads on Vicuna-7B (rank-0 chain); a
                                 stand-in for a draft that llama-server's EAGLE-3 / MTP types would give
  lookup ceiling (Vicuna-7B)     an oracle that knows how many of lookup's guesses are right, on a 7B
                                 model's real MT-bench answers (tokenised with SmolLM2's tokenizer)
For each: the best chain length and its predicted speedup over plain decoding (planner.cost, with the
profile's L(n) and per-step overhead). Writes bench/results/llama_presets.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import Results, bench_main  # noqa: E402

from planner.errors import UserError  # noqa: E402


def best_chain(accept, profile, max_depth: int = 8) -> dict:
    from planner.cost import Guessing, predict
    from workflows.mainjob.candidates import chain_tree

    top = min(max_depth, profile.max_input_length - 1, accept.max_depth or max_depth)
    rows = []
    for d in range(1, top + 1):
        p = predict(chain_tree(accept, d), profile, Guessing())
        rows.append({"depth": d, "tokens_per_step": p.tokens_per_step, "speedup": p.speedup})
    best = max(rows, key=lambda r: r["speedup"])
    return {"best_depth": best["depth"] if best["speedup"] > 1 else 0, "predicted_speedup": max(best["speedup"], 1.0),
            "chains": rows}


def vicuna_lookup_ceiling(profile, tokenizer, answers: list[tuple[str, str]], max_guesses: int = 15) -> dict:
    from decoder.guessers.lookup import available_lengths
    from planner.ceiling import oracle_ceiling
    from planner.cost import step_cost

    G = min(profile.max_input_length - 1, max_guesses)
    cost = [float(step_cost(profile, g + 1)) for g in range(G + 1)]
    plain = oracle = 0.0
    for q, a in answers:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        ans = tokenizer(a, add_special_tokens=False)["input_ids"][:256]
        c = oracle_ceiling(available_lengths(prompt, ans, G)[1], cost)
        plain, oracle = plain + c.plain_s, oracle + c.oracle_s
    return {"ceiling_speedup": plain / oracle, "answers": len(answers)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", action="append", required=True, metavar="NAME=FILE", help="a llama.cpp profile")
    p.add_argument("--lookup", required=True, help="lookup acceptance measured in llama.cpp (autotune's accept-lookup.json)")
    p.add_argument("--answers", type=int, default=40, help="Vicuna-7B MT-bench answers for the lookup ceiling")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "llama_presets"))
    return p


def main(argv=None) -> int:
    # no decoding and no timing (predictions from measured profiles): no load is judged
    return bench_main("llama_presets", parser(), run, argv, writes=lambda a: False)


def _smollm2_tokenizer():
    """SmolLM2's chat tokenizer, from the llama.cpp engine on its GGUF (closed at once: no decoding here)."""
    from decoder.engines.registry import EngineRequest, open_engine

    engine = open_engine("llama.cpp", EngineRequest(model="smollm2-135m", threads=1))
    try:
        return engine.tokenizer
    finally:
        engine.close()


def run(args) -> Results:
    from planner.accept import load_acceptance
    from planner.engines import DEFAULT, kind
    from planner.jsonio import read_json
    from planner.profile import load_profile
    from training.data import DEFAULT_DATA

    profiles = {}
    for spec in args.profile:
        name, _, path = spec.partition("=")
        if not path:
            raise UserError(f"--profile {spec}: expected NAME=FILE")
        prof = load_profile(path)
        engine = kind(prof.source.get("engine") or DEFAULT)
        if engine.caps.trees:  # the chains priced here are what an engine that scores chains only (llama.cpp) runs
            raise UserError(f"--profile {path}: a profile of the {engine.name} engine, which scores trees; expected "
                            "one of a chain-only engine (llama.cpp)")
        profiles[name] = (prof, read_json(path))
    accepts = {"lookup (SmolLM2, measured)": load_acceptance(args.lookup),
               "medusa heads (Vicuna-7B, published)": load_acceptance(f"{DEFAULT_DATA / 'published_acceptance.json'}:medusa-vicuna-7b")}
    tok = _smollm2_tokenizer()
    rows = [json.loads(x) for x in (DEFAULT_DATA / "vicuna7b_mt_bench_answers.jsonl").read_text().splitlines() if x.strip()]
    questions = {json.loads(x)["question_id"]: json.loads(x)["turns"][0]
                 for x in (DEFAULT_DATA / "mt_bench_questions.jsonl").read_text().splitlines() if x.strip()}
    answers = [(questions[r["question_id"]], r["turns"][0]) for r in rows if r["question_id"] in questions][: args.answers]
    out = {}
    for name, (prof, raw) in profiles.items():
        lat = dict(zip(raw["input_lengths"], raw["latency_s"]))
        entry = {"L1_ms": lat.get(1, 0) * 1e3, "L_ratio": {n: lat[n] / lat[1] for n in (2, 4, 8, 16) if n in lat},
                 "threads": raw.get("threads"), "load_avg_1m": raw.get("settings", {}).get("load_avg_1m"),
                 "has_weights": raw.get("has_weights")}
        for label, acc in accepts.items():
            entry[label] = best_chain(acc, prof)
        entry["lookup ceiling (Vicuna-7B answers)"] = vicuna_lookup_ceiling(prof, tok, answers)
        out[name] = entry
    doc = {"profiles": {k: v[1].get("model_file") for k, v in profiles.items()}, "results": out,
           "command": "python3 bench/llama_presets.py " + " ".join(sys.argv[1:])}
    md = ["| model (llama.cpp, this CPU) | L(1) ms | L(2)/L(1) | L(4)/L(1) | L(8)/L(1) | lookup (SmolLM2 acc.) | "
          "medusa heads (Vicuna-7B acc.) | lookup oracle ceiling (Vicuna-7B answers) |", "|---|---|---|---|---|---|---|---|"]
    for name, e in out.items():
        r = e["L_ratio"]
        cell = lambda k: f"{e[k]['predicted_speedup']:.2f}x (chain {e[k]['best_depth']})"  # noqa: E731
        md.append(f"| {name} | {e['L1_ms']:.1f} | {r.get(2, float('nan')):.2f} | {r.get(4, float('nan')):.2f} | "
                  f"{r.get(8, float('nan')):.2f} | {cell('lookup (SmolLM2, measured)')} | "
                  f"{cell('medusa heads (Vicuna-7B, published)')} | "
                  f"{e['lookup ceiling (Vicuna-7B answers)']['ceiling_speedup']:.2f}x |")
    text = "\n".join(md) + "\n"
    return Results({Path(args.out + ".json"): doc, Path(args.out + ".md"): text}, text)


if __name__ == "__main__":
    sys.exit(main())
