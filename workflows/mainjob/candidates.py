"""The plans autotune weighs (phase 3, `plan_phase`): for every guesser, the trees (or chains) the
planner offers, each with its predicted tokens per step and speedup from the one cost model
(planner.cost). Which families fit a guesser is its registry entry's `static` (planner/guessers.py):

- prompt tokens (PPD): the paper's shared-budget sweep, the planner's per-state-budget tree, and
  medusa / sequoia trees carrying prompt tokens on every node;
- drafters and lookup: chains of 1..depth tokens, and the medusa (and sequoia) trees the planner
  sizes for the drafter's pass time, where the kind's proposals branch;
- every kind with a confidence signal, and lookup's hybrids: per-step trees (planner/dynamic.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.accept import Acceptance
from planner.candidate import tree_tau
from planner.cost import Guessing, default_guessing, input_lengths, mean_input_length, padding, predict
from planner.errors import PlainIsFastest, UserError
from planner.guessers import kind as guesser_kind
from planner.guessers import kinds as guesser_kinds
from planner.plan import plan
from planner.profile import LatencyProfile
from planner.tree import CHAIN, DYNAMIC, MEDUSA, PPD, SEQUOIA, Tree, TreeState

METHODS = (PPD, MEDUSA, SEQUOIA)  # the prompt-token guesser's tree families
MAX_CHAIN = 8
DYNAMIC_MAX_SIZE = 15  # per-step trees up to this many candidates: inputs to 16 rows, where the matmul paths are chosen


@dataclass
class Candidate:
    """One plan autotune considers: its guesser, its tree and the model's prediction for this machine."""

    method: str  # ppd, medusa, sequoia, chain or dynamic (planner.tree's method names)
    tree: Tree
    size: int  # candidates (medusa/sequoia/chain) or planned input length (ppd)
    input_length: float  # real forward length in the decoder (amortised over states for ppd)
    predicted_tokens_per_step: float
    predicted_speedup: float
    variant: str = ""  # ppd: "shared budget" (the paper's) or "per-state budgets" (hardware-aware)
    guesser: str = PPD  # the guesser's kind (planner/guessers.py)
    guessing: Guessing = field(default_factory=Guessing)
    measured: dict = field(default_factory=dict)
    tag: str = ""  # tells apart two plans of one (guesser, method, size)
    predicted_step_s: float | None = None  # set by a replayed prediction (workflows/mainjob/predict.py)
    prediction: dict = field(default_factory=dict)  # how it was predicted, and the cost model's own numbers

    def step_s(self, plain_s: float) -> float:
        """Its predicted step time: the replayed one, else the cost model's (plain's step times the
        step's share of it, predicted tokens per step over predicted speedup)."""
        if self.predicted_step_s:
            return self.predicted_step_s
        return plain_s * self.predicted_tokens_per_step / max(self.predicted_speedup, 1e-9)

    @property
    def label(self) -> str:
        return f"{self.guesser}/{self.method}-{self.size}{'+' if self.variant == 'per-state budgets' else ''}{self.tag}"


def real_input_length(tree: Tree, ensemble: int) -> float:
    """Tokens in the decoder's forward pass with prompt-token guessers, amortised over states."""
    return mean_input_length(tree, Guessing(prompt_tokens=True, ensemble=ensemble))


def _candidate(method, tree, size, profile, guessing: Guessing, guesser: str, variant="") -> Candidate:
    pred = predict(tree, profile, guessing)
    tree.predicted_speedup = pred.speedup
    tree.settings = dict(tree.settings, guesser=guesser, **padding(profile))
    return Candidate(method, tree, size, mean_input_length(tree, guessing), pred.tokens_per_step, pred.speedup,
                     variant, guesser, guessing)


def plan_candidates(method: str, accept: Acceptance, profile: LatencyProfile, prompt_tokens: int, ensemble: int,
                    max_input_length: int) -> list[Candidate]:
    """PPD prompt tokens: every size of `method` whose real forward pass fits `max_input_length`."""
    g = Guessing(prompt_tokens=True, ensemble=ensemble)
    out = []
    if method == PPD:
        # The paper's shared budget gives a real size sweep (every state spends up to n tokens);
        # the planner's hardware-aware tree (each state spends what the latency curve says pays)
        # is one more plan, usually equal in speed to the best of the sweep or better.
        sized = [(n, plan(PPD, accept, input_length=n, prompt_tokens=prompt_tokens), "shared budget")
                 for n in range(1 + prompt_tokens, max_input_length + 1)]
        auto = plan(PPD, accept, profile=profile, prompt_tokens=prompt_tokens, max_input_length=max_input_length,
                    guessing=g)
        sized.append((auto.max_input_length, auto, "per-state budgets"))
        seen = set()
        for n, tree, variant in sized:
            if tree.shape() in seen or max(input_lengths(tree, g)) > max_input_length:
                continue
            seen.add(tree.shape())
            out.append(_candidate(method, tree, n, profile, g, PPD, variant))
        return out
    depth = min(prompt_tokens, accept.max_depth or prompt_tokens)
    for size in range(1, max_input_length):
        tree = plan(method, accept, size=size, max_depth=depth)
        if real_input_length(tree, ensemble) > max_input_length:
            break
        out.append(_candidate(method, tree, size, profile, g, PPD))
    return out


def chain_tree(accept: Acceptance, depth: int) -> Tree:
    """A chain of `depth` rank-0 guesses (speculative decoding's draft), tau from the acceptance."""
    nodes = [(0,) * d for d in range(1, depth + 1)]
    tau = tree_tau(accept.rows(depth), nodes)
    return Tree(MEDUSA, [TreeState(0, nodes, tau, 1 + depth)], tau, settings={CHAIN: depth})


def drafter_candidates(kind: str, accept: Acceptance, profile: LatencyProfile, max_input_length: int,
                       max_depth: int | None = None, sampled: bool = False) -> list[Candidate]:
    """Chains of 1..depth, and for tree-capable drafters the medusa (and, for a draft LM, sequoia)
    trees the planner sizes for the drafter's measured pass time. sampled (lossless sampling): a
    drafter that samples its children takes sequoia trees only, whose sibling ranks are the first
    draws without replacement."""
    g = default_guessing(MEDUSA, accept)
    deepest = min(max_depth or MAX_CHAIN, accept.max_depth or MAX_CHAIN, max_input_length - 1)
    out = [_candidate(CHAIN, chain_tree(accept, d), d, profile, g, kind) for d in range(1, deepest + 1)]
    spec = guesser_kind(kind)
    for method in (m for m in spec.static if m != CHAIN and not (sampled and spec.samples and m == MEDUSA)):
        try:
            tree = plan(method, accept, profile=profile, max_size=max_input_length - 1, max_depth=deepest, guessing=g)
        except PlainIsFastest:
            continue
        out.append(_candidate(method, tree, len(tree.states[0].nodes), profile, g, kind, "sized by the planner"))
    return out


def pick(candidates: list[Candidate], neighbours: int, sweep: int = 8) -> tuple[Candidate, list[Candidate]]:
    """The best predicted candidate overall, plus: the best of every other (guesser, method) and the
    `neighbours` sizes either side of the chosen one in its own (guesser, method) (to check the choice)."""
    if not candidates:
        raise UserError("autotune: no plan fits the profiled range")
    best = max(candidates, key=lambda c: c.predicted_speedup)
    same = sorted((c for c in candidates if (c.guesser, c.method) == (best.guesser, best.method)),
                  key=lambda c: (c.input_length, c.size))
    i = same.index(best)
    chosen_and_near = same[max(0, i - neighbours): i + neighbours + 1]
    # and a coarse sweep of the chosen method, to see the curve's shape
    sweep = same[:: max(1, len(same) // sweep)] if sweep > 0 else []
    others = []
    for key in dict.fromkeys((c.guesser, c.method) for c in candidates):
        if key != (best.guesser, best.method):
            others.append(max((c for c in candidates if (c.guesser, c.method) == key), key=lambda c: c.predicted_speedup))
    tried = list({id(c): c for c in chosen_and_near + sweep + others}.values())
    tried.sort(key=lambda c: ((c.guesser, c.method) != (best.guesser, best.method), c.guesser, c.method, c.size))
    return best, tried


def finalists(candidates: list[Candidate], families: int, neighbours: int = 1, sweep: int = 0) -> list[Candidate]:
    """The plans that race (workflows.mainjob.choose), best predicted first: the best predicted plan of
    each of the `families` best (guesser, method) families, the `neighbours` sizes either side of
    the overall best, and `sweep` sizes spread over its family. Predictions only preselect: the
    race decides, so a family predicted a little worse still gets measured."""
    if not candidates:
        raise UserError("autotune: no plan fits the profiled range")
    fams: dict[tuple[str, str], list[Candidate]] = {}
    for c in candidates:
        fams.setdefault((c.guesser, c.method), []).append(c)
    tops = sorted((max(cs, key=lambda c: c.predicted_speedup) for cs in fams.values()),
                  key=lambda c: -c.predicted_speedup)[: max(families, 1)]
    best = tops[0]
    same = sorted(fams[(best.guesser, best.method)], key=lambda c: (c.input_length, c.size))
    i = same.index(best)
    extra = same[max(0, i - neighbours): i + neighbours + 1]
    extra += same[:: max(1, len(same) // sweep)] if sweep > 0 else []
    out = list({id(c): c for c in tops + extra}.values())
    labels: set[str] = set()
    for c in out:  # race arms are keyed by label
        while c.label in labels:
            c.tag += "'"
        labels.add(c.label)
    return sorted(out, key=lambda c: -c.predicted_speedup)


def pearl_candidates(accept: Acceptance, latencies: dict, eta: float, plain_s: float,
                     kind: str, gammas=range(2, 7)) -> list[Candidate]:
    """PEARL with the draft LM, one candidate per gamma: the two-state chain's tokens per round and
    round time (planner.pearl) with each side's latency at the thread count it really gets and the
    measured overlap eta. The candidate's tree is the chain of gamma (what the drafter drafts)."""
    import numpy as np

    from planner.pearl import alpha_from_acceptance, predict_pearl

    n = sorted(latencies["L_split_s"])
    split = LatencyProfile(np.array(n), np.maximum.accumulate(np.array([latencies["L_split_s"][k] for k in n])))
    alpha = alpha_from_acceptance(accept)
    out = []
    for g in gammas:
        if g > split.max_input_length:
            break
        p = predict_pearl(alpha, g, latencies["t_draft_split_s"], split, eta, plain_s)
        tree = chain_tree(accept, g)
        tree.settings = dict(tree.settings, guesser=kind, pearl={"gamma": g, "alpha": alpha, "eta": eta,
                                                                  "pi_a": p.pi_a, "round_s": p.round_s})
        tree.predicted_speedup = p.speedup
        out.append(Candidate(kind, tree, g, float(g), p.tokens_per_round, p.speedup, "overlapped", kind,
                             Guessing(draft_s=latencies["t_draft_split_s"])))
    return out


def dynamic_candidates(kind: str, accept, profile: LatencyProfile | None, max_size: int = 16, max_depth: int = 8,
                       sizes: tuple[int, ...] | None = None) -> list[Candidate]:
    """Dynamic plans (trees chosen at every step, planner/dynamic.py) for guesser `kind` (lookup,
    draft, parallelspec, chain, ppd) or a hybrid `lookup+<drafter>`. accept: the Acceptance (a dict
    {kind: Acceptance} for a hybrid: lookup's and the drafter's); files from `planner accept
    --calibrate` bring their calibration, others are used as the prior. One candidate per size
    limit in `sizes` (default: max_size). The tree decodes with `decoder.generate(model, ids,
    plan=c.tree, guesser=g)`, g the single guesser or decoder.guessers.dynamic.HybridGuesser(lookup, drafter,
    drafter_kind). Predicted tokens/step and speedup are the prior-only forecast (the step the
    prior alone would choose every time); per-step choice adds what the average hides, so measure."""
    from planner.dynamic_plan import plan_dynamic

    kinds = list(guesser_kind(kind).members) or [kind]
    accepts = accept if isinstance(accept, dict) else {kinds[0]: accept}
    missing = [k for k in kinds if k not in accepts]
    if missing:
        raise UserError(f"dynamic {kind}: no acceptance for {', '.join(missing)}")
    out = []
    for n in sizes or (max_size,):
        tree = plan_dynamic([(k, accepts[k]) for k in kinds], profile, max_size=n, max_depth=max_depth)
        preds = tree.settings["prior_prediction"]
        best = max(preds.values(), key=lambda p: p["speedup"])
        tree.settings = dict(tree.settings, guesser=kind)
        out.append(Candidate(DYNAMIC, tree, tree.dynamic.max_size, float(1 + best["size"]), best["tokens_per_step"],
                             best["speedup"], "per-step trees", kind,
                             default_guessing(MEDUSA, accepts[kinds[-1]])))
    return out


# ---------------------------------------------------------------------------------------------- phase 3


def plan_phase(run, accepts: dict, profile: LatencyProfile) -> list[Candidate]:
    """Every size of every (guesser, method) and the per-step trees, predicted with the one cost
    model. accepts: kind -> workflows.mainjob.measure.Measured. run: workflows.mainjob.runs.Run."""
    s = run.settings
    run.clock.phase(3, f"planning {', '.join(accepts)} up to input length {s.max_input_length}", run.clock.left())
    candidates = []
    for kind, m in accepts.items():
        g = run.guessers[kind]
        if guesser_kind(kind).needs_embeddings:  # prompt tokens ride on every node: PPD's own families
            for method in s.methods:
                candidates += plan_candidates(method, m.accept, profile, g.num_prompt_tokens, g.ensemble,
                                              s.max_input_length)
        else:
            candidates += drafter_candidates(kind, m.accept, profile, s.max_input_length,
                                             sampled=s.sampling.rule == "lossless")
    candidates += _dynamic_phase(run, accepts, profile)
    if not candidates:
        raise UserError(f"--max-input-length {s.max_input_length}: no plan fits")
    return candidates


def _dynamic_phase(run, accepts: dict, profile: LatencyProfile) -> list[Candidate]:
    """Per-step trees (planner/dynamic.py) for every guesser with a confidence signal, and every
    registered hybrid whose members were measured (it joins run.guessers)."""
    from decoder.guessers.dynamic import HybridGuesser

    size = min(DYNAMIC_MAX_SIZE, run.settings.max_input_length - 1)
    own = run.settings.kind.defaults.dynamic_sizes  # the engine's size limits (None: the largest only)
    sizes = tuple(n for n in own if n <= size) or None if own else None
    kinds = [k for k in accepts if guesser_kind(k).dynamic]
    for h in guesser_kinds():
        if h.hybrid and all(m in accepts for m in h.members):
            kinds.append(h.name)
            lookup, drafter = (run.guessers[m] for m in h.members)
            hybrid = HybridGuesser(lookup, drafter, h.members[1])
            hybrid.kind, hybrid.source_dir = h.name, drafter.source_dir
            run.guessers[h.name] = hybrid
    out = []
    for kind in kinds:
        members = guesser_kind(kind).members or (kind,)
        try:
            cands = dynamic_candidates(kind, {k: accepts[k].accept for k in members}, profile, max_size=size,
                                       sizes=sizes)
        except UserError as e:  # a guesser the dynamic planner cannot model: the static plans still race
            run.say(f"      dynamic {kind}: skipped ({e})")
            continue
        for c in cands:
            c.tree.settings.update(padding(profile))
        out += cands
    return out
