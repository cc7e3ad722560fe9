"""Read the user's serving workload: the requests a load test sends, one `Request` each.

    from profiler.workload import read_workload
    requests = read_workload("chats.jsonl")  # [Request(messages=[...], max_tokens=128, extras={...}), ...]

Two forms, told apart by the file's first character:
- JSON lines (OpenAI chat completions): one request per line,
  `{"messages": [{"role": "user", "content": "..."}], "max_tokens": 128, "temperature": 0}`;
  `max_completion_tokens` (OpenAI's newer name) is read as max_tokens; other fields are kept in
  `extras` and sent as they are. Blank lines are skipped.
- ShareGPT, as vLLM's serving benchmark reads it: a JSON list of
  `{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}, ...]}`.
  The first human turn is the prompt; the gpt turn after it sets max_tokens when the caller gives
  `output_len` (a token counter: this module loads no tokenizer), else `default_max_tokens` does.
  Conversations without a human turn are skipped (real ShareGPT dumps hold some), as vLLM does.
A malformed request is refused with a one-line UserError naming the file, the line (or the list
entry) and what was expected. Pure Python: no torch at import.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from planner.errors import UserError

MAX_TOKENS = 32768  # longest answer one request may ask for
MAX_REQUESTS = 100_000  # a load test sends every request it reads: more is a mistake, not a workload
DEFAULT_MAX_TOKENS = 256  # ShareGPT without a token counter
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields the load generator sets itself (the served model's name, streaming): dropped from extras.
OWNED = ("model", "stream", "stream_options")
HUMAN, GPT = ("human", "user"), ("gpt", "assistant")


@dataclass(frozen=True)
class Request:
    """One chat-completions request: the messages, the answer's length cap, every other OpenAI field."""
    messages: list[dict[str, Any]]
    max_tokens: int
    extras: dict[str, Any] = field(default_factory=dict)


def read_workload(path: str | Path, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                  output_len: Callable[[str], int] | None = None, limit: int | None = None,
                  max_requests: int = MAX_REQUESTS) -> list[Request]:
    """The requests of a workload file (either form), the first `limit` when given (ShareGPT dumps
    hold tens of thousands); a one-line UserError on the first bad one or past `max_requests`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; expected JSON lines or a ShareGPT JSON list") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    if text.lstrip().startswith("["):
        requests = _sharegpt(path, text, default_max_tokens, output_len, limit, max_requests)
    else:
        requests = _json_lines(path, text, limit, max_requests)
    if not requests:
        raise UserError(f"{path}: no requests; expected JSON lines of chat requests or a ShareGPT JSON list")
    return requests


# ---------------------------------------------------------------------------------------------- JSON lines

def _json_lines(path: Path, text: str, limit: int | None, max_requests: int) -> list[Request]:
    out: list[Request] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(out) == limit:
            break
        where = f"{path}: line {lineno}"
        if len(out) == max_requests:
            raise UserError(f"{where}: more than {max_requests} requests; split the workload")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); expected one request "
                            '{"messages": [...], "max_tokens": N} per line') from None
        out.append(_chat_request(where, row))
    return out


def _chat_request(where: str, row: Any) -> Request:
    if not isinstance(row, dict):
        raise UserError(f'{where}: expected a JSON object {{"messages": [...], "max_tokens": N}}, '
                        f"got {type(row).__name__}")
    if "messages" not in row and "conversations" in row:
        raise UserError(f"{where}: a ShareGPT conversation on its own; a ShareGPT file is a JSON list of them "
                        '(or give chat requests {"messages": [...], "max_tokens": N}, one per line)')
    if "messages" not in row:
        raise UserError(f"{where}: no 'messages'; expected a list of {{\"role\", \"content\"}} objects")
    messages = _messages(where, row["messages"])
    if "max_tokens" in row and "max_completion_tokens" in row:
        raise UserError(f"{where}: both 'max_tokens' and 'max_completion_tokens'; give one")
    key = "max_completion_tokens" if "max_completion_tokens" in row else "max_tokens"
    if key not in row:
        raise UserError(f"{where}: no 'max_tokens'; expected an integer 1..{MAX_TOKENS}")
    max_tokens = _max_tokens(f"{where}: '{key}'", row[key])
    if row.get("n", 1) != 1:
        raise UserError(f"{where}: 'n' is {row['n']!r}; the load generator reads one answer per request (n 1)")
    extras = {k: v for k, v in row.items() if k not in ("messages", "max_tokens", "max_completion_tokens", *OWNED)}
    return Request(messages=messages, max_tokens=max_tokens, extras=extras)


def _messages(where: str, messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"{where}: messages[{i}] must be an object with a 'role' ({', '.join(ROLES)})")
        if m["role"] not in ROLES:
            raise UserError(f"{where}: messages[{i}] has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        content = m.get("content")
        # A list is OpenAI's content parts form ([{"type": "text", "text": ...}]), sent as it is.
        if not (isinstance(content, str) or (isinstance(content, list) and all(isinstance(p, dict) for p in content))):
            raise UserError(f"{where}: messages[{i}] 'content' must be a string or a list of content parts")
    return messages


def _max_tokens(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        raise UserError(f"{where} is {value!r}; expected an integer 1..{MAX_TOKENS}")
    return value


# ---------------------------------------------------------------------------------------------- ShareGPT

def _sharegpt(path: Path, text: str, default_max_tokens: int, output_len: Callable[[str], int] | None,
              limit: int | None, max_requests: int) -> list[Request]:
    _max_tokens(f"{path}: default max_tokens", default_max_tokens)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); expected a ShareGPT "
                        'list of {"conversations": [...]}') from None
    out: list[Request] = []
    for i, row in enumerate(rows):
        if len(out) == limit:
            break
        where = f"{path}: entry {i}"
        turns = _conversation(where, row)
        prompt = next((j for j, t in enumerate(turns) if t["from"] in HUMAN and t["value"].strip()), None)
        if prompt is None:
            continue  # no question to ask
        if len(out) == max_requests:
            raise UserError(f"{where}: more than {max_requests} requests; split the workload")
        answer = turns[prompt + 1]["value"] if prompt + 1 < len(turns) and turns[prompt + 1]["from"] in GPT else None
        max_tokens = default_max_tokens
        if output_len is not None and answer is not None:
            max_tokens = min(max(1, int(output_len(answer))), MAX_TOKENS)
        out.append(Request(messages=[{"role": "user", "content": turns[prompt]["value"]}], max_tokens=max_tokens))
    return out


def _conversation(where: str, row: Any) -> list[dict[str, str]]:
    expected = 'expected {"conversations": [{"from": "human"|"gpt", "value": "..."}, ...]}'
    if not isinstance(row, dict) or not isinstance(row.get("conversations"), list):
        raise UserError(f"{where}: {expected}")
    for j, t in enumerate(row["conversations"]):
        if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
            raise UserError(f"{where}: conversations[{j}] must have string 'from' and 'value'; {expected}")
    return row["conversations"]
