"""llama-cpp-python's low-level library, loaded once per process: the engine (engine.py) and its
stock generation (stock.py) both start here. The build matters: with the llamafile matmul path on
(llama.cpp's default), a multi-token evaluation rounds differently from a one-token one, so the
engine warns once (scripts/install_engine.sh builds it off)."""
from __future__ import annotations

import ctypes
import os
import sys

from planner.errors import UserError

MAX_THREADS = 256


def llama_lib():
    """llama_cpp's low-level module, or a one-line error saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise UserError("--engine llama.cpp: llama-cpp-python is not installed (run bash scripts/setup.sh --engine "
                        "llama.cpp: it builds it with the llamafile matmul path off)") from None
    return llama_cpp


_BACKEND: dict = {}


def _backend(lib) -> None:
    """Initialise llama.cpp once per process, with its log silenced (it prints every load to stderr)."""
    if _BACKEND:
        return
    quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda level, text, data: None)
    lib.llama_log_set(quiet, ctypes.c_void_p(0))
    lib.llama_backend_init()
    _BACKEND["log"] = quiet  # keep the callback alive as long as the library may call it


def system_info() -> str:
    lib = llama_lib()
    _backend(lib)
    return lib.llama_print_system_info().decode(errors="replace")


def llamafile_build() -> bool:
    """True when llama.cpp was built with the llamafile matmul path (GGML_LLAMAFILE=ON, the default):
    its multi-token evaluation then rounds differently from one-token evaluation."""
    return "LLAMAFILE = 1" in system_info()


def build_info() -> dict:
    lib = llama_lib()
    return {"llama_cpp_python": getattr(lib, "__version__", "?"), "system_info": system_info().strip(),
            "llamafile": llamafile_build()}


def _warn_llamafile() -> None:
    if not _BACKEND.get("warned") and llamafile_build():
        print("note: this llama.cpp was built with the llamafile matmul path (GGML_LLAMAFILE=ON): its multi-token "
              "steps round differently from one-token steps, so guesses may change greedy output; rebuild with "
              "scripts/install_engine.sh", file=sys.stderr)
    _BACKEND["warned"] = True


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def check_threads(threads: int | None, flag: str = "--threads") -> int:
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise UserError(f"{flag}: expected an integer in 1..{MAX_THREADS}, got {threads!r}")
    return threads
