"""The workload file (profiler/workload.py): chat-completions JSON lines and ShareGPT lists are read
into requests; every kind of malformed request is refused in one line naming the file and the line
(or the list entry); sizes are bounded."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.errors import UserError
from profiler.workload import MAX_TOKENS, Request, read_workload

ROOT = Path(__file__).resolve().parents[1]


def _lines(tmp_path: Path, *rows, name: str = "w.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _refused(path: Path, **kw) -> str:
    with pytest.raises(UserError) as e:
        read_workload(path, **kw)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_chat_lines_keep_every_other_field(tmp_path):
    path = _lines(tmp_path,
                  {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                   "max_tokens": 32, "temperature": 0.7, "top_p": 0.9},
                  "",  # blank lines are skipped
                  {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
                   "max_completion_tokens": 8, "model": "gpt-x", "stream": False})
    reqs = read_workload(path)
    assert reqs == [
        Request([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], 32,
                {"temperature": 0.7, "top_p": 0.9}),
        # the model's name and streaming are the load generator's: dropped
        Request([{"role": "user", "content": [{"type": "text", "text": "parts"}]}], 8, {}),
    ]
    assert read_workload(path, limit=1) == reqs[:1]


def test_sharegpt_first_human_turn_and_answer_length(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "four five six"},
                               {"from": "human", "value": "and 3+3?"}]},
            {"conversations": [{"from": "gpt", "value": "no question"}]},  # skipped, as vLLM's benchmark does
            {"conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": "Name a colour."}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(rows))
    reqs = read_workload(path, default_max_tokens=64)
    assert reqs == [Request([{"role": "user", "content": "What is 2+2?"}], 64),
                    Request([{"role": "user", "content": "Name a colour."}], 64)]
    words = read_workload(path, output_len=lambda text: len(text.split()))  # the gpt turn sets max_tokens
    assert [r.max_tokens for r in words] == [3, 256]


@pytest.mark.parametrize("row, expected", [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ({"max_tokens": 4}, "line 2: no 'messages'"),
    ({"messages": [], "max_tokens": 4}, "line 2: 'messages' must be a non-empty list"),
    ({"messages": "hi", "max_tokens": 4}, "line 2: 'messages' must be a non-empty list"),
    ({"messages": [{"content": "hi"}], "max_tokens": 4}, "line 2: messages[0] must be an object with a 'role'"),
    ({"messages": [{"role": "robot", "content": "hi"}], "max_tokens": 4}, "line 2: messages[0] has role 'robot'"),
    ({"messages": [{"role": "user", "content": 3}], "max_tokens": 4}, "line 2: messages[0] 'content' must be"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "line 2: no 'max_tokens'"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     "line 2: 'max_tokens' is 0; expected an integer 1.."),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS + 1}, f"is {MAX_TOKENS + 1}"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, "'max_tokens' is '8'"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, "'max_tokens' is True"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_completion_tokens": 4}, "give one"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}, "'n' is 2"),
])
def test_a_malformed_line_is_refused_with_file_and_line(tmp_path, row, expected):
    good = {"messages": [{"role": "user", "content": "fine"}], "max_tokens": 4}
    msg = _refused(_lines(tmp_path, good, row))
    assert expected in msg


@pytest.mark.parametrize("rows, expected", [
    ({"conversations": []}, "line 1: a ShareGPT conversation on its own; a ShareGPT file is a JSON list"),
    ([{"conversations": [{"from": "human", "value": "q"}]}, {"turns": []}], "entry 1: expected {\"conversations\""),
    ([{"conversations": [{"from": "human"}]}], "entry 0: conversations[0] must have string 'from' and 'value'"),
    ([], "no requests"),
])
def test_a_malformed_sharegpt_entry_is_refused(tmp_path, rows, expected):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(rows))
    assert expected in _refused(path)


def test_bounds_and_unreadable_files(tmp_path):
    good = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 4}
    assert "line 4: more than 3 requests" in _refused(_lines(tmp_path, *[good] * 4), max_requests=3)
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": "q"}]}] * 4))
    assert "entry 3: more than 3 requests" in _refused(sg, max_requests=3)
    assert "default max_tokens is 0" in _refused(sg, default_max_tokens=0)
    assert "file not found" in _refused(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert "no requests" in _refused(tmp_path / "empty.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    assert "not UTF-8" in _refused(tmp_path / "bin.jsonl")
    (tmp_path / "bad.json").write_text("[{")
    assert "not valid JSON" in _refused(tmp_path / "bad.json")


def test_imports_without_torch():
    code = "import sys, profiler.workload; print(any(m.split('.')[0] == 'torch' for m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
