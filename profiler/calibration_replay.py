"""Calibration without decoding: profiler/calibration.py's recording session (the guesser's full
pool every step, plain steps) replayed over the shared greedy continuations (profiler/replay.py),
for every guesser: the same observations `measure_calibration` collects by decoding
(tests/test_replay.py), from the decode the acceptance phase runs anyway.

    doc = calibrate_by_replay(engine, guesser, teachers, prior)     # planner.dynamic calibration JSON

What each guesser costs here: lookup and PPD nothing but bookkeeping (PPD's pools come from the
capture on the shared decode), the draft LM one teacher-forced forward per prompt (`TeacherDraft`),
the ParallelSpec drafter one real pass per position, the chain drafter a real pass per level. A
drafter's next level is drafted only while the pool's deepest level has a node on the text's path:
deeper nodes could never be observations (an observation's parent path matches the text), so the
observations are those of the full pool at a fraction of the passes.
"""
from __future__ import annotations

import numpy as np

from decoder.guessers.dynamic import DynamicGuesser, guesser_kind
from planner.errors import UserError
from planner.guessers import kind as registered_kind
from profiler.calibration import _calibration_doc, _plan, _RecordingSession, observations
from profiler.replay import Cursor, Teacher, context, replay, use_teacher_drafts


class _TextRecordingSession(_RecordingSession):
    """The recording session, told the text it will be replayed over."""

    text: list[int]

    def worth_level(self, pool, best_new, draft_s):
        if not super().worth_level(pool, best_new, draft_s):
            return False
        if not pool.tokens:
            return True
        pos, deepest = len(self.records), max(pool.depth)  # records: one per step so far (plain steps)
        on: list[bool] = []
        for tok, par, d in zip(pool.tokens, pool.parent, pool.depth):
            i = pos + d - 1
            on.append(i < len(self.text) and tok == self.text[i] and (par < 0 or on[par]))
        return any(o and d == deepest for o, d in zip(on, pool.depth))


def calibrate_by_replay(engine, guesser, teachers: list[Teacher], prior: np.ndarray, max_depth: int = 8,
                        sampling=None) -> dict:
    """The calibration JSON (planner.dynamic.Calibration.to_json) of `guesser` on the teachers'
    continuations, as profiler.calibration.measure_calibration measures it by decoding. Sampled
    teachers (their p rows kept, `sampling` their settings): each observation is its guess's p(x),
    the lossless rule's acceptance of a deterministic guess, and the path to it stands exactly when
    the rule accepted its parent (profiler.calibration.observations). Coupled teachers (decoder/noise.py)
    replay with the text's noise, every guesser's guesses aimed as decoding aims them (a draft LM's
    too), and each observation is a hit or a miss on the text, as greedily."""
    kind = guesser_kind(guesser)
    sampled = any(t.probs is not None for t in teachers)
    if sampled != (sampling is not None):
        raise UserError("calibration replay: sampled continuations need their settings, greedy ones none")
    coupled = sampling is not None and sampling.rule == "coupled"
    if coupled and any(t.coupled is None for t in teachers if t.tokens.numel()):
        raise UserError("calibration replay: coupled settings need continuations drawn coupled, with their noise seeds")
    if sampled and registered_kind(kind).samples and not coupled:
        raise UserError(f"calibration replay: the {kind} guesser samples its children under sampling, and a sampled "
                        "child's place in the pool cannot follow the text's draw; its per-step plans keep the sampled "
                        "acceptance rows, corrected online")
    plan = _plan(kind, prior, max_depth)
    per_prompt, longest = [], 0
    for t in teachers:
        if t.tokens.numel() == 0:
            continue
        ctx = context(engine, t, guesser.needs_hidden, "calibration")
        if registered_kind(kind).needs_embeddings and t.ppd is None:
            raise UserError(f"calibration replay: {kind}'s pools come from its prompt tokens riding the shared decode "
                            "(profiler.replay.PPDCapture); none were captured")
        session = DynamicGuesser(guesser, plan).begin(engine, plan, t.prompt.to(ctx.device), ctx)
        session.__class__ = _TextRecordingSession
        session.records, session.text = [], t.tokens.tolist()
        cursor = Cursor()
        use_teacher_drafts(session, t, cursor)  # the draft LM's passes: its teacher-forced logits
        replay(session, t, ctx, None, cursor)
        # coupled: the text's token is the draw the guesses aimed at, so each is a hit or a miss, as greedily
        # (a p-scored observation would take an aimed guess for a fixed one)
        per_prompt.append(observations(session.records, session.text, None if coupled else t.probs))
        longest = max(longest, t.tokens.numel())
    return _calibration_doc(kind, per_prompt, len(per_prompt), longest, sampling)
