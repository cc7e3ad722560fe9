"""The load generator (profiler/load_generator.py) against a small fake OpenAI-compatible streaming
server written here with asyncio (no vLLM): concurrency stays bounded, timeouts and refusals are
recorded while the level goes on, TTFT/TPOT come out exactly from an injected clock, and Ctrl-C
cancels what is in flight and keeps what finished. The Prometheus parser
(profiler/serving_metrics.py) reads vLLM 0.32's speculative-decoding counters.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest

from planner.errors import UserError
from profiler.load_generator import LoadInterrupted, LoadLevel, TokenRequest, percentile, request_body, run_load
from profiler.serving_metrics import SpecDecodeCounters, parse_samples, spec_decode_counters
from profiler.workload import Request

HANG = 999_999  # a prompt starting with this token is never answered


class FakeClock:
    """A clock the fake server sets before each chunk; it waits until the client has read the time,
    so every chunk is timed at exactly the time the server chose."""

    def __init__(self):
        self.now = 0.0
        self.read = asyncio.Event()

    def __call__(self) -> float:
        self.read.set()
        return self.now


class FakeOpenAI:
    """Streams `max_tokens` tokens per request (ids prompt[-1]+1, +2, ...) in chunks of `chunks` sizes,
    `gap_s` apart (real sleeps, or steps of a FakeClock), then a usage chunk and [DONE]. Records
    the bodies it got and how many requests were in flight at most."""

    def __init__(self, gap_s: float = 0.0, chunks: list[int] | None = None, clock: FakeClock | None = None,
                 status: int = 200, done: bool = True, on_hang=None):
        self.gap_s, self.chunks, self.clock, self.status, self.done = gap_s, chunks, clock, status, done
        self.on_hang = on_hang
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = self.hanging = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader, writer):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            path, body = await _read_request(reader)
            self.bodies.append(body)
            if self.status != 200:
                raw = json.dumps({"error": {"message": "max_tokens is too large", "code": self.status}}).encode()
                writer.write(f"HTTP/1.1 {self.status} Bad Request\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            if "prompt" in body and body["prompt"][0] == HANG:
                self.hanging += 1
                if self.on_hang:
                    self.on_hang(self)
                await reader.read()  # until the client goes away
                return
            await self._stream(writer, path, body)
        finally:
            self.in_flight -= 1
            writer.close()

    async def _stream(self, writer, path, body):
        chat = path.endswith("/chat/completions")
        first = body["prompt"][-1] + 1 if not chat else 100
        sizes = self.chunks or [1] * body["max_tokens"]
        tok = first
        for n in sizes:
            ids = list(range(tok, tok + n))
            tok += n
            text = "".join(f"<{i}>" for i in ids)
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            await self._event(writer, {"choices": [choice]})
        await self._event(writer, {"choices": [], "usage": {"completion_tokens": tok - first}})
        if self.done:
            await self._send(writer, "data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _event(self, writer, event):
        if self.clock is not None:
            self.clock.now += self.gap_s
            self.clock.read.clear()
        else:
            await asyncio.sleep(self.gap_s)
        await self._send(writer, f"data: {json.dumps(event)}\n\n")
        if self.clock is not None:
            await asyncio.wait_for(self.clock.read.wait(), 10)

    @staticmethod
    async def _send(writer, text):
        data = text.encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()


async def _read_request(reader) -> tuple[str, dict]:
    request_line = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return request_line.split()[1].decode(), json.loads(body)


def _serve_and_run(server: FakeOpenAI, requests, concurrency=2, timeout_s=10.0, **kw):
    async def go():
        url = await server.start()
        try:
            return await LoadLevel(url, "m", requests, concurrency, timeout_s, **kw).run()
        finally:
            server.server.close()
    return asyncio.run(go())


def _tokens(prompt_last: int, n: int, **extras) -> TokenRequest:
    return TokenRequest(prompt_ids=[1, 2, prompt_last], max_tokens=n, extras=extras)


# ---------------------------------------------------------------------------------------------- timing

def test_ttft_tpot_and_itl_from_an_injected_clock():
    clock = FakeClock()
    # 0.25 s apart: the first request's tokens at 0.25, 0.5, 0.75, 1.0; usage at 1.25
    result = _serve_and_run(FakeOpenAI(gap_s=0.25, clock=clock), [_tokens(10, 4), _tokens(20, 2)],
                            concurrency=1, clock=clock)
    a, b = result.records
    assert a.ok and b.ok and not result.interrupted
    assert a.start_s == 0 and a.ttft_s == 0.25 and a.token_times_s == [0.25, 0.5, 0.75, 1.0]
    assert a.latency_s == 1.25 and a.output_tokens == 4 and a.token_ids == [11, 12, 13, 14]
    assert a.text == "<11><12><13><14>" and a.tpot_s == pytest.approx(0.25, rel=1e-12) and a.itl_s == [0.25] * 3
    assert b.start_s == 1.25 and b.ttft_s == 0.25 and b.tpot_s == pytest.approx(0.25) and b.token_ids == [21, 22]
    assert result.wall_s == 2.0 and result.output_tokens == 6 and result.output_tokens_per_s == 3.0
    assert result.ttft_p50_s == 0.25 and result.tpot_p50_s == pytest.approx(0.25)


def test_a_chunk_of_several_tokens_shares_its_time():
    """Speculative decoding streams the accepted tokens of a step in one chunk."""
    clock = FakeClock()
    result = _serve_and_run(FakeOpenAI(gap_s=0.5, chunks=[1, 3, 2], clock=clock), [_tokens(0, 6)],
                            concurrency=1, clock=clock)
    (r,) = result.records
    assert r.token_times_s == [0.5, 1.0, 1.0, 1.0, 1.5, 1.5] and r.output_tokens == 6
    assert r.tpot_s == pytest.approx((1.5 - 0.5) / 5) and r.itl_s == [0.5, 0.5]


def test_percentiles_interpolate_like_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


# ---------------------------------------------------------------------------------------------- load

@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_is_bounded_and_reached(concurrency):
    server = FakeOpenAI(gap_s=0.02)
    result = _serve_and_run(server, [_tokens(i, 5) for i in range(10)], concurrency=concurrency)
    assert server.max_in_flight == concurrency
    assert [r.index for r in result.records] == list(range(10)) and all(r.ok for r in result.records)
    assert result.output_tokens == 50 and result.concurrency == concurrency


def test_a_timeout_is_recorded_and_the_level_goes_on():
    server = FakeOpenAI()
    reqs = [_tokens(1, 3), TokenRequest([HANG], 3), _tokens(2, 3)]
    result = _serve_and_run(server, reqs, concurrency=3, timeout_s=0.5)
    ok, hung, ok2 = result.records
    assert ok.ok and ok2.ok and ok2.token_ids == [3, 4, 5]
    assert hung.timed_out and hung.error == "timeout after 0.5 s" and hung.latency_s is None
    assert result.timed_out == 1 and len(result.completed) == 2 and result.output_tokens == 6


def test_refusals_and_broken_streams_are_recorded():
    refused = _serve_and_run(FakeOpenAI(status=400), [_tokens(1, 3)]).records[0]
    assert refused.error == "HTTP 400: max_tokens is too large"
    cut = _serve_and_run(FakeOpenAI(done=False), [_tokens(1, 3)]).records[0]
    assert cut.error == "the stream ended without data: [DONE]" and cut.output_tokens == 3

    async def nobody():  # a port nothing listens on
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        return await LoadLevel(f"http://127.0.0.1:{port}", "m", [_tokens(1, 2)], 1, 5).run()
    gone = asyncio.run(nobody()).records[0]
    assert not gone.ok and "ConnectionRefusedError" in gone.error


def test_chat_requests_without_token_ids_count_text_chunks_and_usage():
    server = FakeOpenAI(chunks=[1, 2])
    req = Request(messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                  extras={"temperature": 0, "stream": False})
    result = _serve_and_run(server, [req], token_ids=False)
    (r,) = result.records
    assert r.ok and r.text == "<100><101><102>" and r.token_ids is None
    assert r.output_tokens == 3 and len(r.token_times_s) == 2  # the usage count wins over two text chunks
    (body,) = server.bodies
    assert body["messages"] == req.messages and body["temperature"] == 0 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and "return_token_ids" not in body


def test_request_bodies():
    path, raw = request_body(TokenRequest([5, 6], 8, {"seed": 1, "model": "other"}), "m", token_ids=True)
    body = json.loads(raw)
    assert path == "/v1/completions" and body["prompt"] == [5, 6] and body["max_tokens"] == 8
    assert body["model"] == "m" and body["seed"] == 1 and body["return_token_ids"] is True and body["stream"] is True
    with pytest.raises(UserError, match="expected http://HOST:PORT"):
        LoadLevel("https://example.com", "m", [], 1, 1)
    with pytest.raises(UserError, match="expected both positive"):
        LoadLevel("http://127.0.0.1:1", "m", [], 0, 1)


# ---------------------------------------------------------------------------------------------- Ctrl-C

def test_ctrl_c_cancels_in_flight_requests_and_keeps_what_finished():
    """SIGINT while two requests hang: run_load raises LoadInterrupted with the two finished ones,
    the hanging ones recorded as cancelled, and their connections closed."""
    interrupted = threading.Event()

    def interrupt(server):
        if server.hanging == 2 and not interrupted.is_set():
            interrupted.set()
            os.kill(os.getpid(), signal.SIGINT)

    server = FakeOpenAI(on_hang=interrupt)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    urls = []

    def serve():
        asyncio.set_event_loop(loop)
        urls.append(loop.run_until_complete(server.start()))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        reqs = [_tokens(1, 2), _tokens(2, 2), TokenRequest([HANG], 2), TokenRequest([HANG], 2)]
        with pytest.raises(LoadInterrupted) as e:  # concurrency 2: the hanging pair starts after the first pair ends
            run_load(urls[0], "m", reqs, concurrency=2, timeout_s=30)
        result = e.value.result
        assert isinstance(e.value, KeyboardInterrupt) and result.interrupted
        assert [r.ok for r in result.records] == [True, True, False, False]
        assert [r.error for r in result.records[2:]] == ["cancelled", "cancelled"]
        assert result.output_tokens == 4
        deadline = time.monotonic() + 5
        while server.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.in_flight == 0
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


# ---------------------------------------------------------------------------------------------- vLLM's metrics

# vLLM 0.32's /metrics (prometheus_client text), cut to the speculative-decoding counters and a neighbour.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.795765118379891e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 32.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="0"} 1.7957651183800516e+09
"""


def test_spec_decode_counters_from_vllm_metrics():
    c = spec_decode_counters(METRICS)
    assert c == SpecDecodeCounters(12.0, 32.0, 6.0, (4.0, 2.0, 0.0), True)
    assert c.acceptance_rate == 6 / 32 and c.mean_acceptance_length == 1.5
    assert c.acceptance_per_position == (4 / 12, 2 / 12, 0.0)
    later = spec_decode_counters(METRICS.replace("} 12.0", "} 20.0").replace('"0"} 4.0', '"0"} 9.0'))
    level = later - c
    assert (level.drafts, level.draft_tokens, level.accepted_tokens) == (8.0, 0.0, 0.0)
    assert level.accepted_per_position == (5.0, 0.0, 0.0) and level.acceptance_rate is None


def test_a_server_without_speculation_reads_as_zeros():
    c = spec_decode_counters(METRICS.split("# HELP vllm:spec_decode")[0])
    assert c == SpecDecodeCounters() and not c.speculating and c.mean_acceptance_length is None


def test_prometheus_labels_with_escapes_and_odd_lines():
    text = 'x{a="q\\"}",b="2"} 3.5 1700000000\nbroken line\ny NaN\nz{} 1e3\n'
    assert parse_samples(text)[0] == ("x", {"a": 'q\\"}', "b": "2"}, 3.5)
    assert [s[0] for s in parse_samples(text)] == ["x", "y", "z"]
