"""The oracle guesser: guesses from a known continuation, with known statistics (tests, benchmarks,
and `planner tune --objective measured` for methods without trained guessers)."""
from __future__ import annotations

import torch

from decoder.guesser import DistanceGuesser


class OracleGuesser(DistanceGuesser):
    """Guesses from a known token sequence (prompt + continuation), e.g. the model's own greedy output.

    The true token goes to rank 0, or, with `accuracy` = [a_0, ..., a_{K-1}] (every distance) or
    [[...], ...] (row d for distance d+1: the statistics a planner assumed), to rank r with
    probability a_r and nowhere with 1 - sum(a) (seeded): a guesser with known statistics.
    Other ranks hold (true + offset) % vocab, distinct from the truth. `prompt_tokens`, when
    given, supplies the prompt-token inputs so that the forward pass has its real size.
    """

    def __init__(self, sequence: torch.Tensor, vocab_size: int, num_distances: int, top_k: int = 1,
                 accuracy=None, seed: int = 0, prompt_tokens=None):
        self.sequence = sequence.reshape(-1).cpu().long()  # [T_total]
        self.vocab_size = vocab_size
        self.num_distances = num_distances
        self.top_k = top_k
        self.accuracy = None if accuracy is None else torch.as_tensor(accuracy, dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_tokens = prompt_tokens
        self.ensemble = prompt_tokens.ensemble if prompt_tokens is not None else 1

    def input_embeddings(self):
        return None if self.prompt_tokens is None else self.prompt_tokens.input_embeddings()

    def guess(self, prompt_logits, next_root_pos: int, k: int) -> torch.Tensor:
        pos = next_root_pos + torch.arange(1, k + 1)  # [k]
        inside = pos < self.sequence.numel()
        truth = torch.where(inside, self.sequence[pos.clamp(max=self.sequence.numel() - 1)], 0)  # [k]
        rank = self._ranks(k)  # [k]
        # column c holds truth + ((c - rank) mod (K+1)): the truth lands at `rank`, rank K means nowhere
        c = torch.arange(self.top_k)
        offset = (c[None, :] - rank[:, None]) % (self.top_k + 1)  # 0 exactly at c == rank
        return (truth[:, None] + offset) % self.vocab_size  # [k, K]

    def _ranks(self, k: int) -> torch.Tensor:
        if self.accuracy is None:
            return torch.zeros(k, dtype=torch.long)
        acc = self.accuracy if self.accuracy.dim() == 2 else self.accuracy[None].expand(k, -1)
        if acc.shape[0] < k:
            raise ValueError(f"OracleGuesser: accuracy has {acc.shape[0]} rows, distance {k} asked")
        acc = acc[:k, : self.top_k]
        probs = torch.cat([acc, (1 - acc.sum(1, keepdim=True)).clamp(min=0)], dim=1)  # [k, K+1]
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]  # [k]


def load(request) -> OracleGuesser:
    """The registry's loader (planner/guessers.py): options["sequence"] (prompt + continuation) is required."""
    from decoder.engine import vocab_size
    from planner.errors import UserError

    seq = request.options.get("sequence")
    if seq is None:
        raise UserError("--guesser oracle: needs the known continuation (options['sequence']); it is for tests "
                        "and ceilings, not for decoding new text")
    return OracleGuesser(torch.as_tensor(seq), vocab_size(request.target), request.depth or 4, top_k=request.top_k or 1,
                         accuracy=request.options.get("accuracy"), seed=request.options.get("seed", 0))
