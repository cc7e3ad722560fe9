"""The target's own torch modules, for drafters built on them (ParallelSpec's frozen embedding and head,
PPD prompt tokens' initial rows): asked of the engine (Engine.token_modules, caps.torch_modules), or read
off a bare transformers model, which tests and training hand over directly.

    embedding, head = token_modules(target)
    meta = model_meta(target)        # what a drafter's files record about the target they fit
"""
from __future__ import annotations

import hashlib
import json

import torch

from decoder.engine import Needs, refuse


def token_modules(target) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(input embedding, LM head) of an engine that lends them, or of a bare transformers model."""
    if hasattr(target, "caps"):
        if not target.caps.torch_modules:
            refuse(target.caps, "this", Needs(hf_model=True))
        return target.token_modules()
    return target.get_input_embeddings(), target.get_output_embeddings()


def config_fingerprint(config) -> str:
    """Short hash of the fields that decide whether embeddings fit a model."""
    keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    d = {k: getattr(config, k, None) for k in keys}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def model_meta(target) -> dict:
    """The target's name (and a bare model's config fingerprint), as files fitted to it record them."""
    if hasattr(target, "caps"):
        return {"model": target.model_name}
    cfg = target.config
    return {"model": getattr(cfg, "name_or_path", "") or getattr(cfg, "model_type", ""),
            "model_config_hash": config_fingerprint(cfg)}
