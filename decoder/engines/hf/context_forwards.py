"""Forwards of new tokens after one fixed context, cut back to it after each use: what profiler/overlap.py
times for PEARL, the target's and its draft LM's passes at their shares of the cores (HFEngine.context_forwards).

    fw = ContextForwards(model, context)          # the context [C] prefilled once
    fw.forward(ids, positions)                    # ids [1, n] at positions [1, n] (from fw.context_length)
    fw.reset()                                    # the cache back to the context

Unlike the profiler's forward timer (decoder/engines/hf/timer.py: a random context, the decoder's tree mask)
these are plain causal chains after the caller's own context, as PEARL's two sides run them.
"""
from __future__ import annotations

import torch

from decoder.torch_ops.cache import crop_cache
from decoder.torch_ops.forward import kv, prefill


class ContextForwards:
    def __init__(self, model, context: torch.Tensor):
        self.model = model
        self.cache = prefill(model, context.reshape(1, -1)).cache
        self.context_length = self.cache.get_seq_length()
        self.vocab_size = int(model.config.vocab_size)  # the range random inputs are drawn from

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """One forward of input_ids [1, n] at position_ids [1, n] after the cache, which grows by n until reset.
        The positions are the caller's, so that building them stays outside what it times."""
        self.model(input_ids=input_ids, position_ids=position_ids, **kv(self.cache), use_cache=True)

    def reset(self) -> None:
        crop_cache(self.cache, self.context_length)
