"""A transformers causal LM as a drafter (decoder/drafter.py's protocol): the draft LM's KV cache and passes."""
from __future__ import annotations

import torch

from decoder.drafter import DraftPass
from decoder.torch_ops.cache import compact_cache
from decoder.torch_ops.forward import kv, prefill


def max_positions(config) -> int | None:
    """The longest sequence a model's cache holds and crops back: its positions, and below a sliding
    window (a cache past the window cannot be cropped back)."""
    limits = [getattr(config, "max_position_embeddings", None)]
    if getattr(config, "use_sliding_window", True):
        window = getattr(config, "sliding_window", None)
        limits.append(window - 1 if isinstance(window, int) else None)
    return min((x for x in limits if isinstance(x, int)), default=None)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, m, L] additive attention mask from a [m, L] bool visibility (0 visible, the dtype's minimum not)."""
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible.cpu(), torch.finfo(dtype).min)
    return mask[None, None].to(device)


class HFDraft:
    """Any transformers causal LM with the target's vocabulary; it reads no target features, so a tree
    node it was fed is the accepted token's own entry and stays in its cache."""

    features = False
    reuse_tree_kv = True

    def __init__(self, model, label: str = "draft model"):
        self.model = model.eval()
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.label = label
        self.max_positions = max_positions(model.config)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def open(self, prompt_ids: torch.Tensor, prompt_features=None) -> "HFDraftState":
        from transformers import DynamicCache

        ids = prompt_ids.reshape(-1)
        cache = prefill(self.model, ids[None, :-1]).cache if ids.numel() > 1 else DynamicCache(config=self.model.config)
        return HFDraftState(self.model, cache, self.dtype)


class HFDraftState:
    def __init__(self, model, cache, dtype: torch.dtype):
        self.model, self.cache, self.dtype = model, cache, dtype

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None,
                features=None, last_only: bool = False) -> DraftPass:
        mask = None if visible is None else additive_mask(visible, self.dtype, tokens.device)
        extra = {"logits_to_keep": 1} if last_only else {}
        out = self.model(input_ids=tokens[None], position_ids=positions[None], attention_mask=mask, **kv(self.cache),
                         use_cache=True, **extra)
        return DraftPass(out.logits[0], None)

    def keep(self, base: int, rows: list[int]) -> None:
        device = next((layer.keys.device for layer in self.cache.layers if layer.keys is not None), torch.device("cpu"))
        compact_cache(self.cache, base, torch.tensor(rows, dtype=torch.long, device=device), nodes=list(rows))
