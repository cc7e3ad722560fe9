"""training.splits: the benchmark prompts share no text with training, acceptance or race prompts."""
from __future__ import annotations

import pytest

from planner.errors import UserError
from training.data import DEFAULT_DATA, QUESTIONS_FILE, WEB_FILE, read_jsonl
from training.splits import GROUPS, accept_and_race, bench_prompts

DATA_PRESENT = (DEFAULT_DATA / QUESTIONS_FILE).is_file() and (DEFAULT_DATA / WEB_FILE).is_file()
needs_data = pytest.mark.skipif(not DATA_PRESENT, reason="the shared data directory is not beside the repository")


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


@needs_data
def test_benchmark_prompts_are_disjoint_from_every_tuning_set():
    questions = read_jsonl(DEFAULT_DATA / QUESTIONS_FILE)
    every_question_turn = {_norm(t) for q in questions for t in q["turns"]}  # train, accept and race alike
    accept, race = accept_and_race(DEFAULT_DATA / QUESTIONS_FILE, 8, 8)
    assert len(accept) == len(race) == 8 and not set(accept) & set(race)
    web = [str(r.get("text", "")) for r in read_jsonl(DEFAULT_DATA / WEB_FILE)]
    web_train = [_norm(t) for i, t in enumerate(web) if i % 20 != 0]
    chat = bench_prompts("chat", 24)
    repeat = bench_prompts("repeat", 24)
    assert len(chat) == 24 and len(repeat) == 24
    assert len({p.id for p in chat + repeat}) == 48
    for p in chat + repeat:
        for turn in p.turns:
            t = _norm(turn)
            assert t not in every_question_turn
            assert not any(t in q or q in t for q in every_question_turn if len(q) > 40)
    # a repeat prompt built on a web document must quote a validation document, never a training one
    for p in repeat:
        body = _norm(p.turns[0].split("\n\n", 1)[-1])
        assert not any(body[:120] in doc for doc in web_train)


def test_bad_requests_fail_in_one_line(tmp_path):
    with pytest.raises(UserError, match="group"):
        bench_prompts("poetry", 1)
    with pytest.raises(UserError, match="chat prompts"):
        bench_prompts("chat", 1000)
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join('{"question_id": %d, "turns": ["q%d"]}' % (q, q) for q in range(81, 101)))
    with pytest.raises(UserError, match="held-out questions"):
        accept_and_race(f, 5, 5)
    assert GROUPS == ("chat", "repeat")
