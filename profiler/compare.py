"""Is a decoder's output the target's greedy output? Identical, a near tie, or a real mismatch.

In fp32 tree decoding is token-identical to plain decoding. In bf16/fp16 the tree's forward
(other shapes, other kernels, another summation order) may round a logit differently from the
plain forward; where the target's top two logits are closer than that rounding, either token is
the target's greedy choice within the dtype's resolution. Such a difference is a near tie, not a
bug; anything else is a mismatch. Compare against plain decoding in the same dtype and cache path
(decoder.generate with PlainGuesser: the same loop), then classify the first difference here.
"""
from __future__ import annotations

import torch

from decoder.engines.registry import as_engine

RELATIVE_ROUNDING_STEPS = 4  # a gap within a few units of the dtype's rounding at the logits' size is a tie


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (or one ends early), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def classify(target, prompt_ids: torch.Tensor, reference: list[int], other: list[int], sampling=None,
             seed: int = 0) -> dict:
    """{'status': 'identical' | 'near_tie' | 'mismatch', ...} of `other` against `reference`
    (plain greedy decoding of the same prompt). At the first difference: the target's top-2 logit
    gap there and the dtype's resolution at that logit's size. With `sampling` (the coupled rule,
    decoder/noise.py) the reference is plain coupled sampling with `seed`, and the gap is that of
    the draw's scores, log p + g, whose resolution is the logits' over the temperature. `target`: an
    engine (any: the logits come from its teacher-forced pass), or a bare model (the hf engine's)."""
    i = first_difference(reference, other)
    if i is None:
        return {"status": "identical"}
    if i >= len(reference) or i >= len(other):
        return {"status": "mismatch", "position": i, "reason": "one output ends early"}
    engine = as_engine(target)
    ids = torch.cat([prompt_ids.reshape(-1).cpu(), torch.tensor(reference[:i], dtype=torch.long)])
    logits = engine.teacher_forced(ids).logits[-1].float()  # [V] the target's next-token logits at the difference
    resolution = RELATIVE_ROUNDING_STEPS * torch.finfo(engine.dtype).eps * max(abs(float(logits.max())), 1.0)
    if sampling is not None:
        from decoder.noise import PositionNoise
        from decoder.verify import probabilities

        p = probabilities(logits, sampling).cpu()
        logits = torch.log(p) + PositionNoise(seed).gumbel(prompt_ids.numel() + i, p.numel())
        resolution /= sampling.temperature
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    near = gap <= resolution and int(other[i]) in top.indices.tolist()
    return {"status": "near_tie" if near else "mismatch", "position": i, "top2_gap": gap, "resolution": resolution,
            "reference_token": int(reference[i]), "other_token": int(other[i])}


def summarize(statuses: list[str]) -> dict:
    return {"identical": statuses.count("identical"), "near_ties": statuses.count("near_tie"),
            "mismatches": statuses.count("mismatch")}
