"""One step's candidate pool under a dynamic plan, and what fills it (decoder/guessers/dynamic.py decides).

Each step every per-step source (`Source`: one per guesser, two for a hybrid) adds its candidates
to one `Pool`: a token, its parent (parents before children), the corrected acceptance c it is
chosen by, and the calibration cells it is an observation of. The session keeps the best paths
(planner.dynamic.choose) and turns them into rank paths (`rank_paths`) for the step's layout.
Guessers whose guess at distance d does not depend on the path (ParallelSpec, PPD) offer a
Cartesian pool, built best-first by `cartesian`.

The sources live beside their guessers' own drafting code: `LookupSource` in decoder/guessers/lookup.py,
`DraftSource` in decoder/guessers/draft_source.py, `ParallelSource` in decoder/guessers/parallel.py, `PPDSource` in
decoder/guessers/prompt_tokens.py; each guesser's `dynamic_source(...)` opens one.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from planner.dynamic import GuesserModel, path_probabilities

if TYPE_CHECKING:
    from decoder.guesser import DecodeContext, StepOutcome
    from decoder.layout import StepLayout

POOL_WIDTH = 4  # children drafted per expanded node (draft LM), guesses per distance used (Cartesian drafters)


class Pool:
    """One step's candidates, parents before children (parent -1: the root)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.c: list[float] = []  # the (corrected) conditional acceptance used to choose
        self.cells: list[tuple] = []  # per node: ((kind, flat cell, signal bin), ...) it is an observation of
        self.rank: list[int] = []  # the guesser's own rank of the token among its siblings
        self.q: dict[int, torch.Tensor] = {}  # sampled drafts: node (-1: root) -> q [V] its children were drawn from
        self.sunk_s = 0.0  # paid this step at the plan's prices: its decide_s, then draft_s per drafter pass
        self.passes_s = 0.0  # wall time of drafter passes: reported (taken out of the decision's time), never priced
        self.index: dict[tuple[int, int], int] = {}  # (parent, token) -> node: hybrid pools merge equal paths
        self.fixed: list[int] | None = None  # the kept nodes when a source chose them itself (sampled drafts)
        self.sampled: set[int] = set()  # nodes drawn from their parent's q[parent]; the others are fixed guesses

    def add(self, token: int, parent: int, c: float, cell: tuple, rank: int = 0, merge: bool = True) -> int:
        """A node (its index); merge: the same (parent, token) from another guesser is the same node.
        Sampled draws never merge: a draw's place among its siblings is the order it was drawn in."""
        key = (parent, token)
        i = self.index.get(key) if merge else None
        if i is not None:  # the same path from two guessers: one node, the better estimate
            self.c[i] = max(self.c[i], c)
            self.cells[i] = self.cells[i] + (cell,)
            return i
        i = len(self.tokens)
        self.index[key] = i
        self.tokens.append(token)
        self.parent.append(parent)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.c.append(c)
        self.cells.append((cell,))
        self.rank.append(rank)
        return i

    def probabilities(self) -> np.ndarray:
        return path_probabilities(np.array(self.parent, dtype=np.int64), np.array(self.c))


def rank_paths(parent: list[int], chosen: list[int]) -> tuple[tuple[int, ...], ...]:
    """Rank paths of the chosen nodes (sorted, parents first): a node's rank is its place among its chosen siblings."""
    path = {-1: ()}
    kids: dict[int, int] = {}
    out = []
    for i in chosen:
        p = parent[i]
        r = kids.get(p, 0)
        kids[p] = r + 1
        path[i] = path[p] + (r,)
        out.append(path[i])
    return tuple(out)


def cartesian(pool: Pool, kind: str, c: np.ndarray, tokens: np.ndarray, cells: np.ndarray, budget: int,
              sig: np.ndarray | None = None) -> None:
    """The `budget` most probable rank paths of a guess matrix whose guess at distance d does not
    depend on the path (c, tokens, cells, sig [D, K]), best-first with a heap."""
    D, K = c.shape
    heap = [(-c[0, 0], 0, 0, -1, 1.0)]  # (-P, depth index, rank, parent pool index, parent P)
    added = 0
    while heap and added < budget:
        negP, d, r, parent, pP = heapq.heappop(heap)
        b = int(sig[d, r]) if sig is not None else 0
        i = pool.add(int(tokens[d, r]), parent, float(c[d, r]), (kind, int(cells[d, r]), b), r)
        added += 1
        if r + 1 < K:
            heapq.heappush(heap, (-pP * c[d, r + 1], d, r + 1, parent, pP))
        if d + 1 < D:
            heapq.heappush(heap, (negP * c[d + 1, 0], d + 1, 0, i, -negP))


class Decider(Protocol):
    """What a source may ask the session (decoder.guessers.dynamic.DynamicSession) while it fills the pool."""

    cost_n: np.ndarray  # [n_max + 1] step cost by number of candidates

    def c_of(self, kind: str, cells: np.ndarray) -> np.ndarray:
        """The corrected c of each flat cell."""
        ...

    def top1(self, kind: str, depth: int) -> float:
        """The corrected rank-0 acceptance at this distance: what a drafter expects before it drafts."""
        ...

    def worth_level(self, pool: Pool, best_new: float, draft_s: float) -> bool:
        """Whether one more drafter pass, adding a path of probability best_new, raises tokens per second."""
        ...


class Source:
    """One guesser's per-step source: each step `extend` adds its candidates to the pool (drafting
    only what pays, asking the session), `commit` follows the accepted path. Defaults: one forward
    input per candidate and for the root, the session's own layout, no extra inputs."""

    kind = ""
    input_per_node = 1  # forward inputs per candidate
    input_fixed = 1  # forward inputs of a step without candidates

    def __init__(self, model: GuesserModel):
        self.model = model

    def extend(self, pool: Pool, root: torch.Tensor, session: Decider) -> None:
        raise NotImplementedError

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        """accepted: the pool nodes on the accepted path, root excluded."""
        raise NotImplementedError

    def layout(self, paths, top_k: int, ctx: DecodeContext) -> StepLayout | None:
        return None  # a layout of its own (PPD: prompt-token slots after every node)

    def extra_embeds(self, lay: StepLayout) -> torch.Tensor | None:
        return None  # non-token inputs after the tree (PPD's prompt tokens)
