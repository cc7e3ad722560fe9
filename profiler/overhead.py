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
def measure_overhead(engine, max_input_length: int = 64, steps: int = 6, prompt_tokens: int = 2,
                     seed: int = 0) -> dict:
    """{"fixed_s", "per_token_s", "input_lengths", "seconds"}: per-step seconds outside the forward
    (median over steps) at a few input lengths up to max_input_length, and the fitted line. On an
    engine that takes input embeddings and lends its modules, the steps carry PPD prompt tokens on
    static trees (the guesser whose commit costs most: top-k over its tokens' logits); elsewhere
    they are chains of an oracle's guesses (prompt lookup's shape)."""
    from decoder import generate
    from decoder.guesser import PlainGuesser

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.vocab_size, (24,), generator=gen).to(engine.device)
    plain = generate(engine, prompt, None, PlainGuesser(), steps)  # n = 1: plain decoding's own step, in the loop
    points = {1: [sum(plain.stats.times[p][i] for p in OUTSIDE) for i in range(plain.steps)]}
    ppd = engine.caps.input_embeddings and engine.caps.torch_modules
    for plan, guesser, new in (_ppd_steps if ppd else _chain_steps)(engine, max_input_length, steps, prompt_tokens, seed):
        out = generate(engine, prompt, plan=plan, guesser=guesser, max_new_tokens=new)
        outside = [sum(out.stats.times[p][i] for p in OUTSIDE) for i in range(1, len(out.stats.input_lengths))]
        for m, t in zip(out.stats.input_lengths[1:], outside):  # the bootstrap step has another shape
            points.setdefault(m, []).append(t)
    lengths = sorted(points)
    seconds = [statistics.median(points[m]) for m in lengths]
    fixed, per_token = _fit_line(lengths, seconds)
    how = "PPD prompt tokens on static trees" if ppd else "chains of random guesses (an oracle guesser)"
    return {"fixed_s": fixed, "per_token_s": per_token, "input_lengths": lengths, "seconds": seconds,
            "method": f"decoder.generate with {how}; prepare + verify + cache + guess per step, median per input "
                      "length, least-squares line clamped at 0"}


def _ppd_steps(engine, max_input_length: int, steps: int, prompt_tokens: int, seed: int):
    from decoder import PromptTokens

    guesser = PromptTokens.random(engine, prompt_tokens, seed=seed, top_k=10)
    for depth, width in ((1, 1), (2, 2), (2, 4), (2, 6), (2, 10)):
        tree = _chain_tree(depth, width)
        if (1 + len(tree.states[0].nodes)) * (1 + depth) > max_input_length:  # prompt tokens ride on every node
            return
        yield tree, guesser, steps * (depth + 1)


def _chain_steps(engine, max_input_length: int, steps: int, prompt_tokens: int, seed: int):
    from decoder.guessers.oracle import OracleGuesser

    gen = torch.Generator().manual_seed(seed + 1)
    seq = torch.randint(0, engine.vocab_size, (48 + 4 * steps * max_input_length,), generator=gen)
    for depth in (1, 3, 7, 15):
        if depth + 1 > max_input_length:
            return
        yield _chain_tree(depth, 1), OracleGuesser(seq, engine.vocab_size, depth), steps


def _fit_line(x: list[int], y: list[float]) -> tuple[float, float]:
    if len(x) < 2:
        return (max(y[0], 0.0) if y else 0.0), 0.0
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    if slope < 0:
        return float(max(np.median(y), 0.0)), 0.0
    if intercept < 0:
        return 0.0, float(np.dot(x, y) / np.dot(x, x))
    return float(intercept), float(slope)
