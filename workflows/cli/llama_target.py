"""The llama.cpp target for the workflows: `--engine llama.cpp` on profile, accept, plan, decode, autotune.

    add_engine_argument(parser)               # --engine {hf,llama.cpp} (default hf), --n-ctx
    target = open_llama(model_spec, threads)  # LlamaTarget: the engine, the GGUF file, the chat tokenizer

--model names what llama.cpp runs: a registry model (smollm2-135m, the default: its own Q4_1 GGUF
file), a .gguf file, or an architecture preset (a random-filled GGUF written once into the cache,
decoder/engines/llama_cpp/gguf_random.py; profiling only, it has no tokenizer). Prompts are the model's chat template
applied by its Hugging Face tokenizer (workflows.cli.inputs.encode_prompts), and those exact ids are what
llama.cpp is fed.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from planner.errors import UserError
from planner.plan_settings import ENGINES  # one list: the engines a plan may name

DEFAULT_N_CTX = 4096


def add_engine_argument(p: argparse.ArgumentParser, extra: tuple[str, ...] = ()) -> None:
    p.add_argument("--engine", default=None, choices=list(ENGINES) + list(extra),
                   help="the target engine: hf (transformers, default) or llama.cpp (the model's GGUF file through "
                        "llama-cpp-python; --model smollm2-135m, a .gguf file, or a preset for profiling)"
                        + ("; with --simulate: graphs or eager" if extra else ""))
    p.add_argument("--n-ctx", type=int, default=DEFAULT_N_CTX, metavar="N",
                   help=f"--engine llama.cpp: KV cells, prompt + answer + one step (default {DEFAULT_N_CTX})")


@dataclass
class LlamaTarget:
    engine: object  # decoder.engines.llama_cpp.engine.LlamaEngine
    gguf: Path
    name: str  # what records call the model
    source: str  # registry | file | random preset
    tokenizer_dir: Path | None  # the chat template's tokenizer (None: a random preset)
    gguf_tokenizer: bool = False  # the tokenizer comes from the GGUF file itself (transformers reads it)

    def tokenizer(self):
        from transformers import AutoTokenizer

        if self.tokenizer_dir is None:
            raise UserError(f"--model {self.name}: a random-filled preset has no tokenizer; it is for "
                            "`planner profile --engine llama.cpp` only")
        if self.gguf_tokenizer:
            return AutoTokenizer.from_pretrained(self.gguf.parent, gguf_file=self.gguf.name)
        return AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def record(self) -> dict:
        return {"model": self.name, "model_source": self.source, "model_file": str(self.gguf),
                "has_weights": self.source != "random preset"}


def resolve_gguf(spec: str | None, quant: str = "Q4_K", progress: bool = True) -> tuple[Path, str, str, Path | None, bool]:
    """(GGUF file, name, source, tokenizer directory, tokenizer from the GGUF) for --model."""
    from decoder.engines.hf.load import PRESET_DIR
    from decoder.engines.shipped import MODELS, gguf_file, model_dir

    spec = spec or "smollm2-135m"
    if spec in MODELS:
        return gguf_file(spec), spec, "registry", model_dir(spec, progress=progress), False
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"--model {spec}: GGUF file not found")
        return path, path.stem, "file", path.parent, True
    if "/" not in spec and (PRESET_DIR / f"{spec}.json").is_file():
        from decoder.engines.llama_cpp.gguf_random import random_gguf

        return random_gguf(spec, quant, progress=progress), f"{spec}-random-{quant}", "random preset", None, False
    raise UserError(f"--engine llama.cpp: --model {spec}: expected a registry model ({', '.join(MODELS)}), a .gguf "
                    "file, or an architecture preset (planner profile --list-models)")


def open_llama(spec: str | None, threads: int | None = None, n_ctx: int = DEFAULT_N_CTX, quant: str = "Q4_K",
               progress: bool = True) -> LlamaTarget:
    from decoder.engines.llama_cpp.engine import LlamaEngine

    gguf, name, source, tok_dir, from_gguf = resolve_gguf(spec, quant, progress)
    engine = LlamaEngine(gguf, threads=busy_threads(threads), n_ctx=n_ctx)
    engine.model_name = name
    return LlamaTarget(engine, gguf, name, source, tok_dir, from_gguf)


def busy_threads(threads: int | None) -> int | None:
    """--threads as given; unset on a machine busier than its cores, 1 (with a note): llama.cpp's threads
    spin at every barrier, and a 2-thread forward then took 10-20x its quiet time (1 thread: 2-3x)."""
    import os
    import sys

    if threads is not None or not hasattr(os, "getloadavg"):
        return threads
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores and cores > 1:
        print(f"note: the machine is busy (load {load:.1f} on {cores} cores): llama.cpp runs 1 thread (pass --threads "
              "to choose); timings will be noisy", file=sys.stderr)
        return 1
    return threads


def is_llama(args) -> bool:
    return getattr(args, "engine", None) == "llama.cpp"


def refuse_hf_only(args, options: dict) -> None:
    """One line naming the first option given that the llama.cpp engine has no use for."""
    for flag, value in options.items():
        if value:
            raise UserError(f"{flag}: not with --engine llama.cpp (it belongs to the hf engine)")


def llama_plain_report(model_name: str, prompts: list, max_new_tokens: int, hf_tokens_per_s: float | None,
                       threads: int | None = None) -> dict:
    """llama.cpp plain decoding (llama-cpp-python's Llama.generate, greedy) of the model's own GGUF file on the
    hf main job's race prompts: which engine is faster on this machine. A reason instead when it cannot run."""
    import importlib.util
    import os
    import time

    from decoder.engines.shipped import MODELS, gguf_file

    if model_name not in MODELS:
        return {"skipped": f"no GGUF file ships for {model_name}"}
    if importlib.util.find_spec("llama_cpp") is None:
        return {"skipped": "llama-cpp-python is not installed (scripts/setup.sh builds it)"}
    from decoder.engines.llama_cpp.stock import StockLlama

    import torch

    before = torch.get_num_threads()
    stock = StockLlama(gguf_file(model_name), threads)
    stock.greedy(prompts[0], 8)  # warm-up
    tokens = seconds = 0
    t0 = time.time()
    for ids in prompts:
        toks, sec = stock.greedy(ids, max_new_tokens)
        tokens, seconds = tokens + len(toks), seconds + sec
    stock.close()
    torch.set_num_threads(before)
    tps = tokens / seconds if seconds > 0 else None
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tps, "threads": stock.threads,
            "vs_hf_plain": tps / hf_tokens_per_s if tps and hf_tokens_per_s else None,
            "load_avg_1m": round(os.getloadavg()[0], 2), "wall_s": time.time() - t0,
            "how": "llama-cpp-python Llama.generate (greedy) on the model's GGUF file, same race prompt ids and "
                   "new tokens; `planner autotune --engine llama.cpp` plans for that engine"}
