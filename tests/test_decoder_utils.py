"""Shared helpers for the decoder tests: tiny seeded models and legal trees of every method."""
from __future__ import annotations

import itertools
import random

import numpy as np
import torch

from planner.tree import Tree, TreeState, validate_tree

V = 128


def tiny_model(family: str = "llama", vocab: int = V, seed: int = 0, eos: int | None = None):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=eos, pad_token_id=0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif family == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(**kw, sliding_window=256))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kw, use_sliding_window=False))
    with torch.no_grad():
        # larger output weights: well-separated logits, so greedy argmax does not hinge on rounding
        model.lm_head.weight.mul_(4.0)
    model.generation_config.eos_token_id = eos
    return model.eval()


def reference(model, ids: torch.Tensor, n: int, eos: int | None = None) -> list[int]:
    out = model.generate(ids[None], do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=0)
    return out[0, ids.numel():].tolist()


def _tau(nodes, acc) -> float:
    return 1.0 + sum(float(np.prod([acc[d][r] for d, r in enumerate(p)])) for p in nodes)


def topn_nodes(n: int, depth: int, acc: np.ndarray) -> list[tuple[int, ...]]:
    """The n most probable rank paths (deterministic guesses), by brute force; parents first."""
    K = acc.shape[1]
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(K), repeat=d)]
    paths.sort(key=lambda p: -float(np.prod([acc[d][r] for d, r in enumerate(p)])))
    chosen = set()
    for p in paths:
        if len(chosen) >= n:
            break
        for d in range(1, len(p) + 1):  # parent closure keeps the tree legal under ties
            chosen.add(p[:d])
    return sorted(chosen, key=lambda p: (len(p), p))


def contiguous_nodes(n: int, depth: int, K: int, rng: random.Random) -> list[tuple[int, ...]]:
    """A random tree with contiguous sibling ranks (sequoia-legal)."""
    nodes: list[tuple[int, ...]] = []
    kids = {(): 0}
    while len(nodes) < n:
        open_ = [p for p in kids if len(p) < depth and kids[p] < K]
        p = rng.choice(open_)
        child = p + (kids[p],)
        kids[p] += 1
        kids[child] = 0
        nodes.append(child)
    return nodes


ACC = np.array([[0.5, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05], [0.3, 0.15, 0.1, 0.05], [0.25, 0.1, 0.1, 0.05]])


def static_tree(method: str, n: int, depth: int, seed: int = 0) -> Tree:
    nodes = topn_nodes(n, depth, ACC) if method == "medusa" else contiguous_nodes(n, depth, 3, random.Random(seed))
    st = TreeState(0, nodes, _tau(nodes, ACC), 1 + len(nodes))
    tree = Tree(method, [st], st.expected_tokens)
    validate_tree(tree)
    return tree


def ppd_tree(P: int, sizes: list[int], seed: int = 0, full: bool = False) -> Tree:
    """States 0..P; state s: top-n tree of depth <= s, prompt counts random in 1..P (all P when full)."""
    rng = random.Random(seed)
    states = []
    for s in range(P + 1):
        nodes = topn_nodes(sizes[s], s, ACC) if s > 0 else []
        k = [P if full else rng.randint(1, P) for _ in range(len(nodes) + 1)]
        states.append(TreeState(s, nodes, _tau(nodes, ACC), 1 + len(nodes) + sum(k), prompt_tokens=k))
    tree = Tree("ppd", states, 1.0, prompt_tokens_max=P)
    validate_tree(tree)
    return tree
