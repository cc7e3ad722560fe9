"""`planner train-prompts`: train PPD prompt tokens for a frozen model by self-distillation.

    planner train-prompts --model builtin --prompt-tokens 3 --ensemble 1 --steps 300 --out runs/pt

Writes into --out: checkpoint.pt (every --ckpt-every steps and on Ctrl-C; --resume continues
from it), and when done prompt_tokens.json + prompt_tokens.safetensors (decoder/guessers/prompt_tokens.py
format), accept_heldout.json (the planner's acceptance format, measured on held-out text) and
training.json (settings, per-distance top-1/top-5, cost).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (default), builtin, a preset name, or a Hugging Face model directory")
    p.add_argument("--prompt-tokens", type=int, default=3, help="P: distances guessed beyond the next token")
    p.add_argument("--ensemble", type=int, default=1, help="E: copies of each prompt token, logits averaged")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256, help="training window length in tokens")
    p.add_argument("--inserts", type=int, default=32, help="random insertion points per window per step")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (cosine to 0, no warmup, as PPD)")
    p.add_argument("--decay", type=float, default=0.8, help="loss weight of distance d is decay^(d-1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="fp32, fp16 or bf16 for the frozen model (default: fp32 on CPU)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--data", type=Path, nargs="+", default=None,
                   help="training text: .jsonl files (field 'text' or 'turns') or plain text; default: the "
                   "shared data dir's training split (web text + MT-bench chat, held-out questions excluded)")
    p.add_argument("--data-dir", type=Path, default=None, help="the shared data dir (default ../shared/data)")
    p.add_argument("--val-data", type=Path, nargs="+", default=None,
                   help="held-out text for the accuracy report (default: the shared data dir's validation split)")
    p.add_argument("--chat-repeat", type=int, default=4, help="weight of the chat text in the default mix")
    p.add_argument("--self-answers", type=Path, default=None, metavar="JSONL",
                   help="the target's own answers to training questions (scripts/self_distill.py); default: "
                        "models/<model>/self_distill.jsonl when it ships")
    p.add_argument("--eval-windows", type=int, default=48, help="held-out windows per split for the report")


def _check(args) -> None:
    from planner.errors import UserError

    for name in ("prompt_tokens", "ensemble", "steps", "batch_size", "inserts", "ckpt_every", "threads", "eval_windows"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if args.seq_len <= args.prompt_tokens + 1:
        raise UserError(f"--seq-len: must exceed --prompt-tokens + 1, got {args.seq_len}")
    if not 0.0 < args.decay <= 1.0:
        raise UserError(f"--decay: must be in (0, 1], got {args.decay}")
    if args.lr <= 0:
        raise UserError(f"--lr: must be positive, got {args.lr}")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out}: exists and is not a directory")


def _texts(args, tokenizer, model_name: str) -> tuple[list[str], dict, object]:
    """--data / --val-data files, else the default mix for this model (its self-distilled answers
    when they ship: models/<model>/self_distill.jsonl)."""
    from training import data
    from workflows.cli.inputs import SHIPPED_DIR

    if args.data is not None and args.val_data is not None:
        val = {"val": [t for f in args.val_data for t in data.read_texts(f)]}
        return [t for f in args.data for t in data.read_texts(f)], val, [str(f) for f in args.data]
    answers = args.self_answers
    if answers is None and (SHIPPED_DIR / model_name / "self_distill.jsonl").is_file():
        answers = SHIPPED_DIR / model_name / "self_distill.jsonl"
    train, val, desc = data.default_texts(tokenizer, args.data_dir or data.DEFAULT_DATA, args.chat_repeat, answers)
    if args.data is not None:
        train, desc = [t for f in args.data for t in data.read_texts(f)], [str(f) for f in args.data]
    if args.val_data is not None:
        val = {"val": [t for f in args.val_data for t in data.read_texts(f)]}
    return train, val, desc


def _pooled(report: dict, prompt_tokens: int) -> dict:
    """One acceptance matrix for the planner: the held-out splits pooled by count."""
    total = sum(r["count"] for r in report.values())
    ranks = len(next(iter(report.values()))["accuracy"][0])
    accuracy = [[round(sum(r["accuracy"][d][k] * r["count"] for r in report.values()) / total, 5) for k in range(ranks)]
                for d in range(prompt_tokens)]
    return {"accuracy": accuracy, "count": total, "top1": [row[0] for row in accuracy],
            "top5": [round(sum(row[:5]), 4) for row in accuracy]}


def run(args) -> int:
    _check(args)
    import time

    import torch

    from planner.errors import UserError
    from planner.jsonio import atomic_write_json
    from training import data
    from training import prompts as tp
    from workflows.cli.engines import engine_kind, open_from_args

    spec = engine_kind(args)
    if not spec.caps.torch_modules:  # the loss backpropagates through the target's own torch modules
        raise UserError(f"planner train-prompts: the {spec.name} engine lends no torch modules to train through")
    engine = open_from_args(args, spec)  # --model, --device, --dtype, --threads
    record = engine.record()
    model_name, model_hash, device = engine.model_name, record["config_hash"], engine.device
    if not record["has_weights"]:
        print(f"planner train-prompts: note: model '{model_name}' has random weights; the prompt tokens learn its noise")
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise UserError(f"--model {args.model}: no tokenizer files next to the model (tokenizer.json expected)")
    max_pos = engine.max_positions
    if max_pos is not None and args.seq_len + args.prompt_tokens > max_pos:
        raise UserError(f"--seq-len {args.seq_len}: the model has {max_pos} positions")

    train_texts, val_sets, data_desc = _texts(args, tokenizer, model_name)
    windows = data.token_windows(tokenizer, train_texts, args.seq_len)
    if windows.shape[0] == 0:
        raise UserError(f"training data: fewer than {args.seq_len} tokens; pass more text or a smaller --seq-len")

    cfg = tp.TrainConfig(num_prompt_tokens=args.prompt_tokens, ensemble=args.ensemble, steps=args.steps,
                         batch_size=args.batch_size, inserts=args.inserts, lr=args.lr, decay=args.decay,
                         seed=args.seed, ckpt_every=args.ckpt_every)
    meta = {"model": model_name}  # model_config_hash stays the decoder's fingerprint (PromptTokens.random)
    print(f"model {model_name} on {device}; {windows.shape[0]} training windows of {args.seq_len} tokens")
    result = tp.train_prompt_tokens(engine, windows, args.out, cfg, resume=args.resume, device=device, meta=meta)
    if result.interrupted:
        print(f"planner train-prompts: interrupted at step {result.step}; checkpoint in {args.out} (use --resume)")
        return 130

    t0 = time.time()
    report = {}
    for name, texts in val_sets.items():
        w = data.token_windows(tokenizer, texts, args.seq_len)[: args.eval_windows]
        if w.shape[0]:
            report[name] = tp.evaluate(engine, result.prompt_tokens, w, device=device)
    if not report:
        raise UserError(f"held-out data: fewer than {args.seq_len} tokens, nothing to evaluate")
    pooled = _pooled(report, args.prompt_tokens)
    tp.write_acceptance(args.out / "accept_heldout.json", pooled,
                        f"planner train-prompts, held-out {'+'.join(report)} text, greedy targets, teacher-forced context")
    summary = {
        "command": "planner " + " ".join(sys.argv[1:]),
        "model": model_name,
        "model_config_hash": model_hash,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("_run", "command", "data", "val_data", "data_dir", "out")},
        "data": data_desc,
        "trained_parameters": result.trained_parameters,
        "steps": result.step,
        "train_wall_s": round(result.wall_s, 1),
        "eval_wall_s": round(time.time() - t0, 1),
        "device": str(device),
        "torch": torch.__version__,
        "loss_first": result.losses[0] if result.losses else None,
        "loss_last20_mean": round(sum(result.losses[-20:]) / max(1, len(result.losses[-20:])), 4),
        "loss_curve_every_10": result.losses[::10],
        "heldout": report,
        "pooled": pooled,
    }
    atomic_write_json(args.out / "training.json", summary)
    print(f"trained {result.trained_parameters} parameters in {result.wall_s:.0f} s ({result.step} steps)")
    for name, r in report.items():
        print(f"held-out {name}: top-1 per distance {r['top1']}, top-5 {r['top5']} ({r['count']} insertion points)")
    print(f"wrote {args.out}/prompt_tokens.safetensors, accept_heldout.json, training.json")
    return 0
