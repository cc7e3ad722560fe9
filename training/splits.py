"""Which prompts each job may use: one place owns every split, so no benchmark reports a figure on
a prompt that trained a guesser or tuned a plan.

    train    MT-bench questions with question_id % 5 != 0 (and their answers), web documents whose
             index % 20 != 0: what the drafters and PPD prompt tokens learn from (training.data)
    accept   the held-out MT-bench questions, even places: autotune's acceptance pass and calibration
    race     the held-out MT-bench questions, odd places: the plans autotune races
    bench    prompts no tuning step reads: hand-written two-turn chats (bench/data/bench_chat.jsonl)
             and requests that repeat their input (rewrite, summarise, edit, extract) built on
             hand-written texts (bench/data/rewrite_prompts.jsonl) and on web documents of the
             validation split (index % 20 == 0, never trained on)

`tests/test_splits.py` checks that the sets do not overlap, text against text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner.errors import UserError
from training.data import DEFAULT_DATA, QUESTIONS_FILE, WEB_FILE, held_out_question, read_jsonl

REPO = Path(__file__).resolve().parents[1]
BENCH_DATA = REPO / "bench" / "data"
BENCH_CHAT = BENCH_DATA / "bench_chat.jsonl"
BENCH_REWRITE = BENCH_DATA / "rewrite_prompts.jsonl"
GROUPS = ("chat", "repeat")

# What a user asks of a text they paste: the answer repeats much of it (prompt lookup's best case).
REQUESTS = (
    "Summarise the following text in a few sentences, reusing its wording where you can.\n\n{}",
    "Rewrite the following text in simpler words, keeping every fact.\n\n{}",
    "Correct any grammar or spelling mistakes in the following text and return the whole corrected text.\n\n{}",
    "List the main facts stated in the following text as bullet points.\n\n{}",
)


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: `turns` are user turns (a two-turn chat is answered turn by turn)."""

    id: str
    group: str  # chat | repeat
    turns: tuple[str, ...]


def tuning_questions(questions_path: str | Path = DEFAULT_DATA / QUESTIONS_FILE) -> list[tuple[int, str]]:
    """(question_id, first turn) of the MT-bench questions held out of all training, in file order."""
    path = Path(questions_path)
    if not path.is_file():
        raise UserError(f"{path}: file not found (the MT-bench questions; give another with --questions)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            rows.append((int(q["question_id"]), str(q["turns"][0])))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
            raise UserError(f"{path}: line {i + 1}: expected a JSON object with 'question_id' and 'turns'") from None
    return [(qid, text) for qid, text in rows if held_out_question(qid)]


def accept_and_race(questions_path: str | Path, n_accept: int, n_race: int) -> tuple[list[str], list[str]]:
    """The held-out questions in two disjoint sets: acceptance (even places), race (odd places).
    Interleaved so both span the categories (the file groups questions by category)."""
    held = [text for _, text in tuning_questions(questions_path)]
    if n_accept > (len(held) + 1) // 2 or n_race > len(held) // 2:
        raise UserError(f"{questions_path}: {len(held)} held-out questions give at most {(len(held) + 1) // 2} "
                        f"acceptance and {len(held) // 2} race prompts; asked for {n_accept} and {n_race}")
    return held[0::2][:n_accept], held[1::2][:n_race]


SHINGLE = 10  # words: a validation text sharing this many consecutive words with a training text is left out


def _shingles(text: str) -> set[tuple[str, ...]]:
    w = text.lower().split()
    return {tuple(w[i: i + SHINGLE]) for i in range(max(len(w) - SHINGLE + 1, 0))}


def _passages(data_dir: Path, n: int, chars: int) -> list[str]:
    """Web documents of the validation split (never trained on), cut at a sentence end near
    `chars`; a document that shares a run of SHINGLE words with a training document (the web
    file has near-duplicates: boilerplate, syndicated text) is skipped."""
    rows = read_jsonl(Path(data_dir) / WEB_FILE)
    train: set[tuple[str, ...]] = set()
    for i, row in enumerate(rows):
        if i % 20 != 0:  # training documents (training.data.load_corpus)
            train |= _shingles(str(row.get("text", "")))
    out = []
    for i, row in enumerate(rows):
        text = str(row.get("text", "")).strip()
        if i % 20 != 0 or len(text) < chars:
            continue
        cut = text[:chars]
        cut = cut[: cut.rfind(". ") + 1] or cut
        if _shingles(cut) & train:
            continue
        out.append(cut)
        if len(out) == n:
            break
    return out


def bench_prompts(group: str, n: int, data_dir: str | Path = DEFAULT_DATA, chars: int = 480) -> list[BenchPrompt]:
    """The first n benchmark prompts of a group: chat (two-turn, hand-written) or repeat (the
    hand-written rewrite requests, then the REQUESTS in turn on validation web documents)."""
    if group not in GROUPS:
        raise UserError(f"benchmark prompts: group {group!r}, expected one of {', '.join(GROUPS)}")
    if n < 0:
        raise UserError(f"benchmark prompts: expected a count >= 0, got {n}")
    if group == "chat":
        rows = read_jsonl(BENCH_CHAT)
        if n > len(rows):
            raise UserError(f"{BENCH_CHAT}: {len(rows)} chat prompts, {n} asked for")
        return [BenchPrompt(str(r["id"]), "chat", tuple(str(t) for t in r["turns"])) for r in rows[:n]]
    out = [BenchPrompt(f"r{i:02d}", "repeat", (str(r["text"]),)) for i, r in enumerate(read_jsonl(BENCH_REWRITE))]
    if n > len(out):
        for i, text in enumerate(_passages(Path(data_dir), n - len(out), chars)):
            out.append(BenchPrompt(f"w{i:02d}", "repeat", (REQUESTS[i % len(REQUESTS)].format(text),)))
    if n > len(out):
        raise UserError(f"benchmark prompts: {len(out)} repeat prompts available, {n} asked for")
    return out[:n]
