"""The drafter's cache over the accepted text, fed one tree level per pass: the one drafting mechanic
behind a drafter's static trees (decoder/guessers/draft.py `DraftSession`) and its per-step pools
(decoder/guessers/draft_source.py), for every drafter of decoder/drafter.py (a draft LM, EAGLE heads)."""
from __future__ import annotations

import torch

from decoder.drafter import DraftModel


class DraftCache:
    """Between steps the drafter's cache equals a prefill of the accepted text but the tokens in `unseen`
    and the root. A step: `first_pass` feeds the unseen tokens and the root; `level_pass` feeds nodes of
    one level, each seeing the context and its fed ancestors (a tree mask); `keep_accepted` keeps the
    accepted nodes it fed (KV compaction, as the target's) and queues the rest as unseen. Nodes are the
    caller's ids (tree indices, pool indices) with their parents; the root is never one of them.

    Drafters that read the target's features (EAGLE) are fed, beside token x_p, the target's feature at
    p - 1: the unseen tokens wait with theirs (`unseen_features`), a tree node is fed its parent's
    predicted feature, and since those are predictions, no fed node is kept: the accepted tokens are fed
    again next step with the target's own features."""

    def __init__(self, drafter: DraftModel, prompt_ids: torch.Tensor, prompt_features: torch.Tensor | None = None):
        self.drafter = drafter
        ids = prompt_ids.reshape(-1)
        self.reads = bool(drafter.features)
        if self.reads and prompt_features is None and ids.numel() > 1:
            raise ValueError(f"{drafter.label}: reads the target's features; the prompt's are missing")
        inputs = drafter.combine(prompt_features) if self.reads and ids.numel() > 1 else None  # [T-1, H]
        self.state = drafter.open(ids, inputs)
        self.position = ids.numel() - 1  # the root's absolute position
        self.unseen: list[int] = []  # accepted tokens not yet in the drafter's cache (before the root)
        # per unseen token and then the root: the target's feature at the position before it
        self.unseen_features: list[torch.Tensor] = [inputs[-1]] if inputs is not None else []
        self.slots: dict[int, int] = {}  # fed node -> its row in the drafter's cache, this step
        self.hidden: dict[int, torch.Tensor] = {}  # fed node -> its predicted feature, this step (feature readers)
        self.root_hidden: torch.Tensor | None = None  # the root's predicted feature, this step
        self.base = 0  # cache length after the step's first pass (context + unseen + root)
        self.passed = False  # this step's first pass ran

    @property
    def ready(self) -> bool:
        """Whether the root can be fed: a feature reader needs the target's feature before it, which the
        first token of a text has not (a one-token prompt's first step is a plain one)."""
        return not self.reads or len(self.unseen_features) > len(self.unseen)

    def skip(self, root: int) -> None:
        """No pass this step: the root waits with the unseen tokens (a first token without a feature before it
        is never fed, as the prefill never feeds it)."""
        if self.ready:
            self.unseen.append(root)

    def first_pass(self, root: torch.Tensor) -> torch.Tensor:
        """The unseen accepted tokens and the root, as a causal chain: the root's logits [V]."""
        ids = torch.cat([torch.tensor(self.unseen, dtype=torch.long, device=root.device), root])  # [m]
        first = self.position - len(self.unseen)
        pos = torch.arange(first, first + ids.numel(), device=root.device)
        feats = torch.stack(self.unseen_features) if self.reads else None  # [m, F]
        out = self.state.forward(ids, pos, None, feats, last_only=True)
        self.unseen, self.unseen_features = [], []
        self.base = self.state.length
        self.slots, self.hidden = {}, {}
        self.root_hidden = None if out.hidden is None else out.hidden[-1]
        self.passed = True
        return out.logits[-1]

    def level_pass(self, fed: list[int], parent, tokens: torch.Tensor, depth: list[int]) -> torch.Tensor:
        """One pass over the nodes `fed` of one level (tokens [len(fed)], depth beyond the root each),
        each seeing the context and its fed ancestors (parent[u]: u's parent id, -1 the root)
        -> logits [len(fed), V]."""
        L = self.state.length
        visible = torch.zeros(len(fed), L + len(fed), dtype=torch.bool)
        visible[:, : self.base] = True  # context, unseen tokens and the root
        for i, u in enumerate(fed):
            a = parent[u]
            while a in self.slots:  # a fed node's ancestors were all fed (each had a child)
                visible[i, self.slots[a]] = True
                a = parent[a]
            visible[i, L + i] = True
        pos = torch.tensor([self.position + d for d in depth], device=tokens.device)
        # a fed node's parent was fed this step, or is the root
        feats = torch.stack([self.hidden.get(parent[u], self.root_hidden) for u in fed]) if self.reads else None
        out = self.state.forward(tokens, pos, visible, feats)
        for i, u in enumerate(fed):
            self.slots[u] = L + i
            if out.hidden is not None:
                self.hidden[u] = out.hidden[i]
        return out.logits

    def keep_outcome(self, accepted: list[int], outcome) -> None:
        """`keep_accepted` after a step (decoder.guesser.StepOutcome): the target's features at the root and
        the accepted nodes are the outcome's rows on the verified path."""
        feats = outcome.hidden[outcome.verdict.path] if self.reads else None
        self.keep_accepted(accepted, outcome.verdict.emitted, feats)

    def keep_accepted(self, accepted: list[int], emitted: list[int], features: torch.Tensor | None = None) -> None:
        """accepted: the path's nodes (root excluded), emitted: their tokens and the new root; features
        [len(accepted) + 1, F]: the target's at the root and each accepted node (drafters that read them).
        Keep the accepted nodes fed this step (a prefix of the path, none for feature readers); the rest
        wait as unseen."""
        self.position += len(emitted)
        if self.reads:
            if features is None:
                raise ValueError(f"{self.drafter.label}: the step's features are missing")
            # the root's feature pairs with the first accepted token, ..., the last accepted node's with the new root
            self.unseen_features.extend(self.drafter.combine(features))
        if not self.passed:
            self.unseen.extend(emitted[:-1])
            return
        fed = []
        if self.drafter.reuse_tree_kv:
            for u in accepted:
                if u not in self.slots:
                    break
                fed.append(u)
        self.state.keep(self.base, [self.slots[u] - self.base for u in fed])
        self.unseen = list(emitted[len(fed):-1])
        if self.reads:
            self.unseen_features = self.unseen_features[len(self.unseen_features) - len(self.unseen) - 1:]
        self.passed = False
