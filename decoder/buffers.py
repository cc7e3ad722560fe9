"""Per-state step buffers, built once when decoding starts; each step then uses tensor ops only.

Step input layout for a tree state with N candidates:
  [root, node_1 .. node_N, prompt slots]
prompt slots: for each tree token u (root first) with k_u prompt tokens, k_u * E slots in order
(distance j, ensemble copy e), embedding row j * E + e (see decoder/prompt_tokens.py).
Positions: a tree token at depth d sits at prefix + d; prompt slot j (0-based) of u at pos(u) + j + 1.

Static trees (medusa, sequoia) have no per-node prompt counts in the plan: every tree token
carries D prompt tokens (D = tree depth), so the next step can always guess depth D. Their real
input length is therefore larger than the plan's input_length; `StepBuffers.input_length` is
the real one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder.forward import ancestor_matrix, tree_depths
from decoder.prompt_tokens import prompt_block_mask
from planner.errors import UserError
from planner.tree import Tree, TreeState


@dataclass
class StepBuffers:
    state: int  # -1: the bootstrap step (root only, full prompt tokens)
    num_tree: int  # root + candidates
    input_length: int  # real tokens in the forward: num_tree + prompt slots (E each)
    planned_input_length: int  # the plan's count (each prompt token once; static trees: none)
    parents: torch.Tensor  # [num_tree] long, root's parent = 0 (never used)
    cand_index: torch.Tensor  # [N] long into guesses.flatten() of a [depth, K] guess matrix
    position_offsets: torch.Tensor  # [1, n] long, added to the prefix length
    mask_block: torch.Tensor  # [n, n] additive float mask among the step's own tokens
    slot_embedding: torch.Tensor  # [n - num_tree] long rows of the prompt embeddings
    prompt_count: torch.Tensor  # [num_tree] long, k_u
    prompt_count_list: list[int]  # k_u, host copy (next state without a device sync)
    slot_index: torch.Tensor  # [num_tree, Kmax, E] long: input index of slot (u, j, e); 0 where j >= k_u
    paths: torch.Tensor  # [L, depth + 1] long tree indices root..leaf, padded with 0
    path_valid: torch.Tensor  # [L, depth] bool, True for real steps along the path
    paths_list: list[list[int]]  # paths, host copy (the accepted path's indices without a device read)
    children: torch.Tensor  # [num_tree, max_children] long, rank order, -1 padded (sampling)
    depth: int


def build_buffers(state: int, nodes: list[tuple[int, ...]], prompt_count: list[int], top_k: int, ensemble: int,
                  dtype: torch.dtype, device, planned_input_length: int | None = None) -> StepBuffers:
    """ensemble = 0 means no prompt slots in the input (a guesser without embeddings)."""
    parents = [-1] + [0] * len(nodes)
    index = {(): 0}
    for i, p in enumerate(nodes):
        parents[i + 1] = index[p[:-1]]
        index[p] = i + 1
    n_tree = len(nodes) + 1
    anc = ancestor_matrix(parents)  # [n_tree, n_tree]
    depth = tree_depths(parents)
    E = ensemble
    slots = [(u, j, e) for u in range(n_tree) for j in range(prompt_count[u]) for e in range(E)]
    n = n_tree + len(slots)
    visible = torch.zeros(n, n, dtype=torch.bool)
    visible[:n_tree, :n_tree] = anc
    offsets = depth + [depth[u] + j + 1 for (u, j, e) in slots]
    kmax = max(prompt_count)
    slot_index = torch.zeros(n_tree, max(kmax, 1), max(E, 1), dtype=torch.long)
    start = n_tree
    for u in range(n_tree):
        m = prompt_count[u] * E
        if m == 0:
            continue
        block = slice(start, start + m)
        visible[block, :n_tree] = anc[u]
        visible[block, block] = prompt_block_mask(prompt_count[u], E)
        slot_index[u, : prompt_count[u]] = torch.arange(start, start + m).view(prompt_count[u], E)
        start += m
    mask = torch.zeros(n, n, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)

    cand = [(len(p) - 1) * top_k + p[-1] for p in nodes]
    has_child = set(parents[1:])
    leaves = [i for i in range(n_tree) if i not in has_child]
    tree_depth = max(depth)
    paths = torch.zeros(len(leaves), tree_depth + 1, dtype=torch.long)
    valid = torch.zeros(len(leaves), tree_depth, dtype=torch.bool)
    for li, leaf in enumerate(leaves):
        chain = [leaf]
        while chain[-1] != 0:
            chain.append(parents[chain[-1]])
        chain.reverse()
        paths[li, : len(chain)] = torch.tensor(chain)
        valid[li, : len(chain) - 1] = True
    kids: list[list[int]] = [[] for _ in range(n_tree)]
    for i in sorted(range(1, n_tree), key=lambda i: nodes[i - 1][-1]):
        kids[parents[i]].append(i)
    width = max(1, max(len(k) for k in kids))
    children = torch.full((n_tree, width), -1, dtype=torch.long)
    for u, k in enumerate(kids):
        children[u, : len(k)] = torch.tensor(k, dtype=torch.long)

    to = lambda t: t.to(device)  # noqa: E731
    return StepBuffers(
        state=state,
        num_tree=n_tree,
        input_length=n,
        planned_input_length=planned_input_length if planned_input_length is not None else n_tree + sum(prompt_count),
        parents=to(torch.tensor([max(p, 0) for p in parents], dtype=torch.long)),
        cand_index=to(torch.tensor(cand, dtype=torch.long)),
        position_offsets=to(torch.tensor(offsets, dtype=torch.long)[None]),
        mask_block=to(mask),
        slot_embedding=to(torch.tensor([j * max(E, 1) + e for (u, j, e) in slots], dtype=torch.long)),
        prompt_count=to(torch.tensor(prompt_count, dtype=torch.long)),
        prompt_count_list=list(prompt_count),
        slot_index=to(slot_index),
        paths=to(paths),
        path_valid=to(valid),
        paths_list=paths.tolist(),
        children=children,  # host: the sampling walk reads it element by element
        depth=tree_depth,
    )


@dataclass
class PlanBuffers:
    """Buffers of every state of a plan, plus the bootstrap step used right after the prefill."""

    states: dict[int, StepBuffers]
    bootstrap: StepBuffers
    static: bool  # medusa/sequoia: one state, every token carries `depth` prompt tokens
    depth: int
    top_k: int


def check_plan(tree: Tree, guesser, label: str = "plan") -> None:
    """Clear errors before decoding: the plan must not ask more of the guesser than it gives."""
    ranks = max((r for st in tree.states for p in st.nodes for r in p), default=-1)
    if ranks >= guesser.top_k:
        raise UserError(f"{label}: the plan uses rank {ranks}, the guesser gives top-{guesser.top_k} guesses per distance")
    need = tree.prompt_tokens_max if tree.method == "ppd" else tree.depth
    if need > guesser.num_distances:
        what = f"prompt_tokens_max = {need}" if tree.method == "ppd" else f"depth {need}"
        raise UserError(f"{label}: the plan needs {what}, the guesser guesses {guesser.num_distances} distances")
    if tree.method != "ppd" and tree.depth == 0:
        raise UserError(f"{label}: the {tree.method} tree has no candidates")


def build_plan_buffers(tree: Tree, guesser, dtype, device, label: str = "plan") -> PlanBuffers:
    check_plan(tree, guesser, label)
    E = guesser.ensemble if guesser.input_embeddings() is not None else 0
    K = guesser.top_k
    static = tree.method != "ppd"
    states = {}
    if static:
        D = tree.depth
        st = tree.states[0]
        states[0] = build_buffers(0, st.nodes, [D] * (len(st.nodes) + 1), K, E, dtype, device, st.input_length)
        boot_k = D
    else:
        for st in tree.states:
            states[st.state] = build_buffers(st.state, st.nodes, list(st.prompt_tokens), K, E, dtype, device, st.input_length)
        boot_k = tree.prompt_tokens_max
    bootstrap = build_buffers(-1, [], [boot_k], K, E, dtype, device)
    return PlanBuffers(states, bootstrap, static, boot_k, K)
