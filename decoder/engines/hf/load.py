"""Loading a Hugging Face model for the hf engine: a local directory with weights, or a config with
random weights (latency does not depend on the values).

A model without weights is allocated on the target device with initialisation skipped and filled
cheaply (uniform noise of the configured std, norms at one); a 7B model never goes through a full
random init on the CPU. Nothing is ever downloaded: every load is local. What a --model spec names
(registry model, built-in, preset, directory, config file) is decoder/engines/models.py's.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from decoder.engines.models import resolve_spec
from planner.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
NOISE_BLOCK = 1_000_003  # elements of noise tiled over big CPU tensors (odd length: rows do not repeat in step)
# Keys that say nothing about the architecture; left out of the config hash.
UNHASHED_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}


@dataclass
class LoadedModel:
    model: object  # a transformers PreTrainedModel in eval mode, on its device
    name: str
    config_hash: str
    source: str  # "preset" | "dir" | "config"
    has_weights: bool
    tokenizer_dir: str | None


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> None:
    if device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?|meta", str(device)):
        raise UserError(f"--device: expected cpu, cuda or cuda:N, got '{device}'")


def resolve_dtype(dtype: str | None, device: str):
    import torch

    names = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
             "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if dtype is None:
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in names:
        raise UserError(f"--dtype: unknown dtype '{dtype}', expected one of fp32, fp16, bf16")
    return names[dtype]


def dtype_name(dtype) -> str:
    return {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}[str(dtype)]


def config_hash(config) -> str:
    """sha256 (16 hex) of the architecture fields of a transformers config."""
    d = {k: v for k, v in config.to_dict().items() if k not in UNHASHED_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _load_config(path: Path):
    from transformers import AutoConfig

    from planner.jsonio import read_json

    file = path / "config.json" if path.is_dir() else path
    data = read_json(file)
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"{file}: field 'model_type' missing (expected a Hugging Face model config)")
    data = {k: v for k, v in data.items() if k not in ("torch_dtype", "dtype")}
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"{file}: not a usable config ({str(e).splitlines()[0]})") from None


def _fill_cheaply(model, std: float) -> None:
    """Give uninitialised parameters finite values with the model's init scale, cheaply: uniform
    noise with the std of the usual normal init (norms at 1, biases at 0). On the CPU, random
    generation is the slow part, so one block of noise is generated and tiled (a memory copy);
    latency does not depend on the values. Seeded: the same preset gets the same weights whatever
    drew from torch's global generator before (a run, or a test, must not depend on what ran first)."""
    import torch

    bound = std * math.sqrt(3.0)
    block = None
    gens: dict = {}  # one seeded generator per device

    def gen(device):
        if device not in gens:
            gens[device] = torch.Generator(device=device).manual_seed(0)
        return gens[device]

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif p.device.type != "cpu" or p.numel() <= NOISE_BLOCK:
                p.uniform_(-bound, bound, generator=gen(p.device))
            else:
                if block is None:
                    block = torch.empty(NOISE_BLOCK, dtype=p.dtype).uniform_(-bound, bound, generator=gen(p.device))
                flat = p.view(-1)
                k = flat.numel() // NOISE_BLOCK
                flat[: k * NOISE_BLOCK].view(k, NOISE_BLOCK).copy_(block.to(p.dtype).expand(k, NOISE_BLOCK))
                flat[k * NOISE_BLOCK:].copy_(block[: flat.numel() - k * NOISE_BLOCK].to(p.dtype))


def load_model(spec: str, device: str | None = None, dtype: str | None = None, weights: bool = True) -> LoadedModel:
    """Build or load `spec` (registry model, preset name, model directory, or config.json) on `device`.

    device "meta" builds shapes only (no memory, no fill): used to check big presets cheaply.
    weights=False: random weights will do (latency profiles), so a registry model whose package
    is missing falls back to its architecture.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    check_device(device)
    name, source, path = resolve_spec(spec, weights)
    device = device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine")
    torch_dtype = resolve_dtype(dtype, device)
    config = _load_config(path)
    has_weights = path.is_dir() and any(any(path.glob(g)) for g in WEIGHT_GLOBS)
    tokenizer_dir = str(path) if path.is_dir() and any((path / f).is_file() for f in TOKENIZER_FILES) else None

    if has_weights and device != "meta":
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=torch_dtype, local_files_only=True
            ).to(device)  # not device_map=: that needs accelerate
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: cannot load weights ({str(e).splitlines()[0]})") from None
    else:
        has_weights = False
        try:
            with torch.device(device), no_init_weights():
                model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            if not isinstance(e, torch.cuda.OutOfMemoryError) and "memory" not in str(e):
                raise
            raise UserError(f"model '{name}': out of memory building it on {device} in {dtype_name(torch_dtype)}") from None
        model.tie_weights()  # transformers ties inside init_weights, which no_init_weights skips
        if device != "meta":
            _fill_cheaply(model, getattr(config, "initializer_range", 0.02))
    model.eval()
    return LoadedModel(model, name, config_hash(config), source, has_weights, tokenizer_dir)


def max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)
