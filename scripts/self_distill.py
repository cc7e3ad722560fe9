"""Self-distilled chat data: a model's own answers to the MT-bench training questions.

    python3 scripts/self_distill.py --model smollm2-135m -o models/smollm2-135m/self_distill.jsonl

Guessers learn to predict the target's own continuations (PPD and ParallelSpec both train on the
target's outputs), so their chat data is the target answering the training questions: both turns,
the second after its own first answer, greedy, in batches with left padding. The held-out
questions (question_id % 5 == 0) are never asked. Ctrl-C keeps the answers finished so far;
running again continues where it stopped.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.data import DEFAULT_DATA, QUESTIONS_FILE, held_out_question, read_jsonl  # noqa: E402


def _generate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    import torch

    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = out[:, enc["input_ids"].shape[1]:]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from decoder.engines.hf.load import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    rows = [r for r in read_jsonl(DEFAULT_DATA / QUESTIONS_FILE) if not held_out_question(int(r["question_id"]))]
    done = {}
    if args.output.is_file():
        done = {r["question_id"]: r for r in read_jsonl(args.output)}
    todo = [r for r in rows if r["question_id"] not in done]
    print(f"{len(done)} answered, {len(todo)} to go", file=sys.stderr)
    t0 = time.time()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    try:
        for i in range(0, len(todo), args.batch_size):
            batch = todo[i: i + args.batch_size]
            first = _generate(loaded.model, tokenizer, [[{"role": "user", "content": r["turns"][0]}] for r in batch],
                              args.max_new_tokens)
            convs = [[{"role": "user", "content": r["turns"][0]}, {"role": "assistant", "content": a},
                      {"role": "user", "content": r["turns"][1]}] for r, a in zip(batch, first)]
            second = _generate(loaded.model, tokenizer, convs, args.max_new_tokens)
            with args.output.open("a") as f:
                for r, a1, a2 in zip(batch, first, second):
                    f.write(json.dumps({"question_id": r["question_id"], "category": r.get("category"),
                                        "turns": r["turns"][:2], "answers": [a1, a2], "model": loaded.name,
                                        "decoding": f"greedy, max {args.max_new_tokens} new tokens"}) + "\n")
            print(f"{i + len(batch)}/{len(todo)} questions, {time.time() - t0:.0f} s", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted; answers so far kept (run again to continue)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
