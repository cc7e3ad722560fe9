"""Serving engines' speculative-decoding settings from a plan (docs/batching-and-export.md,
section 'What each engine is given').

Pure functions: a plan (a Tree, with its batch-size schedule when it has one) and the draft
length per batch-size range (`DraftRange`: chains planned by planner.batch.plan_chain_schedule,
or the trees' depths when no acceptance and profile are at hand) become an `Export`: the
engine's own settings, one note per thing the engine cannot express, and the measured basis.
workflows/cli/cmd_export.py reads the inputs and writes the files.

What each engine takes (keys read from the engines' sources and docs, late 2026):
- vllm: the --speculative-config JSON object: method, model, num_speculative_tokens (> 0, the
  largest K), num_speculative_tokens_per_batch_size [[first, last, K], ...] (inclusive,
  ascending from 1; K = 0 turns speculation off; beyond the last range the last K). Current
  vLLM verifies chains only. Where the config needs the project's vLLM plugin (a K = 0 range, or a
  schedule for suffix / medusa: planner/vllm_plugin.py), "env" holds its switch for vLLM's environment.
- sglang: --speculative-num-steps S, --speculative-eagle-topk K, --speculative-num-draft-tokens N
  (nodes verified, root included; N = S + 1 when K = 1); per batch size --speculative-adaptive
  with --speculative-adaptive-config FILE, keyed by the lowest batch size of each range as a
  string, {"1": {"candidate_steps": [S]}, ...} (EAGLE/EAGLE3 with topk 1 only).
- trtllm: speculative_config with decoding_type, speculative_model, max_draft_len,
  max_total_draft_tokens and draft_len_schedule {highest batch size of a range: K} (the
  smallest key maps to max_draft_len; above the largest key 0, and max_concurrency, that key, where the last
  ranges are off: speculation switched off above it), or for EAGLE a static tree as paths
  (eagle_choices, every prefix present; max_draft_len its depth, max_total_draft_tokens its size),
  which is the plan's tree itself; an EAGLE-2 dynamic tree (use_dynamic_tree, dynamic_tree_max_topK)
  is the alternative a head's export prices (planner/export_heads.py).
- hf (transformers assisted generation, batch size 1): the assistant's generation config,
  num_assistant_tokens with num_assistant_tokens_schedule "constant" (the planned length, not
  the heuristic's), or prompt lookup: prompt_lookup_num_tokens (+ max_matching_ngram_size).
"""
from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field

import numpy as np

from planner.errors import UserError
from planner.guessers import LOOKUP_SIGNAL, PLAIN
from planner.simulate import describe, simulated_of
from planner.tree import DYNAMIC, PPD, ScheduleEntry, Tree
from planner.vllm_plugin import PLUGIN_SCHEDULES, vllm_serving

FORMAT = "tree-planner/export"
VERSION = 1
ENGINES = ("vllm", "sglang", "trtllm", "hf")
# our method name -> the engine's
ENGINE_METHODS = {
    # vLLM 0.32 (checked in vLLM itself by tests/test_vllm.py) no longer registers the MLP speculator model
    "vllm": {"ngram": "ngram", "medusa": "medusa", "eagle": "eagle", "eagle3": "eagle3", "draft_model": "draft_model",
             "mtp": "mtp", "suffix": "suffix"},
    "sglang": {"eagle": "EAGLE", "eagle3": "EAGLE3", "draft_model": "STANDALONE", "ngram": "NGRAM"},
    "trtllm": {"eagle": "Eagle", "eagle3": "Eagle3", "mtp": "MTP", "ngram": "NGram", "draft_model": "DraftTarget",
               "medusa": "Medusa"},
    "hf": {"draft_model": "assistant model", "ngram": "prompt lookup"},
}
NEEDS_MODEL = frozenset({"medusa", "eagle", "eagle3", "draft_model"})


@dataclass(frozen=True)
class Target:
    """What a serving engine's export can express, so the export asks these instead of the engine's name."""

    model_object: bool = False  # takes the drafter as a loaded model (transformers' assistant): no --draft-model path
    per_step_lookup: str | None = None  # its method whose draft length follows each step's match (vLLM: suffix)
    batch_schedule: bool = True  # takes a draft length per batch size (transformers decodes batch size 1)
    lookup_keys: bool = False  # takes prompt-lookup parameters planned from measurements (lookup_settings)
    runs_here: bool = False  # its CPU build runs on this machine, so `planner export --race` can time configs in it
    head_shape: str | None = None  # an EAGLE head as a "chain", a "grown" tree or static/grown "choices"; None: no head


TARGETS = {"vllm": Target(per_step_lookup="suffix", lookup_keys=True, runs_here=True, head_shape="chain"),
           "sglang": Target(head_shape="grown"), "trtllm": Target(head_shape="choices"),
           "hf": Target(model_object=True, batch_schedule=False)}
DEFAULT_METHOD = {"medusa": "medusa", "sequoia": "draft_model"}  # by plan method; no engine has PPD prompt tokens
TREE_METHODS = {"sglang": {"eagle", "eagle3", "draft_model"}, "trtllm": {"eagle", "eagle3"}}  # run-time trees
# vLLM 0.32's suffix and Medusa proposers assert the step's K is the configured one: a per-batch-size
# schedule passes the config check, then kills the worker at the first switch (seen in a race here)
SCHEDULE_METHODS = {"sglang": {"eagle", "eagle3"}, "trtllm": set(ENGINE_METHODS["trtllm"]) - {"medusa"},
                    "vllm": set(ENGINE_METHODS["vllm"]) - {"suffix", "medusa"}}
DEFAULT_MAX_BATCH_SIZE = 4096


@dataclass(frozen=True)
class DraftRange:
    """A batch-size range [lo, hi] (inclusive) and its draft length (0: no speculation)."""

    lo: int
    hi: int
    k: int


@dataclass(frozen=True)
class ExportOptions:
    engine: str
    method: str  # one of ENGINE_METHODS[engine], our spelling
    draft_model: str | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None
    adaptive_config_path: str = "adaptive.json"  # sglang: where the adaptive config file goes
    yaml_path: str | None = None  # trtllm: the engine-ready YAML written, if any
    chains_planned: bool = True  # False: the draft lengths are the plan's tree depths
    lookup: dict = field(default_factory=dict)  # vllm ngram / suffix keys (`lookup_settings`)
    plugin: bool = True  # vllm: serve with the project's plugin where the config needs it (planner/vllm_plugin.py)


@dataclass
class Export:
    engine: str
    settings: dict  # the engine's own objects by name, e.g. {"speculative_config": {...}}
    command_line: str
    notes: list[str] = field(default_factory=list)
    basis: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "engine": self.engine, **self.settings,
                "command_line": self.command_line, "notes": list(self.notes), "basis": self.basis}


# ---------------------------------------------------------------- inputs


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise UserError(f"--engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    return engine


def plan_guesser(plan: Tree) -> str | None:
    """The guesser a plan was made for (autotune and `planner plan dynamic` record it): lookup,
    draft, chain, parallelspec, ppd, pearl, plain, or a hybrid lookup+DRAFTER; None when unrecorded."""
    g = plan.settings.get("guesser")
    return g if isinstance(g, str) else None


def _kind(plan: Tree):
    from planner.guessers import kind, names

    g = plan_guesser(plan)
    return kind(g) if g in names() else None


def own_drafter(plan: Tree) -> bool:
    """The plan's guesser is a drafter this project trained (files, no engine method: PPD's prompt
    tokens, the ParallelSpec drafter): no serving engine can load it."""
    k = _kind(plan)
    return k is not None and k.files is not None and k.export is None


def implied_method(engine: str, plan: Tree) -> str | None:
    """The engine method a plan's guesser implies, where the engine has one. Prompt lookup (alone or
    in a hybrid, whose drafter no engine can load) maps to n-gram lookup; for vLLM a per-step plan,
    whose draft length follows the guesser's confidence each step, maps to suffix decoding, the one
    vLLM method whose draft length varies per step with the match (a static chain: ngram)."""
    k = _kind(plan)
    target = TARGETS[check_engine(engine)]
    if k is not None and k.export == "ngram":
        return target.per_step_lookup if target.per_step_lookup and plan.method == DYNAMIC else "ngram"
    if k is not None and k.export:
        return k.export
    if own_drafter(plan):
        return None
    return "draft_model" if target.model_object else DEFAULT_METHOD.get(plan.method)


def resolve_method(engine: str, plan: Tree | str, requested: str | None, draft_model: str | None) -> str:
    """The engine's drafting method: the one asked for, else the one the plan implies
    (`implied_method`; a bare plan method string: its default)."""
    known = ENGINE_METHODS[check_engine(engine)]
    if isinstance(plan, str):
        plan = Tree(plan, [], 1.0)
    if requested is None and plan_guesser(plan) == PLAIN:
        raise UserError(f"the plan is plain decoding (no guesser was faster): {engine} has no speculative setting "
                        "to write")
    method = requested or implied_method(engine, plan)
    if method is None:
        what = (f"a plan for this project's {plan_guesser(plan)} drafter" if own_drafter(plan)
                else f"a {plan.method} plan")
        raise UserError(f"--method: {what} has no {engine} equivalent; give one of {', '.join(known)}")
    if method not in known:
        raise UserError(f"--method: {engine} takes one of {', '.join(known)}, got {method!r}")
    if method in NEEDS_MODEL and not draft_model and not TARGETS[engine].model_object:
        raise UserError(f"--method {method} on {engine} needs --draft-model PATH (the drafter's weights)")
    return method


def ranges_from_schedule(entries: list[ScheduleEntry], max_batch_size: int) -> list[DraftRange]:
    """Draft lengths from a chain schedule (depth of each range's chain; None: 0), the last range
    stretched to max_batch_size (above the last planned batch size the last entry applies)."""
    return _stretch([DraftRange(e.batch_sizes[0], e.batch_sizes[1], 0 if e.tree is None else e.tree.depth)
                     for e in entries], max_batch_size)


def ranges_from_depths(plan: Tree, max_batch_size: int) -> list[DraftRange]:
    """Fallback without acceptance and profile: each range's tree depth (not planned as a chain)."""
    entries = plan.schedule or [ScheduleEntry((1, 1), plan)]
    return _stretch([DraftRange(e.batch_sizes[0], e.batch_sizes[1], 0 if e.tree is None else e.tree.depth)
                     for e in entries], max_batch_size)


def _stretch(ranges: list[DraftRange], max_batch_size: int) -> list[DraftRange]:
    merged: list[DraftRange] = []
    for r in ranges:
        if merged and merged[-1].k == r.k:
            merged[-1] = DraftRange(merged[-1].lo, r.hi, r.k)
        else:
            merged.append(r)
    last = merged[-1]
    merged[-1] = DraftRange(last.lo, max(last.hi, max_batch_size), last.k)
    return merged


def tree_knobs(tree: Tree) -> tuple[int, int, int]:
    """(depth, top-k, candidates) of a plan, the largest over its states: top-k is the highest
    rank used + 1, as run-time trees expand the top-k guesses of every node."""
    depth = max(st.depth for st in tree.states)
    topk = max((max(p) + 1 for st in tree.states for p in st.nodes), default=1)
    return depth, topk, max(len(st.nodes) for st in tree.states)


def is_chain(tree: Tree) -> bool:
    return all(all(r == 0 for p in st.nodes for r in p) for st in tree.states)


# ---------------------------------------------------------------- engines


def build(plan: Tree, ranges: list[DraftRange], opts: ExportOptions, basis: dict, notes: list[str]) -> Export:
    """The engine's closest setting; `notes` (what the inputs lacked) come first."""
    builder = {"vllm": _vllm, "sglang": _sglang, "trtllm": _trtllm, "hf": _hf}[check_engine(opts.engine)]
    out = builder(plan, ranges, opts)
    out.notes = list(notes) + simulated_notes(plan, basis) + _common_notes(plan, opts) + out.notes
    out.basis = basis
    return out


def simulated_notes(plan: Tree, basis: dict) -> list[str]:
    """Settings planned on a simulated profile (`planner profile --simulate`) say so, once: they
    are predictions for that GPU, to be checked on it."""
    found = {}
    for what, record in (("the plan", (plan.provenance or {}).get("profile")), ("the draft lengths", basis.get("profile"))):
        mark = simulated_of(record or {})
        if mark is not None:
            found.setdefault(describe(mark), []).append(what)
    return [f"{' and '.join(whats)} rest on a {label} profile: predicted, not measured; profile the real GPU "
            "(planner profile) and plan again before relying on these settings" for label, whats in found.items()]


def _common_notes(plan: Tree, opts: ExportOptions) -> list[str]:
    if plan.method != PPD:
        return []
    return [f"ppd prompt tokens dropped: {opts.engine} has no prompt-token guesser; its {opts.method} drafter "
            "replaces it and the draft lengths use the plan's acceptance statistics"]


def _positive(ranges: list[DraftRange], engine: str) -> int:
    k_max = max(r.k for r in ranges)
    if k_max == 0:
        raise UserError(f"plain decoding is predicted fastest at every batch size: {engine} has no speculative "
                        "setting to write")
    return k_max


def _one_chain(opts: ExportOptions) -> str:
    return "the best chain at batch size 1" if opts.chains_planned else "the tree's depth as the draft length"


def _tree_note(plan: Tree, opts: ExportOptions, what: str) -> list[str]:
    if all(is_chain(e.tree) for e in (plan.schedule or [ScheduleEntry((1, 1), plan)]) if e.tree is not None):
        return []
    how = ("the best chain per batch-size range, planned as a chain under the same cost model" if opts.chains_planned
           else "each range's tree depth as its draft length")
    return [f"tree dropped: {opts.engine} {what}; wrote {how}"]


def _vllm(plan: Tree, ranges: list[DraftRange], opts: ExportOptions) -> Export:
    cfg: dict = {"method": ENGINE_METHODS["vllm"][opts.method]}
    if opts.draft_model:
        cfg["model"] = opts.draft_model
    cfg["num_speculative_tokens"] = _positive(ranges, "vllm")
    cap = opts.lookup.get("num_speculative_tokens") if opts.method == "suffix" else None
    if cap:  # suffix decoding stops each draft itself: the cap wherever the chain plan drafts at all
        ranges = _stretch([DraftRange(r.lo, r.hi, cap if r.k else 0) for r in ranges], ranges[-1].hi)
    off, notes = [f"{r.lo}-{r.hi}" for r in ranges if r.k == 0], []
    schedulable = opts.method in SCHEDULE_METHODS["vllm"] or (opts.plugin and opts.method in PLUGIN_SCHEDULES)
    if len(ranges) > 1 and not schedulable:
        how = (" (the project's vLLM plugin gives it one per batch size: drop --plugin off)"
               if opts.method in PLUGIN_SCHEDULES else "")
        notes.append(f"per-batch-size draft lengths dropped: vLLM's {cfg['method']} proposer takes one draft length{how}; "
                     f"wrote {max(r.k for r in ranges)} for every batch size, also at {', '.join(off) or '-'} (planned off)")
    elif len(ranges) > 1:
        cfg["num_speculative_tokens_per_batch_size"] = [[r.lo, r.hi, r.k] for r in ranges]
    if opts.method in ("ngram", "suffix"):
        cfg.update(opts.lookup)
    if opts.method == "ngram":
        cfg.update({k: v for k, v in (("prompt_lookup_min", opts.ngram_min), ("prompt_lookup_max", opts.ngram_max))
                    if v is not None})
    notes += _tree_note(plan, opts, "verifies chains only (tree attention removed)")
    env, line, serve_notes = vllm_serving(cfg, opts.plugin)
    return Export("vllm", {"speculative_config": cfg, **({"env": env} if env else {})}, line, notes + serve_notes)



def _sglang(plan: Tree, ranges: list[DraftRange], opts: ExportOptions) -> Export:
    args = ["--speculative-algorithm", ENGINE_METHODS["sglang"][opts.method]]
    if opts.draft_model:
        args += ["--speculative-draft-model-path", opts.draft_model]
    notes: list[str] = []
    adaptive = None
    if len(ranges) > 1 and opts.method in SCHEDULE_METHODS["sglang"]:
        k_max = _positive(ranges, "sglang")
        k0 = ranges[0].k or k_max  # the initial steps snap to a candidate; 0 is not a start
        args += ["--speculative-num-steps", str(k0), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k0 + 1), "--speculative-adaptive",
                 "--speculative-adaptive-config", opts.adaptive_config_path]
        adaptive = {str(r.lo): {"candidate_steps": [r.k]} for r in ranges}
        notes += _tree_note(plan, opts, "adaptive mode runs chains only (topk 1)")
        if any(r.k == 0 for r in ranges):
            notes.append("candidate_steps [0] (no speculation) needs a recent SGLang build; older ones take steps >= 1")
    else:
        if len(ranges) > 1:
            notes.append("per-batch-size draft lengths dropped: SGLang's adaptive mode needs EAGLE or EAGLE3; "
                         "wrote the batch-size-1 setting for every batch size")
        args += _sglang_static(plan, ranges, opts, notes)
    settings = {"server_args": args, "adaptive_config": adaptive}
    return Export("sglang", settings, " ".join(shlex.quote(a) for a in args), notes)


def _sglang_static(plan: Tree, ranges: list[DraftRange], opts: ExportOptions, notes: list[str]) -> list[str]:
    tree = plan.for_batch(1)
    if tree is not None and opts.method in TREE_METHODS["sglang"] and not is_chain(tree):
        depth, topk, n = tree_knobs(tree)
        notes.append(f"tree shape dropped: SGLang picks the {n} candidates at run time from the top {topk} "
                     f"guesses over {depth} steps")
        return ["--speculative-num-steps", str(depth), "--speculative-eagle-topk", str(topk),
                "--speculative-num-draft-tokens", str(n + 1)]
    k = ranges[0].k
    if k == 0:
        raise UserError("plain decoding is predicted fastest at batch size 1: sglang has no speculative setting to write")
    if tree is not None and not is_chain(tree):
        notes.append(f"tree dropped: SGLang {opts.method} drafts a chain; wrote {_one_chain(opts)}")
    return ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(k + 1)]


def _trtllm(plan: Tree, ranges: list[DraftRange], opts: ExportOptions) -> Export:
    cfg: dict = {"decoding_type": ENGINE_METHODS["trtllm"][opts.method]}
    if opts.draft_model:
        cfg["speculative_model"] = opts.draft_model
    notes: list[str] = []
    if len(ranges) > 1 and opts.method in SCHEDULE_METHODS["trtllm"]:
        cfg.update(_trtllm_schedule(ranges, notes))
        notes += _tree_note(plan, opts, "varies the draft length of chains per batch size")
    else:
        if len(ranges) > 1:
            notes.append(f"per-batch-size draft lengths dropped: {cfg['decoding_type']} takes no draft_len_schedule; "
                         "wrote the batch-size-1 setting for every batch size")
        cfg.update(_trtllm_static(plan, ranges, opts, notes))
    where = shlex.quote(opts.yaml_path) if opts.yaml_path else "SPEC.yaml  # a YAML file holding speculative_config"
    line = f"--extra_llm_api_options {where}"
    return Export("trtllm", {"speculative_config": cfg}, line, notes)


def _trtllm_schedule(ranges: list[DraftRange], notes: list[str]) -> dict:
    """draft_len_schedule keyed by each range's highest batch size; trailing K = 0 ranges are the
    implicit 0 above the largest key. The smallest key must map to max_draft_len."""
    k_first = ranges[0].k
    if k_first == 0:
        raise UserError("plain decoding is predicted fastest at batch size 1 but not above: TensorRT-LLM's "
                        "draft_len_schedule must start at max_draft_len, so it cannot express this plan")
    if any(r.k > k_first for r in ranges):
        notes.append(f"draft lengths above {k_first} at larger batch sizes clamped to {k_first}: the smallest "
                     "draft_len_schedule key must map to max_draft_len")
    last = max(i for i, r in enumerate(ranges) if r.k > 0)
    schedule = {r.hi: min(r.k, k_first) for r in ranges[: last + 1]}
    out = {"max_draft_len": k_first, "max_total_draft_tokens": k_first, "draft_len_schedule": schedule}
    if last < len(ranges) - 1:  # off above the last speculating range: TensorRT-LLM's own switch says so too
        out["max_concurrency"] = ranges[last].hi
    return out


def _trtllm_static(plan: Tree, ranges: list[DraftRange], opts: ExportOptions, notes: list[str]) -> dict:
    tree = plan.for_batch(1)
    if tree is not None and opts.method in TREE_METHODS["trtllm"] and not is_chain(tree):
        depth, topk, _ = tree_knobs(tree)
        if len(tree.states) > 1:
            notes.append(f"the plan's {len(tree.states)} states merged: eagle_choices is one static tree (state 0's)")
        nodes = [list(p) for p in tree.states[0].nodes]
        notes.append(f"the plan's tree as eagle_choices ({len(nodes)} paths, depth {depth}); TensorRT-LLM also grows an "
                     f"EAGLE-2 tree at run time (use_dynamic_tree, dynamic_tree_max_topK {topk}) instead")
        return {"max_draft_len": max(len(p) for p in nodes), "max_total_draft_tokens": len(nodes), "eagle_choices": nodes}
    k = ranges[0].k
    if k == 0:
        raise UserError("plain decoding is predicted fastest at batch size 1: trtllm has no speculative setting to write")
    if tree is not None and not is_chain(tree):
        notes.append(f"tree dropped: TensorRT-LLM {opts.method} drafts a chain; wrote {_one_chain(opts)}")
    return {"max_draft_len": k, "max_total_draft_tokens": k}


def _hf(plan: Tree, ranges: list[DraftRange], opts: ExportOptions) -> Export:
    k = ranges[0].k
    if k == 0:
        raise UserError("plain decoding is predicted fastest at batch size 1: assisted generation would be slower")
    notes = []
    if len(ranges) > 1 or plan.schedule:
        notes.append("batch sizes above 1 dropped: transformers assisted generation decodes one sequence")
    tree = plan.for_batch(1)
    if tree is not None and not is_chain(tree):
        notes.append(f"tree dropped: transformers drafts a chain; wrote {_one_chain(opts)}")
    if opts.method == "ngram":
        cfg = {"prompt_lookup_num_tokens": k}
        if opts.ngram_max is not None:
            cfg["max_matching_ngram_size"] = opts.ngram_max
        line = "model.generate(..., " + ", ".join(f"{a}={b}" for a, b in cfg.items()) + ")"
    else:
        cfg = {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant"}
        line = "assistant_model.generation_config.update(" + ", ".join(f"{a}={b!r}" for a, b in cfg.items()) + ")"
    return Export("hf", {"generation_config": cfg}, line, notes)


# ---------------------------------------------------------------- lookup parameters

MEASURED_NGRAMS = (1, 3)  # the n-gram sizes this project's prompt lookup matches (decoder/guessers/lookup.py defaults)
SUFFIX_SPEC_FACTOR = 1.0  # vLLM's: at most this many drafted tokens per matched token
SUFFIX_MAX_DRAFT = 24  # vLLM's default suffix tree depth: drafts past it are beyond what our acceptance rows show


def lookup_settings(method: str, k: int, accept, profile, calibration=None) -> tuple[dict, list[str]]:
    """vLLM's ngram or suffix parameters for a lookup plan, from its measurements, and how each was
    chosen. `k`: the planned draft length at batch size 1; `accept`: the lookup's acceptance rows;
    `profile`: the batch-size-1 latency profile; `calibration`: the lookup's acceptance per matched
    n-gram length (planner accept --calibrate), if the plan has one.

    ngram: prompt_lookup_max is the longest n-gram the acceptance was measured with; prompt_lookup_min
    the shortest matched length whose measured acceptance makes a k-token draft pay on the profile
    (with a calibration; without one, the measured range as it is).
    suffix: decoding stops each draft where its path probability falls below
    suffix_decoding_min_token_prob, so that is the setting that matters: the path probability at
    which one more drafted token costs more than it brings, (L(n + 1) - L(n)) * tau_k / L(k + 1)
    with tau_k / L(k + 1) the planned chain's tokens per second (the per-step planner's own rule),
    averaged over the draft lengths up to the cap; num_speculative_tokens caps the draft at the
    longest one whose certainly accepted tokens still pay (at most SUFFIX_MAX_DRAFT); the tree is
    deep enough for a cap-long match plus a cap-long draft."""
    from planner.cost import step_cost

    if k < 1:
        return {}, []
    if method == "ngram":
        lo, hi = MEASURED_NGRAMS
        if calibration is None or calibration.signal != LOOKUP_SIGNAL:
            return ({"prompt_lookup_min": lo, "prompt_lookup_max": hi},
                    [f"n-gram sizes {lo}..{hi}: those the acceptance was measured with (a lookup calibration, "
                     "planner accept --calibrate, would choose the shortest that pays)"])
        paying = [g for g in range(lo, hi + 1) if _ngram_speedup(calibration, g, k, profile) > 1.0]
        lo = paying[0] if paying else hi
        return ({"prompt_lookup_min": lo, "prompt_lookup_max": hi},
                [f"prompt_lookup_min {lo}: the shortest matched n-gram whose calibrated acceptance makes a "
                 f"{k}-token draft pay on the profile"])
    c = accept.accuracy[:, 0]
    tau = 1.0 + float(np.sum(np.cumprod(c[:k])))
    rate = tau / float(step_cost(profile, k + 1))  # tokens per second of the planned chain
    top = min(SUFFIX_MAX_DRAFT, profile.max_input_length - 1)
    marginal = np.diff([float(step_cost(profile, n)) for n in range(1, top + 2)]) * rate  # [top] break-even p
    cap = int(np.argmax(marginal > 1.0)) if (marginal > 1.0).any() else top  # a certain token still pays up to here
    cap = max(cap, k)
    p_min = float(np.clip(np.mean(marginal[:cap]), 0.01, 1.0))
    depth = cap + math.ceil(cap / SUFFIX_SPEC_FACTOR)
    cfg = {"num_speculative_tokens": cap, "suffix_decoding_max_tree_depth": depth,
           "suffix_decoding_max_spec_factor": SUFFIX_SPEC_FACTOR, "suffix_decoding_min_token_prob": round(p_min, 4)}
    return cfg, [f"suffix decoding stops each draft itself: num_speculative_tokens {cap} is the longest draft whose "
                 f"certainly accepted tokens still pay on the profile (at most {SUFFIX_MAX_DRAFT}); "
                 f"suffix_decoding_min_token_prob {p_min:.3f} is the path probability at which one more token "
                 f"stops paying, the profile's mean marginal cost L(n + 1) - L(n) over n = 1..{cap + 1} against "
                 f"{rate:.1f} tokens/s of the planned {k}-token chain (the per-step planner's rule); suffix "
                 "decoding's probabilities are its own frequency counts, not this project's calibrated acceptance"]


def _ngram_speedup(cal, g: int, k: int, profile) -> float:
    """Predicted speedup of a k-token draft after a matched n-gram of length g (calibrated
    acceptance per depth bin, pooled over the follow counts by their observations)."""
    from planner.cost import step_cost
    from planner.dynamic import DEPTH_BINS, LOOKUP_COUNTS

    C = len(LOOKUP_COUNTS)
    cells = slice((g - 1) * C, g * C)
    w = cal.totals[:, cells] + 1e-9
    per_depth = (cal.p[:, cells] * w).sum(axis=1) / w.sum(axis=1)  # [DEPTH_BINS]
    c = per_depth[np.minimum(np.arange(k), DEPTH_BINS - 1)]
    tau = 1.0 + float(np.sum(np.cumprod(c)))
    return tau * float(step_cost(profile, 1)) / float(step_cost(profile, k + 1))


# ---------------------------------------------------------------- basis and YAML


def basis(plan: Tree, plan_file: str, ranges: list[DraftRange], chains: list[ScheduleEntry] | None,
          sources: dict) -> dict:
    """What the export rests on: inputs, and per planned batch size the plan's and the chain's predictions."""
    chain_points = {p["batch_size"]: p for e in (chains or []) for p in (e.points or [])}
    rows = []
    for e in plan.schedule or [ScheduleEntry((1, 1), plan, plan.predicted_speedup)]:
        points = e.points or [{"batch_size": e.batch_sizes[0], "speedup": e.predicted_speedup}]
        for p in points:
            b = p["batch_size"]
            row = {"batch_size": b, "draft_length": next(r.k for r in ranges if r.lo <= b <= r.hi),
                   "plan_tree": _describe(e.tree), "plan_predicted_speedup": p.get("speedup")}
            if b in chain_points:
                row["chain_predicted_speedup"] = chain_points[b]["speedup"]
            rows.append(row)
    for b in sorted(set(chain_points) - {r["batch_size"] for r in rows}):  # sizes only the profile planned
        rows.append({"batch_size": b, "draft_length": next(r.k for r in ranges if r.lo <= b <= r.hi),
                     "plan_tree": _describe(plan.for_batch(b)), "plan_predicted_speedup": None,
                     "chain_predicted_speedup": chain_points[b]["speedup"]})
    layout = plan.schedule[0].layout if plan.schedule else None
    tree = plan.for_batch(1) or plan
    return {"plan": {"file": plan_file, "method": plan.method, "layout": layout},
            "draft_lengths": "chains planned per batch size under the plan's cost model" if chains else
                             "the plan's tree depths (no acceptance and profile to plan chains with)",
            **sources, "per_batch_size": rows,
            "tree_at_batch_size_1": [{"state": st.state, "nodes": [list(p) for p in st.nodes]} for st in tree.states]}


def _describe(tree: Tree | None) -> str:
    if tree is None:
        return "plain decoding"
    depth, topk, n = tree_knobs(tree)
    return f"{tree.method}: {n} candidates, depth {depth}, top-{topk}"


def basis_lines(b: dict) -> list[str]:
    """The basis as one-line comments (YAML output)."""
    if "plan" not in b:  # a head's export, planned from its acceptance (planner/export_heads.py head_basis)
        return [f"basis {k}: {json.dumps(v, sort_keys=True)}" for k, v in b.items()]
    plan = b.get("plan", {})
    lines = [f"basis: plan {plan.get('file')} ({plan.get('method')}, layout {plan.get('layout') or 'none'}); "
             f"draft lengths: {b.get('draft_lengths')}"]
    for kind in ("acceptance", "profile"):
        if b.get(kind):
            lines.append(f"basis {kind}: {json.dumps(b[kind], sort_keys=True)}")
    for row in b.get("per_batch_size", []):
        text = f"basis batch size {row['batch_size']}: draft length {row['draft_length']}; plan {row['plan_tree']}"
        if row.get("plan_predicted_speedup") is not None:
            text += f", predicted {row['plan_predicted_speedup']:.3f}x"
        if row.get("chain_predicted_speedup") is not None:
            text += f"; chain predicted {row['chain_predicted_speedup']:.3f}x"
        lines.append(text)
    lines.append(f"basis tree at batch size 1: {json.dumps(b.get('tree_at_batch_size_1'))}")
    return lines
