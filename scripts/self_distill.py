"""Self-distilled chat data: a model's own answers to the MT-bench training questions, or to the larger
distillation set of training/chat_prompts.py (what the EAGLE head for the default model learns from).

    python3 scripts/self_distill.py --model smollm2-135m -o models/smollm2-135m/self_distill.jsonl
    python3 scripts/self_distill.py --set distill --batch-size 32 --max-new-tokens 256 -o DISTILL.jsonl

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


def _rows_mt_bench() -> list[dict]:
    rows = [r for r in read_jsonl(DEFAULT_DATA / QUESTIONS_FILE) if not held_out_question(int(r["question_id"]))]
    return [{"id": r["question_id"], "category": r.get("category"), "turns": r["turns"][:2]} for r in rows]


def _rows_distill(args) -> list[dict]:
    from training.chat_prompts import distill_prompts

    made = distill_prompts(DEFAULT_DATA, args.questions, args.passage_tasks, seed=args.seed)
    return [{"id": p.id, "category": p.group, "turns": [p.first] + ([p.follow_up] if p.follow_up else [])} for p in made]


def _answer(model, tokenizer, batch: list[dict], max_new_tokens: int) -> list[list[str]]:
    """Each row's answers, turn by turn: a second turn is asked after the model's own first answer."""
    answers = [[a] for a in _generate(model, tokenizer, [[{"role": "user", "content": r["turns"][0]}] for r in batch],
                                      max_new_tokens)]
    second = [i for i, r in enumerate(batch) if len(r["turns"]) > 1]
    if second:
        convs = [[{"role": "user", "content": batch[i]["turns"][0]}, {"role": "assistant", "content": answers[i][0]},
                  {"role": "user", "content": batch[i]["turns"][1]}] for i in second]
        for i, a in zip(second, _generate(model, tokenizer, convs, max_new_tokens)):
            answers[i].append(a)
    return answers


def _answer_vllm(llm, batch: list[dict], max_new_tokens: int) -> list[list[str]]:
    """`_answer` through vLLM's offline engine (continuous batching: several times transformers' generate here)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    first = [o.outputs[0].text.strip() for o in llm.chat([[{"role": "user", "content": r["turns"][0]}] for r in batch],
                                                         params, use_tqdm=False)]
    answers = [[a] for a in first]
    second = [i for i, r in enumerate(batch) if len(r["turns"]) > 1]
    if second:
        convs = [[{"role": "user", "content": batch[i]["turns"][0]}, {"role": "assistant", "content": first[i]},
                  {"role": "user", "content": batch[i]["turns"][1]}] for i in second]
        for i, o in zip(second, llm.chat(convs, params, use_tqdm=False)):
            answers[i].append(o.outputs[0].text.strip())
    return answers


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--set", choices=("mt-bench", "distill"), default="mt-bench",
                   help="mt-bench: the training questions; distill: training/chat_prompts.py's set (EAGLE heads)")
    p.add_argument("--questions", type=int, default=1500, help="distill: template x topic questions")
    p.add_argument("--passage-tasks", type=int, default=1000, help="distill: requests about training web passages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="vllm: answer with vLLM's offline engine (run with the vLLM environment's python; fp32, greedy)")
    args = p.parse_args()
    for name in ("questions", "passage_tasks", "max_new_tokens", "batch_size", "threads"):
        if not 0 < getattr(args, name) <= 100_000:
            p.error(f"--{name.replace('_', '-')}: must be in 1..100000")
    if args.output.exists() and not args.output.is_file():
        p.error(f"-o {args.output}: exists and is not a regular file")

    import torch
    from transformers import AutoTokenizer

    if args.engine == "vllm":
        from vllm import LLM

        from decoder.engines.shipped import model_dir

        folder = str(model_dir(args.model))
        llm = LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0)
        loaded = type("Loaded", (), {"name": args.model, "model": llm, "tokenizer_dir": folder})
        answer = _answer_vllm
    else:
        from decoder.engines.hf.load import load_model

        torch.set_num_threads(args.threads)
        loaded = load_model(args.model, device="cpu")
        answer = _answer
    tokenizer = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    rows = _rows_mt_bench() if args.set == "mt-bench" else _rows_distill(args)
    done = set()
    if args.output.is_file():
        done = {r.get("id", r.get("question_id")) for r in read_jsonl(args.output)}
    # similar lengths together: left padding then wastes little of each batch
    todo = sorted((r for r in rows if r["id"] not in done), key=lambda r: len(r["turns"][0]))
    print(f"{len(done)} answered, {len(todo)} to go", file=sys.stderr)
    t0, made = time.time(), 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    try:
        for i in range(0, len(todo), args.batch_size):
            batch = todo[i: i + args.batch_size]
            answers = answer(loaded.model, batch, args.max_new_tokens) if args.engine == "vllm" else \
                answer(loaded.model, tokenizer, batch, args.max_new_tokens)
            with args.output.open("a") as f:
                for r, a in zip(batch, answers):
                    key = "question_id" if args.set == "mt-bench" else "id"
                    f.write(json.dumps({key: r["id"], "category": r["category"], "turns": r["turns"], "answers": a,
                                        "model": loaded.name, "engine": args.engine,
                                        "decoding": f"greedy, max {args.max_new_tokens} new tokens"}) + "\n")
                    made += sum(len(tokenizer(x)["input_ids"]) for x in a)
            print(f"{i + len(batch)}/{len(todo)} prompts, {made} answer tokens, {time.time() - t0:.0f} s", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted; answers so far kept (run again to continue)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":  # the guard vLLM's worker processes need
    raise SystemExit(main())
