"""The serving engine: an engine that runs as a server (vLLM), the second engine protocol beside
decoder/engine.py's `Engine`.

    engine = open_engine("vllm", EngineRequest(model="smollm2-135m"))     # decoder/engines/registry.py
    with engine.server(speculative_config={"method": "suffix"}, plugin=True) as server:
        ...  # load at server.url (profiler/load_generator.py); counters at server.url + "/metrics"

A step engine is stepped from this process (start, score, commit, a forward timer); a serving engine is
never stepped here: it starts a server for one speculative config, the load generator drives it over
HTTP, its metrics page counts what speculation drafted and accepted (profiler/serving_metrics.py), and
it stops. The main job picks its phases by the protocol (planner/engines.py `EngineKind.protocol`,
workflows/mainjob/phases.py), so a second serving engine (llama-server, SGLang) implements these two
protocols and registers, and the serving main job runs on it unchanged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from planner.engines import EngineCaps


class Server(Protocol):
    """One running server of one config; a context manager that starts it and stops all of its processes."""

    url: str  # http://host:port: the OpenAI-compatible API, GET /health, GET /metrics
    served_model_name: str  # the "model" field requests name

    def __enter__(self) -> Server:
        ...

    def __exit__(self, *exc) -> None:
        ...

    def start(self) -> Server:
        """Start and wait until it answers; a config the engine refuses is a one-line UserError with its reason."""
        ...

    def stop(self) -> None:
        """Stop every process of the server; safe to call twice."""
        ...

    def alive(self) -> bool:
        ...

    def why_stopped(self) -> str:
        """The engine's own reason a server stopped (its log's last error), for a one-line report."""
        ...

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache, so a pass that repeats earlier prompts prefills them as new traffic would."""
        ...


class ServingEngine(Protocol):
    """A model a server program serves: what the serving main job, `planner profile` and `planner accept`
    reach it through (decoder/engines/vllm/open.py is vLLM's)."""

    caps: EngineCaps
    model_name: str
    model_dir: Path  # the folder the server loads
    python: Path  # the interpreter of the engine's own environment (its profile and acceptance workers run there)

    def server(self, speculative_config: dict | None = None, plugin: bool = False, **kwargs) -> Server:
        """A server of this model with `speculative_config` (None: plain decoding), not started yet; `plugin`:
        with this project's engine plugin switched on (vLLM: a schedule's K = 0 runs the plain path)."""
        ...
