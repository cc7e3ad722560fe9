"""Step layouts: the shape of one step's input, built once per tree shape; a step then uses tensor ops only.

A layout says where every token of the step input sits (positions, the [n, n] visibility among the
step's tokens), how to read the accepted path back (root-to-leaf paths, children in rank order),
and, for PPD, where the prompt-token slots are. Guessers propose a layout and the tokens to fill
it; every layout is built once per shape and reused (`layout_for`, `plan_layout`).

Step input layout for a tree with N candidates:
  [root, node_1 .. node_N, prompt slots]
prompt slots: for each tree token u (root first) with k_u prompt tokens, k_u * E slots in order
(distance j, ensemble copy e), embedding row j * E + e (see decoder/guessers/prompt_tokens.py).
Positions: a tree token at depth d sits at prefix + d; prompt slot j (0-based) of u at pos(u) + j + 1.

Static trees (medusa, sequoia) have no per-node prompt counts in the plan: every tree token
carries D prompt tokens (D = tree depth), so the next step can always guess depth D. Their real
input length is therefore larger than the plan's input_length; `StepLayout.input_length` is
the real one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from planner.tree import ancestor_matrix, tree_depths
from planner.tree import PPD, Tree


def prompt_block_mask(num_prompt_tokens: int, ensemble: int = 1) -> torch.Tensor:
    """bool [P*E, P*E]: True where slot a = (j, e) may attend slot b = (j', e'): e == e' and j' <= j."""
    idx = torch.arange(num_prompt_tokens * ensemble)
    j, e = idx // ensemble, idx % ensemble
    return (e[:, None] == e[None, :]) & (j[None, :] <= j[:, None])


@dataclass
class StepLayout:
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
    kernel_tree: object = None  # the tree as a kernels.TreeMask, filled on first use by the kernel path


def build_layout(state: int, nodes: list[tuple[int, ...]], prompt_count: list[int], top_k: int, ensemble: int,
                 dtype: torch.dtype, device, planned_input_length: int | None = None) -> StepLayout:
    """ensemble = 0 means no prompt slots in the input (a guesser without embeddings)."""
    parents = [-1] + [0] * len(nodes)
    index = {(): 0}
    for i, p in enumerate(nodes):
        parents[i + 1] = index[p[:-1]]
        index[p] = i + 1
    n_tree = len(nodes) + 1
    depth = tree_depths(parents)
    slots = [(u, j, e) for u in range(n_tree) for j in range(prompt_count[u]) for e in range(ensemble)]
    visible, slot_index = _visibility(parents, prompt_count, ensemble, len(slots))
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    paths, valid = _root_to_leaf_paths(parents)
    to = lambda t: t.to(device)  # noqa: E731
    return StepLayout(
        state=state,
        num_tree=n_tree,
        input_length=n_tree + len(slots),
        planned_input_length=planned_input_length if planned_input_length is not None else n_tree + sum(prompt_count),
        parents=to(torch.tensor([max(p, 0) for p in parents], dtype=torch.long)),
        cand_index=to(torch.tensor([(len(p) - 1) * top_k + p[-1] for p in nodes], dtype=torch.long)),
        position_offsets=to(torch.tensor(depth + [depth[u] + j + 1 for (u, j, e) in slots], dtype=torch.long)[None]),
        mask_block=to(mask),
        slot_embedding=to(torch.tensor([j * max(ensemble, 1) + e for (u, j, e) in slots], dtype=torch.long)),
        prompt_count=to(torch.tensor(prompt_count, dtype=torch.long)),
        prompt_count_list=list(prompt_count),
        slot_index=to(slot_index),
        paths=to(paths),
        path_valid=to(valid),
        paths_list=paths.tolist(),
        children=_children(nodes, parents),  # host: the sampling walk reads it element by element
        depth=max(depth),
    )


def _visibility(parents: list[int], prompt_count: list[int], E: int, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, n] bool visibility among the step's tokens (tree tokens see their ancestors; a node's
    prompt slots see the node's ancestors and their own ensemble chain) and the slot index
    [num_tree, max(k), E] of slot (u, j, e) in the input (0 where j >= k_u)."""
    n_tree = len(parents)
    n = n_tree + n_slots
    anc = torch.from_numpy(ancestor_matrix(parents))  # [n_tree, n_tree]
    visible = torch.zeros(n, n, dtype=torch.bool)
    visible[:n_tree, :n_tree] = anc
    slot_index = torch.zeros(n_tree, max(max(prompt_count), 1), max(E, 1), dtype=torch.long)
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
    return visible, slot_index


def _root_to_leaf_paths(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """paths [L, depth + 1] tree indices root..leaf (0-padded) and valid [L, depth] steps, one row per leaf."""
    depth = max(tree_depths(parents))
    has_child = set(parents[1:])
    leaves = [i for i in range(len(parents)) if i not in has_child]
    paths = torch.zeros(len(leaves), depth + 1, dtype=torch.long)
    valid = torch.zeros(len(leaves), depth, dtype=torch.bool)
    for li, leaf in enumerate(leaves):
        chain = [leaf]
        while chain[-1] != 0:
            chain.append(parents[chain[-1]])
        chain.reverse()
        paths[li, : len(chain)] = torch.tensor(chain)
        valid[li, : len(chain) - 1] = True
    return paths, valid


def _children(nodes: list[tuple[int, ...]], parents: list[int]) -> torch.Tensor:
    """[num_tree, max_children] children of each tree token in rank order, -1 padded."""
    kids: list[list[int]] = [[] for _ in parents]
    for i in sorted(range(1, len(parents)), key=lambda i: nodes[i - 1][-1]):
        kids[parents[i]].append(i)
    children = torch.full((len(parents), max(1, max(len(k) for k in kids))), -1, dtype=torch.long)
    for u, k in enumerate(kids):
        children[u, : len(k)] = torch.tensor(k, dtype=torch.long)
    return children


@dataclass
class PlanLayout:
    """Layouts of every state of a plan, plus the bootstrap step used right after the prefill."""

    states: dict[int, StepLayout]
    bootstrap: StepLayout
    static: bool  # medusa/sequoia: one state, every token carries `depth` prompt tokens
    depth: int
    top_k: int

    def next(self, prompt_tokens: int) -> StepLayout:
        """The layout after a step whose last accepted node carried `prompt_tokens` prompt tokens."""
        return self.states[0] if self.static else self.states[prompt_tokens]

    @property
    def max_input_length(self) -> int:
        return max([b.input_length for b in self.states.values()] + [self.bootstrap.input_length])


def tree_signature(tree: Tree) -> tuple:
    """Hashable identity of a plan's shapes (two equal plans share their layouts)."""
    return (tree.method, tree.prompt_tokens_max,
            tuple((st.state, tuple(st.nodes), tuple(st.prompt_tokens or ())) for st in tree.states))


_CACHE: dict[tuple, object] = {}
_CACHE_SIZE = 256  # layouts are small; a sweep over many plans keeps the recent ones


def _memo(key: tuple, build):
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = build()
    return _CACHE[key]


def layout_for(nodes: tuple[tuple[int, ...], ...], top_k: int, dtype, device, prompt_count: tuple[int, ...] | None = None,
               ensemble: int = 0, state: int = 0) -> StepLayout:
    """The layout of one tree shape (rank paths; optional prompt tokens per tree token), built once."""
    counts = prompt_count if prompt_count is not None else (0,) * (len(nodes) + 1)
    key = ("step", tuple(nodes), tuple(counts), top_k, ensemble, state, str(dtype), str(torch.device(device)))
    return _memo(key, lambda: build_layout(state, list(nodes), list(counts), top_k, ensemble, dtype, device))


def plan_layout(tree: Tree, top_k: int, ensemble: int, dtype, device) -> PlanLayout:
    """Layouts of a PPD-style plan (prompt tokens per node; static trees carry `depth` on every
    node), built once per plan shape, guesser width and device.

    ensemble = 0: the guesser has no prompt-token inputs (an oracle), so no slots.
    """
    key = ("plan", tree_signature(tree), top_k, ensemble, str(dtype), str(torch.device(device)))
    return _memo(key, lambda: _build_plan_layout(tree, top_k, ensemble, dtype, device))


def _build_plan_layout(tree: Tree, K: int, E: int, dtype, device) -> PlanLayout:
    static = tree.method != PPD
    states = {}
    if static:
        D = tree.depth
        st = tree.states[0]
        states[0] = build_layout(0, st.nodes, [D] * (len(st.nodes) + 1), K, E, dtype, device, st.input_length)
        boot_k = D
    else:
        for st in tree.states:
            states[st.state] = build_layout(st.state, st.nodes, list(st.prompt_tokens), K, E, dtype, device, st.input_length)
        boot_k = tree.prompt_tokens_max
    bootstrap = build_layout(-1, [], [boot_k], K, E, dtype, device)
    return PlanLayout(states, bootstrap, static, boot_k, K)
