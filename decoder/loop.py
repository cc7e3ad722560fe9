"""The decoding loop: one `generate` for every plan, strategy and engine.

    out = generate(engine, ids)                                           # plain decoding, the engine's fastest way
    out = generate(engine, ids, "trees/x.json", guesser, max_new_tokens=128)   # a plan's tree and its guesser
    out = generate(engine, ids, Pearl(drafter, gamma=4), config=cfg)      # a strategy: PEARL's rounds
    outs = generate(engine, [ids_a, ids_b], plan, guesser)                # a batch (decoder/batch.py)

The loop owns what every way of decoding shares: the prompt, the end of the sequence (EOS and
max_new_tokens), the clock (prefill and total), the progress bar and batching. How one step runs is
the plan's strategy (`Strategy`, below):

  Steps(tree, guesser)    propose, score, verify, commit: the guesser's session proposes a tree
                          (decoder/guesser.py), the engine scores it in one forward pass
                          (decoder/engine.py), a verification rule picks the accepted path
                          (decoder/verify.py), the engine keeps it and the session commits the outcome.
                          Every guesser runs so, plain decoding (root-only steps) and MTAD (whose
                          proposals carry their own rule) included.
  Stock()                 the engine's library's own generation (caps.stock_plain), one call.
  Pearl(drafter, gamma)   PEARL's rounds: the drafter drafts while the target verifies
                          (decoder/guessers/pearl.py).

Plain decoding is a plan with no guesser: the engine's fastest plain way, Stock where the engine says
its library's generation is that and samples the loop's law, else root-only Steps. A guesser given
as PlainGuesser() always runs the Steps, so that plain timings compare like with like with a plan's.
Steps invariant: the engine's cache holds every token before the current root; the root (the
target's own last token) is not yet in it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from decoder.config import DecodeConfig, decode_config
from decoder.engine import StepInput
from decoder.engines.registry import as_engine
from decoder.guesser import DecodeContext, GuessSession, PlainGuesser, StepOutcome
from decoder.noise import PositionNoise
from decoder.output import PHASES, DecodeStats, GenerateOutput, truncate
from decoder.verify import verify
from planner.errors import UserError
from planner.plan_settings import plan_settings
from planner.tree import Tree, load_tree


class Run(Protocol):
    """One sequence being decoded by a strategy; the loop drives it step by step."""

    stats: object  # the strategy's records (DecodeStats, PearlStats): the loop sets prefill_s and total_s
    steps: int  # target forwards after the prefill so far
    ended: bool  # the strategy ended the sequence itself (a library's own generation)

    def step(self) -> list[int]:
        """One step; the tokens it decided, before EOS and max_new_tokens cut them."""
        ...

    def settle(self, kept: list[int], stop: bool) -> None:
        """The tokens the loop kept of the step's; stop: it was the last step."""
        ...

    def close(self) -> None:
        """After the last step (and on errors): final syncs, threads and workers given back."""
        ...


class Strategy(Protocol):
    """How a plan decodes, step by step (see the module docstring)."""

    label: str
    batches: bool  # decodes several prompts together (decoder/batch.py)

    def start(self, engine, ids: torch.Tensor, cfg: DecodeConfig) -> Run:
        """Prefill the prompt [T] (every token but the last, which becomes the first root)."""
        ...


def as_tree(plan) -> tuple[Tree | None, str]:
    if plan is None or isinstance(plan, Tree):
        return plan, "plan"
    return load_tree(plan), str(plan)


def generate(target, input_ids, plan=None, guesser=None, max_new_tokens: int | None = None, *,
             config: DecodeConfig | None = None, **options):
    """Decode `input_ids` on `target` (any decoder/engine.py engine, or a transformers model: the hf engine's).

    plan: None (plain decoding, or a guesser's own chain), a tree file path or a loaded Tree (decoded
    by `guesser`: PromptTokens, a draft model, ...; decoder/guesser.py), or a Strategy (Steps, Stock,
    decoder.guessers.pearl.Pearl). config: a DecodeConfig (decoder/config.py); options: its fields as
    keywords, and the sampling ones (temperature, top_k, top_p, verify_rule, eps, delta). verify_rule:
    auto (greedy at temperature 0, lossless sampling above), greedy, typical, lossless, coupled (plain
    sampling's own text with the same seed: decoder/noise.py). attention (engines with tree kernels):
    "auto" (the Triton tree kernels on CUDA when triton is installed, else a dense 4D mask), "kernels"
    or "dense". input_ids: one prompt (1-D, or [1, T]) -> a GenerateOutput; a list of prompts of any
    lengths -> one GenerateOutput per prompt, in order, decoded together in layout "packed" (EMS-SD,
    no padding) or "padded" (the vanilla baseline); see decoder/batch.py. phase_times: split each step
    into PHASES (on a GPU five device syncs per step; pass False for deployment-speed timing: total_s
    stays exact). matmul_paths: a profile whose CPU matmul paths to install on the engine first (they
    stay installed); None leaves the engine as it is.
    """
    cfg = decode_config(config, **(options if max_new_tokens is None else dict(options, max_new_tokens=max_new_tokens)))
    engine = as_engine(target)
    return decode(engine, input_ids, resolve(engine, plan, guesser, cfg, isinstance(input_ids, (list, tuple))), cfg)


def decode(target, input_ids, strategy: Strategy, cfg: DecodeConfig):
    """The loop behind `generate`, with the strategy already resolved (`resolve`: what `generate` does with its
    plan and guesser; decoder/api.py's load_plan and `planner decode` resolve it once for many prompts)."""
    engine = as_engine(target)
    _use_paths(engine, cfg.matmul_paths)
    if isinstance(input_ids, (list, tuple)):
        return _decode_batch(engine, input_ids, strategy, cfg)
    _use_attention(engine, cfg.attention)
    return _decode_one(engine, _ids_1d(input_ids, engine.device), strategy, cfg)


def resolve(engine, plan, guesser, cfg: DecodeConfig, batch: bool = False) -> Strategy:
    """The strategy `generate` runs for these arguments (see its docstring)."""
    if hasattr(plan, "start"):
        if guesser is not None:
            raise UserError(f"{plan.label}: a strategy brings its own drafter; pass no guesser beside it")
        return plan
    tree, label = as_tree(plan)
    if guesser is None and tree is None:
        return plain(engine, cfg, batch)
    guesser = guesser if guesser is not None else PlainGuesser()
    if tree is not None and tree.dynamic is not None:  # a tree chosen every step (decoder/guessers/dynamic.py)
        from decoder.guessers.dynamic import DynamicGuesser

        if batch:
            raise UserError(f"{label}: dynamic plans decode one prompt at a time")
        if not isinstance(guesser, DynamicGuesser):
            guesser = DynamicGuesser(guesser, tree)
    guesser.check(tree, label)
    return Steps(tree, guesser, label)


def plain(engine, cfg: DecodeConfig, batch: bool = False) -> Strategy:
    """Plain decoding the fastest way the engine has it (choosing plain never costs speed): its library's
    own generation where that is its fastest (caps.stock_plain), else root-only Steps. The library must
    sample the law the loop samples: coupled sampling's draws are the loop's own, and a library that cuts
    top-p before applying the temperature (llama.cpp) warps differently from transformers' order unless
    one of the two is off; there the Steps run."""
    s = cfg.sampling
    same_law = s.rule != "coupled" and (s.temperature <= 0 or s.top_p >= 1.0 or s.temperature == 1.0)
    if engine.caps.stock_plain and same_law and not batch:
        return Stock()
    return Steps(None, PlainGuesser(), "plain decoding")


def _decode_batch(engine, prompts, strategy: Strategy, cfg: DecodeConfig):
    from decoder.batch import decode_batch

    if not strategy.batches:
        raise UserError(f"{strategy.label}: decodes one prompt at a time")
    if not engine.caps.batches:
        raise UserError(f"--engine {engine.caps.name}: decodes one prompt at a time (no batched forward)")
    if cfg.sampling.rule == "coupled":
        raise UserError("verify_rule 'coupled': decodes one prompt at a time (its noise is keyed by each "
                        "sequence's token index); use lossless for batches")
    tree, guesser = strategy.tree, strategy.guesser
    if tree is not None and tree.schedule:
        for entry in tree.schedule:
            if entry.tree is not None:
                guesser.check(entry.tree, strategy.label)
    ids = [_ids_1d(p, engine.device) for p in prompts]
    with torch.inference_mode():
        outs, stats = decode_batch(engine, ids, tree, guesser, cfg, _eos(engine, cfg.eos_token_id), strategy.label)
    for o in outs:
        o.batch = stats
    return outs


def _use_paths(engine, matmul_paths) -> None:
    if matmul_paths is not None:
        if not engine.caps.matmul_paths:
            raise UserError(f"matmul_paths: the {engine.caps.name} engine has its own kernels (no CPU matmul paths)")
        engine.use_matmul_paths(matmul_paths)


def _use_attention(engine, attention: str) -> None:
    """The tree kernels are an option of engines that have them; the others score with their own attention."""
    if engine.caps.tree_kernels:
        engine.select_attention(attention)
    elif attention == "kernels":
        raise UserError(f"attention='kernels': the {engine.caps.name} engine has its own attention")


def _eos(engine, eos_token_id) -> set[int]:
    if eos_token_id is None:
        return engine.eos_ids()
    if eos_token_id is False:
        return set()
    return {int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)}


def _ids_1d(input_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise UserError(f"input_ids: batch size {ids.shape[0]}, the decoder runs batch size 1")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise UserError("input_ids: expected a non-empty 1-D token sequence (or [1, T])")
    return ids.to(device=device, dtype=torch.long)


@torch.inference_mode()
def _decode_one(engine, ids: torch.Tensor, strategy: Strategy, cfg: DecodeConfig) -> GenerateOutput:
    """One prompt [T]: start, step until EOS or max_new_tokens, close."""
    eos = _eos(engine, cfg.eos_token_id)
    t_start = time.perf_counter()
    run = strategy.start(engine, ids, cfg)
    new: list[int] = []
    bar = _progress_bar(cfg.max_new_tokens) if cfg.progress else None
    try:
        run.stats.prefill_s = time.perf_counter() - t_start
        while len(new) < cfg.max_new_tokens:
            kept, stop = truncate(run.step(), eos, cfg.max_new_tokens - len(new))
            run.settle(kept, stop)
            new.extend(kept)
            if bar is not None:
                bar.update(len(kept))
            if stop or run.ended:
                break
    finally:
        run.close()
        if bar is not None:
            bar.close()
    run.stats.total_s = time.perf_counter() - t_start
    return GenerateOutput(tokens=torch.tensor(new, dtype=torch.long), steps=run.steps, stats=run.stats)


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", leave=False)


# ---------------------------------------------------------------------------------------------- Steps


@dataclass
class Steps:
    """Propose, score, verify, commit, one step at a time, with any guesser (PlainGuesser: plain decoding)."""

    tree: Tree | None
    guesser: object
    label: str = "plan"
    batches = True

    def start(self, engine, ids: torch.Tensor, cfg: DecodeConfig) -> "StepsRun":
        if isinstance(self.guesser, PlainGuesser):  # one token a step: every rule but coupled is a draw
            s = cfg.sampling
            cfg = replace(cfg, sampling=replace(s, mode="coupled" if s.mode == "coupled" and s.temperature > 0 else "auto"))
        return StepsRun(engine, ids, self, cfg)


def _step_bound(plan: Tree | None) -> int:
    """An upper bound on a step's input before the session exists (engines with a fixed context size it
    from this; check_room then checks the session's own)."""
    if plan is None:
        return 16  # a guesser's own chain without a plan
    if plan.dynamic is not None:
        return len(plan.dynamic.step_cost_s) + 1
    return plan.max_input_length + 1


class StepsRun:
    def __init__(self, engine, ids: torch.Tensor, steps: Steps, cfg: DecodeConfig):
        self.sampling, self.record_guesses = cfg.sampling, cfg.record_guesses
        self.want_hidden = steps.guesser.needs_hidden
        self.clock = _Clock(engine.device, cfg.phase_times)
        self.stats = DecodeStats(guesses=[] if cfg.record_guesses else None)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        pad_to = plan_settings(steps.tree.settings, steps.label).pad_to if steps.tree is not None else None
        engine.reserve(ids.numel() + cfg.max_new_tokens + _step_bound(steps.tree))
        self.seq, prompt_hidden = engine.start(ids, hidden=self.want_hidden, pad_to=pad_to)
        self.noise = PositionNoise(cfg.seed) if self.sampling.rule == "coupled" else None
        self.cursor = ids.numel()  # the index of the token the next step emits first
        ctx = DecodeContext(self.sampling, self.gen, engine.dtype, engine.device, steps.label, prompt_hidden, self.noise)
        self.session: GuessSession = steps.guesser.begin(engine, steps.tree, ids, ctx)
        engine.check_room(self.seq, cfg.max_new_tokens, self.session.max_input_length)
        self.outcome: StepOutcome | None = None
        self.ended = False
        self.clock.sync()

    @property
    def steps(self) -> int:
        return len(self.stats.states)

    def step(self) -> list[int]:
        """Propose, score, verify and keep the accepted path in the engine's cache: the emitted tokens."""
        clock, seq = self.clock, self.seq
        if self.noise is not None:
            self.noise.cursor = self.cursor
        clock.start()
        proposal = self.session.propose(seq.root)
        lay = proposal.layout
        tree_ids = torch.cat([seq.root, proposal.tokens]) if lay.num_tree > 1 else seq.root  # [num_tree]
        step = StepInput(tree_ids, lay, proposal.extra_embeds, self.want_hidden)
        clock.lap("prepare")
        logits, hidden = seq.score(step)  # [n, V], [n, F] | None
        clock.lap("forward")
        tree_logits = logits[: lay.num_tree]
        if proposal.rule is not None:
            verdict = proposal.rule(tree_logits, tree_ids, self.sampling, self.gen)
        else:
            verdict = verify(tree_logits, tree_ids, lay, self.sampling, self.gen, proposal.draft_probs,
                             proposal.deterministic, self.noise)
        clock.lap("verify")
        seq.commit(verdict)
        clock.lap("cache")
        self.outcome = StepOutcome(proposal, verdict, logits, hidden, seq.context_length)
        return verdict.emitted

    def settle(self, kept: list[int], stop: bool) -> None:
        out = self.outcome
        if not stop:  # the last step's commit would only prepare guesses nobody reads
            self.session.commit(out)
        self.clock.lap("guess")
        self.cursor += len(kept)
        lay, stats = out.proposal.layout, self.stats
        stats.states.append(lay.state)
        stats.accepted.append(len(out.verdict.nodes) - 1)
        stats.emitted.append(len(kept))
        stats.input_lengths.append(lay.input_length)
        stats.planned_input_lengths.append(lay.planned_input_length)
        self.clock.record(stats.times)
        if self.record_guesses:
            g = out.proposal.guesses
            stats.guesses.append(None if g is None else g.cpu())

    def close(self) -> None:
        if hasattr(self.session, "report"):  # a dynamic plan's sizes chosen and online corrections
            self.stats.dynamic = self.session.report()
        self.clock.final_sync()


class _Clock:
    """Phase timer. On a GPU each lap is a device sync, so with phase_times=False only the total is
    exact there (the CPU is synchronous: phases are always kept)."""

    def __init__(self, device: torch.device, phase_times: bool):
        self.cuda = device.type == "cuda"
        self.enabled = phase_times or not self.cuda
        self.sync = torch.cuda.synchronize if self.cuda and phase_times else (lambda: None)
        self.laps: dict[str, float] = {}

    def start(self) -> None:
        self.t = time.perf_counter()
        self.laps = {}

    def lap(self, name: str) -> None:
        if name != "verify":  # verification reads the device itself (one copy), so it ends synchronised
            self.sync()
        now = time.perf_counter()
        self.laps[name] = now - self.t
        self.t = now

    def record(self, times: dict[str, list[float]]) -> None:
        if self.enabled:
            for name in PHASES:
                times[name].append(self.laps.get(name, 0.0))

    def final_sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # the last compaction may still be queued


# ---------------------------------------------------------------------------------------------- Stock


class Stock:
    """The engine's library's own generation (transformers' generate, llama.cpp's), in one call: a plain
    decision where the engine says that is its fastest plain decoding (caps.stock_plain)."""

    label = "plain decoding (the engine's own generation)"
    batches = False

    def start(self, engine, ids: torch.Tensor, cfg: DecodeConfig) -> "StockRun":
        return StockRun(engine, ids, cfg)


class StockRun:
    def __init__(self, engine, ids: torch.Tensor, cfg: DecodeConfig):
        self.engine, self.ids, self.cfg = engine, ids, cfg
        self.stats = DecodeStats()
        self.ended = False

    @property
    def steps(self) -> int:
        return len(self.stats.states)

    def step(self) -> list[int]:
        cfg = self.cfg
        tokens, _ = self.engine.stock_generate(self.ids, cfg.max_new_tokens, cfg.sampling, cfg.seed)
        self.ended = True  # the library ends the sequence itself (its EOS, max_new_tokens)
        return tokens

    def settle(self, kept: list[int], stop: bool) -> None:
        n = len(kept)  # one token a step; the library does not split its time into phases
        s = self.stats
        s.states, s.accepted, s.emitted, s.input_lengths, s.planned_input_lengths = [0] * n, [0] * n, [1] * n, [1] * n, [1] * n

    def close(self) -> None:
        pass
