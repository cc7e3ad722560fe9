"""KV compaction: keep only the accepted path, moved to contiguous positions after the prefix.

Works on transformers' DynamicCache (cache.layers[i].keys / .values, [B, H_kv, L, head_dim]),
sliding-window layers included while the context stays below the window;
no model code is touched. After a step over n tokens the cache holds prefix + n entries; the
accepted tree indices (root first, then the path) are gathered to prefix .. prefix + a and the
rest is cut, so memory never grows with rejected candidates or prompt tokens.
"""
from __future__ import annotations

import torch


@torch.inference_mode()
def compact_cache(cache, prefix_len: int, accepted: torch.Tensor) -> None:
    """accepted [a+1] long: step-input indices to keep, in order; the cache ends at prefix_len + a + 1."""
    keep = accepted.numel()
    src = accepted + prefix_len  # [a+1]
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        # advanced indexing copies first, so overlapping source and destination are safe
        layer.keys[:, :, prefix_len : prefix_len + keep] = layer.keys[:, :, src]
        layer.values[:, :, prefix_len : prefix_len + keep] = layer.values[:, :, src]
        layer.keys = layer.keys[:, :, : prefix_len + keep]
        layer.values = layer.values[:, :, : prefix_len + keep]
        if getattr(layer, "is_sliding", False):
            # sliding-window layers count tokens separately; the decoder keeps the whole context
            # below the window (checked in decoder.step), so keys hold every position
            layer.cumulative_length = prefix_len + keep
