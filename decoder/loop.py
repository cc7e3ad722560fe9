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

import torch

from decoder.engine import StepInput
from decoder.guesser import (
    DecodeContext,
    GuessSession,
    PlainGuesser,
    StepOutcome,
)
from decoder.engines.hf.engine import as_engine, model_eos_ids
from decoder.output import PHASES, DecodeStats, GenerateOutput, truncate
from decoder.noise import PositionNoise
from decoder.verify import Sampling, verify
from planner.errors import UserError
from planner.plan_settings import plan_settings
from planner.tree import Tree, load_tree


def as_tree(plan) -> tuple[Tree | None, str]:
    if plan is None or isinstance(plan, Tree):
        return plan, "plan"
    return load_tree(plan), str(plan)


def generate(target, input_ids, plan, guesser, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, verify_rule: str = "auto", eps: float = 0.09, delta: float = 0.3,
             eos_token_id=None, seed: int = 0, record_guesses: bool = False, progress: bool = False,
             attention: str = "auto", phase_times: bool = True, layout: str = "packed", matmul_paths=None):
    """Decode with a plan (a tree file path or a loaded Tree; None for guessers that need none) and
    a guesser (PromptTokens, OracleGuesser, a draft model, ...; decoder/guesser.py), on a target:
    a transformers model (wrapped in decoder.engines.hf.engine.HFEngine) or any decoder/engine.py engine.

    verify_rule: auto (greedy at temperature 0, lossless sampling above), greedy, typical, lossless,
    coupled (plain sampling's own text with the same seed: decoder/noise.py).
    attention (transformers models): "auto" (the Triton tree kernels on CUDA when triton is
    installed, else a dense 4D mask through the model's own attention), "kernels" or "dense".
    Enabling the kernels switches the model to the "tree_triton" attention implementation, which
    keeps using SDPA for every call that is not a tree step.
    input_ids: one prompt (1-D, or [1, T]) -> a GenerateOutput; a list of prompts of any lengths ->
    one GenerateOutput per prompt, in order, decoded together in `layout` "packed" (EMS-SD, no
    padding) or "padded" (the vanilla baseline); see decoder/batch.py.
    phase_times: split each step into PHASES. On a GPU that costs five device syncs per step, which
    stall the launch queue; pass False for deployment-speed timing (total_s stays exact, the
    phase lists stay empty on CUDA; on the CPU, where work is synchronous, they are always kept).
    matmul_paths: a profile file (or decoder.engines.hf.cpu_paths table) whose "matmul_paths" to install on
    the model's Linears first (decoder/engines/hf/cpu_paths.py; stays installed); None leaves the model as it is.
    """
    engine = as_engine(target)
    _use_paths(engine, matmul_paths)
    tree, label = as_tree(plan)
    if tree is not None and tree.dynamic is not None:  # a tree chosen every step (decoder/guessers/dynamic.py)
        from decoder.guessers.dynamic import DynamicGuesser

        if isinstance(input_ids, (list, tuple)):
            raise UserError(f"{label}: dynamic plans decode one prompt at a time")
        if not isinstance(guesser, DynamicGuesser):
            guesser = DynamicGuesser(guesser, tree)
    guesser.check(tree, label)
    sampling = Sampling(temperature, top_k, top_p, verify_rule, eps, delta)
    if isinstance(input_ids, (list, tuple)):
        if sampling.rule == "coupled":
            raise UserError("verify_rule 'coupled': decodes one prompt at a time (its noise is keyed by each "
                            "sequence's token index); use lossless for batches")
        return _generate_batch(engine, input_ids, tree, guesser, max_new_tokens, sampling, eos_token_id, seed, layout,
                               label)
    if engine.caps.name == "hf":
        select_attention(engine.model, attention)
    return decode(engine, input_ids, tree, guesser, max_new_tokens, sampling, eos_token_id=eos_token_id, seed=seed,
                  record_guesses=record_guesses, progress=progress, phase_times=phase_times, label=label)


def _generate_batch(engine, prompts, tree, guesser, max_new_tokens, sampling, eos_token_id, seed, layout, label):
    from decoder.batch import decode_batch

    if not engine.caps.batches:
        raise UserError(f"--engine {engine.caps.name}: decodes one prompt at a time (no batched forward)")
    if tree is not None and tree.schedule:
        for entry in tree.schedule:
            if entry.tree is not None:
                guesser.check(entry.tree, label)
    ids = [_ids_1d(p, engine.device) for p in prompts]
    with torch.inference_mode():
        outs, stats = decode_batch(engine, ids, tree, guesser, max_new_tokens, sampling,
                                   _eos(engine, eos_token_id), seed, layout, label)
    for o in outs:
        o.batch = stats
    return outs


def generate_plain(target, input_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, eos_token_id=None, seed: int = 0, progress: bool = False,
                   phase_times: bool = True, matmul_paths=None, verify_rule: str = "auto") -> GenerateOutput:
    """One token per step through the same prefill, forward, verify and cache path as `generate`.
    verify_rule "coupled" draws with decoder/noise.py's position-keyed noise: then a plan decoded
    with the same seed and rule emits the same text."""
    engine = as_engine(target)
    _use_paths(engine, matmul_paths)
    rule = "coupled" if verify_rule == "coupled" and temperature > 0 else "auto"  # one token a step: every other rule is a draw
    return decode(engine, input_ids, None, PlainGuesser(), max_new_tokens, Sampling(temperature, top_k, top_p, rule),
                  eos_token_id=eos_token_id, seed=seed, progress=progress, phase_times=phase_times)


def _use_paths(engine, matmul_paths) -> None:
    if matmul_paths is not None:
        if engine.caps.name != "hf":
            raise UserError(f"matmul_paths: the CPU matmul paths are the hf engine's; the {engine.caps.name} engine "
                            "has its own kernels")
        from decoder.engines.hf.cpu_paths import use_profile_paths

        use_profile_paths(engine.model, matmul_paths)


def _eos(engine, eos_token_id) -> set[int]:
    if eos_token_id is None:
        return engine.eos_ids()
    return model_eos_ids(None, eos_token_id)


def select_attention(model, attention: str) -> None:
    if attention not in ("auto", "kernels", "dense"):
        raise UserError(f"attention: expected auto, kernels or dense, got {attention!r}")
    if attention == "dense":
        return
    if attention == "auto":
        if model.get_input_embeddings().weight.device.type != "cuda":
            return
        try:
            import triton  # noqa: F401
        except ImportError:
            return
    from decoder.engines.hf.attention import (
        enable_tree_attention,
        unsupported_reason,
        uses_tree_attention,
    )

    reason = unsupported_reason(model)
    if reason:
        if attention == "auto":
            return  # the dense mask serves every model the decoder supports
        raise UserError(f"attention='kernels': {reason}; use attention='dense'")
    if not uses_tree_attention(model):
        enable_tree_attention(model)


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
def decode(target, input_ids, plan: Tree | None, guesser, max_new_tokens: int, sampling: Sampling, *, eos_token_id=None,
           seed: int = 0, record_guesses: bool = False, progress: bool = False, phase_times: bool = True,
           label: str = "plan") -> GenerateOutput:
    """The loop behind `generate` and `generate_plain` (arguments already checked)."""
    engine = as_engine(target)
    ids = _ids_1d(input_ids, engine.device)
    eos = _eos(engine, eos_token_id)
    clock = _Clock(engine.device, phase_times)
    stats = DecodeStats(guesses=[] if record_guesses else None)
    gen = torch.Generator().manual_seed(seed)
    t_start = time.perf_counter()
    pad_to = plan_settings(plan.settings, label).pad_to if plan is not None else None
    seq, prompt_hidden = engine.start(ids, hidden=guesser.needs_hidden, pad_to=pad_to)
    noise = PositionNoise(seed) if sampling.rule == "coupled" else None
    ctx = DecodeContext(sampling, gen, engine.dtype, engine.device, label, prompt_hidden, noise)
    session = guesser.begin(engine, plan, ids, ctx)
    engine.check_room(seq, max_new_tokens, session.max_input_length)
    clock.sync()
    stats.prefill_s = time.perf_counter() - t_start
    new: list[int] = []
    bar = _progress_bar(max_new_tokens) if progress else None
    while len(new) < max_new_tokens:
        if noise is not None:
            noise.cursor = ids.numel() + len(new)  # the index of the token this step emits first
        out, kept, stop = _step(seq, session, sampling, gen, clock, eos, max_new_tokens - len(new), guesser.needs_hidden,
                                noise)
        new.extend(kept)
        _record(stats, out, clock, record_guesses, len(kept))
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
