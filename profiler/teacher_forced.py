"""Acceptance on a known greedy continuation: one target decode per prompt, shared by every guesser.

`profiler.acceptance.measure_accuracy` decodes every prompt once per guesser, a target forward per
token. Here the target decodes each prompt once (with PPD's prompt tokens riding along the roots
when PPD is measured, so PPD's counts come from that same decode), and then:
- one teacher-forced target forward over prompt + continuation gives the logits and hidden states
  that the root-only steps gave at every position (up to float rounding);
- a draft LM: one teacher-forced drafter forward gives its top-k at every position. That is the
  comb the drafter proposes while its rank-0 chain is right, the only rows the conditional counts
  keep (profiler.acceptance.count_hits);
- any other guesser (prompt lookup, the ParallelSpec drafter in one pass or as a chain) replays
  its session over the continuation: it proposes its comb at every root and commits the
  root-only outcome of the teacher-forced forward, with no target forward per token.
The counts equal measure_accuracy's (tests/test_teacher_forced.py) at a fraction of the time, so
the same time buys a larger sample.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from decoder.drafter import teacher_forced
from decoder.engines.registry import as_engine
from decoder.guesser import DecodeContext, StepOutcome
from decoder.loop import generate
from decoder.verify import Sampling, Verdict
from profiler.acceptance import Measuring, accuracy_json, chain_plan, count_hits, guessing_record


@dataclass
class Continuations:
    """Each prompt [T] with the target's greedy continuation [N], and what the forward over both gave."""

    prompts: list[torch.Tensor]
    tokens: list[torch.Tensor]
    ppd: dict | None = None  # PPD's acceptance record when its prompt tokens rode along
    decode_s: float = 0.0


def _is_ppd(guesser) -> bool:
    return getattr(guesser, "input_embeddings", lambda: None)() is not None


@torch.inference_mode()
def greedy_continuations(model, prompts: list[torch.Tensor], max_new_tokens: int, ppd=None, depth: int | None = None,
                         eos_token_id=None, progress=None) -> Continuations:
    """Decode every prompt greedily once; with `ppd` (PromptTokens) its guesses ride along every
    root and its acceptance record comes back too. progress: called with (done, total) per prompt."""
    D = depth or (ppd.num_distances if ppd is not None else 1)
    plan = chain_plan(D) if ppd is not None else None
    runner = ppd if ppd is not None else _NoGuess()
    K = getattr(ppd, "top_k", 1)
    hits, totals = np.zeros((D, K), dtype=np.int64), np.zeros(D, dtype=np.int64)
    tokens = []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        out = generate(model, ids, plan=plan, guesser=runner, max_new_tokens=max_new_tokens, record_guesses=ppd is not None,
                       eos_token_id=eos_token_id, phase_times=False)
        tokens.append(out.tokens.cpu())
        if ppd is not None:
            made = [g for g in out.stats.guesses if g is not None]  # PPD's bootstrap step has none
            if made:
                h, t = count_hits(torch.stack(made), out.tokens[: len(made) + 1].cpu())
                hits += h
                totals += t
        if progress:
            progress(i + 1, len(prompts))
    record = None
    if ppd is not None:
        record = accuracy_json(hits, totals, sum(int(t.numel()) for t in tokens), len(prompts), model,
                               guessing_record(ppd, ppd, D), "profiler.teacher_forced (greedy decoding, PPD tokens on every root)")
    return Continuations([p.cpu() for p in prompts], tokens, record, time.perf_counter() - t0)


class _NoGuess:
    """Plain root-only steps (the continuation alone)."""

    needs_hidden = False

    def check(self, plan, label="plan"):
        pass

    def begin(self, target, plan, prompt_ids, ctx):
        from decoder.guesser import PlainGuesser

        return PlainGuesser().begin(target, plan, prompt_ids, ctx)


@torch.inference_mode()
def target_pass(target, prompt: torch.Tensor, tokens: torch.Tensor, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [L, V] and last hidden states [L, H] (after the final norm, as the decoder returns
    them) over prompt + continuation, L = T + N; target: an engine or a model."""
    return as_engine(target).teacher_forced(torch.cat([prompt, tokens]), hidden)


@torch.inference_mode()
def replay_guesses(target, guesser, prompt: torch.Tensor, tokens: torch.Tensor, depth: int, width: int,
                   runner: Measuring | None = None, steps: int | None = None) -> torch.Tensor:
    """The guesser's comb [G, depth, width] at every root of the known continuation (G = N, or
    `steps`), its session fed the root-only outcomes of one teacher-forced target forward."""
    engine = as_engine(target)
    runner = runner or Measuring(guesser, depth, width)
    T, N = prompt.numel(), tokens.numel()
    G = N if steps is None else min(N, steps)
    logits, hidden = target_pass(engine, prompt, tokens, guesser.needs_hidden)
    seq = torch.cat([prompt, tokens]).to(engine.device)
    ctx = DecodeContext(Sampling(0.0), torch.Generator().manual_seed(0), engine.dtype, engine.device, "acceptance",
                        None if hidden is None else hidden[: T - 1])
    session = runner.begin(engine, None, seq[:T], ctx)
    made = []
    for i in range(G):
        root = seq[T - 1 + i: T + i]  # [1]
        proposal = session.propose(root)
        made.append(proposal.guesses.cpu())
        if i == G - 1:
            break
        nxt = seq[T + i: T + i + 1]
        verdict = Verdict(path=torch.zeros(1, dtype=torch.long, device=engine.device), nodes=[0], emitted=[int(nxt)],
                          root=nxt)
        rows = slice(T - 1 + i, T + i)
        session.commit(StepOutcome(proposal, verdict, logits[rows], None if hidden is None else hidden[rows], T + i))
    return torch.stack(made)


@torch.inference_mode()
def draft_lm_guesses(drafter, prompt: torch.Tensor, tokens: torch.Tensor, depth: int, width: int,
                     device=None) -> torch.Tensor:
    """A drafter's comb [N, depth, width] from one teacher-forced drafter forward (decoder/drafter.py; a
    drafter that reads no target features): the guess for distance d beyond root i (position T-1+i) is
    the drafter's top-k after the true prefix up to position T-2+i+d, which is what it drafts there
    while its rank-0 chain is right. device: the drafter's (the target engine's)."""
    T, N = prompt.numel(), tokens.numel()
    logits = teacher_forced(drafter, torch.cat([prompt, tokens]).to(device or prompt.device))
    top = logits.float().topk(width, dim=-1).indices.cpu()  # [L, width]
    i = torch.arange(N)[:, None]
    d = torch.arange(1, depth + 1)[None, :]
    where = (T - 2 + i + d).clamp(max=T + N - 1)  # [N, depth]; rows past the end are never counted
    return top[where]


def replay_accuracy(model, guesser, cont: Continuations, depth: int, width: int, progress=None,
                    timing_steps: int = 12) -> dict:
    """A non-PPD guesser's acceptance record on the continuations (the counts measure_accuracy gives).
    The drafter's pass time comes from its own proposals: all of them when replayed, the first
    `timing_steps` of the first prompt for a draft LM (whose counts come from one forward)."""
    runner = Measuring(guesser, depth, width)
    drafter = getattr(guesser, "drafter", None)
    drafter = drafter if drafter is not None and not drafter.features else None  # feature readers replay
    hits, totals = np.zeros((depth, width), dtype=np.int64), np.zeros(depth, dtype=np.int64)
    positions = 0
    for i, (ids, toks) in enumerate(zip(cont.prompts, cont.tokens)):
        if toks.numel() == 0:
            continue
        if drafter is not None:
            if i == 0:
                replay_guesses(model, guesser, ids, toks, depth, width, runner, steps=timing_steps)
            g = draft_lm_guesses(drafter, ids, toks, depth, width, as_engine(model).device)
        else:
            g = replay_guesses(model, guesser, ids, toks, depth, width, runner)
        emitted = torch.cat([ids[-1:], toks])
        h, t = count_hits(g, emitted[: g.shape[0] + 1])
        hits += h
        totals += t
        positions += int(toks.numel())
        if progress:
            progress(i + 1, len(cont.prompts))
    how = "one teacher-forced drafter forward per prompt" if drafter is not None else "its session replayed"
    return accuracy_json(hits, totals, positions, len(cont.prompts), model, guessing_record(guesser, runner, depth),
                         f"profiler.teacher_forced (the target's greedy continuation; {how})")
