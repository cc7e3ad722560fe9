"""The main job's replays of the shared greedy decode (profiler/replay.py): calibration in the
acceptance phase, and the finalists' predictions before the race.

    capture = ppd_capture(run)                        # PPD rides along the shared decode, its logits kept
    accepts = calibration_step(run, cont, capture, accepts)   # every confidence map, no extra decode
    racing = prediction_phase(run, racing, profile)   # every finalist's session replayed and priced

Calibration: every measured guesser with a confidence signal (planner/guessers.py) is calibrated by
replaying its full pool over the continuations (profiler.calibration_replay): the observations
`planner accept --calibrate` collects by decoding, so the acceptance files carry `calibration` and
the dynamic plans are planned from it.

Prediction: each finalist decodes each acceptance prompt's known continuation in replay (its first
`decode_tokens`, as long as a race decode), so its tokens per step, the sizes a dynamic plan
chooses, its drafting passes and its decision time are those its session produces there. Each
step is priced by the one cost model (planner.cost.step_cost: L(n) + the decoder's overhead at the
step's real input length n) plus the drafting it paid (static: planner.cost.Guessing.draft_cost of
its depth; dynamic: the passes its session priced, each the measured draft_s) plus, for dynamic
plans, the decision and commit times the replay measured. A dynamic plan's decision cost is
measured here once and recorded in it before its prediction (`dynamic.decide_s`, the median over a
first replay that decided with the planner's 0, profiler.replay.measure_decide_s): the prediction's
replay and the race then decide with that one constant, so the predicted steps are the race's own
(a session never prices a clock it reads while decoding). A prompt's predicted speedup compares
plain decoding with the plan including the prefill (the race times whole decodes); the plan's is
their geometric mean over prompts, as the race's. Made on the acceptance prompts, never the race's.
PEARL (its own two-job loop) keeps its own model (planner/pearl.py).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from planner.accept import load_acceptance
from planner.cost import plain_step, prefill_cost, step_cost
from planner.guessers import kind as guesser_kind
from planner.jsonio import atomic_write_json
from planner.profile import LatencyProfile
from workflows.mainjob.candidates import Candidate


def ppd_capture(run, riding):
    """The prompt tokens riding along the shared decode, wrapped to keep their logits (None: none ride)."""
    from profiler.replay import PPDCapture

    return PPDCapture(riding) if riding is not None else None


def calibration_step(run, cont, capture, measured: dict) -> dict:
    """Teachers of the shared decode (run.replays), and every measured guesser with a confidence
    signal calibrated by replay; its acceptance file rewritten with "calibration". measured:
    kind -> workflows.mainjob.measure.Measured; returns it with the calibrated files reloaded."""
    from profiler.calibration_replay import calibrate_by_replay
    from profiler.replay import teachers

    t0 = time.perf_counter()
    features = {run.guessers[k].needs_hidden for k in measured if run.guessers[k].needs_hidden}  # one spec per reader
    run.replays = teachers(run.engine, cont, features, capture)
    sampling = getattr(cont, "sampling", None)  # a sampled decode's settings (profiler.sampled); greedy: none
    out, done, kept = dict(measured), [], []
    for kind, m in measured.items():
        spec = guesser_kind(kind)
        if not spec.dynamic or (spec.needs_embeddings and capture is None):
            continue
        if sampling is not None and sampling.rule != "coupled" and _draws(kind):
            kept.append(kind)
            continue
        doc = json.loads(m.path.read_text())
        doc["calibration"] = calibrate_by_replay(run.engine, run.guessers[kind], run.replays, np.array(doc["accuracy"]),
                                                 sampling=sampling)
        doc["calibration"]["source"] = ("profiler.calibration_replay (the shared "
                                        + ("sampled decode, replayed, guesses scored with p" if sampling else "greedy decode, replayed")
                                        + ")")
        atomic_write_json(m.path, doc)
        out[kind] = replace(m, accept=load_acceptance(str(m.path)))
        done.append(f"{kind} {doc['calibration']['observations']}")
    run.say(f"      calibrated by replay ({time.perf_counter() - t0:.1f} s): {', '.join(done) or 'none'} observations"
            + (f"; not calibrated (children drawn): {', '.join(kept)}, planned from the sampled rows, corrected online"
               if kept else ""))
    return out


# ---------------------------------------------------------------------------------------------- predictions


@dataclass
class _Prompt:
    tokens: int
    steps: int
    seconds: float  # the plan's decode: every step priced
    prefill_s: float
    forward_s: float = 0.0
    draft_s: float = 0.0
    decide_s: float = 0.0  # dynamic: decision and commit measured in the replay
    sizes: int = 0  # candidates proposed, summed


def _price(c: Candidate, steps, profile: LatencyProfile, dynamic: bool) -> tuple[float, float, float]:
    """(forward + overhead, drafting, decision) seconds of the replayed steps."""
    fwd = float(np.sum(step_cost(profile, np.array([s.input_length for s in steps]))))
    if dynamic:
        return fwd, sum(s.draft_model_s for s in steps), sum(s.decide_s + s.commit_s for s in steps)
    return fwd, float(np.sum(c.guessing.draft_cost(np.array([s.depth for s in steps])))), 0.0


def _teachers(run) -> list:
    """The shared decode's prompts that have a continuation to replay."""
    return [t for t in run.replays or [] if t.tokens.numel()]


def _draws(guesser: str) -> bool:
    """Whether the guesser (or a hybrid's member) draws its children under sampling: then a sampled
    text cannot replay it, since a drawn child's acceptance depends on its own draw, which the text
    does not hold (neither its calibration, profiler.calibration_replay, nor its steps)."""
    spec = guesser_kind(guesser)
    return any(guesser_kind(k).samples for k in (spec.members or (guesser,)))


def _replayable(run, guesser: str) -> bool:
    """Whether replaying the shared decode gives the plan's steps in law. Greedy: always (a step's
    accepted path is the proposal's longest path on the text). Coupled sampling: always, the replay
    given the text's noise (profiler.replay.context), so a drawn-free decode is the text's own. Sampled
    with the lossless rule: when every guess is deterministic, since the rule then emits each node's
    token with the target's warped p whatever was guessed, so the text's draw decides which guess is accepted."""
    return run.settings.sampling.one_text or not _draws(guesser)


def predict_by_replay(run, c: Candidate, profile: LatencyProfile) -> dict | None:
    """The candidate's prediction from its replayed sessions (module docstring); None when it
    cannot be replayed here (PEARL's loop, PPD without its captured logits, no decode to replay)."""
    from profiler.replay import replay_plan

    teachers = _teachers(run)
    g = run.guessers.get(c.guesser)
    spec = guesser_kind(c.guesser)
    ppd = spec.needs_embeddings or any(guesser_kind(m).needs_embeddings for m in spec.members)
    if not teachers or g is None or spec.loop is not None or (ppd and teachers[0].ppd is None) \
            or not _replayable(run, c.guesser):
        return None
    dynamic = c.tree.dynamic is not None
    n, plain = run.settings.decode_tokens, plain_step(profile)
    if dynamic:
        _record_decide_s(run, g, c, teachers, n)
    prompts = []
    for t in teachers:
        steps = replay_plan(run.engine, g, c.tree, t, n, teacher_drafts=not dynamic)
        fwd, draft, decide = _price(c, steps, profile, dynamic)
        prompts.append(_Prompt(sum(s.accepted + 1 for s in steps), len(steps), fwd + draft + decide,
                               prefill_cost(profile, t.prompt.numel()), fwd, draft, decide, sum(s.size for s in steps)))
    tokens, steps_ = sum(p.tokens for p in prompts), sum(p.steps for p in prompts)
    seconds = sum(p.seconds for p in prompts)
    logs = [math.log((p.prefill_s + p.tokens * plain) / (p.prefill_s + p.seconds)) for p in prompts]
    pred = {"method": "replay", "prompts": len(prompts), "tokens": tokens, "steps": steps_,
            "tokens_per_step": tokens / steps_, "step_s": seconds / steps_,
            "speedup": math.exp(sum(logs) / len(logs)), "decode_speedup": tokens * plain / seconds,
            "forward_s_per_step": sum(p.forward_s for p in prompts) / steps_,
            "draft_s_per_step": sum(p.draft_s for p in prompts) / steps_,
            "decide_s_per_step": sum(p.decide_s for p in prompts) / steps_,
            "candidates_per_step": sum(p.sizes for p in prompts) / steps_}
    if dynamic:
        pred["decide_s_recorded"] = c.tree.dynamic.decide_s  # what the plan decides with, its prediction included
    return pred


def _record_decide_s(run, g, c: Candidate, teachers: list, n: int) -> None:
    """Time the dynamic plan's decision once and record it in the plan, which then decides with that
    constant wherever it runs (its prediction below, the race, chosen.json)."""
    from profiler.replay import measure_decide_s

    c.tree.dynamic.decide_s = measure_decide_s(run.engine, g, c.tree, teachers, n)


def prediction_phase(run, racing: list[Candidate], profile: LatencyProfile) -> list[Candidate]:
    """Every finalist predicted by replay (where it can be), best predicted first; the cost
    model's own prediction stays beside it (candidate.prediction["cost_model"])."""
    t0 = time.perf_counter()
    done = 0
    for c in racing:
        model = {"tokens_per_step": c.predicted_tokens_per_step, "speedup": c.predicted_speedup,
                 "step_s": c.step_s(plain_step(profile))}
        pred = predict_by_replay(run, c, profile)
        if pred is None:
            c.prediction = {"method": "cost model", "cost_model": model}
            continue
        c.prediction = pred | {"cost_model": model}
        c.predicted_tokens_per_step, c.predicted_speedup = pred["tokens_per_step"], pred["speedup"]
        c.predicted_step_s = pred["step_s"]
        c.tree.predicted_speedup = pred["speedup"]
        c.tree.settings = dict(c.tree.settings, replayed_prediction={k: v for k, v in pred.items() if k != "method"})
        done += 1
    run.say(f"      predictions: {done} of {len(racing)} finalists replayed over {len(_teachers(run))} acceptance prompts x "
            f"{run.settings.decode_tokens} tokens ({time.perf_counter() - t0:.1f} s)")
    return sorted(racing, key=lambda c: -c.predicted_speedup)
