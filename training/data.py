"""Training data: the shared data dir's files, its held-out split, chat formatting, token windows.

Shared by every trainer (prompt tokens, drafters) and by `scripts/train_builtin.py`: the held-out
MT-bench questions (`held_out_question`) are never trained on by any of them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from planner.errors import UserError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / ".." / "shared" / "data"
WEB_FILE = "openwebtext_eval.jsonl"
ANSWERS_FILE = "vicuna7b_mt_bench_answers.jsonl"
QUESTIONS_FILE = "mt_bench_questions.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found (pass --data)") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a .jsonl file") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}: line {n}: not valid JSON ({e.msg})") from None
    return rows


def held_out_question(question_id: int) -> bool:
    """MT-bench questions kept out of all training, base model and prompt tokens (two per category)."""
    return question_id % 5 == 0


def chat_text(question_turns: list[str], answer_turns: list[str]) -> str:
    """The built-in model's prompt format; every turn ends with </s>."""
    return "".join(f"USER: {q.strip()} ASSISTANT: {a.strip()}</s>" for q, a in zip(question_turns, answer_turns))


def template_chat(tokenizer):
    """A chat formatter from the tokenizer's chat template (SmolLM2's turns), or `chat_text` when it
    has none (the built-in model)."""
    if not getattr(tokenizer, "chat_template", None):
        return chat_text

    def fmt(question_turns: list[str], answer_turns: list[str]) -> str:
        messages = []
        for q, a in zip(question_turns, answer_turns):
            messages += [{"role": "user", "content": q.strip()}, {"role": "assistant", "content": a.strip()}]
        return tokenizer.apply_chat_template(messages, tokenize=False)

    return fmt


def load_corpus(data_dir: Path, chat_format=chat_text, self_answers: Path | None = None) -> dict:
    """The shared data dir split: {'web_train', 'web_val', 'chat_train', 'chat_val', 'chat_self': list[str], 'sha256': {...}}.

    Web documents with index % 20 == 0 are validation; chat = MT-bench question + Vicuna answer
    formatted by `chat_format`, held out by `held_out_question`. `self_answers`: a JSONL of the
    target's own answers (scripts/self_distill.py) to training questions: 'chat_self'.
    """
    import hashlib

    data_dir = Path(data_dir)
    web = [r["text"] for r in read_jsonl(data_dir / WEB_FILE)]
    questions = {r["question_id"]: r["turns"] for r in read_jsonl(data_dir / QUESTIONS_FILE)}
    answers = {r["question_id"]: r["turns"] for r in read_jsonl(data_dir / ANSWERS_FILE)}
    chat_train, chat_val = [], []
    for qid in sorted(answers):
        if qid not in questions:
            continue
        text = chat_format(questions[qid], answers[qid])
        (chat_val if held_out_question(qid) else chat_train).append(text)
    files = [data_dir / WEB_FILE, data_dir / ANSWERS_FILE, data_dir / QUESTIONS_FILE]
    chat_self = []
    if self_answers is not None:
        for r in read_jsonl(self_answers):
            if held_out_question(int(r["question_id"])):
                raise UserError(f"{self_answers}: question {r['question_id']} is held out and must not be trained on")
            chat_self.append(chat_format(r["turns"], r["answers"]))
        files.append(Path(self_answers))
    return {
        "web_train": [t for i, t in enumerate(web) if i % 20 != 0],
        "web_val": [t for i, t in enumerate(web) if i % 20 == 0],
        "chat_train": chat_train,
        "chat_val": chat_val,
        "chat_self": chat_self,
        "sha256": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
    }


def read_texts(path: Path) -> list[str]:
    """Texts of a user data file: .jsonl rows with 'text', or 'turns' (+ MT-bench style), or plain text."""
    path = Path(path)
    if path.suffix != ".jsonl":
        try:
            return [path.read_text()]
        except FileNotFoundError:
            raise UserError(f"{path}: file not found") from None
    texts = []
    for n, row in enumerate(read_jsonl(path), 1):
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            texts.append(row["text"])
        elif isinstance(row, dict) and isinstance(row.get("turns"), list):
            texts.append("\n".join(str(t) for t in row["turns"]))
        else:
            raise UserError(f"{path}: row {n}: expected a field 'text' (string) or 'turns' (list of strings)")
    return texts


def token_windows(tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate the tokenised texts (each starts with the tokenizer's BOS when it adds one) and
    cut the stream into non-overlapping windows [N, seq_len]; the tail shorter than a window is dropped."""
    ids: list[int] = []
    for enc in tokenizer(texts)["input_ids"]:
        ids.extend(enc)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def default_texts(tokenizer, data_dir: Path, chat_repeat: int, self_answers: Path | None = None) -> tuple[list[str], dict, dict]:
    """The default training mix and held-out sets for a target with this tokenizer.

    Training: web text + MT-bench chat in the target's chat format, the chat repeated
    `chat_repeat` times (the target serves chat), and the target's own answers (self-distilled,
    repeated likewise) when given. Held out: web validation documents and the held-out questions'
    chat. Returns (train_texts, {name: held-out texts}, a description for the training record).
    """
    corpus = load_corpus(data_dir, template_chat(tokenizer), self_answers)
    train = corpus["web_train"] + (corpus["chat_train"] + corpus["chat_self"]) * chat_repeat
    desc = {"dir": str(data_dir), "split": "web_train + (chat_train + chat_self) x chat_repeat",
            "chat_repeat": chat_repeat, "self_answers": None if self_answers is None else str(self_answers),
            "chat_format": "chat template" if getattr(tokenizer, "chat_template", None) else "USER/ASSISTANT",
            "sha256": corpus["sha256"]}
    return train, {"web": corpus["web_val"], "chat": corpus["chat_val"]}, desc
