"""`planner train-drafter`: train a drafter for a frozen target by distillation from its own outputs.

    planner train-drafter --kind parallelspec --out models/smollm2-135m/parallelspec   # k = 4 masks
    planner train-drafter --kind draft-lm --layers 2 --out models/smollm2-135m/draft_lm
    planner train-drafter --kind eagle3 --data DISTILL.jsonl --out models/smollm2-135m/eagle3   # workflows/cli/train_eagle.py

Data: the shared data dir's training split in the target's chat format, with the target's own
answers to the training questions (models/<model>/self_distill.jsonl when it ships) and web text;
the held-out MT-bench questions are never trained on. The target's outputs (top-k next-token
distributions and, for ParallelSpec, its last hidden states) are computed once and cached
(training/teacher.py). Writes into --out: the drafter (fp16 safetensors of its own tensors only),
checkpoint.pt (every --ckpt-every steps and on Ctrl-C; --resume continues), training.json
(command, data, time, held-out evaluation) and accept_heldout.json (acceptance for `planner plan`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

KINDS = ("parallelspec", "draft-lm", "eagle3")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", choices=KINDS, default="parallelspec")
    p.add_argument("--model", default="smollm2-135m", help="the target (default smollm2-135m)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--num-masks", type=int, default=4, help="parallelspec: K mask tokens (guesses K + 1 distances)")
    p.add_argument("--layers", type=int, default=2, help="draft-lm: decoder layers (initialised from the target's first)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=4, help="windows per step")
    p.add_argument("--groups", type=int, default=32, help="parallelspec: mask groups sampled per window")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--feature-weight", type=float, default=0.5, help="parallelspec: weight of the feature regression")
    p.add_argument("--seq-len", type=int, default=256, help="window length in tokens")
    p.add_argument("--windows", type=int, default=1024, help="training windows at most (chat first, then web)")
    p.add_argument("--val-windows", type=int, default=24, help="held-out windows for the evaluation")
    p.add_argument("--head-vocab", type=int, default=8192,
                   help="restrict the drafter's LM head to the N tokens the target predicts most (0: full head)")
    p.add_argument("--teacher-top-k", type=int, default=32, help="teacher probabilities kept per position")
    p.add_argument("--top-k", type=int, default=8, help="guesses per distance the shipped drafter offers")
    p.add_argument("--self-answers", type=Path, default=None, metavar="JSONL",
                   help="the target's own answers (default models/<model>/self_distill.jsonl when it ships)")
    p.add_argument("--data-dir", type=Path, default=None, help="the shared data dir (default ../shared/data)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--no-progress", action="store_true")
    from workflows.cli.train_eagle import add_arguments as add_eagle_arguments

    add_eagle_arguments(p)


def _check(args) -> None:
    from planner.errors import UserError

    for name in ("num_masks", "layers", "steps", "batch_size", "groups", "windows", "val_windows", "teacher_top_k",
                 "top_k", "threads", "ckpt_every"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if args.num_masks > 16 or args.top_k > 64 or args.teacher_top_k > 1024 or args.windows > 100_000:
        raise UserError("--num-masks at most 16, --top-k at most 64, --teacher-top-k at most 1024, --windows at most 100000")
    if args.seq_len <= args.num_masks + 2 or args.seq_len > 8192:
        raise UserError(f"--seq-len: must be in {args.num_masks + 3}..8192, got {args.seq_len}")
    if args.head_vocab < 0:
        raise UserError(f"--head-vocab: must be >= 0, got {args.head_vocab}")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out}: exists and is not a directory")


def windows_for(args, tokenizer, model_name: str):
    """(train windows [N, T], held-out windows [M, T], data description): chat first, then web."""
    import torch

    from training import data
    from workflows.cli.inputs import SHIPPED_DIR

    answers = args.self_answers
    if answers is None and (SHIPPED_DIR / model_name / "self_distill.jsonl").is_file():
        answers = SHIPPED_DIR / model_name / "self_distill.jsonl"
    corpus = data.load_corpus(args.data_dir or data.DEFAULT_DATA, data.template_chat(tokenizer), answers)
    g = torch.Generator().manual_seed(args.seed)
    chat = data.token_windows(tokenizer, corpus["chat_self"] + corpus["chat_train"], args.seq_len)
    web = data.token_windows(tokenizer, corpus["web_train"], args.seq_len)
    web = web[torch.randperm(web.shape[0], generator=g)[: max(0, args.windows - chat.shape[0])]]
    train = torch.cat([chat[: args.windows], web])
    val_chat = data.token_windows(tokenizer, corpus["chat_val"], args.seq_len)
    val_web = data.token_windows(tokenizer, corpus["web_val"], args.seq_len)
    half = args.val_windows // 2
    val = torch.cat([val_chat[: args.val_windows - half], val_web[:half]])
    desc = {"chat_windows": int(min(chat.shape[0], args.windows)), "web_windows": int(web.shape[0]),
            "val_windows": int(val.shape[0]), "self_answers": None if answers is None else str(answers),
            "sha256": corpus["sha256"]}
    return train, val, desc


def run(args) -> int:
    _check(args)
    import json
    import time

    import torch

    from decoder.engines.registry import EngineRequest, open_engine
    from planner.errors import UserError
    from planner.jsonio import atomic_write_json
    from training import drafters, teacher
    from workflows.cli.engines import engine_kind

    spec = engine_kind(args)
    if not spec.caps.torch_modules:  # distillation backpropagates into drafters on the target's own torch modules
        raise UserError(f"planner train-drafter: the {spec.name} engine lends no torch modules to train through")
    engine = open_engine(spec.name, EngineRequest(model=args.model, device="cpu", dtype="fp32", threads=args.threads,
                                                  progress=not args.no_progress))
    target = engine.training()  # the target's passes, the target frozen (decoder/engines/hf/training.py)
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise UserError(f"--model {args.model}: no tokenizer next to the model")
    if args.kind == "eagle3":  # its own data (the target's answers) and layout: workflows/cli/train_eagle.py
        from workflows.cli.train_eagle import run_eagle

        return run_eagle(args, engine)
    train_w, val_w, desc = windows_for(args, tokenizer, engine.model_name)
    print(f"target {engine.model_name}; {train_w.shape[0]} training windows, {val_w.shape[0]} held-out, "
          f"{args.seq_len} tokens", file=sys.stderr)
    t0 = time.time()
    # features too, for either kind: both drafters then share one cached pass of the target
    tr = teacher.teacher_data(engine, train_w, k=args.teacher_top_k, hidden=True, progress=not args.no_progress)
    va = teacher.teacher_data(engine, val_w, k=args.teacher_top_k, hidden=True, progress=not args.no_progress)
    teacher_s = time.time() - t0
    head = teacher.frequent_vocab(tr, args.head_vocab) if args.head_vocab else None
    cfg = drafters.DrafterConfig(steps=args.steps, batch_size=args.batch_size, groups=args.groups, lr=args.lr,
                                 feature_weight=args.feature_weight, seed=args.seed, ckpt_every=args.ckpt_every)
    drafters.check_config(cfg)
    train_one = {"parallelspec": _train_parallel, "draft-lm": _train_draft_lm}[args.kind]
    result, evaluation, save = train_one(args, target, tr, va, head, cfg)
    if result.interrupted:
        print(f"planner train-drafter: interrupted at step {result.step}; checkpoint in {args.out} (use --resume)",
              file=sys.stderr)
        return 130
    meta = {"target": engine.model_name, "target_config_hash": engine.record()["config_hash"],
            "training": {"steps": result.step, "wall_s": round(result.wall_s, 1), "teacher_s": round(teacher_s, 1)}}
    save(meta)
    summary = {"kind": args.kind, "target": engine.model_name, "command": "planner " + " ".join(sys.argv[1:]),
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")},
               "data": desc, "trained_parameters": result.trained_parameters, "train_wall_s": round(result.wall_s, 1),
               "teacher_wall_s": round(teacher_s, 1), "device": "cpu", "threads": args.threads, "torch": torch.__version__,
               "head_vocab": None if head is None else int(head.numel()),
               "head_coverage_heldout": None if head is None else round(teacher.coverage(va, head), 4),
               "loss_first": result.losses[:1], "loss_last50_mean": round(sum(result.losses[-50:]) / max(1, len(result.losses[-50:])), 4),
               "loss_curve_every_25": result.losses[::25], "heldout": evaluation}
    atomic_write_json(args.out / "training.json", summary)
    print(json.dumps(evaluation, indent=None)[:600], file=sys.stderr)
    print(f"trained {result.trained_parameters} parameters in {result.wall_s:.0f} s; wrote {args.out}", file=sys.stderr)
    return 0


def _train_parallel(args, target, tr, va, head, cfg):
    from planner.jsonio import atomic_write_json
    from training import drafters

    # started from the target's last layer and final norm: its features are what the slots carry
    d = target.parallel_drafter(args.num_masks, head, args.top_k)
    params = [p for p in d.parameters() if p.requires_grad]
    result = drafters.train(d, params, lambda rows, gen: drafters.parallel_loss(d, tr, rows, cfg, gen), tr, args.out,
                            cfg, resume=args.resume, progress=not args.no_progress, desc="train parallelspec drafter")
    d.eval()
    evaluation = {"restricted_head": drafters.evaluate_parallel(d, va),
                  "full_head": drafters.evaluate_parallel(d, va, full_head=True)}

    def save(meta):
        d.meta.update(meta)
        d.save(args.out)
        atomic_write_json(args.out / "accept_heldout.json", {
            "accuracy": evaluation["restricted_head"]["accuracy"], "kind": "parallelspec",
            "guesser": {"prompt_tokens": False, "draft_passes": "one"},
            "source": "planner train-drafter: teacher-forced held-out windows, target's greedy tokens"})

    return result, evaluation, save


def _train_draft_lm(args, target, tr, va, head, cfg):
    from decoder.engines.hf.training import draft_lm_parameters
    from decoder.torch_ops.draft_lm import save_draft_lm
    from planner.jsonio import atomic_write_json
    from training import drafters

    draft = target.draft_lm(args.layers)
    params = draft_lm_parameters(draft)  # its own layers and final norm, not the target's shared embedding and head
    for p in params:
        p.requires_grad_(True)
    draft.train()
    result = drafters.train(draft, params, lambda rows, gen: drafters.draft_lm_loss(draft, head, tr, rows, cfg, gen),
                            tr, args.out, cfg, resume=args.resume, progress=not args.no_progress, desc="train draft LM")
    draft.eval()
    evaluation = drafters.evaluate_draft_lm(draft, va, ranks=args.top_k)

    def save(meta):
        save_draft_lm(draft, args.out, meta)
        atomic_write_json(args.out / "accept_heldout.json", {
            "positional": evaluation["positional"], "kind": "draft-lm",
            "guesser": {"prompt_tokens": False, "draft_passes": "depth"},
            "source": "planner train-drafter: teacher-forced held-out windows, target's greedy tokens"})

    return result, evaluation, save
