"""Acceptance under sampling, from the target's own sampled continuation and one teacher-forced pass.

Under temperature, top-k and top-p the lossless rules accept (docs/sampling.md):
- a deterministic guess x (prompt lookup, PPD prompt tokens, the ParallelSpec drafter's top-k)
  with the target's warped probability p(x); rank r of a node's fixed guesses with p(x_r), since
  each rejection zeroes its token and renormalises;
- a sampled draft (the draft LM) with sum_x min(p(x), q(x)) for the first child, q the drafter's
  own warped distribution, and the sibling procedure's share for the later ones.

So no decode per guesser is needed. The target samples each prompt's continuation once (with
PPD's prompt tokens riding along the roots when PPD is measured, as in profiler.teacher_forced);
one teacher-forced target forward gives the warped p at every position, and then:
- a deterministic guesser replays its session along the continuation (profiler.teacher_forced's
  replay) and scores each guess with p instead of a 0/1 hit. A point-mass guess is accepted
  exactly when the emitted token is that guess, and the emitted token follows p, so the text's
  own tokens decide whether the rank-0 path to a distance is alive (`soft_counts`);
- a draft LM's teacher-forced pass gives q at every position: position j's first child is
  accepted with a_j = sum min(p_j, q_j) and later siblings with the sibling procedure's Monte
  Carlo share; distance d from root i weighs position i+d-1 by the probability that the chain
  survived to it, a_i ... a_{i+d-2} (`draft_rows`), the drafter reading the text's tokens where
  its accepted draws would stand.
The records have the greedy records' format (planner/accept.py) plus "sampling": the settings
they hold for. tests/test_sampled_acceptance.py checks them against real sampled decoding.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from decoder.drafter import teacher_forced
from decoder.engines.registry import as_engine
from decoder.guesser import PlainGuesser
from decoder.loop import generate
from decoder.verify import Sampling, probabilities, residual, without
from planner.errors import UserError
from planner.sampling import LOSSLESS, record
from profiler.acceptance import Measuring, accuracy_json, chain_plan, guessing_record
from profiler.teacher_forced import Continuations, replay_guesses

sampling_record = record  # the settings a record was measured under (what plans and `planner decode` compare)


@dataclass
class SampledContinuations(Continuations):
    """Continuations sampled by the target, with the warped p [N, V] that drew each new token."""

    probs: list[torch.Tensor] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    seed: int = 0  # prompt i was sampled with seed + i (under the coupled rule: its noise, decoder/noise.py)


@torch.inference_mode()
def sampled_continuations(target, prompts: list[torch.Tensor], max_new_tokens: int, s: Sampling, seed: int = 0,
                          ppd=None, eos_token_id=None, progress=None) -> SampledContinuations:
    """Sample every prompt's continuation once (prompt i with seed + i); with `ppd` (PromptTokens)
    its guesses ride along every root and its acceptance record comes back too."""
    if s.rule not in LOSSLESS:
        raise UserError(f"sampled acceptance: needs temperature > 0 and an exact rule (lossless, coupled), got {s}")
    engine = as_engine(target)
    D = ppd.num_distances if ppd is not None else 1
    plan = chain_plan(D) if ppd is not None else None
    K = getattr(ppd, "top_k", 1)
    hits, totals = np.zeros((D, K)), np.zeros(D, dtype=np.int64)
    tokens, probs = [], []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        if ppd is not None:
            out = generate(engine, ids, plan=plan, guesser=ppd, max_new_tokens=max_new_tokens, record_guesses=True,
                           eos_token_id=eos_token_id, phase_times=False, temperature=s.temperature, top_k=s.top_k,
                           top_p=s.top_p, seed=seed + i, verify_rule=s.mode)
        else:  # plain sampling through the same loop (root-only steps)
            out = generate(engine, ids, None, PlainGuesser(), max_new_tokens=max_new_tokens, temperature=s.temperature,
                           top_k=s.top_k, top_p=s.top_p, seed=seed + i, eos_token_id=eos_token_id, phase_times=False,
                           verify_rule=s.mode)
        toks = out.tokens.cpu()
        T = ids.numel()
        logits = engine.teacher_forced(torch.cat([ids.cpu(), toks]).to(engine.device)).logits
        p = probabilities(logits[T - 1: T - 1 + toks.numel()], s).cpu()  # [N, V]: what drew each new token
        tokens.append(toks)
        probs.append(p)
        if ppd is not None:
            made = [g for g in out.stats.guesses if g is not None]  # PPD's bootstrap step has none
            if made:
                h, t = soft_counts(torch.stack(made), toks[: len(made) + 1], p[: len(made) + 1])
                hits += h
                totals += t
        if progress:
            progress(i + 1, len(prompts))
    record = None
    if ppd is not None:
        record = accuracy_json(hits, totals, sum(int(t.numel()) for t in tokens), len(prompts), engine,
                               guessing_record(ppd, ppd, D), "profiler.sampled (sampled decoding, PPD tokens on every root)")
        record["sampling"] = sampling_record(s)
    return SampledContinuations([p.cpu() for p in prompts], tokens, record, time.perf_counter() - t0, probs, s, seed)


def soft_counts(guesses: torch.Tensor, emitted: torch.Tensor, probs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """guesses [G, D, K]: row i guesses distances 1..D beyond emitted[i]; emitted [S]; probs [S, V]:
    row j the warped p that drew emitted[j] (row 0 unused when emitted[0] is the prompt's last
    token). Returns expected hits [D, K] (float) and totals [D], conditional as
    profiler.acceptance.count_hits: a row counts at distance d while its rank-0 guesses at 1..d-1
    equal the text (exactly the event that the lossless rule accepted them), and scores rank r
    there with p(guess), its probability of acceptance."""
    _, D, K = guesses.shape
    S = emitted.numel()
    hits = np.zeros((D, K))
    totals = np.zeros(D, dtype=np.int64)
    alive = torch.ones(max(S - 1, 0), dtype=torch.bool)
    for d in range(1, min(D, S - 1) + 1):
        rows = S - d
        g = guesses[:rows, d - 1, :]  # [rows, K]
        pv = probs[d: d + rows].gather(1, g.clamp(min=0)).double() * (g >= 0)  # [rows, K]
        keep = alive[:rows]
        hits[d - 1] += pv[keep].sum(0).numpy()
        totals[d - 1] += int(keep.sum())
        alive = alive[:rows] & (g[:, 0] == emitted[d:])
    return hits, totals


def replay_sampled_accuracy(target, guesser, cont: SampledContinuations, depth: int, width: int, progress=None) -> dict:
    """A deterministic guesser's acceptance record under cont.sampling: its session replayed along
    each sampled continuation, each guess scored with the target's warped p."""
    runner = Measuring(guesser, depth, width)
    hits, totals = np.zeros((depth, width)), np.zeros(depth, dtype=np.int64)
    positions = 0
    for i, (ids, toks, p) in enumerate(zip(cont.prompts, cont.tokens, cont.probs)):
        if toks.numel() == 0:
            continue
        g = replay_guesses(target, guesser, ids, toks, depth, width, runner)
        emitted = torch.cat([ids[-1:], toks])
        aligned = torch.cat([torch.zeros(1, p.shape[1]), p])  # row j: what drew emitted[j]
        h, t = soft_counts(g, emitted[: g.shape[0] + 1], aligned[: g.shape[0] + 1])
        hits += h
        totals += t
        positions += int(toks.numel())
        if progress:
            progress(i + 1, len(cont.prompts))
    rec = accuracy_json(hits, totals, positions, len(cont.prompts), target, guessing_record(guesser, runner, depth),
                        "profiler.sampled (the target's sampled continuation; its session replayed, guesses scored with p)")
    rec["sampling"] = sampling_record(cont.sampling)
    return rec


def sibling_shares(p: torch.Tensor, q: torch.Tensor, width: int, samples: int, generator) -> np.ndarray:
    """[width]: P(the r-th sampled child is the one accepted) at one position, children drawn from q
    without replacement and verified by decoder.verify's rule. Rank 0 exactly (sum min(p, q)), the
    later ranks by `samples` Monte Carlo runs of the sibling procedure on the union of the supports
    (a few hundred tokens under top-p, not the vocabulary). A q whose support is spent has no more
    children (a static tree fills them with deterministic guesses, not counted here)."""
    from decoder.verify import draw

    out = np.zeros(width)
    out[0] = float(torch.minimum(p, q).sum())
    if width == 1 or samples == 0:
        return out
    keep = (p > 0) | (q > 0)
    p, q = p[keep].double(), q[keep].double()
    for _ in range(samples):
        pp, qq = p, q
        for r in range(width):
            if float(qq.sum()) <= 0:
                break
            x = draw(qq, generator)
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(qq[x]) < float(pp[x]):
                if r:
                    out[r] += 1.0 / samples
                break
            pp, qq = residual(pp, qq), without(qq, x)
    return out


def coupled_shares(p: torch.Tensor, q: torch.Tensor, width: int, samples: int, generator) -> np.ndarray:
    """[width]: P(the rank-r child is the target's draw) under coupled sampling (decoder/noise.py) at one
    position: the children are the Gumbel top-width of log q + g and the draw is argmax log p + g, one
    g for both (decoder.noise.noisy_top_k), estimated over `samples` draws of g (at least one)."""
    from decoder.noise import noisy_top_k, standard_gumbel

    n = max(samples, 1)
    g = standard_gumbel((n, p.numel()), generator)  # [n, V]
    y = (torch.log(p.float())[None] + g).argmax(-1)  # [n] the target's draws
    top = noisy_top_k(q.float()[None].expand(n, -1), g, width)  # [n, width] the aimed children
    out = np.zeros(width)
    out[: top.shape[1]] = (top == y[:, None]).double().mean(0).numpy()
    return out


def draft_rows(shares: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """shares [N, K] (position j, rank r) -> (expected hits [depth, K], weights [depth]): distance d
    from root i reads position i+d-1, weighted by the chance the rank-0 chain survived to it,
    prod of shares[i .. i+d-2, 0]."""
    N, K = shares.shape
    hits, weights = np.zeros((depth, K)), np.zeros(depth)
    w = np.ones(N)  # survival weight of root i at the current distance
    for d in range(1, min(depth, N) + 1):
        rows = N - d + 1
        w = w[:rows]
        hits[d - 1] = (w[:, None] * shares[d - 1: d - 1 + rows]).sum(0)
        weights[d - 1] = w.sum()
        w = w[: rows - 1] * shares[d - 1: d - 1 + rows - 1, 0] if rows > 1 else w[:0]
    return hits, weights


@torch.inference_mode()
def draft_sampled_accuracy(target, guesser, cont: SampledContinuations, depth: int, width: int, samples: int = 16,
                           seed: int = 0, timing_steps: int = 12, progress=None) -> dict:
    """A draft LM's acceptance record under cont.sampling: its own warped q along each continuation
    (one teacher-forced drafter forward per prompt), the first child's exact acceptance and the
    later siblings' Monte Carlo shares, distances weighted by the chain's survival (`draft_rows`).
    Under the coupled rule the children are aimed at the noise instead (`coupled_shares`, Monte Carlo
    for every rank), what a coupled decode proposes."""
    s = cont.sampling
    drafter, device = guesser.drafter, as_engine(target).device  # its teacher-forced pass (decoder/drafter.py)
    gen = torch.Generator().manual_seed(seed)
    runner = Measuring(guesser, depth, width)
    if cont.prompts and cont.tokens[0].numel():  # the drafter's pass time, from its own proposals
        replay_guesses(target, guesser, cont.prompts[0], cont.tokens[0], depth, width, runner, steps=timing_steps)
    hits, weights = np.zeros((depth, width)), np.zeros(depth)
    positions, first = 0, []
    for i, (ids, toks, p) in enumerate(zip(cont.prompts, cont.tokens, cont.probs)):
        N, T = toks.numel(), ids.numel()
        if N == 0:
            continue
        logits = teacher_forced(drafter, torch.cat([ids, toks]).to(device))[T - 1: T - 1 + N]
        q = probabilities(logits, s).cpu()  # [N, V] the drafter's warped q where the text's tokens stand
        if s.rule == "coupled":  # the children decoding will propose: aimed at the noise, not drawn
            shares = np.stack([coupled_shares(p[j], q[j], width, samples, gen) for j in range(N)])
        else:
            shares = np.stack([sibling_shares(p[j].double(), q[j].double(), width, samples, gen) for j in range(N)])
        h, w = draft_rows(shares, depth)
        hits += h
        weights += w
        first.extend(shares[:, 0].tolist())
        positions += N
        if progress:
            progress(i + 1, len(cont.prompts))
    totals = np.round(weights).astype(np.int64)  # the record's totals: effective rows (accuracy uses the weights)
    rec = accuracy_json(hits, np.maximum(totals, (weights > 0).astype(np.int64)), positions, len(cont.prompts), target,
                        guessing_record(guesser, runner, depth),
                        "profiler.sampled (the target's sampled continuation; the drafter's warped q, "
                        + ("its Gumbel top-k against the draw with the same noise (coupled)" if s.rule == "coupled"
                           else "sum min(p, q) and the sibling procedure")
                        + ", weighted by the chain's survival)")
    rec["accuracy"] = np.divide(hits, weights[:, None], out=np.zeros(hits.shape), where=weights[:, None] > 0).tolist()
    rec["sampling"] = sampling_record(s)
    rec["first_child_mean"] = float(np.mean(first)) if first else 0.0
    rec["sibling_samples"] = samples
    return rec
