"""The drafter's KV cache over the accepted text, fed one tree level per pass: the one drafting
mechanic behind a draft LM's static trees (decoder/guessers/draft.py `DraftSession`) and its per-step pools
(decoder/guessers/draft_source.py)."""
from __future__ import annotations

import torch

from decoder.engines.hf.cache import compact_cache
from decoder.engines.hf.forward import kv, prefill


class DraftCache:
    """The drafter's KV cache over the accepted text, fed one tree level per pass; the one drafting
    mechanic behind static trees (`DraftSession`) and per-step pools (`DraftSource`).

    Between steps the cache equals a prefill of the accepted text but the tokens in `unseen` and the
    root. A step: `first_pass` feeds the unseen tokens and the root; `level_pass` feeds nodes of one
    level, each seeing the context and its fed ancestors (a tree mask); `keep_accepted` keeps the
    accepted nodes it fed (KV compaction, as the target's) and queues the rest as unseen. Nodes are
    the caller's ids (tree indices, pool indices) with their parents; the root is never one of them."""

    def __init__(self, draft_model, prompt_ids: torch.Tensor):
        self.model = draft_model
        ids = prompt_ids.reshape(-1)
        self.cache = prefill(draft_model, ids[None, :-1]).cache if ids.numel() > 1 else _empty_cache(draft_model)
        self.unseen: list[int] = []  # accepted tokens not yet in the drafter's cache (before the root)
        self.slots: dict[int, int] = {}  # fed node -> its row in the drafter's cache, this step
        self.base = 0  # cache length after the step's first pass (context + unseen + root)
        self.passed = False  # this step's first pass ran

    def skip(self, root: int) -> None:
        """No pass this step: the root waits with the unseen tokens."""
        self.unseen.append(root)

    def first_pass(self, root: torch.Tensor) -> torch.Tensor:
        """The unseen accepted tokens and the root, as a causal chain: the root's logits [V]."""
        C = self.cache.get_seq_length()
        ids = torch.tensor(self.unseen, dtype=torch.long, device=root.device)
        ids = torch.cat([ids, root])[None]  # [1, m]
        pos = torch.arange(C, C + ids.shape[1], device=root.device)[None]
        out = self.model(input_ids=ids, position_ids=pos, **kv(self.cache), use_cache=True, logits_to_keep=1)
        self.unseen = []
        self.base = self.cache.get_seq_length()
        self.slots = {}
        self.passed = True
        return out.logits[0, -1]

    def level_pass(self, fed: list[int], parent, tokens: torch.Tensor, depth: list[int]) -> torch.Tensor:
        """One pass over the nodes `fed` of one level (tokens [len(fed)], depth beyond the root each),
        each seeing the context and its fed ancestors (parent[u]: u's parent id) -> logits [len(fed), V]."""
        L = self.cache.get_seq_length()
        dev = tokens.device
        visible = torch.zeros(len(fed), L + len(fed), dtype=torch.bool)
        visible[:, : self.base] = True  # context, unseen tokens and the root
        for i, u in enumerate(fed):
            a = parent[u]
            while a in self.slots:  # a fed node's ancestors were all fed (each had a child)
                visible[i, self.slots[a]] = True
                a = parent[a]
            visible[i, L + i] = True
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        pos = torch.tensor([[self.base - 1 + d for d in depth]], device=dev)
        out = self.model(input_ids=tokens[None], position_ids=pos, attention_mask=mask[None, None].to(dev),
                         **kv(self.cache), use_cache=True)
        for i, u in enumerate(fed):
            self.slots[u] = L + i
        return out.logits[0]

    def keep_accepted(self, accepted: list[int], emitted: list[int]) -> None:
        """accepted: the path's nodes (root excluded), emitted: their tokens and the new root. Keep the
        accepted nodes fed this step (a prefix of the path); the rest wait as unseen."""
        if not self.passed:
            self.unseen.extend(emitted[:-1])
            return
        fed = []
        for u in accepted:
            if u not in self.slots:
                break
            fed.append(u)
        keep = torch.tensor([self.slots[u] - self.base for u in fed], dtype=torch.long)
        compact_cache(self.cache, self.base, keep.to(_cache_device(self.cache)))
        self.unseen = list(emitted[len(fed):-1])
        self.passed = False


def _empty_cache(draft_model):
    from transformers import DynamicCache

    return DynamicCache(config=draft_model.config)


def _cache_device(cache):
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.numel():
            return layer.keys.device
    return torch.device("cpu")
