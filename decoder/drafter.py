"""The drafter interface: a model that proposes tokens, behind one narrow protocol.

A drafter is a small model with a KV cache of its own over the accepted text. Guessers that draft
(a draft LM's chains and trees, EAGLE heads, their per-step pools: decoder/guessers/draft_cache.py)
drive it through these three calls and nothing else, and so do the strategies that draft with one
(PEARL's rounds, MTAD's beams), so a drafter can be any model an engine can run:

    state = drafter.open(prompt_ids, prompt_features)    # the prompt but its last token, in the cache
    out = state.forward(tokens, positions, visible, features)   # m new inputs after the cache
    state.keep(base, rows)                               # keep inputs base + rows, drop the rest
    state.keep(length, [])                               # crop back to the first `length` inputs

`DraftPass.logits` are over the target's vocabulary (a head with a smaller draft vocabulary maps its
ids, EAGLE-3's d2t), so guessers never see a drafter's own vocabulary. A drafter that reads the target's
features (EAGLE) says which in `features` (decoder/engine.py `Features`): the engine then returns
them with every step, and the drafter is fed, beside each token x_p, the target's feature at
position p - 1. Its own output `hidden` is the feature it predicts for the next input (its tree
nodes' inputs), so inputs fed with predicted features are never kept: `reuse_tree_kv` is False
and the accepted tokens are fed again with the target's true features (EAGLE's rule).

The torch implementations live in decoder/torch_ops/draft.py (any transformers causal LM) and
decoder/guessers/eagle.py (EAGLE-1 and EAGLE-3 heads); an engine with its own runtime (llama.cpp)
implements the same three calls for a draft model it runs.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from decoder.engine import Features


class DraftPass(NamedTuple):
    logits: torch.Tensor  # [m, V] over the target's vocabulary, one row per fed input
    hidden: torch.Tensor | None  # [m, F] the drafter's predicted feature per input (drafters that read features)


class DraftState(Protocol):
    """One sequence's drafter cache."""

    length: int  # inputs in the cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None,
                features: torch.Tensor | None, last_only: bool = False) -> DraftPass:
        """tokens [m] at absolute positions [m] after the cache; visible [m, length + m] bool (None: a causal
        chain that sees the whole cache); features [m, F] the feature paired with each token (drafters
        that read features). The cache grows by m inputs. last_only: logits of the last input only [1, V]
        (a chain's catch-up pass needs no others, and a head over the vocabulary is a drafter's biggest cost)."""
        ...

    def keep(self, base: int, rows: list[int]) -> None:
        """Keep the cache's first `base` inputs and then inputs base + rows (increasing), drop the rest."""
        ...


class DraftModel(Protocol):
    vocab_size: int  # the target's vocabulary, which logits are over
    features: Features  # the target features it reads: False (none), True (the last hidden state), layer ids
    reuse_tree_kv: bool  # a fed tree node's cache entry equals the accepted token's (no predicted inputs)
    label: str
    max_positions: int | None  # the longest sequence its cache holds and crops back (None: unbounded)

    def open(self, prompt_ids: torch.Tensor, prompt_inputs: torch.Tensor | None) -> DraftState:
        """A cache over the prompt [T] but its last token (the first root); prompt_inputs [T-1, H] the
        target's features over those tokens as `combine` makes them, for drafters that read them."""
        ...

    # drafters that read features also have:
    #   combine(features [m, F]) -> [m, H]: the target's features as the drafter's input features (EAGLE-3's
    #   fc over three layers); its own predicted features (DraftPass.hidden) are inputs already


def teacher_forced(drafter: DraftModel, ids: torch.Tensor) -> torch.Tensor:
    """The drafter's logits [T, V] at every position of a token sequence [T], in one pass over a fresh
    cache (a drafter that reads no target features): what it predicts along a known text."""
    if drafter.features:
        raise ValueError(f"{drafter.label}: reads the target's features; its passes need them beside the tokens")
    ids = ids.reshape(-1)
    state = drafter.open(ids[:1], None)  # an empty cache: the first token is fed below
    return state.forward(ids, torch.arange(ids.numel(), device=ids.device), None, None).logits
