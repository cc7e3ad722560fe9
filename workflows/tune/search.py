"""Optuna search over the planner's and decoder's knobs (`planner tune`).

The planner already picks the best tree *size* for one method and one set of settings; the
tuner searches the rest: method, number of prompt tokens P, ensemble size (one acceptance file
per E), maximum depth, size or input-length budget, shared or per-state budgets, and at
temperature > 0 the verification rule and its typical-acceptance thresholds.

Objectives:
  predicted  the planner's model: tokens per step * L(1) / amortised step latency (fast)
  measured   real decoding of validation prompts, tokens per second (needs a model)
and optionally a second objective, memory (the largest input length or the extra KV bytes a
step writes), which makes the study multi-objective and gives a Pareto front.

The `planner plan` point (automatic size selection, default settings) of every method is
enqueued as a trial, so the study's best is never worse than `planner plan` on the same inputs.

optuna is imported inside functions only: the GPU machines do not have it.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from planner.accept import Acceptance, load_acceptance
from planner.cost import Guessing, Prediction, default_guessing, input_lengths, predict
from planner.errors import UserError
from planner.plan import MAX_PROMPT_TOKENS, MAX_SIZE
from planner.profile import LatencyProfile
from planner.simulate import refuse_to_measure
from planner.tree import MEDUSA, METHODS, PPD, SEQUOIA, Tree, save_tree
from workflows.tune.storage import open_storage

OBJECTIVES = ("predicted", "measured")
MEMORY_OBJECTIVES = ("input_length", "kv_bytes")
VERIFY_RULES = ("typical", "lossless")
# `planner plan` defaults: the enqueued reference point uses exactly these.
PLAN_DEFAULT_PROMPT_TOKENS = 3

_PREFIX = re.compile(r"^(?P<method>medusa|sequoia|ppd|all)(?:/e(?P<ept>\d+))?$")


# ---------------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class Source:
    """One acceptance file and the methods (and PPD ensemble size E) it describes."""

    label: str
    accept: Acceptance
    methods: tuple[str, ...]
    ept: int = 1  # ensemble prompt tokens per prompt token: each costs E input tokens


def guess_methods(accept: Acceptance, spec: str) -> tuple[str, ...]:
    """Methods an unprefixed acceptance file describes: from its name, else by its form."""
    name = spec.lower()
    named = tuple(m for m in METHODS if m in name)
    if named:
        return named
    return (SEQUOIA,) if accept.positional else (PPD, MEDUSA)


def parse_accept_spec(spec: str) -> Source:
    """'[METHOD[/eE]=]FILE[:NAME]'; METHOD is medusa, sequoia, ppd or all; E the PPD ensemble size.

    Without a prefix the methods are guessed from the name (ppd-..., medusa-...), else positional
    statistics are taken as a draft model's (sequoia) and the others as ppd and medusa.
    """
    prefix, _, rest = spec.partition("=")
    m = _PREFIX.match(prefix) if rest else None
    if m is None:
        accept = load_acceptance(spec)
        return Source(spec, accept, guess_methods(accept, spec))
    accept = load_acceptance(rest)
    ept = int(m.group("ept") or 1)
    if ept < 1:
        raise UserError(f"--accept {spec}: ensemble size must be at least 1")
    methods = METHODS if m.group("method") == "all" else (m.group("method"),)
    return Source(spec, accept, methods, ept)


def kv_bytes_per_token(config_path: str, dtype_bytes: int = 2) -> int:
    """K and V bytes one token adds to the cache, from a Hugging Face config.json."""
    from planner.jsonio import read_json

    cfg = read_json(config_path)
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{config_path}: cannot read the KV size (field {e} missing or not a number)") from None
    return 2 * layers * kv_heads * head_dim * dtype_bytes


# ---------------------------------------------------------------------------------------------
# the search space


@dataclass
class SearchSpace:
    sources: list[Source]
    methods: tuple[str, ...] = METHODS
    max_size: int = 64  # candidates at most
    max_prompt_tokens: int = 3  # PPD: P is searched in 1..this (capped by the acceptance depth)
    temperature: float = 0.0
    draft_latency_s: float = 0.0  # sequoia: one draft step's latency, paid depth times
    top_k: int = 0  # measured decoding's sampling cut-offs (0 / 1: off)
    top_p: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "draft_latency_s"):
            x = getattr(self, name)
            if not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0):
                raise UserError(f"{name.replace('_s', '').replace('_', ' ')}: expected a finite number >= 0, got {x!r}")
        if self.max_size > MAX_SIZE or self.max_prompt_tokens > MAX_PROMPT_TOKENS:
            raise UserError(f"search space: max size at most {MAX_SIZE}, max prompt tokens at most {MAX_PROMPT_TOKENS}")
        self.methods = tuple(m for m in self.methods if self.sources_for(m))
        if not self.methods:
            raise UserError("--accept: no acceptance file describes any of the methods searched")

    def source(self, label: str) -> Source:
        for s in self.sources:
            if s.label == label:
                return s
        raise UserError(f"no acceptance source '{label}' in this search space")

    def sources_for(self, method: str) -> list[Source]:
        return [s for s in self.sources if method in s.methods]

    def depth_cap(self, source: Source) -> int:
        """Deepest tree searched: the planner's default depth (all distances the statistics cover)."""
        from planner.plan import default_max_depth

        return default_max_depth(source.accept)

    def prompt_tokens_cap(self, source: Source) -> int:
        d = source.accept.max_depth
        return self.max_prompt_tokens if d is None else max(1, min(self.max_prompt_tokens, d))

    def fingerprint(self, profile: LatencyProfile | None) -> str:
        """Hash of the inputs, so a resumed study refuses different inputs (values would not compare)."""
        obj = {
            "sources": [(s.label, s.methods, s.ept, s.accept.to_json()) for s in self.sources],
            "methods": self.methods, "max_size": self.max_size, "P": self.max_prompt_tokens,
            "temperature": self.temperature, "draft_latency_s": self.draft_latency_s,
            "profile": None if profile is None else [profile.input_lengths.tolist(), profile.latency_s.tolist()],
        }
        if self.top_k or self.top_p < 1:  # only then: studies made before these existed still resume
            obj.update(top_k=self.top_k, top_p=self.top_p)
        return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Config:
    """One point of the search space: everything needed to plan (and decode) one tree."""

    method: str
    source: str  # Source.label
    size: int | None = None  # candidates; None: the planner picks with the profile
    max_depth: int | None = None  # None: the planner's default
    prompt_tokens: int = PLAN_DEFAULT_PROMPT_TOKENS  # ppd only
    per_state_budgets: bool = True  # ppd only
    input_length: int | None = None  # ppd with a shared budget: tokens per forward pass
    verify: str = "auto"  # the decoder's rule names: auto (greedy at temperature 0, lossless above), typical, lossless
    typical_eps: float | None = None
    typical_delta: float | None = None

    def to_json(self) -> dict:
        """All fields (Config(**d) rebuilds it); fields the method ignores are dropped for readability."""
        d = dict(self.__dict__)
        if self.method != PPD:
            for k in ("prompt_tokens", "per_state_budgets", "input_length"):
                d.pop(k)
        return d


def suggest(trial, space: SearchSpace, profile: LatencyProfile | None, tune_verify: bool = False) -> Config:
    """Sample a Config. Parameter names carry the method, so each method has its own subspace."""
    m = trial.suggest_categorical("method", list(space.methods))
    sources = space.sources_for(m)
    labels = [s.label for s in sources]
    label = trial.suggest_categorical(f"{m}.source", labels) if len(labels) > 1 else labels[0]
    src = next(s for s in sources if s.label == label)
    cfg = Config(method=m, source=label)
    auto = profile is not None and trial.suggest_categorical(f"{m}.size_mode", ["auto", "fixed"]) == "auto"
    if m == PPD:
        cfg.prompt_tokens = trial.suggest_int("ppd.prompt_tokens", 1, space.prompt_tokens_cap(src))
        if profile is not None:
            cfg.per_state_budgets = trial.suggest_categorical("ppd.per_state_budgets", [True, False])
        if not auto:  # PPD's budget is the forward-pass length (root + candidates + prompt tokens)
            cap = profile.max_input_length if profile is not None else space.max_size + 1
            cfg.input_length = trial.suggest_int("ppd.input_length", 2, max(2, cap))
    else:
        if not auto:  # a tree of size n runs n + 1 tokens: stay inside the profiled range
            hi = space.max_size if profile is None else max(1, min(space.max_size, profile.max_input_length - 1))
            cfg.size = trial.suggest_int(f"{m}.size", 1, hi)
        cap = space.depth_cap(src)
        depth = trial.suggest_int(f"{m}.max_depth", 1, cap)
        # The top of the range is the planner's default (all distances the statistics cover).
        cfg.max_depth = None if depth == cap else depth
    if tune_verify:  # only decoding sees the rule: the predicted objective would search it blindly
        cfg.verify = trial.suggest_categorical("verify", list(VERIFY_RULES))
        if cfg.verify == "typical":
            cfg.typical_eps = trial.suggest_float("typical.eps", 0.01, 0.3, log=True)
            cfg.typical_delta = trial.suggest_float("typical.delta", 0.05, 1.0, log=True)
    return cfg


def front_seed_points(space: SearchSpace, profile: LatencyProfile | None) -> list[dict]:
    """Multi-objective: fixed sizes on a doubling grid per method, so the front's small-memory end is
    sampled from the start instead of left to chance (the auto points sit at its fast end)."""
    if profile is None:
        return []
    out = []
    for ref in reference_points(space, profile):
        m = ref["method"]
        top = profile.max_input_length if m == PPD else min(space.max_size, profile.max_input_length - 1)
        grid, n = [], 2 if m == PPD else 1
        while n <= top:
            grid.append(n)
            n *= 2
        for n in grid:
            p = dict(ref)
            p[f"{m}.size_mode"] = "fixed"
            p["ppd.input_length" if m == PPD else f"{m}.size"] = n
            out.append(p)
    return out


def reference_points(space: SearchSpace, profile: LatencyProfile | None) -> list[dict]:
    """Trial parameters reproducing `planner plan` (automatic size, defaults), one per method and source."""
    out = []
    for m in space.methods:
        for src in space.sources_for(m):
            p: dict[str, Any] = {"method": m}
            if len(space.sources_for(m)) > 1:
                p[f"{m}.source"] = src.label
            if profile is None:
                continue  # no automatic size without a profile: nothing to reproduce
            p[f"{m}.size_mode"] = "auto"
            if m == PPD:
                p["ppd.prompt_tokens"] = min(PLAN_DEFAULT_PROMPT_TOKENS, space.prompt_tokens_cap(src))
                p["ppd.per_state_budgets"] = True
            else:
                p[f"{m}.max_depth"] = space.depth_cap(src)
            out.append(p)
    return out


# ---------------------------------------------------------------------------------------------
# evaluating one point


def trial_guessing(method: str, src: Source, space: SearchSpace) -> Guessing:
    """How the trial's guesser feeds its tree: E input tokens per prompt token (prompt-token
    guessers), a draft model's pass per level for sequoia, whose drafts come from one."""
    draft = space.draft_latency_s if method == "sequoia" else None
    return default_guessing(method, src.accept, ensemble=src.ept, draft_s=draft)


def predict_config(tree: Tree, profile: LatencyProfile, src: Source, space: SearchSpace) -> Prediction:
    """The cost model (planner.cost) for one trial."""
    return predict(tree, profile, trial_guessing(tree.method, src, space))


def build_tree(cfg: Config, space: SearchSpace, profile: LatencyProfile | None) -> Tree:
    """Plan the tree of one configuration (raises UserError when the point is infeasible)."""
    from planner.plan import plan

    src = space.source(cfg.source)
    kw: dict[str, Any] = dict(size=cfg.size, max_depth=cfg.max_depth, profile=profile, max_size=space.max_size)
    if cfg.method == PPD:
        kw.update(prompt_tokens=cfg.prompt_tokens, per_state_budgets=cfg.per_state_budgets)
        if cfg.input_length is not None:
            kw["input_length"] = cfg.input_length
    kw["guessing"] = trial_guessing(cfg.method, src, space)
    return plan(cfg.method, src.accept, **kw)


Evaluator = Callable[[Tree, Config, Source], dict]  # -> {"tokens_per_s": ..., "tokens_per_step": ...}


@dataclass
class TuneResult:
    study_name: str
    storage: str
    best: dict  # trial number, values, config, prediction
    pareto: list[dict]  # multi-objective: the front, fastest first
    trials_run: int  # in this call
    trials_total: int  # completed trials in the study
    out: Path | None
    reference: list[dict] = field(default_factory=list)  # the `planner plan` points and their values


def objective_names(objective: str, memory: str | None) -> list[str]:
    first = "predicted speedup (x)" if objective == "predicted" else "measured tokens per second"
    if memory is None:
        return [first]
    return [first, "largest input length (tokens)" if memory == "input_length" else "extra KV bytes per step"]


def memory_value(pred_max_input_length: int, memory: str, kv_per_token: int | None) -> float:
    if memory == "input_length":
        return float(pred_max_input_length)
    if kv_per_token is None:
        raise UserError("--memory kv_bytes needs the model's KV size: give --model-config CONFIG.json or --kv-bytes-per-token")
    # The step writes K and V for every input token before the rejected ones are cropped.
    return float(pred_max_input_length * kv_per_token)


def _evaluate(trial, space, profile, objective, memory, kv_per_token, evaluator, tune_verify):
    """One trial: sample, plan, predict (and decode). Infeasible points are pruned with the reason."""
    import optuna

    cfg = suggest(trial, space, profile, tune_verify)
    src = space.source(cfg.source)
    try:
        tree = build_tree(cfg, space, profile)
        pred = predict_config(tree, profile, src, space) if profile is not None else None
    except UserError as e:
        trial.set_user_attr("infeasible", str(e))
        raise optuna.TrialPruned(str(e)) from None
    trial.set_user_attr("config", cfg.to_json())
    trial.set_user_attr("ept", src.ept)
    longest = max(input_lengths(tree, trial_guessing(tree.method, src, space)))
    trial.set_user_attr("max_input_length", longest)
    trial.set_user_attr("expected_tokens_per_step", tree.expected_tokens_per_step)
    if pred is not None:
        trial.set_user_attr("predicted_speedup", pred.speedup)
        trial.set_user_attr("step_latency_s", pred.step_latency_s)
    if objective == "predicted":
        value = pred.speedup
    else:
        measured = evaluator(tree, cfg, src)
        for k, v in measured.items():
            trial.set_user_attr(f"measured_{k}", v)
        value = float(measured["tokens_per_s"])
    if memory is None:
        return value
    return value, memory_value(longest, memory, kv_per_token)


def open_study(storage: str, study_name: str, directions: list[str], fingerprint: str, names: list[str]):
    """Create or resume a study; refuses to mix different inputs or objectives into one study."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = open_storage(storage)
    try:
        study = optuna.create_study(storage=st, study_name=study_name, directions=directions, load_if_exists=True)
    except ValueError as e:
        raise UserError(f"study '{study_name}' in {storage}: {e}") from None
    got = [d.name.lower() for d in study.directions]
    if got != directions:
        raise UserError(f"study '{study_name}' in {storage} optimises {got}, this run asks {directions}: use another --study-name")
    old = study.user_attrs.get("fingerprint")
    if old is None:
        study.set_user_attr("fingerprint", fingerprint)
        study.set_user_attr("objective_names", names)
    elif old != fingerprint:
        raise UserError(f"study '{study_name}' in {storage} was run on other inputs (acceptance, profile or search "
                        "options differ): use another --study-name")
    return study


def _trial_summary(t, names: list[str]) -> dict:
    out = {"trial": t.number, "values": list(t.values), "objectives": names, "params": dict(t.params)}
    out.update({k: v for k, v in t.user_attrs.items() if k != "config"})
    out["config"] = t.user_attrs.get("config")
    return out


def tune(space: SearchSpace, profile: LatencyProfile | None, *, trials: int, storage: str, study_name: str,
         out: str | Path | None = None, objective: str = "predicted", memory: str | None = None,
         kv_per_token: int | None = None, evaluator: Evaluator | None = None, seed: int | None = None,
         progress: bool = True, allow_typical: bool = False) -> TuneResult:
    """Run `trials` more trials of the study (created or resumed) and write the best tree to `out`.

    The `planner plan` points (see reference_points) are enqueued once per study, so with
    objective 'predicted' the best value is at least plan's automatic choice.
    Ctrl-C stops after the running trial is marked failed; the best so far is still written.
    """
    import optuna

    if objective not in OBJECTIVES:
        raise UserError(f"--objective {objective}: expected one of {', '.join(OBJECTIVES)}")
    if memory is not None and memory not in MEMORY_OBJECTIVES:
        raise UserError(f"--memory {memory}: expected one of {', '.join(MEMORY_OBJECTIVES)}")
    if objective == "predicted" and profile is None:
        raise UserError("--objective predicted needs a latency profile (--profile)")
    if objective == "measured" and evaluator is None:
        raise UserError("--objective measured needs a model to decode with (--model)")
    if objective == "measured" and profile is not None:
        refuse_to_measure(profile, "planner tune --objective measured")
    if memory == "kv_bytes" and kv_per_token is None:
        memory_value(1, memory, None)  # raises the explanation
    if trials < 0:
        raise UserError(f"--trials must be >= 0, got {trials}")
    names = objective_names(objective, memory)
    directions = ["maximize"] + (["minimize"] if memory else [])
    study = open_study(storage, study_name, directions, space.fingerprint(profile), names)
    study.sampler = _sampler(seed, len(directions))
    # typical acceptance is not distribution-exact: searched only when asked for (--allow-typical)
    tune_verify = objective == "measured" and space.temperature > 0 and allow_typical
    refs = reference_points(space, profile)
    for p in refs:
        study.enqueue_trial(p, user_attrs={"reference": True}, skip_if_exists=True)
    if memory is not None:
        for p in front_seed_points(space, profile):
            study.enqueue_trial(p, skip_if_exists=True)

    from tqdm import tqdm

    bar = tqdm(total=trials, desc=f"tune {study_name}", unit="trial", disable=not progress, leave=False)

    def on_done(st, t):
        bar.update(1)
        if t.state == optuna.trial.TrialState.COMPLETE and len(directions) == 1:
            bar.set_postfix(best=f"{st.best_value:.4g}")

    interrupted = False
    try:
        study.optimize(lambda t: _evaluate(t, space, profile, objective, memory, kv_per_token, evaluator, tune_verify),
                       n_trials=trials, callbacks=[on_done], catch=())
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    result = _finish(study, space, profile, storage, names, trials if not interrupted else bar.n, out)
    if interrupted:
        raise KeyboardInterrupt
    return result


def _sampler(seed: int, n_objectives: int):
    import optuna

    if n_objectives > 1:
        return optuna.samplers.NSGAIISampler(seed=seed)
    import warnings

    with warnings.catch_warnings():  # multivariate/group are "experimental" but are what a conditional space needs
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=8)


def _finish(study, space, profile, storage, names, trials_run, out) -> TuneResult:
    import optuna

    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
    reference = [_trial_summary(t, names) for t in done if t.user_attrs.get("reference")]
    if not done:
        return TuneResult(study.study_name, storage, {}, [], trials_run, 0, None, reference)
    front = sorted(study.best_trials, key=lambda t: -t.values[0]) if len(names) > 1 else [study.best_trial]
    best = front[0]
    pareto = [_trial_summary(t, names) for t in front] if len(names) > 1 else []
    path = None
    if out is not None:
        cfg = Config(**best.user_attrs["config"])
        tree = build_tree(cfg, space, profile)
        src = space.source(cfg.source)
        if profile is not None:
            tree.predicted_speedup = predict_config(tree, profile, src, space).speedup
        tree.settings = dict(tree.settings)
        tree.settings["tune"] = {
            "study_name": study.study_name, "storage": storage, "trial": best.number,
            "objectives": names, "values": list(best.values), "config": cfg.to_json(), "ensemble": src.ept,
            "acceptance": src.label, "completed_trials": len(done),
            "decode": {"verify_rule": cfg.verify, "eps": cfg.typical_eps, "delta": cfg.typical_delta,
                       "temperature": space.temperature, "top_k": space.top_k, "top_p": space.top_p},
            "reference": [{"trial": r["trial"], "values": r["values"], "params": r["params"]} for r in reference],
            "pareto": [{"trial": p["trial"], "values": p["values"], "config": p["config"]} for p in pareto],
        }
        tree.settings["sampling"] = ({"temperature": float(space.temperature), "top_k": int(space.top_k),
                                      "top_p": float(space.top_p)} if space.temperature > 0
                                     else {"temperature": 0.0, "top_k": 0, "top_p": 1.0})
        tree.settings["distribution_exact"] = not (cfg.verify == "typical" and space.temperature > 0)
        tree.provenance = dict(tree.provenance)
        tree.provenance.setdefault("acceptance", src.accept.provenance())
        if profile is not None:
            tree.provenance.setdefault("profile", profile.source)
        path = save_tree(tree, out)
    return TuneResult(study.study_name, storage, _trial_summary(best, names), pareto, trials_run, len(done), path, reference)
