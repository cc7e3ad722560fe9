"""The decoding loop: one loop for every guesser.

    out = generate(model, input_ids, plan="trees/x.json", guesser=guesser, max_new_tokens=128)

A step: the guesser's session proposes a tree (decoder/guesser.py), the target scores it in one
forward pass (`_score`), a verification rule picks the accepted path (decoder/verify.py), the
target cache keeps it (decoder/cache.py) and the session commits the outcome.
Loop invariant: the cache holds every token before the current root; the root (the target's own
last token) is not yet in it. `generate_plain` runs the same loop with root-only steps, so their
timings compare like with like. Batch size 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from decoder.cache import compact_cache
from decoder.forward import prefill, step_mask, tree_forward
from decoder.guesser import (
    DecodeContext,
    GuessSession,
    PlainGuesser,
    Proposal,
    StepOutcome,
)
from decoder.output import PHASES, DecodeStats, GenerateOutput, truncate
from decoder.verify import Sampling, Verdict, verify
from planner.errors import UserError
from planner.tree import Tree, load_tree


@dataclass
class _Target:
    """The target's side of the loop: its cache, the context length C and the current root."""

    model: object
    cache: object
    context_length: int
    root: torch.Tensor  # [1] long, on the device
    kernel_path: bool  # attention through the tree kernels: trees go in as parents, no dense mask
    want_hidden: bool
    pad_to: dict = field(default_factory=dict)  # {n: m}: run n-token steps at m tokens (planner.profile._padded)


def _eos_set(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None or eos_token_id is False:
        return set()
    return {int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)}


def as_tree(plan) -> tuple[Tree | None, str]:
    if plan is None or isinstance(plan, Tree):
        return plan, "plan"
    return load_tree(plan), str(plan)


def generate(model, input_ids, plan, guesser, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, verify_rule: str = "auto", eps: float = 0.09, delta: float = 0.3,
             eos_token_id=None, seed: int = 0, record_guesses: bool = False, progress: bool = False,
             attention: str = "auto", phase_times: bool = True, layout: str = "packed", matmul_paths=None):
    """Decode with a plan (a tree file path or a loaded Tree; None for guessers that need none) and
    a guesser (PromptTokens, OracleGuesser, a draft model, ...; decoder/guesser.py).

    verify_rule: auto (greedy at temperature 0, lossless sampling above), greedy, typical, lossless.
    attention: "auto" (the Triton tree kernels on CUDA when triton is installed, else a dense
    4D mask through the model's own attention), "kernels" or "dense". Enabling the kernels
    switches the model to the "tree_triton" attention implementation, which keeps using SDPA for
    every call that is not a tree step.
    input_ids: one prompt (1-D, or [1, T]) -> a GenerateOutput; a list of prompts of any lengths ->
    one GenerateOutput per prompt, in order, decoded together in `layout` "packed" (EMS-SD, no
    padding) or "padded" (the vanilla baseline); see decoder/batch.py.
    phase_times: split each step into PHASES. On a GPU that costs five device syncs per step, which
    stall the launch queue; pass False for deployment-speed timing (total_s stays exact, the
    phase lists stay empty on CUDA; on the CPU, where work is synchronous, they are always kept).
    matmul_paths: a profile file (or decoder.cpu_paths table) whose "matmul_paths" to install on
    the model's Linears first (decoder/cpu_paths.py; stays installed); None leaves the model as it is.
    """
    _use_paths(model, matmul_paths)
    tree, label = as_tree(plan)
    if tree is not None and tree.dynamic is not None:  # a tree chosen every step (decoder/dynamic.py)
        from decoder.dynamic import DynamicGuesser

        if isinstance(input_ids, (list, tuple)):
            raise UserError(f"{label}: dynamic plans decode one prompt at a time")
        if not isinstance(guesser, DynamicGuesser):
            guesser = DynamicGuesser(guesser, tree)
    guesser.check(tree, label)
    sampling = Sampling(temperature, top_k, top_p, verify_rule, eps, delta)
    if isinstance(input_ids, (list, tuple)):
        return _generate_batch(model, input_ids, tree, guesser, max_new_tokens, sampling, eos_token_id, seed, layout, label)
    select_attention(model, attention)
    return decode(model, input_ids, tree, guesser, max_new_tokens, sampling, eos_token_id=eos_token_id, seed=seed,
                  record_guesses=record_guesses, progress=progress, phase_times=phase_times, label=label)


def _generate_batch(model, prompts, tree, guesser, max_new_tokens, sampling, eos_token_id, seed, layout, label):
    from decoder.batch import decode_batch

    if tree is not None and tree.schedule:
        for entry in tree.schedule:
            if entry.tree is not None:
                guesser.check(entry.tree, label)
    device = model.get_input_embeddings().weight.device
    ids = [_ids_1d(p, device) for p in prompts]
    with torch.inference_mode():
        outs, stats = decode_batch(model, ids, tree, guesser, max_new_tokens, sampling, _eos_set(model, eos_token_id),
                                   seed, layout, label)
    for o in outs:
        o.batch = stats
    return outs


def generate_plain(model, input_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, eos_token_id=None, seed: int = 0, progress: bool = False,
                   phase_times: bool = True, matmul_paths=None) -> GenerateOutput:
    """One token per step through the same prefill, forward, verify and cache path as `generate`."""
    _use_paths(model, matmul_paths)
    return decode(model, input_ids, None, PlainGuesser(), max_new_tokens, Sampling(temperature, top_k, top_p),
                  eos_token_id=eos_token_id, seed=seed, progress=progress, phase_times=phase_times)


def _use_paths(model, matmul_paths) -> None:
    if matmul_paths is not None:
        from decoder.cpu_paths import use_profile_paths

        use_profile_paths(model, matmul_paths)


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
    from decoder.attention import (
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


def _start_target(model, ids: torch.Tensor, want_hidden: bool) -> tuple[_Target, torch.Tensor | None]:
    """Prefill all prompt tokens but the last, which is the first root; returns the prompt's hidden
    states [T-1, hidden] too when a guesser reads them."""
    from transformers import DynamicCache

    hidden = None
    if ids.numel() > 1:
        out = prefill(model, ids[None, :-1], hidden=want_hidden)
        cache = out.cache
        hidden = None if out.hidden is None else out.hidden[0]
    else:
        cache = DynamicCache(config=model.config)
    kernel_path = getattr(model.config, "_attn_implementation", None) == "tree_triton"
    return _Target(model, cache, ids.numel() - 1, ids[-1:], kernel_path, want_hidden), hidden


def _check_window(target: _Target, session: GuessSession, max_new_tokens: int) -> None:
    """The whole run must fit the model's positions (and a sliding window, which compaction cannot cross)."""
    T = target.context_length + 1
    longest = T + max_new_tokens + max(session.max_input_length, *target.pad_to.values(), 0)
    max_pos = getattr(target.model.config, "max_position_embeddings", None)
    if max_pos is not None and longest > max_pos:
        raise UserError(f"model: prompt ({T}) + max_new_tokens ({max_new_tokens}) + step input "
                        f"({session.max_input_length}) exceeds the model's {max_pos} positions")
    windows = [layer.sliding_window for layer in getattr(target.cache, "layers", []) if getattr(layer, "is_sliding", False)]
    if windows and T + max_new_tokens + session.max_input_length >= min(windows):
        raise UserError(f"model: sliding window of {min(windows)} tokens: prompt ({T}) + max_new_tokens ({max_new_tokens}) "
                        f"+ step input ({session.max_input_length}) must stay below it (KV compaction keeps the whole context)")


def _kernel_tree(layout, device):
    if layout.kernel_tree is None:
        from decoder.attention import prepare_tree
        from kernels import parents_from_visibility

        layout.kernel_tree = prepare_tree(parents_from_visibility(layout.mask_block), device)
    return layout.kernel_tree


def _step_inputs(target: _Target, proposal: Proposal) -> tuple[torch.Tensor, dict]:
    """Tree tokens [num_tree] and the forward's keyword arguments for this proposal."""
    lay = proposal.layout
    tree_ids = torch.cat([target.root, proposal.tokens]) if lay.num_tree > 1 else target.root  # [num_tree]
    C = target.context_length
    args = {"position_ids": lay.position_offsets + C, "hidden": target.want_hidden}
    if lay.input_length == 1:  # a lone token sees the whole cache and itself: no mask, as in generate
        args["attention_mask"] = None
    elif target.kernel_path:  # the tree reaches the kernel as parents; no dense mask
        args.update(attention_mask=None, tree=_kernel_tree(lay, tree_ids.device))
    else:
        args["attention_mask"] = step_mask(lay.mask_block, C)
    if proposal.extra_embeds is not None:
        embed = target.model.get_input_embeddings()
        args.update(input_ids=None, inputs_embeds=torch.cat([embed(tree_ids), proposal.extra_embeds])[None])  # [1, n, hidden]
    else:
        args.update(input_ids=tree_ids[None], inputs_embeds=None)
    m = target.pad_to.get(lay.input_length)
    if m and args["attention_mask"] is not None:
        _pad(args, target.root, m, C)
    return tree_ids, args


def _pad(args: dict, root: torch.Tensor, m: int, C: int) -> None:
    """Append m - n tokens that nothing reads, so the forward runs at the length the profile measured
    cheaper: each sees the cache and itself, no tree token sees them, their logits are dropped and
    the cache commit keeps accepted tree tokens only, so the step's outcome is the unpadded one's."""
    pos = args["position_ids"]  # [1, n]
    n = pos.shape[1]
    k = m - n
    args["position_ids"] = torch.cat([pos, pos.new_full((1, k), C)], dim=1)
    if args["input_ids"] is not None:
        args["input_ids"] = torch.cat([args["input_ids"], root.expand(k)[None]], dim=1)  # [1, m]
    else:
        e = args["inputs_embeds"]  # [1, n, H], the root first
        args["inputs_embeds"] = torch.cat([e, e[:, :1].expand(1, k, e.shape[2])], dim=1)
    mask = args["attention_mask"]  # [1, 1, n, C + n]
    padded = mask.new_full((1, 1, m, C + m), torch.finfo(mask.dtype).min)
    padded[..., :n, : C + n] = mask
    padded[..., n:, :C] = 0
    extra = torch.arange(n, m, device=mask.device)
    padded[0, 0, extra, C + extra] = 0
    args["attention_mask"] = padded


def _score(target: _Target, args: dict):
    out = tree_forward(target.model, cache=target.cache, **args)
    return out.logits[0], None if out.hidden is None else out.hidden[0]  # [n, V], [n, hidden]


def _commit_target(target: _Target, verdict: Verdict) -> None:
    # one launch for all layers on the kernel path; a verified path is increasing, so skip the index check's sync
    target.context_length = compact_cache(target.cache, target.context_length, verdict.path,
                                          kernel=target.kernel_path, validate=False, nodes=verdict.nodes)
    target.root = verdict.root


@torch.inference_mode()
def decode(model, input_ids, plan: Tree | None, guesser, max_new_tokens: int, sampling: Sampling, *, eos_token_id=None,
           seed: int = 0, record_guesses: bool = False, progress: bool = False, phase_times: bool = True,
           label: str = "plan") -> GenerateOutput:
    """The loop behind `generate` and `generate_plain` (arguments already checked)."""
    embed = model.get_input_embeddings()
    device, dtype = embed.weight.device, embed.weight.dtype
    ids = _ids_1d(input_ids, device)
    eos = _eos_set(model, eos_token_id)
    clock = _Clock(device, phase_times)
    stats = DecodeStats(guesses=[] if record_guesses else None)
    gen = torch.Generator().manual_seed(seed)
    t_start = time.perf_counter()
    target, prompt_hidden = _start_target(model, ids, guesser.needs_hidden)
    if plan is not None and not target.kernel_path:
        target.pad_to = {int(k): int(v) for k, v in plan.settings.get("pad_to", {}).items()}
    session = guesser.begin(model, plan, ids, DecodeContext(sampling, gen, dtype, device, label, prompt_hidden))
    _check_window(target, session, max_new_tokens)
    clock.sync()
    stats.prefill_s = time.perf_counter() - t_start
    new: list[int] = []
    bar = _progress_bar(max_new_tokens) if progress else None
    while len(new) < max_new_tokens:
        out, kept, stop = _step(target, session, sampling, gen, clock, eos, max_new_tokens - len(new))
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


def _step(target: _Target, session: GuessSession, sampling: Sampling, gen, clock: "_Clock", eos: set[int],
          room: int) -> tuple[StepOutcome, list[int], bool]:
    """One step: propose, score, verify, commit. Returns the outcome, the tokens kept (EOS and
    max_new_tokens cut the accepted path) and whether decoding stops."""
    clock.start()
    proposal = session.propose(target.root)
    tree_ids, args = _step_inputs(target, proposal)
    clock.lap("prepare")
    logits, hidden = _score(target, args)
    n = proposal.layout.input_length
    if logits.shape[0] > n:  # a padded step: the padding's rows are nobody's
        logits, hidden = logits[:n], None if hidden is None else hidden[:n]
    clock.lap("forward")
    tree_logits = logits[: proposal.layout.num_tree]
    if proposal.rule is not None:
        verdict = proposal.rule(tree_logits, tree_ids, sampling, gen)
    else:
        verdict = verify(tree_logits, tree_ids, proposal.layout, sampling, gen, proposal.draft_probs)
    clock.lap("verify")
    _commit_target(target, verdict)
    clock.lap("cache")
    outcome = StepOutcome(proposal, verdict, logits, hidden, target.context_length)
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
