"""What a --model spec names, for every engine: a registry model (SmolLM2, its weights shipped as a
package), the built-in toy model, an architecture preset (a config only: random weights for
profiling), a local Hugging Face directory, or a config.json file. Each engine's opener turns the
answer into its own model (decoder/engines/hf/load.py, decoder/engines/llama_cpp/open.py).
"""
from __future__ import annotations

from pathlib import Path

from decoder.engines import shipped as packaged
from planner.errors import UserError

PRESET_DIR = Path(__file__).resolve().parent / "presets"
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILTIN_DIR = REPO_ROOT / "models" / "builtin"
DEFAULT_MODEL = "smollm2-135m"  # the default of profile, accept, train-prompts, decode and autotune
SHIPPED_DIR = REPO_ROOT / "models"  # models/<model name>/<guesser files>: what ships with the repository


def preset_names() -> list[str]:
    return sorted(set([p.stem for p in PRESET_DIR.glob("*.json")] + ["builtin"] + list(packaged.MODELS)))


def default_model_spec() -> str:
    return DEFAULT_MODEL


def is_preset(spec: str) -> bool:
    return "/" not in spec and (PRESET_DIR / f"{spec}.json").is_file()


def resolve_spec(spec: str, weights: bool = True) -> tuple[str, str, Path]:
    """spec -> (name, source, path): path is a directory (with config.json) or a config file.

    A registry model (smollm2-135m) resolves to its converted directory in the cache; when its
    package is missing and the caller needs no weights (profiling), to its architecture preset.
    """
    if spec in packaged.MODELS:
        try:
            return spec, "dir", packaged.model_dir(spec)
        except UserError:
            if weights or not is_preset(spec):
                raise
            return spec, "preset", PRESET_DIR / f"{spec}.json"
    if spec == "builtin":
        if not (BUILTIN_DIR / "config.json").is_file():
            raise UserError(f"preset 'builtin': {BUILTIN_DIR}/config.json not found (train it with scripts/train_builtin.py)")
        return "builtin", "dir", BUILTIN_DIR
    if is_preset(spec):
        return spec, "preset", PRESET_DIR / f"{spec}.json"
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: directory has no config.json (expected a Hugging Face model directory)")
        return path.resolve().name, "dir", path
    if path.is_file():
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
        return name, "config", path
    if "/" in spec or spec.endswith(".json"):
        raise UserError(f"{spec}: file not found (expected a preset name, a model directory or a config.json)")
    raise UserError(f"unknown model preset '{spec}' (presets: {', '.join(preset_names())}; or pass a model directory or config.json)")


def shipped(model_name: str, files: str) -> Path | None:
    """The guesser files shipped for a named model (builtin, smollm2-135m): models/<name>/<files>, files
    prompt_tokens, parallelspec or draft_lm; None when nothing ships for it."""
    d = SHIPPED_DIR / model_name / files
    return d if d.is_dir() else None
