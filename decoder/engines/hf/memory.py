"""Whether a forward fits: the model's positions and this machine's memory, checked before profiling
(a 7B model's long forwards would otherwise die half-way through a run)."""
from __future__ import annotations

import torch

from planner.errors import UserError


def check_lengths(input_lengths: list[int], context_length: int, max_positions: int | None, model=None,
                  batch_size: int = 1, device=None) -> None:
    """Every length must fit the model's positions and, with `model`, this machine's memory."""
    if context_length < 1:
        raise UserError(f"--context-length: must be at least 1, got {context_length}")
    if max_positions is not None and context_length + max(input_lengths) > max_positions:
        raise UserError(
            f"--input-lengths: length {max(input_lengths)} exceeds the model's maximum position "
            f"(context {context_length} + {max(input_lengths)} > max_position_embeddings {max_positions}; "
            f"longest allowed {max_positions - context_length})"
        )
    if model is not None:
        need = forward_bytes(model, max(input_lengths), context_length, batch_size)
        free = available_bytes(torch.device(device) if device is not None else next(model.parameters()).device)
        if free is not None and need > 0.8 * free:
            raise UserError(f"--input-lengths/--context-length/--batch-size: a forward over {max(input_lengths)} tokens "
                            f"after {context_length} at batch {batch_size} needs about {need / 2**30:.1f} GiB, "
                            f"{free / 2**30:.1f} GiB are free")


def forward_bytes(model, n: int, context_length: int, batch_size: int = 1) -> int:
    """Rough peak memory of one forward over n new tokens: fp32 logits, the KV cache, activations."""
    cfg = model.config.get_text_config()
    item = next(model.parameters()).element_size()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = 2 * cfg.num_hidden_layers * (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim * item
    logits = n * cfg.vocab_size * 4
    activations = n * (cfg.hidden_size * 8 + getattr(cfg, "intermediate_size", 4 * cfg.hidden_size) * 3) * item
    scores = heads * n * (context_length + n) * 4  # one layer's attention scores at a time
    return batch_size * (logits + (context_length + n) * kv + activations + scores)


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device (CPU: MemAvailable), None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
