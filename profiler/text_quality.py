"""What a produced text is worth beside its speed: perplexity under the target (and the drafter) and
distinct-n, over the same prompts for every method so the figures compare (MTAD's texts lean to
sequences both models find likely; docs/pearl-mtad.md).

    q = text_quality(engine, prompts, outputs, drafter)     # outputs: token lists after each prompt
    q.to_json()   # {"perplexity", "draft_perplexity", "distinct_1", "distinct_2", "distinct_3", "tokens"}

The target's log-probabilities come from the engine's teacher-forced pass (decoder/engine.py), the
drafter's from its own (decoder/drafter.py `teacher_forced`): neither model is reached past its interface.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decoder.drafter import teacher_forced
from decoder.engines.registry import as_engine


@torch.inference_mode()
def token_logprobs(scorer, prompt_ids: torch.Tensor, new_ids) -> torch.Tensor:
    """log p(new_t | prompt, new_<t) [n] under the raw distribution (temperature 1, no warp) of `scorer`:
    an engine (or a transformers model: the hf engine's) or a decoder/drafter.py DraftModel."""
    new = torch.as_tensor(new_ids, dtype=torch.long).reshape(-1)
    n = new.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    ids = torch.cat([torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).cpu(), new])
    if hasattr(scorer, "open"):  # a drafter
        logits = teacher_forced(scorer, ids)
    else:
        engine = as_engine(scorer)
        logits = engine.teacher_forced(ids.to(engine.device)).logits
    logits = logits[-n - 1: -1]  # [n, V] predicting each new token
    return logits.double().log_softmax(-1).gather(1, new.to(logits.device)[:, None])[:, 0].cpu()


def perplexity(scorer, prompts, outputs) -> float | None:
    """exp(-sum log p / tokens), pooled over all sequences (token-weighted), under the raw distribution.
    Not under the warped p~: a token outside the warped support (MTAD at tau_acc = 0 can emit one) would
    make it infinite. None when there are no tokens."""
    total, count = 0.0, 0
    for prompt, out in zip(prompts, outputs):
        lp = token_logprobs(scorer, prompt, out)
        total += float(lp.sum())
        count += lp.numel()
    return math.exp(-total / count) if count else None


def distinct_n(sequences, n: int) -> float | None:
    """Distinct-n within each text: sum_i |unique n-grams of i| / sum_i |n-grams of i| (repetition
    loops lower it; cross-prompt overlap does not count). None when no text has n tokens."""
    unique = total = 0
    for seq in sequences:
        seq = [int(t) for t in seq]
        grams = [tuple(seq[i: i + n]) for i in range(len(seq) - n + 1)]
        unique += len(set(grams))
        total += len(grams)
    return unique / total if total else None


@dataclass
class TextQuality:
    perplexity: float | None  # under the target, raw distribution
    draft_perplexity: float | None  # under the drafter, when given
    distinct: dict[str, float | None]  # distinct-1, -2, -3
    tokens: int

    def to_json(self) -> dict:
        return {"perplexity": self.perplexity, "draft_perplexity": self.draft_perplexity, **self.distinct,
                "tokens": self.tokens}


def text_quality(target, prompts, outputs, drafter=None) -> TextQuality:
    """Quality figures of produced texts `outputs` (token lists) after `prompts`, under the target engine
    and, when given, a drafter (decoder/drafter.py)."""
    outputs = [list(map(int, o)) for o in outputs]
    return TextQuality(perplexity(target, prompts, outputs),
                       perplexity(drafter, prompts, outputs) if drafter is not None else None,
                       {f"distinct_{n}": distinct_n(outputs, n) for n in (1, 2, 3)}, sum(map(len, outputs)))
