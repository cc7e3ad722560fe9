"""The decoding loop: one tree forward pass per step, greedy or sampled verification, KV compaction.

    out = generate(model, input_ids, plan="trees/x.json", guesser=guesser, max_new_tokens=128)

Loop invariant: the cache holds every token before the current root; the root (the base model's
own last token) is not yet in it. Decoding starts with a bootstrap step (root = last prompt
token, no candidates, the full number of prompt tokens) so the first real step has guesses;
`generate_plain` runs the same loop with root-only steps, so their timings compare like with like.
Batch size 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from decoder.buffers import PlanBuffers, StepBuffers, build_buffers, build_plan_buffers
from decoder.cache import compact_cache
from decoder.forward import prefill, step_mask, tree_forward
from decoder.verify import Sampling, verify
from planner.errors import UserError
from planner.tree import Tree, load_tree

PHASES = ("prepare", "forward", "verify", "cache", "guess")


@dataclass
class DecodeStats:
    """Per-step records. state -1 is the bootstrap step; accepted counts candidates (tokens = accepted + 1)."""

    states: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)  # after EOS / max_new_tokens truncation
    input_lengths: list[int] = field(default_factory=list)  # real forward length (prompt tokens x E)
    planned_input_lengths: list[int] = field(default_factory=list)  # the plan's count
    times: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    guesses: list[torch.Tensor] | None = None  # [k, K] per step when record_guesses
    prefill_s: float = 0.0
    total_s: float = 0.0

    def summary(self) -> dict:
        steps = len(self.states)
        tokens = sum(self.emitted)
        out = {
            "steps": steps,
            "tokens": tokens,
            "tokens_per_step": tokens / steps if steps else 0.0,
            "mean_input_length": sum(self.input_lengths) / steps if steps else 0.0,
            "prefill_s": self.prefill_s,
            "total_s": self.total_s,
            "tokens_per_s": tokens / self.total_s if self.total_s > 0 else None,
        }
        out.update({f"{p}_s": sum(self.times[p]) if self.times[p] or not steps else None for p in PHASES})
        return out

    def to_json(self) -> dict:
        return {
            "states": self.states,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "input_lengths": self.input_lengths,
            "planned_input_lengths": self.planned_input_lengths,
            "times": self.times,
            "summary": self.summary(),
        }


@dataclass
class GenerateOutput:
    tokens: torch.Tensor  # [T_new] long, new tokens only
    steps: int  # forward passes of the base model after the prefill
    stats: DecodeStats


def _eos_set(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None or eos_token_id is False:
        return set()
    return {int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)}


def _as_tree(plan) -> tuple[Tree, str]:
    if isinstance(plan, Tree):
        return plan, "plan"
    return load_tree(plan), str(plan)


def generate(model, input_ids, plan, guesser, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, verify_rule: str = "auto", eps: float = 0.09, delta: float = 0.3,
             eos_token_id=None, seed: int = 0, record_guesses: bool = False, progress: bool = False,
             buffers: PlanBuffers | None = None, attention: str = "auto", phase_times: bool = True) -> GenerateOutput:
    """Decode with a tree plan (a path or a loaded Tree) and a guesser (PromptTokens, OracleGuesser, ...).

    verify_rule: auto (greedy at temperature 0, lossless sampling above), greedy, typical, lossless.
    Pass `buffers` (from `build_plan_buffers`) to reuse them across calls.
    attention: "auto" (the Triton tree kernels on CUDA when triton is installed, else a dense
    4D mask through the model's own attention), "kernels" or "dense". Enabling the kernels
    switches the model to the "tree_triton" attention implementation, which keeps using SDPA for
    every call that is not a tree step.
    phase_times: split each step into PHASES. On a GPU that costs five device syncs per step, which
    stall the launch queue; pass False for deployment-speed timing (total_s stays exact, the
    phase lists stay empty on CUDA; on the CPU, where work is synchronous, they are always kept).
    """
    _select_attention(model, attention)
    tree, label = _as_tree(plan)
    embed = model.get_input_embeddings()
    if buffers is None:
        buffers = build_plan_buffers(tree, guesser, embed.weight.dtype, embed.weight.device, label)
    sampling = Sampling(temperature, top_k, top_p, verify_rule, eps, delta)
    return _decode(model, input_ids, buffers, guesser, max_new_tokens, sampling, eos_token_id, seed,
                   record_guesses, progress, phase_times)


def _select_attention(model, attention: str) -> None:
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
    from kernels.hf import enable_tree_attention, unsupported_reason

    reason = unsupported_reason(model)
    if reason:
        if attention == "auto":
            return  # the dense mask serves every model the decoder supports
        raise UserError(f"attention='kernels': {reason}; use attention='dense'")

    if getattr(model.config, "_attn_implementation", None) != "tree_triton":
        enable_tree_attention(model)


def _kernel_parents(pb: PlanBuffers) -> dict[int, list[int]]:
    """Each step buffer's tree (prompt-token lanes included) as parent indices, for the kernels."""
    from kernels import parents_from_visibility

    bufs = list(pb.states.values()) + [pb.bootstrap]
    return {id(b): parents_from_visibility(b.mask_block) for b in bufs}


def generate_plain(model, input_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, eos_token_id=None, seed: int = 0, progress: bool = False,
                   phase_times: bool = True) -> GenerateOutput:
    """One token per step through the same prefill, forward, verify and cache path as `generate`."""
    w = model.get_input_embeddings().weight
    root_only = build_buffers(0, [], [0], 1, 0, w.dtype, w.device)
    buffers = PlanBuffers({0: root_only}, root_only, static=True, depth=0, top_k=1)
    return _decode(model, input_ids, buffers, None, max_new_tokens, Sampling(temperature, top_k, top_p),
                   eos_token_id, seed, False, progress, phase_times)


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
def _decode(model, input_ids, pb: PlanBuffers, guesser, max_new_tokens: int, sampling: Sampling, eos_token_id,
            seed: int, record_guesses: bool, progress: bool, phase_times: bool) -> GenerateOutput:
    from transformers import DynamicCache

    embed = model.get_input_embeddings()
    device, dtype = embed.weight.device, embed.weight.dtype
    ids = _ids_1d(input_ids, device)
    eos = _eos_set(model, eos_token_id)
    table = None if guesser is None else guesser.input_embeddings()
    if table is not None:
        table = table.detach().to(device=device, dtype=dtype)  # [P*E, hidden]
    cuda = device.type == "cuda"
    record_phases = phase_times or not cuda
    sync = torch.cuda.synchronize if cuda and phase_times else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    stats = DecodeStats(guesses=[] if record_guesses else None)
    kernel_path = getattr(model.config, "_attn_implementation", None) == "tree_triton"
    tree_parents = _kernel_parents(pb) if kernel_path else {}

    t_start = time.perf_counter()
    T = ids.numel()
    if T > 1:
        _, cache = prefill(model, ids[None, :-1])
    else:
        cache = DynamicCache(config=model.config)
    windows = [layer.sliding_window for layer in getattr(cache, "layers", []) if getattr(layer, "is_sliding", False)]
    longest = max([b.input_length for b in pb.states.values()] + [pb.bootstrap.input_length])
    if windows and T + max_new_tokens + longest >= min(windows):
        raise UserError(f"model: sliding window of {min(windows)} tokens: prompt ({T}) + max_new_tokens ({max_new_tokens}) "
                        f"+ step input ({longest}) must stay below it (KV compaction keeps the whole context)")
    sync()
    stats.prefill_s = time.perf_counter() - t_start
    C = T - 1
    root = ids[-1:]  # [1]
    buf: StepBuffers = pb.bootstrap
    guesses = None  # [k, K]
    new: list[int] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=max_new_tokens, unit="tok", leave=False)
    while len(new) < max_new_tokens:
        t0 = time.perf_counter()
        n = buf.input_length
        if buf.num_tree > 1:
            tree_ids = torch.cat([root, guesses.reshape(-1)[buf.cand_index]])  # [num_tree]
        else:
            tree_ids = root
        position_ids = buf.position_offsets + C  # [1, n]
        if kernel_path:  # the tree reaches the kernel as parents; no dense mask
            mask, args_tree = None, {"tree_parents": tree_parents[id(buf)]}
        else:
            mask, args_tree = step_mask(buf.mask_block, C), {}
        if n > buf.num_tree:
            x = torch.cat([embed(tree_ids), table[buf.slot_embedding]])  # [n, hidden]
            args = dict(input_ids=None, inputs_embeds=x[None])
        else:
            args = dict(input_ids=tree_ids[None], inputs_embeds=None)
        sync()
        t1 = time.perf_counter()
        logits = tree_forward(model, position_ids=position_ids, attention_mask=mask, cache=cache, **args,
                              **args_tree)[0]  # [n, V]
        sync()
        t2 = time.perf_counter()
        verdict = verify(logits[: buf.num_tree], tree_ids, buf, sampling, gen)
        t3 = time.perf_counter()
        if kernel_path:
            from kernels.hf import compact_cache as kernel_compact_cache

            # one launch for all layers; a verified path is increasing, so skip the index check's sync
            kernel_compact_cache(cache, C, verdict.path, validate=False)
        else:
            compact_cache(cache, C, verdict.path)
        sync()
        t4 = time.perf_counter()
        a = len(verdict.nodes) - 1
        C += a + 1
        last = verdict.nodes[-1]
        k = buf.prompt_count_list[last]
        if k > 0:
            prompt_logits = logits[buf.slot_index[last, :k]] if n > buf.num_tree else None  # [k, E, V]
            guesses = guesser.guess(prompt_logits, C, k).to(device)  # [k, K]
        else:
            guesses = None
        sync()
        t5 = time.perf_counter()

        out = verdict.emitted
        stop = False
        for i, tok in enumerate(out):
            if tok in eos:
                out, stop = out[: i + 1], True
                break
        if len(new) + len(out) >= max_new_tokens:
            out, stop = out[: max_new_tokens - len(new)], True
        new.extend(out)
        stats.states.append(buf.state)
        stats.accepted.append(a)
        stats.emitted.append(len(out))
        stats.input_lengths.append(n)
        stats.planned_input_lengths.append(buf.planned_input_length)
        if record_phases:
            for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                stats.times[name].append(dt)
        if record_guesses:
            stats.guesses.append(None if guesses is None else guesses.cpu())
        if bar is not None:
            bar.update(len(out))
        if stop:
            break
        root = verdict.root
        buf = pb.states[0] if pb.static else pb.states[k]
    if bar is not None:
        bar.close()
    if cuda:
        torch.cuda.synchronize()  # the last compaction may still be queued
    stats.total_s = time.perf_counter() - t_start
    tokens = torch.tensor(new, dtype=torch.long)
    return GenerateOutput(tokens=tokens, steps=len(stats.states), stats=stats)
