"""The plans autotune weighs: for every guesser, the trees (or chains) the planner offers, each with
its predicted tokens per step and speedup from the one cost model (planner.cost).

- ppd (PPD prompt tokens): the paper's shared-budget sweep, the planner's per-state-budget tree,
  and medusa / sequoia trees carrying prompt tokens on every node;
- draft (a draft LM): chains of gamma tokens (speculative decoding), and the medusa / sequoia
  trees the planner sizes for the drafter's pass time (one pass per level);
- parallelspec (one drafter pass for every distance): medusa trees up to depth K + 1, and chains;
- chain (the same drafter, one token per pass, EAGLE-style): chains;
- lookup (prompt lookup, near-zero cost): chains.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.accept import Acceptance
from planner.candidate import tree_tau
from planner.cost import Guessing, default_guessing, input_lengths, mean_input_length, padding, predict
from planner.errors import PlainIsFastest, UserError
from planner.plan import plan
from planner.profile import LatencyProfile
from planner.tree import Tree, TreeState

METHODS = ("ppd", "medusa", "sequoia")
MAX_CHAIN = 8


@dataclass
class Candidate:
    """One plan autotune considers: its guesser, its tree and the model's prediction for this machine."""

    method: str  # ppd, medusa, sequoia or chain
    tree: Tree
    size: int  # candidates (medusa/sequoia/chain) or planned input length (ppd)
    input_length: float  # real forward length in the decoder (amortised over states for ppd)
    predicted_tokens_per_step: float
    predicted_speedup: float
    variant: str = ""  # ppd: "shared budget" (the paper's) or "per-state budgets" (hardware-aware)
    guesser: str = "ppd"  # ppd, draft, parallelspec, chain, lookup
    guessing: Guessing = field(default_factory=Guessing)
    measured: dict = field(default_factory=dict)
    tag: str = ""  # tells apart two plans of one (guesser, method, size)

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
    if method == "ppd":
        # The paper's shared budget gives a real size sweep (every state spends up to n tokens);
        # the planner's hardware-aware tree (each state spends what the latency curve says pays)
        # is one more plan, usually equal in speed to the best of the sweep or better.
        sized = [(n, plan("ppd", accept, input_length=n, prompt_tokens=prompt_tokens), "shared budget")
                 for n in range(1 + prompt_tokens, max_input_length + 1)]
        auto = plan("ppd", accept, profile=profile, prompt_tokens=prompt_tokens, max_input_length=max_input_length,
                    guessing=g)
        sized.append((auto.max_input_length, auto, "per-state budgets"))
        seen = set()
        for n, tree, variant in sized:
            if tree.shape() in seen or max(input_lengths(tree, g)) > max_input_length:
                continue
            seen.add(tree.shape())
            out.append(_candidate(method, tree, n, profile, g, "ppd", variant))
        return out
    depth = min(prompt_tokens, accept.max_depth or prompt_tokens)
    for size in range(1, max_input_length):
        tree = plan(method, accept, size=size, max_depth=depth)
        if real_input_length(tree, ensemble) > max_input_length:
            break
        out.append(_candidate(method, tree, size, profile, g, "ppd"))
    return out


def chain_tree(accept: Acceptance, depth: int) -> Tree:
    """A chain of `depth` rank-0 guesses (speculative decoding's draft), tau from the acceptance."""
    nodes = [(0,) * d for d in range(1, depth + 1)]
    tau = tree_tau(accept.rows(depth), nodes)
    return Tree("medusa", [TreeState(0, nodes, tau, 1 + depth)], tau, settings={"chain": depth})


def drafter_candidates(kind: str, accept: Acceptance, profile: LatencyProfile, max_input_length: int,
                       max_depth: int | None = None) -> list[Candidate]:
    """Chains of 1..depth, and for tree-capable drafters the medusa (and, for a draft LM, sequoia)
    trees the planner sizes for the drafter's measured pass time."""
    g = default_guessing("medusa", accept)
    deepest = min(max_depth or MAX_CHAIN, accept.max_depth or MAX_CHAIN, max_input_length - 1)
    out = [_candidate("chain", chain_tree(accept, d), d, profile, g, kind) for d in range(1, deepest + 1)]
    methods = {"draft": ("medusa", "sequoia"), "parallelspec": ("medusa",)}.get(kind, ())
    for method in methods:
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
    """The plans that race (workflows.choose), best predicted first: the best predicted plan of
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
                     gammas=range(2, 7)) -> list[Candidate]:
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
        tree.settings = dict(tree.settings, guesser="pearl", pearl={"gamma": g, "alpha": alpha, "eta": eta,
                                                                     "pi_a": p.pi_a, "round_s": p.round_s})
        tree.predicted_speedup = p.speedup
        out.append(Candidate("pearl", tree, g, float(g), p.tokens_per_round, p.speedup, "overlapped", "pearl",
                             Guessing(draft_s=latencies["t_draft_split_s"])))
    return out


def dynamic_candidates(kind: str, accept, profile: LatencyProfile | None, max_size: int = 16, max_depth: int = 8,
                       sizes: tuple[int, ...] | None = None) -> list[Candidate]:
    """Dynamic plans (trees chosen at every step, planner/dynamic.py) for guesser `kind` (lookup,
    draft, parallelspec, chain, ppd) or a hybrid `lookup+<drafter>`. accept: the Acceptance (a dict
    {kind: Acceptance} for a hybrid: lookup's and the drafter's); files from `planner accept
    --calibrate` bring their calibration, others are used as the prior. One candidate per size
    limit in `sizes` (default: max_size). The tree decodes with `decoder.generate(model, ids,
    plan=c.tree, guesser=g)`, g the single guesser or decoder.dynamic.HybridGuesser(lookup, drafter,
    drafter_kind). Predicted tokens/step and speedup are the prior-only forecast (the step the
    prior alone would choose every time); per-step choice adds what the average hides, so measure."""
    from planner.dynamic_plan import plan_dynamic

    kinds = kind.split("+")
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
        out.append(Candidate("dynamic", tree, tree.dynamic.max_size, float(1 + best["size"]), best["tokens_per_step"],
                             best["speedup"], "per-step trees", kind,
                             default_guessing("medusa", accepts[kinds[-1]])))
    return out
