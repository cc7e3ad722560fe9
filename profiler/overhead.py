"""The decoder's own work per step, outside the forward pass, as a line in the step's input length.

A step is more than its forward: building the input, verification (argmax over [n, V] logits and
the path search), KV compaction and the guesser's commit (PPD: top-k over its prompt tokens'
logits). `measure_overhead` runs the real decoding loop (decoder.generate, PPD prompt tokens on
static trees of several sizes), takes each step's time outside the forward pass, and fits
fixed_s + per_token_s * n by least squares (both clamped at 0). The cost model
(planner.cost.step_cost) adds it to L(n), so predictions include what the decoder really does.
"""
from __future__ import annotations

import statistics

import numpy as np
import torch

from planner.tree import Tree, TreeState

OUTSIDE = ("prepare", "verify", "cache", "guess")


def _chain_tree(depth: int, width: int) -> Tree:
    """A static tree: a chain of `depth` rank-0 nodes, each with `width - 1` siblings."""
    nodes = []
    for d in range(depth):
        nodes += [(0,) * d + (r,) for r in range(width)]
    nodes.sort(key=lambda p: (len(p), p))
    st = TreeState(0, nodes, 1.0, 1 + len(nodes))
    return Tree("medusa", [st], 1.0)


@torch.inference_mode()
def measure_overhead(model, max_input_length: int = 64, steps: int = 6, prompt_tokens: int = 2,
                     seed: int = 0) -> dict:
    """{"fixed_s", "per_token_s", "input_lengths", "seconds"}: per-step seconds outside the forward
    (median over steps) at a few input lengths up to max_input_length, and the fitted line."""
    from decoder import PromptTokens, generate, generate_plain

    vocab = model.get_input_embeddings().weight.shape[0]
    dev = model.get_input_embeddings().weight.device
    guesser = PromptTokens.random(model, prompt_tokens, seed=seed, top_k=10)
    prompt = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(seed)).to(dev)
    plain = generate_plain(model, prompt, max_new_tokens=steps)  # n = 1: plain decoding's own step
    points = {1: [sum(plain.stats.times[p][i] for p in OUTSIDE) for i in range(plain.steps)]}
    for depth, width in ((1, 1), (2, 2), (2, 4), (2, 6), (2, 10)):
        tree = _chain_tree(depth, width)
        n = (1 + len(tree.states[0].nodes)) * (1 + depth)  # the decoder's real input (prompt tokens on every node)
        if n > max_input_length:
            break
        out = generate(model, prompt, plan=tree, guesser=guesser, max_new_tokens=steps * (depth + 1))
        real = out.stats.input_lengths[1:]  # the bootstrap step has another shape
        outside = [sum(out.stats.times[p][i] for p in OUTSIDE) for i in range(1, len(out.stats.input_lengths))]
        for m, t in zip(real, outside):
            points.setdefault(m, []).append(t)
    lengths = sorted(points)
    seconds = [statistics.median(points[m]) for m in lengths]
    fixed, per_token = _fit_line(lengths, seconds)
    return {"fixed_s": fixed, "per_token_s": per_token, "input_lengths": lengths, "seconds": seconds,
            "method": "decoder.generate with PPD prompt tokens on static trees; prepare + verify + cache + guess "
                      "per step, median per input length, least-squares line clamped at 0"}


def _fit_line(x: list[int], y: list[float]) -> tuple[float, float]:
    if len(x) < 2:
        return (max(y[0], 0.0) if y else 0.0), 0.0
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    if slope < 0:
        return float(max(np.median(y), 0.0)), 0.0
    if intercept < 0:
        return 0.0, float(np.dot(x, y) / np.dot(x, x))
    return float(intercept), float(slope)
