"""Calibration of a guesser's live signal (planner/dynamic.py): decode prompts greedily with plain
steps while the guesser's dynamic source builds its full candidate pool every step; afterwards
every pool node whose path up to its parent matches the text is an observation: accepted iff its
token is the text's. Fitted per depth bin, monotone in the signal; the reliability table is
cross-fitted (each half of the prompts scored by the map fitted on the other half).
"""
from __future__ import annotations

import numpy as np
import torch

from decoder.guesser import DecodeContext, Proposal, StepOutcome
from decoder.guessers.dynamic import DynamicGuesser, DynamicSession, guesser_kind
from decoder.guessers.pool import Pool
from decoder.layout import layout_for
from decoder.loop import generate
from decoder.verify import Sampling, Verdict
from planner.dynamic import GuesserModel, dynamic_spec, fit_calibration, reliability
from planner.errors import UserError
from planner.guessers import kind as registered_kind
from planner.tree import DYNAMIC, Tree, TreeState


class _Recording(DynamicGuesser):
    def begin(self, model, plan, prompt_ids, ctx):
        inner = super().begin(model, plan, prompt_ids, ctx)
        inner.__class__ = _RecordingSession
        inner.records = []
        return inner


class _RecordingSession(DynamicSession):
    """Builds the whole pool (every level pays on a flat cost), proposes nothing: plain steps."""

    def worth_level(self, pool, best_new, draft_s):
        return len(pool.tokens) < self.spec.max_size * 4

    def propose(self, root):
        pool = Pool()
        for s in self.sources:
            s.extend(pool, root, self)
        self.records.append((list(pool.tokens), list(pool.parent), list(pool.depth), [c[0][2] for c in pool.cells]))
        self.pool, self.chosen = pool, []
        lay = self._layout((), 1)  # PPD's prompt tokens ride along the plain step: their logits are its next pool
        extra = next((e for e in (s.extra_embeds(lay) for s in self.sources) if e is not None), None)
        return Proposal(lay, root.new_empty(0), extra_embeds=extra)


def _plan(kind: str, prior: np.ndarray, max_depth: int) -> Tree:
    spec = dynamic_spec({kind: GuesserModel(kind, prior)}, 16, None, max_depth)
    return Tree(DYNAMIC, [TreeState(0, [], 1.0, 1)], 1.0, dynamic=spec)


def observations(records, text: list[int], probs: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(depth, signal bin, accepted, step) of every pool node whose parent's path matches `text`
    (the new tokens; step i's depth-d node guesses text[i + d - 1]). Under sampling, probs [N, V]
    (the warped p that drew each token of text): a deterministic guess x is accepted with p(x),
    its expected hit, and its path matches exactly when the lossless rule accepted it."""
    out = []
    for i, (tokens, parent, depth, sig) in enumerate(records):
        ok = {}
        for j, (tok, par, d) in enumerate(zip(tokens, parent, depth)):
            if i + d - 1 >= len(text) or (par >= 0 and not ok.get(par, False)):
                continue
            ok[j] = tok == text[i + d - 1]
            out.append((d, sig[j], float(ok[j]) if probs is None else float(probs[i + d - 1, tok]), i))
    a = np.array(out, dtype=np.float64).reshape(-1, 4)
    return a[:, 0].astype(np.int64), a[:, 1].astype(np.int64), a[:, 2], a[:, 3].astype(np.int64)


def _drew(model, ids: torch.Tensor, tokens: torch.Tensor, sampling) -> torch.Tensor:
    """[N, V]: the warped p that drew each new token (one teacher-forced pass)."""
    from decoder.engines.registry import as_engine
    from decoder.verify import probabilities

    T = ids.numel()
    with torch.inference_mode():
        logits = as_engine(model).teacher_forced(torch.cat([ids.cpu(), tokens.cpu()])).logits
    return probabilities(logits[T - 1: T - 1 + tokens.numel()], sampling).cpu()


def measure_calibration(model, guesser, prompts: list[torch.Tensor], prior: np.ndarray, max_new_tokens: int = 64,
                        max_depth: int = 8, progress: bool = False, sampling=None, seed: int = 0) -> dict:
    """The calibration JSON (planner.dynamic.Calibration.to_json) of `guesser` on `prompts`.
    sampling (a decoder.verify.Sampling above temperature 0): the text is sampled (prompt i with
    seed + i) and each observation is its guess's acceptance under those settings, p(x)."""
    from tqdm import tqdm

    kind = guesser_kind(guesser)
    sampled = sampling is not None and sampling.rule != "greedy"
    if sampled and registered_kind(kind).samples:
        raise UserError(f"--calibrate: the {kind} guesser samples its children under --temperature, and a sampled "
                        "child's place in the tree cannot follow its own draw; its per-step plans use the sampled "
                        "acceptance rows (planner accept --temperature ...) corrected online")
    warp = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p} if sampled else {}
    plan = _plan(kind, prior, max_depth)
    per_prompt = []
    for ids in tqdm(prompts, desc="calibrate", unit="prompt", disable=not progress):
        rec = _Recording(guesser, plan)
        sess = {}
        orig = rec.begin

        def begin(*a, **k):
            sess["s"] = orig(*a, **k)
            return sess["s"]

        rec.begin = begin
        out = generate(model, ids, plan=plan, guesser=rec, max_new_tokens=max_new_tokens, seed=seed + len(per_prompt),
                       **warp)
        probs = _drew(model, ids, out.tokens, sampling) if sampled else None
        per_prompt.append(observations(sess["s"].records, out.tokens.tolist(), probs))
    return _calibration_doc(kind, per_prompt, len(prompts), max_new_tokens, sampling if sampled else None)


def replay_calibration(guesser, prompts: list[torch.Tensor], continuations: list[torch.Tensor], prior: np.ndarray,
                       max_depth: int = 8, probs: list[torch.Tensor] | None = None, sampling=None) -> dict:
    """measure_calibration without the target, for guessers whose pools read only the text (prompt lookup):
    the session is fed each known continuation's tokens as its roots, so one shared decode serves
    acceptance and calibration alike. A sampled continuation comes with probs (per prompt [N, V], the
    warped p that drew each token, profiler.sampled.SampledContinuations) and its sampling settings:
    each observation is then its guess's p(x), as measure_calibration scores it when decoding sampled."""
    kind = guesser_kind(guesser)
    spec = registered_kind(kind)
    if spec.needs_torch or spec.needs_hidden or spec.needs_embeddings:
        raise UserError(f"calibration replay: the {kind} guesser's pool reads the target; measure it by decoding")
    plan = _plan(kind, prior, max_depth)
    per_prompt = []
    ctx = DecodeContext(Sampling(0.0), torch.Generator().manual_seed(0), torch.float32, torch.device("cpu"), "calibration")
    if (probs is None) != (sampling is None):
        raise UserError("calibration replay: a sampled continuation needs both its probabilities and its settings")
    for ids, toks, drew in zip(prompts, continuations, probs or [None] * len(prompts)):
        session = _Recording(guesser, plan).begin(None, plan, ids, ctx)
        text = toks.tolist()
        roots = [int(ids[-1])] + text
        for i in range(len(text)):
            session.propose(torch.tensor(roots[i: i + 1]))
            verdict = Verdict(torch.zeros(1, dtype=torch.long), [0], [roots[i + 1]], torch.tensor(roots[i + 1: i + 2]))
            session.commit(StepOutcome(Proposal(layout_for((), 1, torch.float32, "cpu"), torch.empty(0, dtype=torch.long)),
                                       verdict, torch.empty(0), None, 0))
        per_prompt.append(observations(session.records, text, drew))
    return _calibration_doc(kind, per_prompt, len(prompts), max(len(t) for t in continuations) if continuations else 0,
                            sampling)


def _calibration_doc(kind: str, per_prompt: list, n_prompts: int, max_new_tokens: int, sampling=None) -> dict:
    """Fit the map on every prompt's observations, with a 2-fold cross-fitted reliability table."""
    if not per_prompt or sum(len(o[0]) for o in per_prompt) == 0:
        raise UserError("calibration: no candidate was ever observed (too few tokens decoded?)")
    signal = registered_kind(kind).signal

    def cat(parts, k):
        return np.concatenate([p[k] for p in parts]) if parts else np.zeros(0)

    halves = [per_prompt[0::2], per_prompt[1::2]]
    rel = []
    if all(halves):
        for fit_on, score_on in ((halves[0], halves[1]), (halves[1], halves[0])):
            cal = fit_calibration(signal, cat(fit_on, 0), cat(fit_on, 1), cat(fit_on, 2))
            rel.extend(reliability(cal, cat(score_on, 0), cat(score_on, 1), cat(score_on, 2)))
    merged: dict[tuple, dict] = {}
    for r in rel:  # the two folds' rows of one cell, pooled
        m = merged.setdefault((r["depth_bin"], r["bin"]), {"depth_bin": r["depth_bin"], "bin": r["bin"], "n": 0,
                                                           "predicted": 0.0, "realised": 0.0})
        m["predicted"] += r["predicted"] * r["n"]
        m["realised"] += r["realised"] * r["n"]
        m["n"] += r["n"]
    for m in merged.values():
        m["predicted"] /= m["n"]
        m["realised"] /= m["n"]
    cal = fit_calibration(signal, cat(per_prompt, 0), cat(per_prompt, 1), cat(per_prompt, 2))
    doc = cal.to_json()
    doc.update({"reliability": sorted(merged.values(), key=lambda r: (r["depth_bin"], r["bin"])),
                "reliability_method": "2-fold cross-fit over prompts (each half scored by the map fitted on the other)",
                "prompts": n_prompts, "observations": int(sum(len(o[0]) for o in per_prompt)),
                "guesser": kind, "max_new_tokens": max_new_tokens})
    if sampling is not None:
        from planner.sampling import record

        doc["sampling"] = record(sampling)
    return doc
