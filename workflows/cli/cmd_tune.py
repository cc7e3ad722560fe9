"""`planner tune`: Optuna search over the planner's and decoder's knobs; writes the best tree."""
from __future__ import annotations

import argparse
from pathlib import Path

from workflows.cli.sampling import add_sampling_arguments, sampling_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept", action="append", required=True, metavar="[METHOD[/eE]=]FILE[:NAME]",
                   help="acceptance statistics (repeatable). METHOD (medusa, sequoia, ppd, all) says which method "
                        "they describe, /eE the PPD ensemble size E; without a prefix the method is guessed from the name")
    p.add_argument("--profile", metavar="FILE", help="latency profile (needed by --objective predicted)")
    p.add_argument("--objective", choices=("predicted", "measured"), default="predicted",
                   help="predicted: the planner's speedup model (fast); measured: decode --prompts, tokens per second")
    p.add_argument("--memory", choices=("input_length", "kv_bytes"),
                   help="add a second objective to minimise (multi-objective: a Pareto front)")
    p.add_argument("--model-config", metavar="CONFIG.json", help="model config, for --memory kv_bytes")
    p.add_argument("--kv-bytes-per-token", type=int, help="KV bytes per token, instead of --model-config")
    p.add_argument("--methods", default="ppd,medusa,sequoia", help="methods to search, comma-separated (default all)")
    p.add_argument("--max-size", type=int, default=64, help="largest candidate count searched (default 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=3, help="PPD: P searched in 1..this (default 3)")
    add_sampling_arguments(p, "--objective measured: decode")
    p.add_argument("--allow-typical", action="store_true",
                   help="with --temperature and --objective measured: also search Medusa's typical acceptance and its "
                        "thresholds (faster, NOT distribution-exact; the tree says so); default: lossless only")
    p.add_argument("--draft-latency-ms", type=float, default=0.0, help="sequoia: one draft step's latency")
    p.add_argument("--trials", type=int, default=50, help="trials to add to the study in this run (default 50)")
    p.add_argument("--storage", metavar="URL",
                   help="Optuna storage: sqlite:///FILE, a .db or .log (journal) file, postgresql://..., mysql://... "
                        "(default: sqlite file next to -o, BEST.optuna.db)")
    p.add_argument("--study-name", default="tune", help="study to create or resume (default 'tune')")
    p.add_argument("-o", "--out", required=True, metavar="BEST.json", help="best tree file (settings inside)")
    p.add_argument("--seed", type=int, help="sampler seed (one worker; several workers differ anyway)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = p.add_argument_group("measured objective")
    m.add_argument("--model", help="model: preset name, model directory or config.json")
    m.add_argument("--device", help="cpu, cuda, ... (default: cuda when available)")
    m.add_argument("--dtype", help="fp32, fp16, bf16 (default: by device)")
    m.add_argument("--prompts", metavar="JSONL", help="validation prompts (default ../shared/data/mt_bench_questions.jsonl)")
    m.add_argument("--num-prompts", type=int, default=4, help="prompts decoded per trial (default 4)")
    m.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    m.add_argument("--prompt-tokens-dir", metavar="DIR", help="trained PPD prompt tokens (else an oracle guesser)")


def run(args) -> int:
    from planner.errors import UserError
    from planner.profile import load_profile
    from planner.tree import METHODS
    from workflows.cli.inputs import DEFAULT_PROMPTS, read_prompts
    from workflows.tune.measured import MeasuredEvaluator
    from workflows.tune.search import SearchSpace, kv_bytes_per_token, parse_accept_spec, tune

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise UserError(f"--methods {args.methods}: expected a comma-separated subset of {', '.join(METHODS)}")
    for name, value, lo in (("--trials", args.trials, 0), ("--max-size", args.max_size, 1),
                            ("--max-prompt-tokens", args.max_prompt_tokens, 1), ("--num-prompts", args.num_prompts, 1),
                            ("--max-new-tokens", args.max_new_tokens, 1)):
        if value < lo:
            raise UserError(f"{name} must be at least {lo}, got {value}")
    import math

    sampling_from_args(args)
    if not (math.isfinite(args.draft_latency_ms) and args.draft_latency_ms >= 0):
        raise UserError(f"--draft-latency-ms: expected a finite number >= 0, got {args.draft_latency_ms}")
    if args.allow_typical and not (args.temperature > 0 and args.objective == "measured"):
        raise UserError("--allow-typical: typical acceptance samples; needs --temperature > 0 and --objective measured")
    sources = [parse_accept_spec(a) for a in args.accept]
    profile = load_profile(args.profile) if args.profile else None
    space = SearchSpace(sources, methods=methods, max_size=args.max_size, max_prompt_tokens=args.max_prompt_tokens,
                        temperature=args.temperature, draft_latency_s=args.draft_latency_ms / 1e3,
                        top_k=args.top_k, top_p=args.top_p)
    kv = args.kv_bytes_per_token
    if kv is None and args.model_config:
        kv = kv_bytes_per_token(args.model_config)
    evaluator = None
    if args.objective == "measured":
        if not args.model:
            raise UserError("--objective measured needs --model (preset name, model directory or config.json)")
        prompts = read_prompts(args.prompts or DEFAULT_PROMPTS, args.num_prompts)
        evaluator = MeasuredEvaluator(args.model, prompts, max_new_tokens=args.max_new_tokens, device=args.device,
                                      dtype=args.dtype, temperature=args.temperature, top_k=args.top_k,
                                      top_p=args.top_p,
                                      prompt_tokens_dir=args.prompt_tokens_dir, seed=args.seed or 0)
    storage = args.storage or f"sqlite:///{Path(args.out).resolve().with_suffix('.optuna.db')}"
    res = tune(space, profile, trials=args.trials, storage=storage, study_name=args.study_name, out=args.out,
               objective=args.objective, memory=args.memory, kv_per_token=kv, evaluator=evaluator, seed=args.seed,
               progress=not args.no_progress, allow_typical=args.allow_typical)
    if not res.best:
        raise UserError(f"study '{res.study_name}': no trial completed (every point was infeasible?)")
    b = res.best
    vals = ", ".join(f"{n} {v:.4g}" for n, v in zip(b["objectives"], b["values"]))
    print(f"study '{res.study_name}' in {res.storage}: {res.trials_total} completed trials ({res.trials_run} this run)")
    for r in res.reference:
        print(f"  planner plan ({r['params'].get('method')}): {r['values'][0]:.4g}")
    print(f"best: trial {b['trial']}: {vals}; {b['config']}")
    if res.pareto:
        print(f"Pareto front: {len(res.pareto)} trials (in {res.out} settings.tune.pareto)")
    print(f"wrote {res.out}")
    return 0
