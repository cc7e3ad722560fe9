"""training.splits: the benchmark prompts share no text with training, acceptance or race prompts."""
from __future__ import annotations

import json

import pytest

from planner.errors import UserError
from training.data import DEFAULT_DATA, QUESTIONS_FILE, WEB_FILE, read_jsonl
from training.splits import ANSWER_CHARS, GROUPS, TUNE_PASSAGES, Chat, accept_and_race, bench_prompts, tuning_repeats

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
    accept2, race2 = accept_and_race(DEFAULT_DATA / QUESTIONS_FILE, 16, 16, turns=2)
    assert accept2[0::2] == accept and race2[0::2] == race  # a question's first turn, then its follow-up
    assert all(isinstance(c, Chat) and len(c.turns) == 3 for c in accept2[1::2] + race2[1::2])
    assert [c.turns[0] for c in race2[1::2]] == race and not {c.turns for c in accept2[1::2]} & {c.turns for c in race2[1::2]}
    web = [str(r.get("text", "")) for r in read_jsonl(DEFAULT_DATA / WEB_FILE)]
    web_train = [_norm(t) for i, t in enumerate(web) if i % 20 != 0]
    chat = bench_prompts("chat", 64)
    repeat = bench_prompts("repeat", 144)  # every one: the serving benchmark sends each once per server
    assert len(chat) == 64 and len(repeat) == 144
    assert len({p.id for p in chat + repeat}) == 208
    assert len({p.turns[0] for p in chat}) == 64 and len({p.turns[0] for p in repeat}) == 144  # distinct texts
    with pytest.raises(UserError, match="144 repeat prompts available, 145 asked for"):
        bench_prompts("repeat", 145)  # the last TUNE_PASSAGES documents are tuning's
    tune_a, tune_r = tuning_repeats(16, 16)
    assert TUNE_PASSAGES == 32 and len(set(tune_a)) == len(set(tune_r)) == 16 and not set(tune_a) & set(tune_r)
    bodies = {_norm(t.split("\n\n", 1)[-1])[:120] for t in tune_a + tune_r}
    assert not any(b in _norm(p.turns[0]) for p in repeat for b in bodies)  # never a benchmark text
    assert not any(b in doc for doc in web_train for b in bodies)  # never a training one
    assert [t.split("\n\n")[0] for t in tune_a] == [t.split("\n\n")[0] for t in tune_r]  # the same tasks
    for p in chat + repeat:
        for turn in p.turns:
            t = _norm(turn)
            assert t not in every_question_turn
            assert not any(t in q or q in t for q in every_question_turn if len(q) > 40)
    answers = [_norm(c.turns[1]) for c in accept2[1::2] + race2[1::2]]  # what the follow-ups quote
    for p in chat + repeat:
        assert not any(_norm(t)[:200] in a or a[:200] in _norm(t) for t in p.turns for a in answers)
    # a repeat prompt built on a web document must quote a validation document, never a training one
    for p in repeat:
        body = _norm(p.turns[0].split("\n\n", 1)[-1])
        assert not any(body[:120] in doc for doc in web_train)


def test_bad_requests_fail_in_one_line(tmp_path):
    with pytest.raises(UserError, match="group"):
        bench_prompts("poetry", 1)
    with pytest.raises(UserError, match="chat prompts"):
        bench_prompts("chat", 1000)
    with pytest.raises(UserError, match="16 acceptance and 16 race input-repeating requests; asked for 17 and 1"):
        tuning_repeats(17, 1)
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join('{"question_id": %d, "turns": ["q%d"]}' % (q, q) for q in range(81, 101)))
    with pytest.raises(UserError, match="held-out questions"):
        accept_and_race(f, 5, 5)
    with pytest.raises(UserError, match="vicuna7b_mt_bench_answers.jsonl: file not found .*--turns 1"):
        accept_and_race(f, 1, 1, turns=2)
    (tmp_path / "vicuna7b_mt_bench_answers.jsonl").write_text('{"question_id": 85, "turns": ["a"]}\n')
    with pytest.raises(UserError, match="question 85 has no second turn"):
        accept_and_race(f, 1, 1, turns=2)
    with pytest.raises(UserError, match="turns: expected 1 or 2"):
        accept_and_race(f, 1, 1, turns=3)


def test_a_follow_up_quotes_the_answer_cut_at_a_sentence(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join('{"question_id": %d, "turns": ["q%d", "again %d"]}' % (q, q, q) for q in (85, 90)))
    long = "One sentence here. " * 200
    (tmp_path / "vicuna7b_mt_bench_answers.jsonl").write_text(
        '{"question_id": 85, "turns": ["short answer", "x"]}\n' + json.dumps({"question_id": 90, "turns": [long]}) + "\n")
    accept, race = accept_and_race(f, 2, 2, turns=2)
    assert accept == ["q85", Chat(("q85", "short answer", "again 85"))]
    cut = race[1].turns[1]
    assert cut.endswith("here.") and ANSWER_CHARS // 3 < len(cut) <= ANSWER_CHARS and long.startswith(cut)
    assert race[1].messages() == [{"role": "user", "content": "q90"}, {"role": "assistant", "content": cut},
                                  {"role": "user", "content": "again 90"}]
    assert GROUPS == ("single", "chat", "repeat")
    single, chat = bench_prompts("single", 2), bench_prompts("chat", 2)
    assert [p.turns for p in single] == [c.turns[:1] for c in chat] and {p.group for p in single} == {"single"}


def test_a_follow_up_is_encoded_as_its_conversation():
    from transformers import AutoTokenizer

    from workflows.cli.inputs import REPO, encode_prompts

    tok = AutoTokenizer.from_pretrained(REPO / "models" / "builtin")  # no chat template: its training format
    one, chat = encode_prompts(tok, ["q1", Chat(("q1", "the answer", "q2"))])
    assert tok.decode(chat, skip_special_tokens=False).replace(" ", "").endswith(
        "USER:q1ASSISTANT:theanswer</s>USER:q2ASSISTANT:")
    assert chat[: one.numel() - 1].tolist() == one[:-1].tolist()  # the first turn, as asked alone


def test_question_of_keeps_a_questions_turns_together():
    from training.splits import question_of

    assert question_of(4, 2) == {0: 0, 1: 0, 2: 1, 3: 1} and question_of(3, 1) == {0: 0, 1: 1, 2: 2}
