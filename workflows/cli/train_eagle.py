"""`planner train-drafter --kind eagle3`: an EAGLE-3 head for the target, from the target's own answers.

    python3 scripts/self_distill.py --engine vllm --set distill -o DISTILL.jsonl     # the target answers
    planner train-drafter --kind eagle3 --data DISTILL.jsonl --out models/smollm2-135m/eagle3

Data: conversations the target answered itself (scripts/self_distill.py: training/chat_prompts.py's set and
the MT-bench training questions), in the target's chat format, cut into windows; one in twenty
conversations (by a hash of its id) is held out for the evaluation. The target's top-k distribution and
the streams entering its three feature layers are computed once and cached (training/teacher.py).
Training: training/eagle.py (training-time test); positions whose next token is the assistant's count
fully, the user's turns and the template at `--prompt-weight`. Writes into --out the released EAGLE-3
layout (config.json, model.safetensors in fp16: decoder/torch_ops/heads.py save_eagle3), training.json
(command, data, settings, time, loss and held-out acceptance curves), accept_heldout.json (the planner's
acceptance format) and checkpoint.pt (--resume continues; Ctrl-C keeps it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA = "distill/{model}-distill.jsonl"  # under the cache dir (scripts/self_distill.py writes it there)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--kind eagle3")
    g.add_argument("--data", type=Path, default=None, metavar="JSONL",
                   help="the target's own answers (scripts/self_distill.py --set distill; default "
                        f"<cache>/{DEFAULT_DATA})")
    g.add_argument("--draft-vocab", type=int, default=4096,
                   help="the head's draft vocabulary: the N tokens the target predicts most (d2t maps them)")
    g.add_argument("--aux-layers", default=None, metavar="I,J,K",
                   help="target layers whose entering streams the head reads (default 2, L/2, L-3)")
    g.add_argument("--ttt-steps", type=int, default=4, help="draft steps unrolled in training (training-time test)")
    g.add_argument("--decay", type=float, default=0.8, help="weight of unrolled step j: decay^j")
    g.add_argument("--prompt-weight", type=float, default=0.1,
                   help="loss weight of positions predicting the user's turns and the chat template")
    g.add_argument("--eval-windows", type=int, default=16, help="held-out windows evaluated at each checkpoint")
    g.add_argument("--autocast", choices=["bf16", "off"], default="bf16",
                   help="training passes in bfloat16 autocast (the weights, the optimiser and the loss stay fp32): "
                        "2.7x faster matmuls on a CPU with AVX-512 BF16 / AMX; evaluation runs in fp32")


def _check(args) -> None:
    from planner.errors import UserError

    if not 64 <= args.draft_vocab <= 1 << 20:
        raise UserError(f"--draft-vocab: expected 64..1048576, got {args.draft_vocab}")
    if not 1 <= args.ttt_steps <= 16 or not 0 < args.decay <= 1 or not 0 <= args.prompt_weight <= 1:
        raise UserError("--ttt-steps in 1..16, --decay in (0, 1], --prompt-weight in [0, 1]")
    if args.eval_windows < 1:
        raise UserError(f"--eval-windows: expected a positive integer, got {args.eval_windows}")


def conversations(path: Path, extra: Path | None) -> tuple[list[dict], list[dict]]:
    """(training, held-out) conversations: rows with 'turns' and 'answers'; one in twenty by a hash of its id."""
    from planner.errors import UserError
    from training.data import held_out_question, read_jsonl

    rows = read_jsonl(path) + (read_jsonl(extra) if extra is not None else [])
    train, held = [], []
    for n, r in enumerate(rows, 1):
        if not isinstance(r.get("turns"), list) or not isinstance(r.get("answers"), list) or not r["answers"]:
            raise UserError(f"{path}: row {n}: expected 'turns' and 'answers' (lists of strings)")
        if "question_id" in r and held_out_question(int(r["question_id"])):
            raise UserError(f"{path}: row {n}: MT-bench question {r['question_id']} is held out of all training")
        key = str(r.get("id", r.get("question_id")))
        (held if int(hashlib.sha256(key.encode()).hexdigest(), 16) % 20 == 0 else train).append(r)
    return train, held


def _texts(tokenizer, rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        messages = []
        for q, a in zip(r["turns"], r["answers"]):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return out


def answer_weights(tokenizer, windows, prompt_weight: float):
    """[N, T] loss weights: 1 where position t predicts a token of an assistant answer (its closing marker
    included), prompt_weight elsewhere. Found by the template's assistant header and end-of-turn token."""
    import torch

    header = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    head_ids = tokenizer(header[len(plain):], add_special_tokens=False)["input_ids"]  # the assistant turn's opening
    end = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
    w = torch.full(windows.shape, prompt_weight)
    m = len(head_ids)
    for i, row in enumerate(windows.tolist()):
        inside = False
        for t in range(len(row)):
            if inside:
                w[i, t - 1] = 1.0  # position t - 1 predicts token t, an answer's
                if row[t] == end:
                    inside = False
            elif m and row[max(0, t - m + 1): t + 1] == head_ids:
                inside = True
    return w


def run_eagle(args, engine) -> int:
    """Train, evaluate and write the head (cmd_train_drafter dispatches --kind eagle3 here)."""
    _check(args)
    import torch

    from decoder.engines.shipped import cache_dir
    from planner.errors import UserError
    from planner.jsonio import atomic_write_json
    from training import drafters, teacher
    from training.data import token_windows
    from training.eagle import EagleTrainConfig, eagle_loss, evaluate
    from workflows.cli.inputs import SHIPPED_DIR

    passes = engine.training()
    tok = engine.tokenizer
    data_file = args.data or cache_dir() / DEFAULT_DATA.format(model=engine.model_name)
    if not Path(data_file).is_file():
        raise UserError(f"--data {data_file}: file not found (make it with scripts/self_distill.py --set distill)")
    mt = SHIPPED_DIR / engine.model_name / "self_distill.jsonl"
    train_rows, held_rows = conversations(Path(data_file), mt if mt.is_file() else None)
    train_w = token_windows(tok, _texts(tok, train_rows), args.seq_len)[: args.windows]
    val_w = token_windows(tok, _texts(tok, held_rows), args.seq_len)[: args.val_windows]
    L = passes.num_layers()
    aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else (2, L // 2, L - 3)
    if len(set(aux)) != len(aux) or not all(0 <= i < L for i in aux):
        raise UserError(f"--aux-layers {args.aux_layers}: expected distinct layer ids in 0..{L - 1}")
    aux = tuple(sorted(aux))
    print(f"target {engine.model_name}; {len(train_rows)} conversations ({train_w.shape[0]} windows of {args.seq_len}) "
          f"for training, {len(held_rows)} ({val_w.shape[0]} windows) held out; features of layers {list(aux)}",
          file=sys.stderr)
    t0 = time.time()
    tr = teacher.teacher_data(engine, train_w, k=args.teacher_top_k, hidden=aux, progress=not args.no_progress)
    va = teacher.teacher_data(engine, val_w, k=args.teacher_top_k, hidden=aux, progress=not args.no_progress)
    teacher_s = time.time() - t0
    tr.weights = answer_weights(tok, tr.tokens, args.prompt_weight)
    va.weights = answer_weights(tok, va.tokens, 0.0)
    draft_ids = teacher.frequent_vocab(tr, args.draft_vocab)
    head = passes.eagle3_head(aux, draft_ids)
    params = [p for p in head.parameters() if p.requires_grad]
    cfg = drafters.DrafterConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                                 ckpt_every=args.ckpt_every)
    drafters.check_config(cfg)
    ecfg = EagleTrainConfig(ttt_steps=args.ttt_steps, decay=args.decay)
    curve_file = Path(args.out) / "curve.json"
    curve = json.loads(curve_file.read_text()) if args.resume and curve_file.is_file() else []

    def loss_fn(rows, gen):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            return eagle_loss(head, tr.tokens[rows], tr.hidden[rows].float(), tr.top_ids[rows], tr.top_probs[rows],
                              tr.weights[rows], ecfg)

    def checkpoint(step):
        ev = evaluate(head, va, depth=args.ttt_steps, ranks=1, max_windows=args.eval_windows)
        head.train()
        curve.append({"step": step, "top1": ev["top1"]})
        atomic_write_json(curve_file, curve)

    Path(args.out).mkdir(parents=True, exist_ok=True)
    head.train()
    result = drafters.train(head, params, loss_fn, tr, args.out, cfg, resume=args.resume, progress=not args.no_progress,
                            desc="train EAGLE-3 head", on_checkpoint=checkpoint)
    if result.interrupted:
        print(f"planner train-drafter: interrupted at step {result.step}; checkpoint in {args.out} (use --resume)",
              file=sys.stderr)
        return 130
    head.eval()
    evaluation = evaluate(head, va, depth=6, ranks=8)
    curve.append({"step": result.step, "top1": evaluation["top1"][: args.ttt_steps]})
    data = {"file": str(data_file), "conversations": len(train_rows), "held_out_conversations": len(held_rows)}
    _write(args, engine, Trained(head, tr, va, draft_ids, aux, result, evaluation, curve, teacher_s, data))
    return 0


@dataclass
class Trained:
    """What a finished run writes: the head, its data (training and held-out), the draft vocabulary, the
    target layers read, the trainer's result, the held-out evaluation and curve, the teacher's time."""

    head: object
    tr: object
    va: object
    draft_ids: object
    aux: tuple
    result: object
    evaluation: dict
    curve: list
    teacher_s: float
    data: dict


def _write(args, engine, t: Trained) -> None:
    import torch

    from decoder.torch_ops.heads import save_eagle3
    from planner.jsonio import atomic_write_json
    from training import teacher

    meta = {"target": engine.model_name, "target_config_hash": engine.record()["config_hash"],
            "trained_by": "planner train-drafter --kind eagle3"}
    save_eagle3(t.head, args.out, meta)
    coverage = teacher.coverage(t.va, t.draft_ids)
    summary = {"kind": "eagle3", "target": engine.model_name, "command": "planner " + " ".join(sys.argv[1:]),
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")},
               "data": {**t.data, "train_windows": int(t.tr.tokens.shape[0]), "held_out_windows": int(t.va.tokens.shape[0]),
                        "seq_len": int(t.tr.tokens.shape[1]), "answer_positions": int((t.tr.weights == 1).sum())},
               "aux_layers": list(t.aux), "draft_vocab": int(t.draft_ids.numel()), "draft_vocab_coverage_heldout": round(coverage, 4),
               "trained_parameters": t.result.trained_parameters, "train_wall_s": round(t.result.wall_s, 1),
               "teacher_wall_s": round(t.teacher_s, 1), "device": "cpu", "threads": args.threads, "torch": torch.__version__,
               "loss_first": t.result.losses[:1], "loss_curve_every_25": t.result.losses[::25],
               "heldout_curve": t.curve, "heldout": t.evaluation,
               "note": "held-out: teacher-forced chains on the held-out conversations' answer positions; accuracy[d][r] "
                       "is whether rank r at chain step d (after d tokens the head drafted itself) is the target's "
                       "greedy token"}
    atomic_write_json(Path(args.out) / "training.json", summary)
    atomic_write_json(Path(args.out) / "accept_heldout.json", {
        "accuracy": t.evaluation["accuracy"], "kind": "eagle-head", "guesser": {"kind": "eagle-head", "draft_passes": "depth"},
        "source": "planner train-drafter --kind eagle3: teacher-forced held-out chains, target's greedy tokens"})
    print(json.dumps(t.evaluation["top1"]), file=sys.stderr)
    print(f"trained {t.result.trained_parameters} parameters in {t.result.wall_s:.0f} s; wrote {args.out}", file=sys.stderr)
