"""Opening engines by name: planner/engines.py registers the kinds, this module opens them.

    engine = open_engine("hf", EngineRequest(model="smollm2-135m"))
    engine = open_engine("llama.cpp", EngineRequest(threads=2, context=1024))
    spec = kind_of(engine)                      # its EngineKind (caps, defaults, what it refuses)

An engine kind whose library is missing (`requires`) is installed on first use by its `install`
command, with the build's own progress on the terminal, or refused in one line that says how to
install it (TREE_PLANNER_NO_INSTALL=1, or a command that must not take minutes). Everything after
opening asks the engine's capabilities (`engine.caps`), never its name.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from planner.engines import DEFAULT, EngineKind, kind
from planner.errors import UserError

REPO = Path(__file__).resolve().parents[2]
NO_INSTALL = "TREE_PLANNER_NO_INSTALL"


@dataclass(frozen=True)
class EngineRequest:
    """What an opener may use. Every field has a default: an engine chooses what the user left open."""

    model: str | None = None  # registry model, builtin, preset, model directory, config.json or .gguf (None: the default)
    device: str | None = None  # engines with caps.devices beyond the CPU: cpu, cuda or cuda:N (None: the best present)
    dtype: str | None = None  # fp32, fp16, bf16 (None: the engine's choice)
    threads: int | None = None  # CPU threads (None: the library's choice, fewer on a busy machine)
    context: int | None = None  # tokens one sequence needs at most: engines with a fixed context size it from this
    weights: bool = True  # False: random weights will do (latency profiles of architectures)
    quant: str = "Q4_K"  # a random-filled GGUF's 4-bit type (llama.cpp, architecture presets)
    progress: bool = True
    install: bool = True  # install a missing library (kind.install) instead of refusing


def open_engine(name: str | None, request: EngineRequest | None = None):
    """The engine of kind `name` (None: the default) on `request`'s model."""
    spec = kind(name or DEFAULT)
    request = request or EngineRequest()
    ensure_installed(spec, request.install and not os.environ.get(NO_INSTALL), request.progress)
    return resolve(spec.opener)(request)


def resolve(opener: str):
    module, _, name = opener.partition(":")
    return getattr(importlib.import_module(module), name)


def installed(spec: EngineKind) -> bool:
    return spec.requires is None or importlib.util.find_spec(spec.requires) is not None


def ensure_installed(spec: EngineKind, install: bool = True, progress: bool = True) -> None:
    """The engine's library, installed now by its own command when missing (minutes: the build prints
    its progress), or a one-line error saying how to install it."""
    if installed(spec):
        return
    how = f"bash {spec.install}" if spec.install else f"pip install {spec.requires}"
    if not install or spec.install is None:
        raise UserError(f"--engine {spec.name}: {spec.requires} is not installed (run {how}, or bash scripts/setup.sh "
                        f"--engine {spec.name})")
    if progress:
        print(f"--engine {spec.name}: {spec.requires} is not installed; installing it now ({how}, once per machine; "
              f"set {NO_INSTALL}=1 to refuse instead)", file=sys.stderr, flush=True)
    script, *args = spec.install.split()
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(REPO / script), *args], env=env, check=False,
                          stdout=None if progress else subprocess.DEVNULL)
    importlib.invalidate_caches()
    if done.returncode != 0 or not installed(spec):
        raise UserError(f"--engine {spec.name}: installing {spec.requires} failed (exit code {done.returncode}); "
                        f"run {how} to see why")


def kind_of(engine) -> EngineKind:
    """The registered kind an opened engine is (by its caps)."""
    return kind(engine.caps.name)


def as_engine(target):
    """An engine for `target`: an engine stays as it is; a bare transformers model, or one loaded by
    decoder/engines/hf/load.py (library callers, tests), is the hf engine's."""
    if hasattr(target, "caps") and hasattr(target, "start"):
        return target
    from decoder.engines.hf.engine import HFEngine

    if hasattr(target, "config_hash") and hasattr(target, "model"):  # a LoadedModel
        return HFEngine(target.model, loaded=target)
    return HFEngine(target)
