"""KV-cache bookkeeping: crop, and compact to the accepted path.

Works on transformers' DynamicCache (cache.layers[i].keys / .values, [B, H_kv, L, head_dim]),
sliding-window layers included while the context stays below the window; no model code is
touched. After a step over n tokens the cache holds prefix + n entries; the accepted tree
indices (root first, then the path) are moved to prefix .. prefix + a and the rest is cut, so
memory never grows with rejected candidates or prompt tokens.

One `compact_cache` serves both paths: indexed copies in PyTorch (any device), or the Triton
`kv_compact` kernel (one launch for all layers) on CUDA.
"""
from __future__ import annotations

import torch


def crop_cache(cache, length: int) -> None:
    """Drop cache entries past `length` in every layer."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)  # a negative count removes that many tokens in every transformers version


def _filled_layers(cache) -> list:
    return [layer for layer in cache.layers if layer.keys is not None and layer.keys.numel()]  # skip lazy, empty layers


@torch.inference_mode()
def compact_cache(cache, prefix_len: int, accepted: torch.Tensor, kernel: bool = False, validate: bool = True,
                  nodes: list[int] | None = None) -> int:
    """Keep the step-input indices `accepted` [a+1] (strictly increasing) after the first
    `prefix_len` entries; the cache ends at prefix_len + a + 1, which is returned.

    kernel: move the rows with the Triton kv_compact kernel (one launch for all layers; on the CPU
    its reference). validate=False skips the kernel's host-side index check (a device sync): the
    decoder passes it because a verified path is increasing by construction.
    nodes: `accepted` on the host, when the caller has it: a path 0, 1, .., a (a plain step, a chain
    accepted from its start) is already in place, so the cache is only cut (60 copies fewer a step).
    """
    keep = accepted.numel()
    if nodes is not None and nodes == list(range(keep)):
        crop_cache(cache, prefix_len + keep)
        return prefix_len + keep
    layers = _filled_layers(cache)
    if kernel:
        from kernels import kv_compact

        kv_compact([layer.keys for layer in layers], [layer.values for layer in layers], prefix_len, accepted,
                   validate=validate)
        crop_cache(cache, prefix_len + keep)
        return prefix_len + keep
    src = accepted + prefix_len  # [a+1]
    for layer in layers:
        # advanced indexing copies first, so overlapping source and destination are safe
        layer.keys[:, :, prefix_len: prefix_len + keep] = layer.keys[:, :, src]
        layer.values[:, :, prefix_len: prefix_len + keep] = layer.values[:, :, src]
        layer.keys = layer.keys[:, :, : prefix_len + keep]
        layer.values = layer.values[:, :, : prefix_len + keep]
        if getattr(layer, "is_sliding", False):
            # sliding-window layers count tokens separately; the decoder keeps the whole context
            # below the window (checked in decoder.loop), so keys hold every position
            layer.cumulative_length = prefix_len + keep
    return prefix_len + keep
