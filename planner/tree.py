"""Tree files: the planner's output and the decoder's input.

A tree file holds one tree per decoder state (medusa/sequoia: a single state 0; ppd: states
0..P, the number of prompt tokens on the last accepted node). Nodes are rank paths, 0-based, the
root implicit (Medusa-choices convention), listed parents first. The JSON Schema is
trees/schema.json; `load_tree` validates structure and meaning and raises UserError with a
one-line message.

An optional "schedule" holds one tree per batch-size range (planned with a latency profile per
batch size, planner/batch.py): [{"batch_sizes": [lo, hi], "tree": {...} | null, ...}], ranges
inclusive, contiguous from 1; null is plain decoding; above the last range the last entry
applies. The top-level tree is the batch-size-1 entry's, so readers that know no schedule
decode batch size 1 as planned. `Tree.for_batch(b)` picks the entry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from planner.errors import UserError
from planner.jsonio import atomic_write_json, read_json
from planner.plan_settings import engines, plan_settings

FORMAT = "tree-planner/tree"
VERSION = 1
MEDUSA, SEQUOIA, PPD = "medusa", "sequoia", "ppd"  # static tree families (planner/candidate.py, planner/ppd.py)
METHODS = (MEDUSA, SEQUOIA, PPD)  # static trees (what tune and the searches plan)
DYNAMIC = "dynamic"  # a tree chosen at every step (planner/dynamic.py); states[0] holds the prior's tree
CHAIN = "chain"  # a medusa tree of rank-0 guesses only: speculative decoding's draft (autotune's method name)
FILE_METHODS = METHODS + (DYNAMIC,)
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "trees" / "schema.json"

Path_ = tuple[int, ...]
# Bounds on what a user can type or a file can say: far above any useful tree (the best trees of
# the published matrices stop near 64-256 tokens) and small enough that the searches' arrays and
# the decoder's buffers fit in memory.
MAX_SIZE = 4096  # candidates (medusa, sequoia: the DP is [depth, size, size])
MAX_INPUT_LENGTH = 8192  # tokens per forward pass
MAX_PROMPT_TOKENS = 16  # ppd: P
MAX_DEPTH = 64
MAX_BATCH_SIZE = 1 << 20  # a bound on what a schedule range may name
LAYOUTS = ("packed", "padded")  # batched decoding without padding (EMS-SD) or padded to the longest



# ---------------------------------------------------------------------------------------------- tree maths


def tree_depths(parents) -> list[int]:
    """Depth of each tree token below the cache: a token with parent -1 has depth 0. parents[i] < i."""
    depth: list[int] = []
    for p in (int(x) for x in parents):
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def ancestor_matrix(parents) -> np.ndarray:
    """[n, n] bool, True where column j is row i itself or one of its ancestors.

    parents[i] is the index of token i's parent within the tree, -1 for a token hanging directly
    off the cache; tokens are in topological order (parent index < own index). Built once per tree
    shape, so the loop over nodes is off the decoder's hot path."""
    parents = [int(p) for p in parents]
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"parents[{i}] = {p}: tree tokens must follow their parent")
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def path_parents(nodes) -> list[int]:
    """Tree indices of each rank path's parent, root (index 0) first with parent -1: nodes are rank
    paths, parents listed before children, the root implicit."""
    index = {(): 0}
    parents = [-1]
    for i, p in enumerate(nodes):
        parents.append(index[tuple(p[:-1])])
        index[tuple(p)] = i + 1
    return parents

@dataclass
class TreeState:
    state: int
    nodes: list[Path_]  # candidate rank paths, parents before children
    expected_tokens: float  # tau_s = 1 + sum of path probabilities
    input_length: int  # tokens in the forward pass: root + candidates + prompt tokens
    prompt_tokens: list[int] | None = None  # ppd: [k_root, k_node1, ...] aligned with root + nodes
    stationary_probability: float | None = None  # ppd: pi_s
    transitions: list[float] | None = None  # ppd: M[s][k] for k = 0..P

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.nodes), default=0)

    def parents(self) -> list[int]:
        """Parent index of each node within the tree input (0 = root, node i is i+1); root's is -1."""
        index = {(): 0}
        out = [-1]
        for i, p in enumerate(self.nodes):
            out.append(index[p[:-1]])
            index[p] = i + 1
        return out

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "state": self.state,
            "nodes": [list(p) for p in self.nodes],
            "input_length": self.input_length,
            "expected_tokens": self.expected_tokens,
        }
        if self.prompt_tokens is not None:
            d["prompt_tokens"] = list(self.prompt_tokens)
        if self.stationary_probability is not None:
            d["stationary_probability"] = self.stationary_probability
        if self.transitions is not None:
            d["transitions"] = list(self.transitions)
        return d


@dataclass
class Tree:
    method: str
    states: list[TreeState]
    expected_tokens_per_step: float  # amortised tau under the model
    prompt_tokens_max: int | None = None  # ppd: P
    predicted_speedup: float | None = None
    size_curve: list[dict] | None = None  # with a profile: one row per size tried
    settings: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    schedule: list[ScheduleEntry] | None = None  # per batch-size range; None: this tree at every batch size
    dynamic: object = None  # planner.dynamic.DynamicSpec for method "dynamic": trees chosen at every step
    engine: str | None = None  # the target engine it was planned for (planner/engines.py); None: the default (older files)

    def state(self, s: int) -> TreeState:
        for st in self.states:
            if st.state == s:
                return st
        raise KeyError(s)

    @property
    def max_input_length(self) -> int:
        return max(st.input_length for st in self.states)

    @property
    def depth(self) -> int:
        return max(st.depth for st in self.states)

    def for_batch(self, batch_size: int) -> Tree | None:
        """The tree for a batch of `batch_size` sequences; None = plain decoding.

        Without a schedule: this tree at every batch size. Above the last range: the last entry.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch size must be an integer >= 1, got {batch_size!r}")
        if not self.schedule:
            return self
        for entry in self.schedule:
            if entry.batch_sizes[0] <= batch_size <= entry.batch_sizes[1]:
                return entry.tree
        return self.schedule[-1].tree

    def shape(self) -> tuple:
        """What decoding depends on (nodes and prompt tokens per state), to tell trees apart."""
        return self.method, tuple((st.state, tuple(st.nodes), tuple(st.prompt_tokens or ())) for st in self.states)

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "method": self.method,
            "expected_tokens_per_step": self.expected_tokens_per_step,
        }
        if self.prompt_tokens_max is not None:
            d["prompt_tokens_max"] = self.prompt_tokens_max
        if self.predicted_speedup is not None:
            d["predicted_speedup"] = self.predicted_speedup
        d["states"] = [s.to_json() for s in self.states]
        if self.size_curve is not None:
            d["size_curve"] = self.size_curve
        if self.schedule is not None:
            d["schedule"] = [e.to_json() for e in self.schedule]
        if self.dynamic is not None:
            d["dynamic"] = self.dynamic.to_json()
        if self.engine is not None:
            d["engine"] = self.engine
        d["settings"] = self.settings
        d["provenance"] = self.provenance
        return d


@dataclass
class ScheduleEntry:
    """One batch-size range of a schedule and the tree to decode it with (None: plain decoding).

    The predictions are the batched model's (planner/batch.py) at the lowest planned batch size
    of the range; `points` holds one row per planned batch size inside it.
    """

    batch_sizes: tuple[int, int]  # inclusive
    tree: Tree | None
    predicted_speedup: float | None = None  # per sequence, over batched plain decoding
    predicted_tokens_per_step: float | None = None  # E[tau] per sequence
    layout: str | None = None  # LAYOUTS
    points: list[dict] | None = None

    def to_json(self) -> dict:
        d: dict[str, Any] = {"batch_sizes": list(self.batch_sizes),
                             "tree": None if self.tree is None else self.tree.to_json()}
        for key in ("predicted_speedup", "predicted_tokens_per_step", "layout", "points"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


def save_tree(tree: Tree, path) -> Path:
    validate_tree(tree, label=str(path))
    return atomic_write_json(path, tree.to_json())


def load_tree(path) -> Tree:
    return tree_from_json(read_json(path), label=str(path))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def tree_from_json(data, label: str = "tree") -> Tree:
    if not isinstance(data, dict):
        raise UserError(f"{label}: expected a JSON object (a tree file)")
    if data.get("format", FORMAT) != FORMAT:
        raise UserError(f"{label}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version", VERSION) != VERSION:
        raise UserError(f"{label}: field 'version' is {data.get('version')!r}, expected {VERSION}")
    for key in ("method", "expected_tokens_per_step", "states"):
        if key not in data:
            raise UserError(f"{label}: missing field '{key}'")
    if data["method"] not in FILE_METHODS:
        raise UserError(f"{label}: field 'method' is {data['method']!r}, expected one of {', '.join(FILE_METHODS)}")
    if not _is_num(data["expected_tokens_per_step"]):
        raise UserError(f"{label}: field 'expected_tokens_per_step' must be a number")
    if not isinstance(data["states"], list) or not data["states"]:
        raise UserError(f"{label}: field 'states' must be a non-empty list")
    states = []
    for i, s in enumerate(data["states"]):
        f = f"states[{i}]"
        if not isinstance(s, dict):
            raise UserError(f"{label}: field '{f}' must be an object")
        for key in ("state", "nodes", "input_length", "expected_tokens"):
            if key not in s:
                raise UserError(f"{label}: missing field '{f}.{key}'")
        if not _is_int(s["state"]) or s["state"] < 0:
            raise UserError(f"{label}: field '{f}.state' must be a non-negative integer")
        if not _is_int(s["input_length"]) or not 1 <= s["input_length"] <= MAX_INPUT_LENGTH:
            raise UserError(f"{label}: field '{f}.input_length' must be an integer in 1..{MAX_INPUT_LENGTH}")
        if not _is_num(s["expected_tokens"]):
            raise UserError(f"{label}: field '{f}.expected_tokens' must be a number")
        if not isinstance(s["nodes"], list) or len(s["nodes"]) > MAX_SIZE:
            raise UserError(f"{label}: field '{f}.nodes' must be a list of at most {MAX_SIZE} rank paths")
        nodes = []
        for j, p in enumerate(s["nodes"]):
            if not isinstance(p, list) or not 0 < len(p) <= MAX_DEPTH or not all(_is_int(r) and 0 <= r < MAX_SIZE for r in p):
                raise UserError(f"{label}: field '{f}.nodes[{j}]' must be a list of 1..{MAX_DEPTH} ranks in 0..{MAX_SIZE - 1}")
            nodes.append(tuple(p))
        pt = s.get("prompt_tokens")
        if pt is not None and (not isinstance(pt, list) or not all(_is_int(k) and 0 <= k <= MAX_PROMPT_TOKENS for k in pt)):
            raise UserError(f"{label}: field '{f}.prompt_tokens' must be a list of integers in 0..{MAX_PROMPT_TOKENS}")
        pi = s.get("stationary_probability")
        if pi is not None and not (_is_num(pi) and 0 <= pi <= 1 + 1e-9):
            raise UserError(f"{label}: field '{f}.stationary_probability' must be a number in [0, 1]")
        tr = s.get("transitions")
        if tr is not None and (not isinstance(tr, list) or not all(_is_num(x) for x in tr)):
            raise UserError(f"{label}: field '{f}.transitions' must be a list of numbers")
        states.append(TreeState(s["state"], nodes, float(s["expected_tokens"]), s["input_length"], pt, pi, tr))
    pmax = data.get("prompt_tokens_max")
    if pmax is not None and (not _is_int(pmax) or not 1 <= pmax <= MAX_PROMPT_TOKENS):
        raise UserError(f"{label}: field 'prompt_tokens_max' must be an integer in 1..{MAX_PROMPT_TOKENS}, got {pmax!r}")
    sp = data.get("predicted_speedup")
    if sp is not None and not _is_num(sp):
        raise UserError(f"{label}: field 'predicted_speedup' must be a number")
    engine = data.get("engine")
    if engine is not None and engine not in engines():
        raise UserError(f"{label}: field 'engine' is {engine!r}, expected one of {', '.join(engines())}")
    tree = Tree(
        method=data["method"],
        states=states,
        expected_tokens_per_step=float(data["expected_tokens_per_step"]),
        prompt_tokens_max=pmax,
        predicted_speedup=sp,
        size_curve=data.get("size_curve"),
        settings=data.get("settings", {}) or {},
        provenance=data.get("provenance", {}) or {},
        schedule=_schedule_from_json(data["schedule"], label) if data.get("schedule") is not None else None,
        dynamic=_dynamic_from_json(data, label),
        engine=engine,
    )
    validate_tree(tree, label)
    plan_settings(tree.settings, label)  # the runtime fields the decoder reads: checked on load
    return tree


def _dynamic_from_json(data: dict, label: str):
    if data["method"] != DYNAMIC:
        if data.get("dynamic") is not None:
            raise UserError(f"{label}: field 'dynamic' belongs to method 'dynamic' plans only")
        return None
    if data.get("dynamic") is None:
        raise UserError(f"{label}: missing field 'dynamic' (required for method 'dynamic')")
    from planner.dynamic import spec_from_json

    return spec_from_json(data["dynamic"], label)


def _schedule_from_json(obj, label: str) -> list[ScheduleEntry]:
    if not isinstance(obj, list) or not obj:
        raise UserError(f"{label}: field 'schedule' must be a non-empty list of batch-size ranges")
    entries = []
    for i, e in enumerate(obj):
        f = f"schedule[{i}]"
        if not isinstance(e, dict):
            raise UserError(f"{label}: field '{f}' must be an object with 'batch_sizes' and 'tree'")
        for key in ("batch_sizes", "tree"):
            if key not in e:
                raise UserError(f"{label}: missing field '{f}.{key}'")
        bs = e["batch_sizes"]
        if (not isinstance(bs, list) or len(bs) != 2 or not all(_is_int(x) and 1 <= x <= MAX_BATCH_SIZE for x in bs)
                or bs[0] > bs[1]):
            raise UserError(f"{label}: field '{f}.batch_sizes' must be [lo, hi], integers 1 <= lo <= hi <= {MAX_BATCH_SIZE}, got {bs!r}")
        sub = e["tree"]
        if isinstance(sub, dict) and "schedule" in sub:
            raise UserError(f"{label}: field '{f}.tree' must not hold a schedule of its own")
        tree = None if sub is None else tree_from_json(sub, f"{label}: {f}.tree")
        for key in ("predicted_speedup", "predicted_tokens_per_step"):
            if e.get(key) is not None and not (_is_num(e[key]) and e[key] > 0):
                raise UserError(f"{label}: field '{f}.{key}' must be a positive number, got {e[key]!r}")
        layout = e.get("layout")
        if layout is not None and layout not in LAYOUTS:
            raise UserError(f"{label}: field '{f}.layout' is {layout!r}, expected one of {', '.join(LAYOUTS)}")
        points = e.get("points")
        if points is not None and (not isinstance(points, list) or not all(isinstance(p, dict) for p in points)):
            raise UserError(f"{label}: field '{f}.points' must be a list of objects")
        entries.append(ScheduleEntry((bs[0], bs[1]), tree, e.get("predicted_speedup"),
                                     e.get("predicted_tokens_per_step"), layout, points))
    return entries


def validate_tree(tree: Tree, label: str = "tree") -> None:
    """Meaning checks shared by writing and loading: legal trees, consistent sizes."""
    seen_states = set()
    for i, st in enumerate(tree.states):
        f = f"states[{i}]"
        if st.state in seen_states:
            raise UserError(f"{label}: field '{f}.state' repeats state {st.state}")
        seen_states.add(st.state)
        present = {()}
        for j, p in enumerate(st.nodes):
            if p in present:
                raise UserError(f"{label}: field '{f}.nodes[{j}]' repeats the path {list(p)}")
            if p[:-1] not in present:
                raise UserError(f"{label}: field '{f}.nodes[{j}]' = {list(p)} comes before its parent {list(p[:-1])}")
            if tree.method == "sequoia" and p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in present:
                raise UserError(f"{label}: field '{f}.nodes[{j}]' = {list(p)}: sequoia needs contiguous sibling ranks")
            present.add(p)
        n_prompt = 0
        if tree.method == "ppd":
            if st.prompt_tokens is None:
                raise UserError(f"{label}: missing field '{f}.prompt_tokens' (required for ppd)")
            if len(st.prompt_tokens) != len(st.nodes) + 1:
                raise UserError(
                    f"{label}: field '{f}.prompt_tokens' has {len(st.prompt_tokens)} entries, expected {len(st.nodes) + 1} (root + nodes)"
                )
            if tree.prompt_tokens_max is None:
                raise UserError(f"{label}: missing field 'prompt_tokens_max' (required for ppd)")
            if max(st.prompt_tokens) > tree.prompt_tokens_max:
                raise UserError(f"{label}: field '{f}.prompt_tokens' exceeds prompt_tokens_max = {tree.prompt_tokens_max}")
            if st.depth > st.state:
                raise UserError(f"{label}: field '{f}.nodes' reaches depth {st.depth}, state {st.state} allows {st.state}")
            n_prompt = sum(st.prompt_tokens)
        elif st.prompt_tokens is not None and any(st.prompt_tokens):
            raise UserError(f"{label}: field '{f}.prompt_tokens' is only meaningful for ppd trees")
        expected_n = 1 + len(st.nodes) + n_prompt
        if st.input_length != expected_n:
            raise UserError(f"{label}: field '{f}.input_length' is {st.input_length}, the tree has {expected_n} tokens")
        if st.expected_tokens < 1 - 1e-9 or st.expected_tokens > 1 + len(st.nodes) + 1e-9:
            raise UserError(f"{label}: field '{f}.expected_tokens' = {st.expected_tokens} is impossible for {len(st.nodes)} candidates")
    if tree.method == DYNAMIC:
        if tree.dynamic is None:
            raise UserError(f"{label}: missing field 'dynamic' (required for method 'dynamic')")
        if tree.schedule is not None:
            raise UserError(f"{label}: a dynamic plan chooses its tree every step; field 'schedule' is not allowed")
        if len(tree.states[0].nodes) > tree.dynamic.max_size:
            raise UserError(f"{label}: field 'states[0].nodes' has more than dynamic.max_size = {tree.dynamic.max_size} candidates")
    if tree.method != "ppd" and len(tree.states) != 1:
        raise UserError(f"{label}: field 'states': {tree.method} trees have a single state, found {len(tree.states)}")
    if tree.method == "ppd":
        want = set(range(tree.prompt_tokens_max + 1))
        if seen_states != want:
            raise UserError(f"{label}: field 'states': ppd needs states 0..{tree.prompt_tokens_max}, found {sorted(seen_states)}")
    if tree.schedule is not None:
        validate_schedule(tree, label)


def validate_schedule(tree: Tree, label: str = "tree") -> None:
    """Ranges contiguous from batch size 1, one guesser (method) throughout, no nested schedules,
    and the top-level tree equal to the batch-size-1 entry's (what schedule-unaware readers decode)."""
    if not tree.schedule:
        raise UserError(f"{label}: field 'schedule' must be a non-empty list of batch-size ranges")
    expect_lo = 1
    for i, e in enumerate(tree.schedule):
        f = f"schedule[{i}]"
        lo, hi = e.batch_sizes
        if lo != expect_lo or hi < lo:
            raise UserError(f"{label}: field '{f}.batch_sizes' = [{lo}, {hi}]: ranges must be ascending, "
                            f"non-overlapping and contiguous from 1 (this one should start at {expect_lo})")
        expect_lo = hi + 1
        if e.tree is None:
            continue
        if e.tree.schedule is not None:
            raise UserError(f"{label}: field '{f}.tree' must not hold a schedule of its own")
        if e.tree.method != tree.method:
            raise UserError(f"{label}: field '{f}.tree.method' is {e.tree.method!r}, the file's method is {tree.method!r}")
        validate_tree(e.tree, f"{label}: {f}.tree")
    first = tree.schedule[0].tree
    if first is not None and first.shape() != tree.shape():
        raise UserError(f"{label}: field 'schedule[0].tree' differs from the top-level tree, "
                        "which must be the batch-size-1 entry's")
