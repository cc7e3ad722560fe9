"""Opening the llama.cpp engine (planner/engines.py's opener for "llama.cpp").

    engine = open_engine(EngineRequest(model="smollm2-135m", threads=2, context=1024))

--model names what llama.cpp runs: a registry model (smollm2-135m, the default: its own Q4_1 GGUF
file), a .gguf file, or an architecture preset (a random-filled GGUF written once into the cache,
decoder/engines/llama_cpp/gguf_random.py; profiling only, it has no tokenizer). Prompts are the
model's chat template applied by its Hugging Face tokenizer, and those exact ids are what llama.cpp
is fed. The context is sized to what the run needs (request.context, at least the kind's n_ctx
default, rounded up to 256 cells) and grows when a longer sequence comes (LlamaEngine.reserve).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.errors import UserError


@dataclass(frozen=True)
class GGUF:
    path: Path
    name: str  # what records call the model
    source: str  # registry | file | random preset
    tokenizer_dir: Path | None  # the chat template's tokenizer (None: a random preset)
    gguf_tokenizer: bool = False  # the tokenizer comes from the GGUF file itself (transformers reads it)


def resolve_gguf(spec: str | None, quant: str = "Q4_K", progress: bool = True) -> GGUF:
    """The GGUF file --model names, and where its tokenizer is."""
    from decoder.engines.models import DEFAULT_MODEL, is_preset, preset_names
    from decoder.engines.shipped import MODELS, gguf_file, model_dir

    spec = spec or DEFAULT_MODEL
    if spec in MODELS:
        return GGUF(gguf_file(spec), spec, "registry", model_dir(spec, progress=progress))
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"--model {spec}: GGUF file not found")
        return GGUF(path, path.stem, "file", path.parent, True)
    if is_preset(spec):
        from decoder.engines.llama_cpp.gguf_random import random_gguf

        return GGUF(random_gguf(spec, quant, progress=progress), f"{spec}-random-{quant}", "random preset", None)
    raise UserError(f"--engine llama.cpp: --model {spec}: expected a registry model ({', '.join(MODELS)}), a .gguf "
                    f"file, or an architecture preset ({', '.join(preset_names())})")


def tokenizer_of(g: GGUF):
    if g.tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    if g.gguf_tokenizer:
        return AutoTokenizer.from_pretrained(g.path.parent, gguf_file=g.path.name)
    return AutoTokenizer.from_pretrained(g.tokenizer_dir)


def open_engine(request):
    """A LlamaEngine on the GGUF file request.model names (decoder.engines.registry.EngineRequest)."""
    from decoder.engines.llama_cpp.engine import LlamaEngine
    from planner.engines import kind

    g = resolve_gguf(request.model, request.quant, request.progress)
    smallest = kind("llama.cpp").defaults.n_ctx or 256
    n_ctx = max(smallest, -(-(request.context or 0) // 256) * 256)
    record = {"model": g.name, "model_source": g.source, "has_weights": g.source != "random preset"}
    engine = LlamaEngine(g.path, threads=request.threads, n_ctx=n_ctx, tokenizer=tokenizer_of(g),
                         record=record)
    engine.model_name = g.name
    return engine
