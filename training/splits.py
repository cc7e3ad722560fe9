"""Which prompts each job may use: one place owns every split, so no benchmark reports a figure on
a prompt that trained a guesser or tuned a plan.

    train    MT-bench questions with question_id % 5 != 0 (and their answers), web documents whose
             index % 20 != 0: what the drafters and PPD prompt tokens learn from (training.data)
    accept   the held-out MT-bench questions, even places: autotune's acceptance pass and calibration
    race     the held-out MT-bench questions, odd places: the plans autotune races
             (with turns=2 each question gives two prompts: its first turn, and its second turn asked
             after Vicuna's answer to the first, as a user's follow-up is: `Chat`)
    bench    prompts no tuning step reads: hand-written two-turn chats (bench/data/bench_chat.jsonl)
             and requests that repeat their input (rewrite, summarise, edit, extract) built on
             hand-written texts (bench/data/rewrite_prompts.jsonl) and on web documents of the
             validation split (index % 20 == 0, never trained on), all but its last TUNE_PASSAGES
    tune     input-repeating requests on those last TUNE_PASSAGES validation documents: the serving
             main job's default traffic beside the held-out questions (even places: acceptance, odd:
             race), so it tunes on both kinds of request the serving benchmark sends, never on its texts

`tests/test_splits.py` checks that the sets do not overlap, text against text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from planner.errors import UserError
from training.data import ANSWERS_FILE, DEFAULT_DATA, QUESTIONS_FILE, WEB_FILE, held_out_question, read_jsonl

REPO = Path(__file__).resolve().parents[1]
BENCH_DATA = REPO / "bench" / "data"
BENCH_CHAT = BENCH_DATA / "bench_chat.jsonl"
BENCH_REWRITE = BENCH_DATA / "rewrite_prompts.jsonl"
GROUPS = ("single", "chat", "repeat")  # single-turn chats, follow-up turns, input-repeating requests

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
    group: str  # single | chat | repeat
    turns: tuple[str, ...]


ANSWER_CHARS = 1200  # a previous answer in a follow-up prompt is cut near this (prefill stays bounded)


@dataclass(frozen=True)
class Chat:
    """A conversation up to the assistant's next answer: turns alternate user, assistant, ..., user."""

    turns: tuple[str, ...]

    def messages(self) -> list[dict]:
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t.strip()} for i, t in enumerate(self.turns)]


def _questions(questions_path: str | Path) -> list[tuple[int, list[str]]]:
    path = Path(questions_path)
    if not path.is_file():
        raise UserError(f"{path}: file not found (the MT-bench questions; give another with --questions)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            turns = [str(t) for t in q["turns"]]
            if not turns:
                raise IndexError
            rows.append((int(q["question_id"]), turns))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
            raise UserError(f"{path}: line {i + 1}: expected a JSON object with 'question_id' and 'turns'") from None
    return [(qid, turns) for qid, turns in rows if held_out_question(qid)]


def tuning_questions(questions_path: str | Path = DEFAULT_DATA / QUESTIONS_FILE) -> list[tuple[int, str]]:
    """(question_id, first turn) of the MT-bench questions held out of all training, in file order."""
    return [(qid, turns[0]) for qid, turns in _questions(questions_path)]


def _cut(text: str, chars: int = ANSWER_CHARS) -> str:
    """`text` cut at the last paragraph or sentence end before `chars` (whole when shorter)."""
    if len(text) <= chars:
        return text
    head = text[:chars]
    end = max(head.rfind("\n\n"), head.rfind(". ") + 1)
    return head[:end].rstrip() if end > chars // 3 else head


def _follow_ups(questions_path: Path, held: list[tuple[int, list[str]]]) -> dict[int, Chat]:
    """question_id -> its second turn asked after Vicuna's first answer (the answers file beside the
    questions file; training never reads the held-out questions' answers)."""
    answers_path = Path(questions_path).parent / ANSWERS_FILE
    if not answers_path.is_file():
        raise UserError(f"{answers_path}: file not found (the answers a follow-up prompt quotes; "
                        "without it race on first turns only: --turns 1)")
    answers = {}
    for row in read_jsonl(answers_path):
        try:
            answers[int(row["question_id"])] = str(row["turns"][0])
        except (KeyError, IndexError, TypeError, ValueError):
            raise UserError(f"{answers_path}: expected objects with 'question_id' and 'turns' (the answers)") from None
    out = {}
    for qid, turns in held:
        if len(turns) < 2 or qid not in answers:
            raise UserError(f"{questions_path}: question {qid} has no second turn, or {answers_path.name} no answer "
                            "to it; race on first turns only: --turns 1")
        out[qid] = Chat((turns[0], _cut(answers[qid]), turns[1]))
    return out


def accept_and_race(questions_path: str | Path, n_accept: int, n_race: int, turns: int = 1) -> tuple[list, list]:
    """The held-out questions in two disjoint sets: acceptance (even places), race (odd places).
    Interleaved so both span the categories (the file groups questions by category).

    turns=2: each question gives its first turn and then its follow-up (a `Chat`), one after the
    other, so a cut after any even count keeps a question's two prompts together (the race's
    selection and confirmation never share a question)."""
    if turns not in (1, 2):
        raise UserError(f"turns: expected 1 or 2, got {turns}")
    held = _questions(questions_path)
    follow = _follow_ups(Path(questions_path), held) if turns == 2 else {}
    prompts = [[t[0]] + ([follow[qid]] if turns == 2 else []) for qid, t in held]
    accept = [p for q in prompts[0::2] for p in q]
    race = [p for q in prompts[1::2] for p in q]
    if n_accept > len(accept) or n_race > len(race):
        raise UserError(f"{questions_path}: {len(held)} held-out questions give at most {len(accept)} "
                        f"acceptance and {len(race)} race prompts ({turns} per question); asked for {n_accept} and {n_race}")
    return accept[:n_accept], race[:n_race]


def question_of(prompts: int, turns: int) -> dict[int, int]:
    """prompt index -> its question's index, for a list accept_and_race made with `turns` (a
    question's prompts sit in a row): the race keeps one question on one side (workflows.mainjob.choose)."""
    return {p: p // turns for p in range(prompts)}


TUNE_PASSAGES = 32  # the validation documents' last ones: tuning's input-repeating requests, never benchmarked
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
    """The first n benchmark prompts of a group: single (the hand-written chats' first turns, asked
    alone), chat (two-turn, hand-written: the follow-up is timed) or repeat (the hand-written rewrite
    requests, then the REQUESTS in turn on validation web documents)."""
    if group not in GROUPS:
        raise UserError(f"benchmark prompts: group {group!r}, expected one of {', '.join(GROUPS)}")
    if n < 0:
        raise UserError(f"benchmark prompts: expected a count >= 0, got {n}")
    if group in ("single", "chat"):
        rows = read_jsonl(BENCH_CHAT)
        if n > len(rows):
            raise UserError(f"{BENCH_CHAT}: {len(rows)} chat prompts, {n} asked for")
        if group == "single":
            return [BenchPrompt(f"{r['id']}-1", "single", (str(r["turns"][0]),)) for r in rows[:n]]
        return [BenchPrompt(str(r["id"]), "chat", tuple(str(t) for t in r["turns"])) for r in rows[:n]]
    out = [BenchPrompt(f"r{i:02d}", "repeat", (str(r["text"]),)) for i, r in enumerate(read_jsonl(BENCH_REWRITE))]
    if n > len(out):
        texts = _passages(Path(data_dir), 1 << 30, chars)[:-TUNE_PASSAGES]  # the tail is tuning's
        for i, text in enumerate(texts[: n - len(out)]):
            out.append(BenchPrompt(f"w{i:02d}", "repeat", (REQUESTS[i % len(REQUESTS)].format(text),)))
    if n > len(out):
        raise UserError(f"benchmark prompts: {len(out)} repeat prompts available, {n} asked for")
    return out[:n]


def tuning_repeats(n_accept: int, n_race: int, data_dir: str | Path = DEFAULT_DATA,
                   chars: int = 480) -> tuple[list[str], list[str]]:
    """Input-repeating requests on the last TUNE_PASSAGES validation documents (bench_prompts leaves them
    out) in two disjoint halves, acceptance (even places) and race (odd places). Neighbouring documents
    share a request (REQUESTS in turn by pair), so both halves ask the same tasks in the same order."""
    texts = _passages(Path(data_dir), 1 << 30, chars)
    tail = texts[-TUNE_PASSAGES:] if len(texts) > TUNE_PASSAGES else []
    asks = [REQUESTS[(j // 2) % len(REQUESTS)].format(t) for j, t in enumerate(tail)]
    accept, race = asks[0::2], asks[1::2]
    if n_accept > len(accept) or n_race > len(race):
        raise UserError(f"{Path(data_dir) / WEB_FILE}: {len(texts)} validation documents leave {len(accept)} "
                        f"acceptance and {len(race)} race input-repeating requests; asked for {n_accept} and {n_race}")
    return accept[:n_accept], race[:n_race]
