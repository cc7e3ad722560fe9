"""Train the built-in model: a BPE tokenizer and a small Llama causal LM on ../shared/data/.

    python scripts/train_builtin.py --out models/builtin --steps 600 --batch 8 --seed 0

Reproducible: seeded, single process, deterministic given the thread count (--threads).
Writes config.json, model.safetensors (fp16), tokenizer files and training.json (settings,
data sha256, validation perplexity, wall time, versions) into --out, all atomically.
A training state (weights + optimiser + step) is checkpointed to --out/_train_state.pt every
--ckpt-every steps; --resume continues from it; Ctrl-C saves it and stops.

Data and splits (documented in docs/readme/model.md):
  web text  openwebtext_eval.jsonl: documents whose index % 20 == 0 are held out (validation).
  chat      vicuna7b_mt_bench_answers.jsonl + mt_bench_questions.jsonl, formatted as
            "USER: q1 ASSISTANT: a1</s>USER: q2 ASSISTANT: a2</s>"; questions with
            question_id % 5 == 0 (16 of 80, two per category) are held out of all training,
            base model and prompt tokens, so autotune can decode them as unseen prompts.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.data import (  # the data split lives there
    DEFAULT_DATA,
    held_out_question,
    load_corpus,
)

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>"]

ARCH = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (no unknown characters possible) with <s>, </s>, <unk>, <pad> as ids 0..3."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # </s> inside the chat text is a real token; <s> is prepended by the post-processor.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


# ---------------------------------------------------------------- model


def make_config(vocab_size: int):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=3, dtype="float16", **ARCH
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def token_stream(tokenizer, texts: list[str]) -> "torch.Tensor":  # noqa: F821
    """All texts as one id stream [N], each text starting with <s> (and chat turns ending in </s>)."""
    import torch

    ids: list[int] = []
    for enc in tokenizer(texts)["input_ids"]:
        ids.extend(enc)
    return torch.tensor(ids, dtype=torch.long)


def perplexity(model, stream, seq_len: int, max_windows: int | None = None) -> float:
    """exp(mean next-token NLL) over consecutive non-overlapping windows [seq_len] of `stream`."""
    import torch

    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for b in range(0, n, 16):
            idx = torch.arange(b, min(n, b + 16))[:, None] * seq_len + torch.arange(seq_len + 1)
            x = stream[idx]  # [B, seq_len + 1]
            logits = model(input_ids=x[:, :-1]).logits.float()  # [B, seq_len, V]
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            total += nll.item()
            count += x[:, 1:].numel()
    return math.exp(total / max(count, 1))


def save_checkpoint(model, tokenizer, out: Path, meta: dict) -> None:
    """config.json, model.safetensors (fp16), tokenizer files, training.json; each file atomic."""
    import tempfile

    import torch
    from safetensors.torch import save as st_save

    from planner.jsonio import atomic_write_bytes, atomic_write_json

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to embed_tokens
    atomic_write_bytes(out / "model.safetensors", st_save(state, metadata={"format": "pt"}))
    atomic_write_json(out / "config.json", model.config.to_diff_dict())
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for f in sorted(Path(tmp).iterdir()):
            atomic_write_bytes(out / f.name, f.read_bytes())
    atomic_write_json(out / "training.json", meta)


# ---------------------------------------------------------------- training


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "models" / "builtin")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--chat-repeat", type=int, default=4, help="weight of the chat data in the mix")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-after", type=int, default=None,
                   help="save the training state after this step and stop (then --resume, possibly with other --steps)")
    p.add_argument("--config-only", action="store_true", help="write config.json and the tokenizer, then stop")
    args = p.parse_args(argv)

    import torch
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    from planner.jsonio import atomic_write_json

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    corpus = load_corpus(args.data)
    tok = train_tokenizer(corpus["web_train"] + corpus["chat_train"], args.vocab)
    tokenizer = hf_tokenizer(tok)
    config = make_config(tok.get_vocab_size())
    if args.config_only:
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.out / "config.json", config.to_diff_dict())
        tokenizer.save_pretrained(args.out)
        return 0

    web_train = token_stream(tokenizer, corpus["web_train"])
    chat_train = token_stream(tokenizer, corpus["chat_train"])
    train = torch.cat([web_train] + [chat_train] * args.chat_repeat)
    web_val = token_stream(tokenizer, corpus["web_val"])
    chat_val = token_stream(tokenizer, corpus["chat_val"])
    print(
        f"tokens: web train {len(web_train)}, chat train {len(chat_train)} (x{args.chat_repeat}), "
        f"web val {len(web_val)}, chat val {len(chat_val)}",
        flush=True,
    )

    model = LlamaForCausalLM(config).float()  # train in fp32; shipped in fp16
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    state_path = args.out / "_train_state.pt"
    step, elapsed_before, losses, resumed_at = 0, 0.0, [], []
    if args.resume and state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, elapsed_before, losses = st["step"], st["elapsed"], st["losses"]
        resumed_at = st.get("resumed_at", []) + [{"step": step, "steps_before": st.get("steps", None)}]
        print(f"resumed at step {step}", flush=True)

    def save_state():
        buf = io.BytesIO()
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
             "elapsed": elapsed_before + time.time() - t_loop, "losses": losses, "steps": args.steps,
             "resumed_at": resumed_at},
            buf,
        )
        from planner.jsonio import atomic_write_bytes

        atomic_write_bytes(state_path, buf.getvalue())

    t_loop = time.time()
    warmup = max(1, args.steps // 20)
    model.train()
    bar = tqdm(total=args.steps, initial=step, desc="train builtin", dynamic_ncols=True)
    try:
        while step < args.steps:
            starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch,), generator=gen)
            x = train[starts[:, None] + torch.arange(args.seq_len + 1)]  # [B, T + 1]
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.steps, args.lr, warmup)
            logits = model(input_ids=x[:, :-1]).logits  # [B, T, V]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            losses.append(round(loss.item(), 4))
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if step % args.ckpt_every == 0 and step < args.steps:
                save_state()
            if args.stop_after is not None and step >= args.stop_after:
                save_state()
                print(f"\nstopped after step {step}; state saved to {state_path} (use --resume)", flush=True)
                return 0
    except KeyboardInterrupt:
        save_state()
        print(f"\ninterrupted at step {step}; state saved to {state_path} (use --resume)", file=sys.stderr)
        return 130
    bar.close()
    train_wall = elapsed_before + time.time() - t_loop

    # Validate what ships: the fp16-rounded weights, evaluated in fp32.
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(prm.to(torch.float16).float())
    val = {
        "web_ppl": round(perplexity(model, web_val, args.seq_len), 2),
        "chat_ppl": round(perplexity(model, chat_val, args.seq_len), 2),
        "web_val_tokens": len(web_val),
        "chat_val_tokens": len(chat_val),
        "seq_len": args.seq_len,
    }
    meta = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out", "data", "resume")},
        "architecture": dict(ARCH, vocab_size=config.vocab_size),
        "parameters": n_params,
        "data_sha256": corpus["sha256"],
        "splits": {
            "web": "openwebtext_eval.jsonl documents with index % 20 == 0 are validation",
            "chat": "MT-bench question_id % 5 == 0 held out of all training: "
            + ", ".join(str(q) for q in range(81, 161) if held_out_question(q)),
            "train_tokens": {"web": len(web_train), "chat": len(chat_train), "chat_repeat": args.chat_repeat},
        },
        "prompt_format": "USER: {question} ASSISTANT: {answer}</s> per turn; <s> at the start",
        "validation": val,
        "resumed": resumed_at,
        "final_train_loss_mean_last50": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4),
        "loss_curve_every_25": losses[::25],
        "train_wall_s": round(train_wall, 1),
        "total_wall_s": round(time.time() - t_start, 1),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "machine": "2-core CPU shared with other jobs",
    }
    save_checkpoint(model, tokenizer, args.out, meta)
    if state_path.exists():
        state_path.unlink()
    print(json.dumps(val), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
