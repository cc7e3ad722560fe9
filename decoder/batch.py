"""Batched decoding: several sequences per forward pass, each accepting its own number of tokens.

    outs = generate(model, [ids_a, ids_b, ids_c], plan="trees/x.json", guesser=pt, layout="packed")

Two layouts (EMS-SD; docs/seed-systems.md, section 'EMS-SD'):

- packed (EMS-SD, no padding anywhere): one row. The cache is the concatenation of the live
  sequences' contexts [ctx_0 | ctx_1 | ...]; a step feeds the concatenation of their step inputs
  (sum n_i tokens), each at its own positions, with a mask that lets a token see its own
  sequence's context and its own tree ancestors only. After verification one gather keeps every
  sequence's context plus its accepted path (and drops finished sequences): no slot is ever
  padded. Attention over the packed cache is computed per sequence (`packed_attention`, a
  registered transformers attention function), so a token costs its own context, not the batch's.
- padded (the vanilla baseline): b rows. Inputs are padded to the longest step input; every
  row's cache advances by the batch's longest accepted path (tau_max), the rows that accepted
  fewer keep masked holes. Padding is counted: padded input tokens and cache holes per step.

Each sequence keeps its own guesser session (decoder/guesser.py), sampling generator and stats;
the tree comes from the plan's batch-size schedule (planner.tree.Tree.for_batch) for the number of
live sequences, re-chosen when a sequence leaves; a session that cannot switch trees keeps its own.
A sequence that ends (EOS, max_new_tokens) leaves the batch without stalling the others.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from decoder.config import DecodeConfig
from decoder.guesser import DecodeContext, StepOutcome
from decoder.output import DecodeStats, GenerateOutput, truncate
from decoder.verify import Sampling, verify
from planner.errors import UserError

LAYOUTS = ("packed", "padded")


@dataclass
class BatchStats:
    """What a batched run did as a whole (per-sequence stats live in each GenerateOutput)."""

    layout: str
    steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # live sequences per step
    input_tokens: list[int] = field(default_factory=list)  # tokens fed per step (padding included)
    padded_inputs: list[int] = field(default_factory=list)  # padding tokens among them
    cache_holes: list[int] = field(default_factory=list)  # padded: masked cache slots added per step
    total_s: float = 0.0

    def summary(self) -> dict:
        fed = sum(self.input_tokens)
        return {"layout": self.layout, "steps": self.steps, "input_tokens": fed,
                "padded_input_tokens": sum(self.padded_inputs), "cache_holes": sum(self.cache_holes),
                "input_padding_ratio": sum(self.padded_inputs) / fed if fed else 0.0, "total_s": self.total_s}


@dataclass
class _Seq:
    """One sequence of the batch: its session, its context length, its root and what it emitted."""

    index: int
    session: object
    context_length: int
    root: torch.Tensor  # [1]
    generator: torch.Generator
    stats: DecodeStats
    new: list[int] = field(default_factory=list)
    done: bool = False


def _trees(plan, batch_size: int):
    return plan.for_batch(batch_size) if plan is not None and hasattr(plan, "for_batch") else plan


def _start(engine, prompts, plan, guesser, sampling, seed, label):
    """Each prompt prefilled on its own (the engine's sequences) and its guesser session begun."""
    seqs, started = [], []
    tree = _trees(plan, len(prompts))
    for i, ids in enumerate(prompts):
        gen = torch.Generator().manual_seed(seed + i)
        seq, hidden = engine.start(ids, hidden=guesser.needs_hidden)
        started.append(seq)
        ctx = DecodeContext(sampling, gen, engine.dtype, engine.device, label, hidden)
        seqs.append(_Seq(i, guesser.begin(engine, tree, ids, ctx), ids.numel() - 1, ids[-1:], gen, DecodeStats()))
    return seqs, started


def decode_batch(engine, prompts: list[torch.Tensor], plan, guesser, cfg: DecodeConfig, eos: set[int],
                 label: str = "plan"):
    """Returns (one GenerateOutput per prompt, in order; BatchStats). cfg: decoder/config.py's DecodeConfig."""
    max_new_tokens, sampling, seed, layout = cfg.max_new_tokens, cfg.sampling, cfg.seed, cfg.layout
    if layout not in LAYOUTS:
        raise UserError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    if not prompts:
        raise UserError("input_ids: an empty batch")
    t0 = time.perf_counter()
    seqs, started = _start(engine, prompts, plan, guesser, sampling, seed, label)
    runner = engine.batch_runner(layout, seqs, started, guesser.needs_hidden)
    try:
        return _run(runner, seqs, plan, max_new_tokens, sampling, eos, layout, t0)
    finally:
        runner.close()


def _run(runner, seqs, plan, max_new_tokens, sampling, eos, layout, t0):
    stats = BatchStats(layout)
    live = list(seqs)
    current = _trees(plan, len(live))
    while live:
        tree = _trees(plan, len(live))
        if tree is not current:
            for s in live:
                if hasattr(s.session, "switch"):
                    s.session.switch(tree)
            current = tree
        _step(runner, live, sampling, eos, max_new_tokens, stats)
        finished = [s for s in live if s.done]
        if finished:
            runner.drop(finished)
            live = [s for s in live if not s.done]
    stats.total_s = time.perf_counter() - t0
    for s in seqs:
        s.stats.total_s = stats.total_s
    return [GenerateOutput(torch.tensor(s.new, dtype=torch.long), len(s.stats.states), s.stats) for s in seqs], stats


def _step(runner, live: list[_Seq], sampling: Sampling, eos: set[int], max_new_tokens: int, stats: BatchStats) -> None:
    proposals = [s.session.propose(s.root) for s in live]
    logits, hidden = runner.forward(live, proposals, stats)  # per sequence [n_i, V], [n_i, H] or None
    verdicts = []
    for s, p, lg in zip(live, proposals, logits):
        if p.rule is not None:  # a rule of its own (MTAD's joint acceptance) keeps per-run state: one prompt a time
            raise UserError("a guesser whose proposals carry their own verification rule (MTAD) decodes one prompt "
                            "at a time")
        tree_ids = torch.cat([s.root, p.tokens])
        verdicts.append(verify(lg[: p.layout.num_tree], tree_ids, p.layout, sampling, s.generator, p.draft_probs,
                               p.deterministic))
    runner.commit(live, proposals, verdicts, stats)
    stats.steps += 1
    stats.batch_sizes.append(len(live))
    for s, p, v, lg, h in zip(live, proposals, verdicts, logits, hidden):
        s.context_length += len(v.nodes)
        s.root = v.root
        kept, stop = truncate(v.emitted, eos, max_new_tokens - len(s.new))
        s.new.extend(kept)
        s.stats.states.append(p.layout.state)
        s.stats.accepted.append(len(v.nodes) - 1)
        s.stats.emitted.append(len(kept))
        s.stats.input_lengths.append(p.layout.input_length)
        s.stats.planned_input_lengths.append(p.layout.planned_input_length)
        if stop:
            s.done = True
        else:
            s.session.commit(StepOutcome(p, v, lg, h, s.context_length))
