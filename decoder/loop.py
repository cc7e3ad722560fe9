"""The decoding loop: one loop for every guesser and every engine.

    out = generate(model, input_ids, plan="trees/x.json", guesser=guesser, max_new_tokens=128)
    out = generate(engine, input_ids, plan=plan, guesser=guesser)     # any decoder/engine.py engine

A step: the guesser's session proposes a tree (decoder/guesser.py), the engine scores it in one
forward pass (decoder/engine.py), a verification rule picks the accepted path (decoder/verify.py),
the engine keeps it in its cache and the session commits the outcome.
Loop invariant: the cache holds every token before the current root; the root (the target's own
last token) is not yet in it. `generate_plain` runs the same loop with root-only steps, so their
timings compare like with like. Batch size 1 (decoder/batch.py batches).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from decoder.config import DecodeConfig, decode_config
from decoder.engine import StepInput
from decoder.engines.registry import as_engine
from decoder.guesser import (
    DecodeContext,
    GuessSession,
    PlainGuesser,
    StepOutcome,
)
from decoder.noise import PositionNoise
from decoder.output import PHASES, DecodeStats, GenerateOutput, truncate
from decoder.verify import Sampling, verify
from planner.errors import UserError
from planner.plan_settings import plan_settings
from planner.tree import Tree, load_tree


def as_tree(plan) -> tuple[Tree | None, str]:
    if plan is None or isinstance(plan, Tree):
        return plan, "plan"
    return load_tree(plan), str(plan)


def generate(target, input_ids, plan=None, guesser=None, max_new_tokens: int | None = None, *,
             config: DecodeConfig | None = None, **options):
    """Decode with a plan (a tree file path or a loaded Tree; None for guessers that need none) and
    a guesser (PromptTokens, OracleGuesser, a draft model, ...; decoder/guesser.py), on a target:
    any decoder/engine.py engine, or a transformers model (the hf engine's).

    config: a DecodeConfig (decoder/config.py); options: its fields as keywords, and the sampling ones
    (temperature, top_k, top_p, verify_rule, eps, delta). verify_rule: auto (greedy at temperature 0,
    lossless sampling above), greedy, typical, lossless, coupled (plain sampling's own text with the
    same seed: decoder/noise.py). attention (engines with tree kernels): "auto" (the Triton tree
    kernels on CUDA when triton is installed, else a dense 4D mask through the model's own attention),
    "kernels" or "dense". input_ids: one prompt (1-D, or [1, T]) -> a GenerateOutput; a list of
    prompts of any lengths -> one GenerateOutput per prompt, in order, decoded together in layout
    "packed" (EMS-SD, no padding) or "padded" (the vanilla baseline); see decoder/batch.py.
    phase_times: split each step into PHASES (on a GPU five device syncs per step; pass False for
    deployment-speed timing: total_s stays exact). matmul_paths: a profile whose CPU matmul paths to
    install on the engine first (they stay installed); None leaves the engine as it is.
    """
    cfg = decode_config(config, **_with_length(options, max_new_tokens))
    engine = as_engine(target)
    _use_paths(engine, cfg.matmul_paths)
    tree, label = as_tree(plan)
    guesser = guesser if guesser is not None else PlainGuesser()
    if tree is not None and tree.dynamic is not None:  # a tree chosen every step (decoder/guessers/dynamic.py)
        from decoder.guessers.dynamic import DynamicGuesser

        if isinstance(input_ids, (list, tuple)):
            raise UserError(f"{label}: dynamic plans decode one prompt at a time")
        if not isinstance(guesser, DynamicGuesser):
            guesser = DynamicGuesser(guesser, tree)
    guesser.check(tree, label)
    if isinstance(input_ids, (list, tuple)):
        if cfg.sampling.rule == "coupled":
            raise UserError("verify_rule 'coupled': decodes one prompt at a time (its noise is keyed by each "
                            "sequence's token index); use lossless for batches")
        return _generate_batch(engine, input_ids, tree, guesser, cfg, label)
    _use_attention(engine, cfg.attention)
    return decode(engine, input_ids, tree, guesser, cfg, label=label)


def _generate_batch(engine, prompts, tree, guesser, cfg: DecodeConfig, label):
    from decoder.batch import decode_batch

    if not engine.caps.batches:
        raise UserError(f"--engine {engine.caps.name}: decodes one prompt at a time (no batched forward)")
    if tree is not None and tree.schedule:
        for entry in tree.schedule:
            if entry.tree is not None:
                guesser.check(entry.tree, label)
    ids = [_ids_1d(p, engine.device) for p in prompts]
    with torch.inference_mode():
        outs, stats = decode_batch(engine, ids, tree, guesser, cfg, _eos(engine, cfg.eos_token_id), label)
    for o in outs:
        o.batch = stats
    return outs


def generate_plain(target, input_ids, max_new_tokens: int | None = None, *, config: DecodeConfig | None = None,
                   **options) -> GenerateOutput:
    """One token per step through the same prefill, forward, verify and cache path as `generate`.
    verify_rule "coupled" draws with decoder/noise.py's position-keyed noise: then a plan decoded
    with the same seed and rule emits the same text."""
    cfg = decode_config(config, **_with_length(options, max_new_tokens))
    engine = as_engine(target)
    _use_paths(engine, cfg.matmul_paths)
    s = cfg.sampling
    mode = "coupled" if s.mode == "coupled" and s.temperature > 0 else "auto"  # one token a step: every other rule is a draw
    return decode(engine, input_ids, None, PlainGuesser(), replace(cfg, sampling=replace(s, mode=mode)))


def _with_length(options: dict, max_new_tokens: int | None) -> dict:
    return options if max_new_tokens is None else dict(options, max_new_tokens=max_new_tokens)


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
def decode(target, input_ids, plan: Tree | None, guesser, cfg: DecodeConfig, label: str = "plan") -> GenerateOutput:
    """The loop behind `generate` and `generate_plain` (arguments already checked)."""
    engine = as_engine(target)
    ids = _ids_1d(input_ids, engine.device)
    eos = _eos(engine, cfg.eos_token_id)
    clock = _Clock(engine.device, cfg.phase_times)
    stats = DecodeStats(guesses=[] if cfg.record_guesses else None)
    gen = torch.Generator().manual_seed(cfg.seed)
    t_start = time.perf_counter()
    pad_to = plan_settings(plan.settings, label).pad_to if plan is not None else None
    engine.reserve(ids.numel() + cfg.max_new_tokens + _step_bound(plan))
    seq, prompt_hidden = engine.start(ids, hidden=guesser.needs_hidden, pad_to=pad_to)
    noise = PositionNoise(cfg.seed) if cfg.sampling.rule == "coupled" else None
    ctx = DecodeContext(cfg.sampling, gen, engine.dtype, engine.device, label, prompt_hidden, noise)
    session = guesser.begin(engine, plan, ids, ctx)
    engine.check_room(seq, cfg.max_new_tokens, session.max_input_length)
    clock.sync()
    stats.prefill_s = time.perf_counter() - t_start
    new: list[int] = []
    bar = _progress_bar(cfg.max_new_tokens) if cfg.progress else None
    while len(new) < cfg.max_new_tokens:
        if noise is not None:
            noise.cursor = ids.numel() + len(new)  # the index of the token this step emits first
        out, kept, stop = _step(seq, session, cfg.sampling, gen, clock, eos, cfg.max_new_tokens - len(new),
                                guesser.needs_hidden, noise)
        new.extend(kept)
        _record(stats, out, clock, cfg.record_guesses, len(kept))
        if bar is not None:
            bar.update(len(kept))
        if stop:
            break
    if bar is not None:
        bar.close()
    if hasattr(session, "report"):  # a dynamic plan's sizes chosen and online corrections
        stats.dynamic = session.report()
    clock.final_sync()
    stats.total_s = time.perf_counter() - t_start
    return GenerateOutput(tokens=torch.tensor(new, dtype=torch.long), steps=len(stats.states), stats=stats)


def _step_bound(plan: Tree | None) -> int:
    """An upper bound on a step's input before the session exists (engines with a fixed context size it
    from this; check_room then checks the session's own)."""
    if plan is None:
        return 16  # a guesser's own chain without a plan
    if plan.dynamic is not None:
        return len(plan.dynamic.step_cost_s) + 1
    return plan.max_input_length + 1


def _step(seq, session: GuessSession, sampling: Sampling, gen, clock: "_Clock", eos: set[int],
          room: int, want_hidden: bool, noise=None) -> tuple[StepOutcome, list[int], bool]:
    """One step: propose, score, verify, commit. Returns the outcome, the tokens kept (EOS and
    max_new_tokens cut the accepted path) and whether decoding stops."""
    clock.start()
    proposal = session.propose(seq.root)
    lay = proposal.layout
    tree_ids = torch.cat([seq.root, proposal.tokens]) if lay.num_tree > 1 else seq.root  # [num_tree]
    step = StepInput(tree_ids, lay, proposal.extra_embeds, want_hidden)
    clock.lap("prepare")
    logits, hidden = seq.score(step)  # [n, V], [n, hidden] | None
    clock.lap("forward")
    tree_logits = logits[: lay.num_tree]
    if proposal.rule is not None:
        verdict = proposal.rule(tree_logits, tree_ids, sampling, gen)
    else:
        verdict = verify(tree_logits, tree_ids, lay, sampling, gen, proposal.draft_probs, proposal.deterministic, noise)
    clock.lap("verify")
    seq.commit(verdict)
    clock.lap("cache")
    outcome = StepOutcome(proposal, verdict, logits, hidden, seq.context_length)
    kept, stop = truncate(verdict.emitted, eos, room)
    if not stop:  # the last step's commit would only prepare guesses nobody reads
        session.commit(outcome)
    clock.lap("guess")
    return outcome, kept, stop


def _record(stats: DecodeStats, out: StepOutcome, clock: "_Clock", record_guesses: bool, kept: int) -> None:
    lay = out.proposal.layout
    stats.states.append(lay.state)
    stats.accepted.append(len(out.verdict.nodes) - 1)
    stats.emitted.append(kept)
    stats.input_lengths.append(lay.input_length)
    stats.planned_input_lengths.append(lay.planned_input_length)
    clock.record(stats.times)
    if record_guesses:
        g = out.proposal.guesses
        stats.guesses.append(None if g is None else g.cpu())


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


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", leave=False)


def decode_plain(target, input_ids, config: DecodeConfig | None = None, **options) -> GenerateOutput:
    """Plain decoding the fastest way the engine has it, for a plain decision (choosing plain never costs
    speed): its library's own generation where that is its fastest (caps.stock_plain), else this loop.
    The library must sample the distribution this loop samples: coupled sampling's draws are the loop's
    own, and a library that cuts top-p before applying the temperature (llama.cpp) warps differently
    from transformers' order unless one of the two is off; there it runs the loop."""
    cfg = decode_config(config, **options)
    engine = as_engine(target)
    s = cfg.sampling
    same_law = s.rule != "coupled" and (s.temperature <= 0 or s.top_p >= 1.0 or s.temperature == 1.0)
    if not engine.caps.stock_plain or not same_law:
        return generate_plain(engine, input_ids, config=cfg)
    ids = _ids_1d(input_ids, engine.device)
    tokens, seconds = engine.stock_generate(ids, cfg.max_new_tokens, cfg.sampling, cfg.seed)
    n = len(tokens)  # one token a step; the library does not split its time into phases
    stats = DecodeStats(states=[0] * n, accepted=[0] * n, emitted=[1] * n, input_lengths=[1] * n,
                        planned_input_lengths=[1] * n, total_s=seconds)
    return GenerateOutput(tokens=torch.tensor(tokens, dtype=torch.long), steps=n, stats=stats)
