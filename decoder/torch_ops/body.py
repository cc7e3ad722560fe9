"""A drafter's own decoder layers, for drafters that are networks of their own (ParallelSpec): a Llama
stack of the target's shape that reads input embeddings only, run with or without a KV cache.

    body = llama_body(arch, num_layers=1)           # arch: the target's shape (hidden size, heads, rope, ...)
    hidden = run_body(body, inputs, positions, mask, cache)   # [B, L, H] after the final norm
    cache = body_cache(body)                         # an empty KV cache for it
"""
from __future__ import annotations

import torch

from decoder.torch_ops.forward import kv


def llama_body(arch: dict, num_layers: int = 1):
    """A Llama decoder stack of `arch`'s shape; vocab_size 1: it reads inputs_embeds only (its embedding is
    never used)."""
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(vocab_size=1, num_hidden_layers=num_layers, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None, **arch))


def run_body(body, inputs: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             cache=None) -> torch.Tensor:
    """inputs [B, L, H] at position_ids [B, L] (additive mask [B, 1, L, C + L] or None: causal) -> the last
    hidden state [B, L, H] after the final norm; a cache grows by L."""
    out = body(inputs_embeds=inputs, position_ids=position_ids, attention_mask=attention_mask, **kv(cache),
               use_cache=cache is not None)
    return out.last_hidden_state


def body_cache(body):
    from transformers import DynamicCache

    return DynamicCache(config=body.config)
