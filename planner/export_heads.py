"""Tree settings for the engines that run EAGLE heads, from the head's measured acceptance and a profile.

Each engine takes the tree in its own terms (docs/batching-and-export.md, 'EAGLE heads'):
  SGLang        (steps S, topk K, draft tokens N): an EAGLE-2 tree grown at run time. Step 1 takes the
                root's top K; each further step expands the K best frontier nodes by their top K and keeps
                the K best of those K^2 as the next frontier; the N - 1 best of all drafted nodes are
                verified with the root. topk 1 is a chain of S (N = S + 1).
  TensorRT-LLM  a static tree as paths (`eagle_choices`, every prefix present), or the same EAGLE-2 budget
                (use_dynamic_tree, max_draft_len S, dynamic_tree_max_topK K, max_total_draft_tokens N - 1).
  vLLM 0.32     a chain of num_speculative_tokens (its tree attention was removed), per batch size.

Under the planner's independence model (a node at rank path (r_1..r_d) is accepted with probability
prod_i a[i][r_i], the head's measured acceptance), run-time growth keeps the nodes of largest path
probability, so the expected tokens of a step are 1 + the sum of the kept nodes' path probabilities, and
its time L(N) + S passes of the head. Every (S, K, N) in range is priced and the fastest kept; a chain is
the K = 1 row of the same table, so what an engine that takes only chains loses is a ratio of two rows.
"""
from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass

import numpy as np

from planner.accept import Acceptance
from planner.errors import UserError
from planner.candidate import sequoia_tree, tree_tau
from planner.profile import LatencyProfile

TOPKS = (1, 2, 4, 8)
MAX_STEPS = 8  # EAGLE issue 209: depth 7-8 was where a user's best setting lay
MAX_NODES = 64  # verified nodes with the root (SGLang's num_draft_tokens)


@dataclass(frozen=True)
class EagleBudget:
    steps: int  # S: drafting steps (tree depth)
    topk: int  # K: children per expanded node, and frontier width
    draft_tokens: int  # N: nodes verified, root included
    expected_tokens: float  # per step, the bonus token included
    step_s: float  # predicted seconds per step: L(N) + S head passes
    tokens_per_s: float

    def to_json(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def grown_tree(rows: np.ndarray, steps: int, topk: int) -> list[tuple[tuple[int, ...], float]]:
    """Every node SGLang's EAGLE-2 growth drafts in `steps` steps of width `topk`, with its path probability:
    rows [D, R] the acceptance per distance and rank (ranks beyond R and depths beyond D accept 0)."""
    D, R = rows.shape
    drafted: list[tuple[tuple[int, ...], float]] = []
    frontier = [((), 1.0)]
    for d in range(steps):
        children = [(path + (r,), p * (rows[d, r] if d < D and r < R else 0.0))
                    for path, p in frontier for r in range(topk)]
        drafted += children
        frontier = heapq.nlargest(topk, children, key=lambda c: c[1])
    return drafted


def budget_tokens(rows: np.ndarray, steps: int, topk: int, draft_tokens: int) -> float:
    """Expected tokens per step of the (S, K, N) budget: 1 + the N - 1 largest path probabilities drafted."""
    probs = sorted((p for _, p in grown_tree(rows, steps, topk)), reverse=True)
    return 1.0 + float(sum(probs[: draft_tokens - 1]))


def budgets(accept: Acceptance, profile: LatencyProfile, draft_s: float, topks=TOPKS, max_steps: int = MAX_STEPS,
            max_nodes: int = MAX_NODES) -> list[EagleBudget]:
    """Every (S, K, N) that fits the profile, priced: N from S + 1 up to min(max_nodes, all drafted + 1)."""
    rows = accept.rows(min(max_steps, accept.max_depth or max_steps))
    cap = min(max_nodes, profile.max_input_length)
    out = []
    for K in topks:
        for S in range(1, max_steps + 1):
            probs = sorted((p for _, p in grown_tree(rows, S, K)), reverse=True)
            for N in (range(S + 1, S + 2) if K == 1 else range(S + 1, min(cap, len(probs) + 1) + 1)):
                if N > cap:
                    break
                tau = 1.0 + float(sum(probs[: N - 1]))
                t = _step_s(profile, N, S, draft_s)
                out.append(EagleBudget(S, K, N, tau, t, tau / t))
    return out


def _step_s(profile: LatencyProfile, n: int, passes: int, draft_s: float) -> float:
    """A step of n verified tokens and `passes` head passes: the forward, the decoder's own work, the drafting."""
    return float(profile.latency(n)) + float(profile.overhead(n)) + passes * draft_s


def best_budget(accept: Acceptance, profile: LatencyProfile, draft_s: float, chain: bool = False) -> EagleBudget:
    """The fastest budget (chain=True: topk 1 only, what vLLM and TensorRT-LLM's draft_len_schedule take)."""
    table = budgets(accept, profile, draft_s, topks=(1,) if chain else TOPKS)
    return max(table, key=lambda b: b.tokens_per_s)


def plain_budget(profile: LatencyProfile) -> EagleBudget:
    t = _step_s(profile, 1, 0, 0.0)
    return EagleBudget(0, 1, 1, 1.0, t, 1.0 / t)


def eagle_choices(accept: Acceptance, profile: LatencyProfile, draft_s: float, max_depth: int = MAX_STEPS,
                  max_nodes: int = MAX_NODES) -> tuple[list[list[int]], EagleBudget]:
    """TensorRT-LLM's static `eagle_choices` (paths, parents first, every prefix present): the Sequoia tree of
    the size that is fastest on the profile, priced as a budget (S its depth, K its widest rank + 1)."""
    depth = min(max_depth, accept.max_depth or max_depth)
    rows = accept.rows(depth)
    best = None
    for n in range(1, min(max_nodes, profile.max_input_length) - 1 + 1):
        nodes = sequoia_tree(rows, n, depth)
        S = max(len(p) for p in nodes)
        tau = tree_tau(rows, nodes)
        t = _step_s(profile, len(nodes) + 1, S, draft_s)
        if best is None or tau / t > best[1].tokens_per_s:
            best = ([list(p) for p in nodes], EagleBudget(S, max(max(p) for p in nodes) + 1, len(nodes) + 1, float(tau), t,
                                                           float(tau) / t))
    return best


def chain_loss(accept: Acceptance, profile: LatencyProfile, draft_s: float, tree: EagleBudget | None = None) -> dict:
    """What an engine that takes only chains loses: the best tree's (`tree` where the caller priced it already)
    and the best chain's predicted speed."""
    tree = tree or best_budget(accept, profile, draft_s)
    chain, plain = best_budget(accept, profile, draft_s, chain=True), plain_budget(profile)
    return {"tree": tree.to_json(), "chain": chain.to_json(), "plain_tokens_per_s": round(plain.tokens_per_s, 4),
            "tree_over_plain": round(tree.tokens_per_s / plain.tokens_per_s, 4),
            "chain_over_plain": round(chain.tokens_per_s / plain.tokens_per_s, 4),
            "chain_over_tree": round(chain.tokens_per_s / tree.tokens_per_s, 4)}


# ---------------------------------------------------------------------------------------------- a head's export


def chain_ranges(accept: Acceptance, profiles: dict, draft_s: float, max_batch_size: int) -> list:
    """The best chain per profiled batch size (K = 0 where plain is faster), merged into planner.export
    DraftRange ranges reaching max_batch_size."""
    from planner.export import DraftRange

    sizes = sorted(profiles)
    ks = []
    for b in sizes:
        chain, plain = best_budget(accept, profiles[b], draft_s, chain=True), plain_budget(profiles[b])
        ks.append(chain.steps if chain.tokens_per_s > plain.tokens_per_s else 0)
    his = [nxt - 1 for nxt in sizes[1:]] + [max_batch_size]
    out: list = []
    for lo, hi, k in zip(sizes, his, ks):
        if out and out[-1].k == k:
            out[-1] = DraftRange(out[-1].lo, hi, k)
        else:
            out.append(DraftRange(1 if not out else lo, hi, k))
    return out


@dataclass(frozen=True)
class HeadExport:
    """What every engine's writer reads: the head, its acceptance and the profiles per batch size, with the best
    tree at batch size 1 (priced once) and the note on what a chain-only engine loses."""

    engine: str
    method: str
    folder: str
    accept: Acceptance
    profiles: dict
    draft_s: float
    max_batch_size: int
    plugin: bool
    tree: EagleBudget
    note: str


def head_export(engine: str, method: str, folder: str, accept: Acceptance, profiles: dict, draft_s: float,
                max_batch_size: int, plugin: bool = True):
    """A head's settings for `engine` (planner.export's Export), by how the engine runs a head: a chain per
    batch size (vLLM), a tree grown from (steps, topk, draft tokens) (SGLang), static eagle_choices or an
    EAGLE-2 budget (TensorRT-LLM), whichever the profile prices faster at batch size 1; with notes saying
    what each alternative and a chain-only engine give."""
    from planner.export import TARGETS, check_engine

    shape = TARGETS[check_engine(engine)].head_shape
    if shape is None:
        raise UserError(f"--drafter: engine {engine!r} runs no EAGLE head; use one of "
                        + ", ".join(e for e, t in TARGETS.items() if t.head_shape))
    p1 = profiles[min(profiles)]
    tree = best_budget(accept, p1, draft_s)
    loss = chain_loss(accept, p1, draft_s, tree)
    note = (f"at batch size 1 the best tree predicts {loss['tree_over_plain']:.2f}x plain and the best chain "
            f"{loss['chain_over_plain']:.2f}x ({100 * (1 - loss['chain_over_tree']):.0f} % lost to a chain-only engine)")
    h = HeadExport(engine, method, folder, accept, profiles, draft_s, max_batch_size, plugin, tree, note)
    return {"chain": _chain_export, "grown": _grown_export, "choices": _choices_export}[shape](h)


def _chain_export(h: HeadExport):
    from planner.export import Export, ExportOptions, build
    from planner.tree import Tree, TreeState

    ranges = chain_ranges(h.accept, h.profiles, h.draft_s, h.max_batch_size)
    depth = max(r.k for r in ranges)
    if depth == 0:
        raise UserError("plain decoding is predicted fastest at every batch size: no speculative setting to write")
    chain = Tree("medusa", [TreeState(0, [(0,) * i for i in range(1, depth + 1)], 1.0, depth + 1)], 1.0)
    out: Export = build(chain, ranges, ExportOptions(h.engine, h.method, h.folder, plugin=h.plugin), {}, [])
    out.notes.append(f"this engine verifies chains: {h.note}")
    return out


def _grown_export(h: HeadExport):
    from planner.export import ENGINE_METHODS, Export

    tree = h.tree
    args = ["--speculative-algorithm", ENGINE_METHODS[h.engine][h.method], "--speculative-draft-model-path", h.folder,
            "--speculative-num-steps", str(tree.steps), "--speculative-eagle-topk", str(tree.topk),
            "--speculative-num-draft-tokens", str(tree.draft_tokens)]
    return Export(h.engine, {"server_args": args, "adaptive_config": None}, " ".join(args), [
        f"the engine grows this tree at run time: predicted {tree.expected_tokens:.2f} tokens a step; {h.note}"])


def _choices_export(h: HeadExport):
    from planner.export import ENGINE_METHODS, Export

    tree = h.tree
    choices, static = eagle_choices(h.accept, h.profiles[min(h.profiles)], h.draft_s)
    cfg = {"decoding_type": ENGINE_METHODS[h.engine][h.method], "speculative_model": h.folder}
    if static.tokens_per_s >= tree.tokens_per_s:
        cfg.update(max_draft_len=static.steps, max_total_draft_tokens=static.draft_tokens - 1, eagle_choices=choices)
        other = (f"a dynamic tree (use_dynamic_tree, max_draft_len {tree.steps}, dynamic_tree_max_topK {tree.topk}, "
                 f"max_total_draft_tokens {tree.draft_tokens - 1}) predicts {tree.tokens_per_s / static.tokens_per_s:.2f}x "
                 "this static tree")
    else:
        cfg.update(max_draft_len=tree.steps, max_total_draft_tokens=tree.draft_tokens - 1, use_dynamic_tree=True,
                   dynamic_tree_max_topK=tree.topk)
        other = f"the best static eagle_choices ({len(choices)} paths) predicts {static.tokens_per_s / tree.tokens_per_s:.2f}x"
    return Export(h.engine, {"speculative_config": cfg}, "--extra_llm_api_options SPEC.yaml  # speculative_config",
                  [other, h.note])


def head_basis(accept_file: str, profile_file: str, accept: Acceptance, profiles: dict, draft_s: float) -> dict:
    p1 = profiles[min(profiles)]
    table = sorted(budgets(accept, p1, draft_s), key=lambda b: -b.tokens_per_s)[:8]
    return {"acceptance": accept_file, "profile": profile_file, "draft_s": draft_s,
            "chain_loss_batch_1": chain_loss(accept, p1, draft_s), "best_budgets_batch_1": [b.to_json() for b in table]}
