"""Send requests to an OpenAI-compatible server, at most N at a time, and time every streamed token.

    from profiler.load_generator import TokenRequest, run_load
    requests = [TokenRequest(prompt_ids=ids, max_tokens=64, extras={"temperature": 0}) for ids in prompts]
    result = run_load("http://127.0.0.1:8000", "m", requests, concurrency=8, timeout_s=120)
    result.output_tokens_per_s, result.tpot_p50_s, result.ttft_p50_s, result.records[0].token_ids

A `TokenRequest` goes to /v1/completions with the prompt as token ids (the ids the project's other
benchmarks feed, so no chat template or tokenizer differs); a workload `Request` (profiler/workload.py)
goes to /v1/chat/completions. Every request streams (server-sent events over chunked transfer
encoding) with `stream_options.include_usage`, and, unless `token_ids=False`, vLLM's
`return_token_ids`, which puts each chunk's new token ids beside its text. A chunk may carry several
tokens (speculative decoding accepts several per step): they share the chunk's arrival time.

Standard library only (asyncio streams, no aiohttp): the project's environment has no HTTP client
for asyncio. Plain http:// only, one connection per request, no proxy. The clock is injectable so
tests can fix every time. Ctrl-C (or cancelling `LoadLevel.run`) cancels the requests in flight and
keeps what finished: `run_load` raises `LoadInterrupted` (a KeyboardInterrupt) carrying the result.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union
from urllib.parse import urlsplit

from planner.errors import UserError
from profiler.workload import Request

MAX_ERROR_BODY = 1 << 16  # bytes of a refused request's answer read for its message


@dataclass(frozen=True)
class TokenRequest:
    """A /v1/completions request on prompt token ids; `extras` are sent as they are (temperature, seed)."""
    prompt_ids: list[int]
    max_tokens: int
    extras: dict[str, Any] = field(default_factory=dict)


AnyRequest = Union[TokenRequest, Request]


@dataclass
class RequestRecord:
    """One request's timeline. Times are seconds: `start_s` after the level began, the rest after sending."""
    index: int
    start_s: float
    ttft_s: float | None = None  # the first output token
    token_times_s: list[float] = field(default_factory=list)  # every output token (a chunk's tokens share its time)
    latency_s: float | None = None  # the end of the stream
    output_tokens: int = 0  # the server's usage count when it sends one, else the tokens streamed
    token_ids: list[int] | None = None  # None when the server does not return ids
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None  # None: completed; else one line ("timeout after 30 s", "HTTP 400: ...", "cancelled")
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last token - first token) / (tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2 or not self.token_times_s:
            return None
        return (self.token_times_s[-1] - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between successive chunks that carried tokens."""
        times = sorted(set(self.token_times_s))
        return [b - a for a, b in zip(times, times[1:])]


@dataclass
class LoadResult:
    """One concurrency level: every request sent (by index), the level's wall time, and aggregates
    over the completed requests."""
    concurrency: int
    wall_s: float
    records: list[RequestRecord]
    interrupted: bool = False

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.completed)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def step_p50_s(self) -> float | None:
        """The median gap between a request's successive token-carrying chunks, over every completed
        request: the server's step while requests decode (a chunk per step, with every token the step
        accepted). The median leaves out the steps stalled by another request's prefill."""
        return percentile([g for r in self.completed for g in r.itl_s], 50)

    @property
    def tpot_p50_s(self) -> float | None:
        return percentile([r.tpot_s for r in self.completed if r.tpot_s is not None], 50)

    @property
    def tpot_p99_s(self) -> float | None:
        return percentile([r.tpot_s for r in self.completed if r.tpot_s is not None], 99)

    @property
    def ttft_p50_s(self) -> float | None:
        return percentile([r.ttft_s for r in self.completed if r.ttft_s is not None], 50)

    @property
    def timed_out(self) -> int:
        return sum(r.timed_out for r in self.records)

    def summary(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "requests": len(self.records), "completed": len(self.completed),
                "timed_out": self.timed_out, "interrupted": self.interrupted, "wall_s": self.wall_s,
                "output_tokens": self.output_tokens, "output_tokens_per_s": self.output_tokens_per_s,
                "step_p50_s": self.step_p50_s,
                "tpot_p50_s": self.tpot_p50_s, "tpot_p99_s": self.tpot_p99_s, "ttft_p50_s": self.ttft_p50_s}


class LoadInterrupted(KeyboardInterrupt):
    """Ctrl-C during `run_load`: the requests in flight were cancelled; `result` holds what finished."""

    def __init__(self, result: LoadResult):
        super().__init__(f"interrupted after {len(result.completed)} of {len(result.records)} requests")
        self.result = result


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between ranks (numpy's default); None when empty."""
    if not values:
        return None
    s = sorted(values)
    rank = (len(s) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def run_load(url: str, model: str, requests: Sequence[AnyRequest], concurrency: int, timeout_s: float,
             token_ids: bool = True, clock: Callable[[], float] = time.perf_counter) -> LoadResult:
    """Send every request, at most `concurrency` in flight; `LoadInterrupted` on Ctrl-C."""
    level = LoadLevel(url, model, requests, concurrency, timeout_s, token_ids=token_ids, clock=clock)
    try:
        return asyncio.run(level.run())
    except KeyboardInterrupt:
        raise LoadInterrupted(level.result(interrupted=True)) from None


class LoadLevel:
    """One load level. `await run()` sends everything; after a cancellation `result(interrupted=True)`
    holds what finished (the requests in flight recorded as "cancelled")."""

    def __init__(self, url: str, model: str, requests: Sequence[AnyRequest], concurrency: int, timeout_s: float,
                 token_ids: bool = True, clock: Callable[[], float] = time.perf_counter):
        if concurrency < 1 or timeout_s <= 0:
            raise UserError(f"load level: concurrency {concurrency} and timeout {timeout_s} s; expected both positive")
        self.host, self.port, self.base_path = _parse_url(url)
        self.model, self.requests, self.concurrency, self.timeout_s = model, list(requests), concurrency, timeout_s
        self.token_ids, self.clock = token_ids, clock
        self._records: dict[int, RequestRecord] = {}
        self._t0: float | None = None
        self._t_end: float | None = None

    async def run(self) -> LoadResult:
        self._t0 = self.clock()
        pending = iter(enumerate(self.requests))
        # `concurrency` workers, each sending the next request when its last one ends: at most that
        # many in flight, and no task per request waiting on a semaphore (a workload may be long).
        n = min(self.concurrency, len(self.requests))
        workers = [asyncio.ensure_future(self._worker(pending)) for _ in range(n)]
        try:
            await asyncio.gather(*workers)
        except BaseException:  # cancelled (Ctrl-C): no request may outlive the level
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        finally:
            self._t_end = self.clock()
        return self.result()

    def result(self, interrupted: bool = False) -> LoadResult:
        """The records so far (by index) and the level's wall time, from its start to its end (or now)."""
        if self._t0 is None:
            return LoadResult(self.concurrency, 0.0, [], interrupted)
        wall = (self._t_end if self._t_end is not None else self.clock()) - self._t0
        return LoadResult(self.concurrency, wall, [self._records[i] for i in sorted(self._records)], interrupted)

    async def _worker(self, pending) -> None:
        for index, request in pending:
            await self._one(index, request)

    async def _one(self, index: int, request: AnyRequest) -> None:
        sent = self.clock()
        rec = self._records[index] = RequestRecord(index=index, start_s=sent - self._t0)
        path, body = request_body(request, self.model, self.token_ids)
        try:
            await asyncio.wait_for(self._exchange(self.base_path + path, body, rec, sent), self.timeout_s)
        except asyncio.TimeoutError:
            rec.error, rec.timed_out = f"timeout after {self.timeout_s:g} s", True
        except asyncio.CancelledError:
            rec.error = "cancelled"
            raise
        except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError, ProtocolError) as e:
            # refused, reset, cut short or not JSON: this request failed, the level goes on
            rec.error = _one_line(f"{type(e).__name__}: {e}" if not isinstance(e, ProtocolError) else str(e))

    async def _exchange(self, path: str, body: bytes, rec: RequestRecord, sent: float) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                    f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode() + body)
            await writer.drain()
            status, headers = await _read_head(reader)
            stream = _Body(reader, headers)
            if status != 200:
                raise ProtocolError(f"HTTP {status}: {_error_message(await stream.read_all(MAX_ERROR_BODY))}")
            events = _Events(stream)
            while (data := await events.next()) != "[DONE]":
                if data is None:
                    raise ProtocolError("the stream ended without data: [DONE]")
                _take(rec, json.loads(data), self.clock() - sent)
            rec.latency_s = self.clock() - sent
        finally:
            writer.close()  # no wait_closed: a cancelled request must not wait on the server


def request_body(request: AnyRequest, model: str, token_ids: bool) -> tuple[str, bytes]:
    """(path, JSON body) of one streamed request; the harness's own fields win over `extras`."""
    if isinstance(request, TokenRequest):
        path, fields = "/v1/completions", {"prompt": [int(t) for t in request.prompt_ids]}
    else:
        path, fields = "/v1/chat/completions", {"messages": request.messages}
    body = {**request.extras, **fields, "model": model, "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if token_ids:
        body["return_token_ids"] = True  # vLLM: each chunk's new token ids beside its text
    return path, json.dumps(body).encode()


def _take(rec: RequestRecord, event: dict[str, Any], t: float) -> None:
    """Fold one streamed chunk into the record: its tokens (arriving at t), text, finish and usage."""
    if "error" in event:
        err = event["error"]
        raise ProtocolError(f"server error: {err.get('message', err) if isinstance(err, dict) else err}")
    if event.get("usage") and event["usage"].get("completion_tokens") is not None:
        rec.output_tokens = int(event["usage"]["completion_tokens"])  # the server's count wins
    for choice in event.get("choices") or []:
        text = (choice["delta"].get("content") or "") if "delta" in choice else (choice.get("text") or "")
        ids = choice.get("token_ids")
        n = len(ids) if ids is not None else int(bool(text))
        if ids is not None:
            rec.token_ids = rec.token_ids if rec.token_ids is not None else []
            rec.token_ids.extend(int(x) for x in ids)
        if n and rec.ttft_s is None:
            rec.ttft_s = t
        rec.token_times_s += [t] * n
        rec.output_tokens = max(rec.output_tokens, len(rec.token_times_s))
        rec.text += text
        rec.finish_reason = choice.get("finish_reason") or rec.finish_reason


# ---------------------------------------------------------------------------------------------- HTTP and SSE

class ProtocolError(Exception):
    """The server's answer is not a streamed completion (a refusal, a broken stream)."""


def _parse_url(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise UserError(f"server url {url!r}: expected http://HOST:PORT (plain http, no TLS)")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    try:
        status = int(status_line.split()[1])
    except (IndexError, ValueError):
        raise ProtocolError(f"not an HTTP answer: {status_line[:80]!r}") from None
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


class _Body:
    """An HTTP body, chunked or not, read piece by piece as it arrives."""

    def __init__(self, reader: asyncio.StreamReader, headers: dict[str, str]):
        self.reader = reader
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self.left = int(length) if length is not None and not self.chunked else None
        self.done = False

    async def read(self) -> bytes:
        """The next piece; b"" at the end."""
        if self.done:
            return b""
        if self.chunked:
            size_line = await self.reader.readline()
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size {size_line[:40]!r}") from None
            if size == 0:
                self.done = True
                return b""
            data = await self.reader.readexactly(size)
            await self.reader.readexactly(2)  # the CRLF after each chunk
            return data
        data = await self.reader.read(65536 if self.left is None else min(65536, self.left))
        if self.left is not None:
            self.left -= len(data)
        self.done = not data or self.left == 0
        return data

    async def read_all(self, limit: int) -> bytes:
        out = b""
        while len(out) < limit and (piece := await self.read()):
            out += piece
        return out[:limit]


class _Events:
    """Server-sent events: the `data:` payload of each event (lines up to a blank line)."""

    def __init__(self, body: _Body):
        self.body, self.buffer, self.data = body, b"", []

    async def next(self) -> str | None:
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                line = line.rstrip(b"\r")
                if not line:
                    if self.data:
                        event, self.data = "\n".join(self.data), []
                        return event
                elif line.startswith(b"data:"):
                    self.data.append(line[5:].decode("utf-8").removeprefix(" "))
            piece = await self.body.read()
            if not piece:
                event, self.data = ("\n".join(self.data) if self.data else None), []
                return event
            self.buffer += piece


def _error_message(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _one_line(raw.decode("utf-8", "replace")) or "(no body)"
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    msg = err.get("message") or err.get("detail") if isinstance(err, dict) else None
    return _one_line(str(msg if msg is not None else doc))


def _one_line(text: str, width: int = 300) -> str:
    return " ".join(text.split())[:width]
