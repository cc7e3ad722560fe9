"""Coupled sampling (`verify_rule="coupled"`): every token drawn with noise keyed by its index.

The Gumbel-max trick draws y from p exactly: y = argmax_x (log p(x) + g(x)), g i.i.d. standard
Gumbel over the vocabulary. If g depends only on the run's seed and the index of the token in the
sequence, every decoder that draws each index's token this way emits the same text:

- plain sampling draws index t's token with g_t;
- a tree step walks from the root: at each node it draws the node's next token with the noise of
  that token's index and moves to the child holding it; the first node without such a child emits
  the drawn token and the step ends (decoder.verify.verify_coupled).

So a plan's output under this rule is plain sampling's output with the same seed (up to the
floating-point ties greedy decoding also has), whatever the guesses were: lossless by identity,
not only in law. A guess is accepted when it equals the drawn token: a fixed guess x with
probability p(x), as under the recursive-rejection rule; a drafter that sees the noise can aim at
the draw, guessing the top-k of log q + g (`noisy_top_k`), which is accepted with about
sum_x min(p(x), q(x)) when q is close to p. And since the text is plain sampling's, two decoders'
times on one prompt compare like greedy decoding's: the autotuner's sampled race pairs them on
the same text (workflows/mainjob/race.py), and a replay of a plan on that text is its decode.
"""
from __future__ import annotations

import torch

KEEP = 96  # indices whose noise stays cached behind the cursor (a step reads at most its depth ahead)
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: seeds of neighbouring (seed, index) pairs far apart


class PositionNoise:
    """Standard Gumbel noise g_t [V] for every token index t of one decode, from (seed, t) alone.

    cursor: the index of the next token the decoder emits (decoder.loop sets it every step), so a
    guesser reads the noise of distance d beyond the root at cursor + d - 1."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.cursor = 0
        self._cache: dict[tuple[int, int], torch.Tensor] = {}

    def gumbel(self, index: int, vocab: int) -> torch.Tensor:
        """g [vocab] float32 on the CPU for token index `index`."""
        key = (int(index), int(vocab))
        g = self._cache.get(key)
        if g is None:
            g = standard_gumbel(vocab, torch.Generator().manual_seed((self.seed * _MIX + int(index)) % (1 << 63)))
            if len(self._cache) > 2 * KEEP:
                self._cache = {k: v for k, v in self._cache.items() if k[0] >= self.cursor - KEEP}
            self._cache[key] = g
        return g

    def draw(self, p: torch.Tensor, index: int) -> int:
        """The token at `index` drawn from p [V] (any device): argmax of log p + g_index."""
        p = p.float().cpu()
        return int((torch.log(p) + self.gumbel(index, p.numel())).argmax())


def standard_gumbel(shape, generator: torch.Generator) -> torch.Tensor:
    """Standard Gumbel noise [shape] float32 on the CPU (ties at a row's max ~1e-7 a token)."""
    u = torch.rand(shape, generator=generator).clamp_(1e-38, 1.0 - 2 ** -24)
    return u.log_().neg_().log_().neg_()


def aimed_top_k(logits: torch.Tensor, s, noise: PositionNoise, indices: list[int], k: int, vocab: int | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, k] positions in a drafter's logits [rows, V'] (on their device): each row's Gumbel top-k
    of its warped q (`s`, decoder.verify.probabilities) with the noise of token index indices[row].
    A head over part of the vocabulary gives token_ids [V'] (its positions' ids) and the target's
    vocab, whose noise its positions read; otherwise the noise spans V'."""
    from decoder.verify import probabilities

    q = probabilities(logits, s).cpu()  # [rows, V']
    rows = [noise.gumbel(i, vocab or q.shape[-1]) for i in indices]
    g = torch.stack([r if token_ids is None else r[token_ids] for r in rows])  # [rows, V']
    return noisy_top_k(q, g, k).to(logits.device)


def noisy_top_k(q: torch.Tensor, g: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, k] indices: the k best of log q + g per row (q [rows, V'] a proposal on the host, g
    [rows, V'] the noise of each row's index over the same tokens): Gumbel top-k, the first k draws
    of q without replacement, aimed at the draw coupled verification makes with the same g.
    Tokens outside q's support (cut by top-k or top-p) rank after every token in it, by g alone."""
    score = torch.log(q.float()) + g
    score = torch.where(torch.isfinite(score), score, g - 1e30)
    return score.topk(min(k, q.shape[-1]), dim=-1).indices
