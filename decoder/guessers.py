"""Guessers: what proposes the candidate tokens of the next step.

A guesser is anything with
  num_distances: int            distances it can guess beyond the next root (P for prompt tokens)
  top_k: int                    guesses per distance (ranks 0..top_k-1)
  ensemble: int                 copies of each prompt token in the input (E)
  input_embeddings() -> Tensor [P*E, hidden] | None
                                prompt-token inputs appended after tree nodes; None: the step
                                input has no prompt tokens (an oracle needs none)
  guess(prompt_logits [k, E, V] | None, next_root_pos, k) -> LongTensor [k, top_k]
                                guesses for distances 1..k beyond the next root, which sits at
                                absolute position next_root_pos

PromptTokens (decoder/prompt_tokens.py) guesses from its own logits; OracleGuesser from a known
continuation, for tests and benchmarks.
"""
from __future__ import annotations

from typing import Protocol

import torch


class Guesser(Protocol):
    num_distances: int
    top_k: int
    ensemble: int

    def input_embeddings(self) -> torch.Tensor | None: ...

    def guess(self, prompt_logits: torch.Tensor | None, next_root_pos: int, k: int) -> torch.Tensor: ...


class OracleGuesser:
    """Guesses from a known token sequence (prompt + continuation), e.g. the model's own greedy output.

    The true token goes to rank 0, or, with `accuracy` = [a_0, ..., a_{K-1}] (every distance) or
    [[...], ...] (row d for distance d+1), to rank r with probability a_r and nowhere with
    1 - sum(a) (seeded): a guesser with known statistics.
    Other ranks hold (true + offset) % vocab, distinct from the truth. `prompt_tokens`, when
    given, supplies the prompt-token inputs so that the forward pass has its real size.
    """

    def __init__(self, sequence: torch.Tensor, vocab_size: int, num_distances: int, top_k: int = 1,
                 accuracy: list[float] | None = None, seed: int = 0, prompt_tokens=None):
        self.sequence = sequence.reshape(-1).cpu().long()  # [T_total]
        self.vocab_size = vocab_size
        self.num_distances = num_distances
        self.top_k = top_k
        self.accuracy = None if accuracy is None else torch.tensor(accuracy, dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_tokens = prompt_tokens
        self.ensemble = prompt_tokens.ensemble if prompt_tokens is not None else 1

    def input_embeddings(self):
        return None if self.prompt_tokens is None else self.prompt_tokens.input_embeddings()

    def guess(self, prompt_logits, next_root_pos: int, k: int) -> torch.Tensor:
        pos = next_root_pos + torch.arange(1, k + 1)  # [k]
        inside = pos < self.sequence.numel()
        truth = torch.where(inside, self.sequence[pos.clamp(max=self.sequence.numel() - 1)], 0)  # [k]
        if self.accuracy is None:
            rank = torch.zeros(k, dtype=torch.long)
        else:
            # rank K means "the truth is not among the guesses"; one row per distance, or one for all
            acc = self.accuracy if self.accuracy.dim() == 2 else self.accuracy[None].expand(k, -1)
            if acc.shape[0] < k:
                raise ValueError(f"OracleGuesser: accuracy has {acc.shape[0]} rows, distance {k} asked")
            acc = acc[:k]
            probs = torch.cat([acc, (1 - acc.sum(1, keepdim=True)).clamp(min=0)], dim=1)  # [k, K+1]
            rank = torch.multinomial(probs, 1, generator=self.generator)[:, 0]  # [k]
        # column c holds truth + ((c - rank) mod (K+1)) ... shifted so the truth lands at `rank`
        c = torch.arange(self.top_k)
        offset = (c[None, :] - rank[:, None]) % (self.top_k + 1)  # 0 exactly at c == rank
        return (truth[:, None] + offset) % self.vocab_size
