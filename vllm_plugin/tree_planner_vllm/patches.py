"""The patches, written against vLLM 0.32.0's source (gate.TESTED_VLLM); `install` applies them once.

Three roles, as in vLLM: the scheduler and engine core (which step drafts how much, and whether the
worker's drafts are fetched), the model runner (scorer and verification rule of a step), and the
proposers (drafting). Each patched method first asks whether the plugin acts on this engine
(`_tree_planner_on`, decided once per engine by gate.refusal); where it does not, it calls vLLM's own
method unchanged.

- GPUModelRunner._prepare_inputs (the CPU runner inherits it): a step in which no running request has a
  scheduled draft takes vLLM's plain branch (no SpecDecodeMetadata), so GPUModelRunner._sample calls the
  plain Sampler instead of the RejectionSampler. vLLM 0.32 takes the speculative branch whenever a
  speculative config exists (`use_spec_decode = self.speculative_config is not None`).
- GPUModelRunner.propose_draft_token_ids: at K = 0 (the schedule's length for this step's batch) ngram
  and Medusa are not called; suffix decoding and the model drafters run (below).
- SuffixDecodingProposer.propose, MedusaProposer.propose: take the step's K (0 <= K <= the configured
  num_speculative_tokens) instead of asserting the configured one. Suffix decoding at K = 0 still adds
  the new tokens to the request's suffix tree and drafts nothing.
- Scheduler.schedule records the step's K; EngineCore.post_step skips take_draft_token_ids after a
  K = 0 step (nothing was drafted).
- EngineCore.reset_prefix_cache: where the reset succeeded (no request was running) and the engine drafts
  with suffix decoding, the worker's suffix cache also forgets every cached answer (its global tree), with
  one log line (gate.FORGOT) saying how many. Suffix decoding drafts from earlier requests' answers, so after
  vLLM's own reset a pass that repeats earlier prompts would draft them from their own earlier answers; a
  reset now leaves the drafter as a fresh server's is (the race repeats a pass's prompts on one server).
  For every engine of a patched process, like the CPU fix below: a reset is no decoding step.
- rejection_sampler.expand_batch_to_tokens, on vLLM's CPU backend only: vLLM 0.32's CPU stand-in for its
  Triton expand kernel (vllm/utils/cpu_triton_utils.py `_expand_kernel_impl`) casts the output tensor to
  int64, which for the float temperature and top-p (and int32 top-k) is a copy: the kernel writes the copy,
  and the rejection sampler reads the uninitialised tensor it allocated. Every sampled request with a draft
  was verified and its rejected positions resampled at a garbage temperature (seen: 5.5e15, -7.8e33, NaN), so
  vLLM's CPU speculative sampling accepted almost nothing and emitted tokens plain never would. Replaced by the
  same expansion in torch, for every engine of the process (a module function has no engine to ask).
- rejection_sampler.apply_top_k_top_p, on vLLM's CPU backend only: the top-p of a sampled request's drafted
  positions. vLLM's CPU path sorts the whole vocabulary of every drafted position (5-8 ms a row here), so
  a sampled verify step cost a plain step plus that per draft; nucleus.top_p_filter keeps the same tokens
  from a partial selection and leaves a row whose nucleus is too wide (or a top-k) to vLLM's sort. The
  bonus token and every plain step still sample through vLLM's own Sampler, unchanged.
"""
from __future__ import annotations

import logging

import torch

from tree_planner_vllm import gate, nucleus

logger = logging.getLogger("vllm.tree_planner_vllm")
MARK = "_tree_planner_patched"


def install() -> bool:
    """Patch vLLM's classes (once per process); False if they were patched already."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.spec_decode.medusa import MedusaProposer
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, MARK, False):
        return False
    _fix_cpu_expand()
    _fast_cpu_top_p()
    _wrap(GPUModelRunner, "__init__", _runner_init)
    _wrap(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    _wrap(GPUModelRunner, "propose_draft_token_ids", _propose_draft_token_ids)
    _wrap(Scheduler, "__init__", _scheduler_init)
    _wrap(Scheduler, "schedule", _schedule)
    _wrap(EngineCore, "post_step", _post_step)
    _wrap(EngineCore, "reset_prefix_cache", _reset_prefix_cache)
    _wrap(SuffixDecodingProposer, "propose", _suffix_propose)
    _wrap(MedusaProposer, "propose", _medusa_propose)
    setattr(GPUModelRunner, MARK, True)
    return True


def _wrap(cls, name: str, make) -> None:
    original = cls.__dict__[name]
    patched = make(original)
    patched.__name__, patched.__qualname__, patched.__doc__ = original.__name__, original.__qualname__, original.__doc__
    patched.__wrapped__ = original
    setattr(cls, name, patched)


def _fix_cpu_expand() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return  # the Triton kernel writes its output in place
    original = rejection_sampler.expand_batch_to_tokens
    expand_batch_to_tokens.__wrapped__ = original
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens  # apply_sampling_constraints reads the global


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """[batch] -> [num_tokens]: request i's value repeated for its tokens (cu_num_tokens the running ends), a value
    equal to replace_from replaced by replace_to: what vLLM's expand kernel computes, written where it is read."""
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [batch]
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return x.repeat_interleave(counts, output_size=num_tokens)  # [num_tokens]


def _fast_cpu_top_p() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return  # GPUs filter with a kernel of their own
    original = rejection_sampler.apply_top_k_top_p

    def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        """vLLM's apply_top_k_top_p for the drafted positions [num_tokens, vocab]: top-p alone without a sort
        where the nucleus fits the candidates (nucleus.py), anything else as vLLM does it."""
        if k is None and p is not None:
            filtered = nucleus.top_p_filter(logits, p)
            if filtered is not None:
                return filtered
        return original(logits, k, p)

    apply_top_k_top_p.__wrapped__ = original
    rejection_sampler.apply_top_k_top_p = apply_top_k_top_p  # apply_sampling_constraints reads the global


def decide(vllm_config) -> str | None:
    from vllm.platforms import current_platform

    return gate.refusal(vllm_config, platform_is_cpu=current_platform.is_cpu())


# ---------------------------------------------------------------------------------------------- scheduler, engine core

def _scheduler_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        reason = decide(self.vllm_config)
        self._tree_planner_on = reason is None
        self._tree_planner_k = None  # the K of the step last scheduled (its drafts are proposed after it)
        # the one line per engine: the engine core builds one scheduler, the worker decides silently
        if reason is None:
            method = self.vllm_config.speculative_config.method
            logger.info("tree-planner plugin: on for %s: %s", method, gate.describe(method))
        else:
            logger.info("tree-planner plugin: off for this engine: %s", reason)

    return __init__


def _schedule(original):
    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if getattr(self, "_tree_planner_on", False):
            self._tree_planner_k = out.num_spec_tokens_to_schedule if out.num_scheduled_tokens else None
        return out

    return schedule


def _post_step(original):
    def post_step(self, model_executed: bool) -> None:
        scheduler = self.scheduler
        if model_executed and getattr(scheduler, "_tree_planner_on", False) and scheduler._tree_planner_k == 0:
            return  # the worker drafted nothing after this step: no take_draft_token_ids round trip
        return original(self, model_executed)

    return post_step


def _reset_prefix_cache(original):
    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        done = original(self, *args, **kwargs)
        spec = self.vllm_config.speculative_config
        if done and spec is not None and spec.method == "suffix":
            forgotten = sum(self.collective_rpc(forget_suffix_answers))  # a count from each worker
            logger.info("%s: %d", gate.FORGOT, forgotten)
        return done

    return reset_prefix_cache


def forget_suffix_answers(worker) -> int:
    """In the worker (collective_rpc): evict every cached answer from its suffix cache; how many there were.
    A request still active keeps its own tree (its prompt and answer so far) and drafts on, from it alone."""
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    if not isinstance(drafter, SuffixDecodingProposer):
        return 0
    cache = drafter.suffix_cache
    cached = list(cache.cached_requests)
    for req_id in cached:
        cache.evict_cached_response(req_id)
    return len(cached)


# ---------------------------------------------------------------------------------------------- model runner

def _runner_init(original):
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        self._tree_planner_on = decide(vllm_config) is None

    return __init__


def _prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        if not getattr(self, "_tree_planner_on", False) or any(scheduler_output.scheduled_spec_decode_tokens.values()):
            return original(self, scheduler_output, num_scheduled_tokens)
        # No request has a draft: vLLM's own plain branch, exactly as without a speculative config
        # (logits at each request's last token, no SpecDecodeMetadata, so the plain Sampler samples).
        # The attribute is read once inside, at the branch; the drafter keeps its own reference.
        spec, self.speculative_config = self.speculative_config, None
        try:
            return original(self, scheduler_output, num_scheduled_tokens)
        finally:
            self.speculative_config = spec

    return _prepare_inputs


def _propose_draft_token_ids(original):
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if (getattr(self, "_tree_planner_on", False) and scheduler_output.num_spec_tokens_to_schedule == 0
                and self.speculative_config.method in gate.SKIP_AT_K0):
            return [[] for _ in self.input_batch.req_ids]
        return original(self, scheduler_output, *args, **kwargs)

    return propose_draft_token_ids


# ---------------------------------------------------------------------------------------------- proposers

def _step_k(k: int, configured: int, who: str) -> int:
    if not 0 <= k <= configured:
        raise ValueError(f"{who}: draft length {k} outside 0..{configured} (num_speculative_tokens)")
    return k


def _suffix_propose(original):
    def propose(self, num_speculative_tokens, input_batch, sampled_token_ids, slot_mappings=None):
        """Suffix decoding at the step's K: every request's new tokens go into its suffix tree (later
        drafts match against the whole response); K = 0 drafts nothing."""
        k = _step_k(num_speculative_tokens, self.num_speculative_tokens, "suffix decoding")
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            num_tokens = int(input_batch.num_tokens_no_spec[i])
            if not sampled or num_tokens >= self.max_model_len:  # a partial prefill, or the request is full
                drafts.append([])
                continue
            req_id = input_batch.req_ids[i]
            _suffix_track(self.suffix_cache, req_id, input_batch, i)
            self.suffix_cache.add_active_response(req_id, sampled)
            room = min(k, self.max_model_len - num_tokens - 1)
            if room <= 0:  # arctic-inference reads max_spec_tokens=0 as "up to the tree depth"
                drafts.append([])
                continue
            context = input_batch.token_ids_cpu[i, max(0, num_tokens - self.max_tree_depth):num_tokens]
            draft = self.suffix_cache.speculate(req_id, context, max_spec_tokens=room,
                                                max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
            drafts.append(draft.token_ids)
        for req_id in self.suffix_cache.active_requests - input_batch.req_id_to_index.keys():
            self.suffix_cache.stop_request(req_id)  # finished or preempted: its answer joins the global cache
        return drafts

    return propose


def _suffix_track(cache, req_id, input_batch, i: int) -> None:
    """Start the request's suffix tree from its prompt the first time it is seen (as vLLM does)."""
    if req_id in cache.active_requests:
        return
    if req_id in cache.cached_requests:
        cache.evict_cached_response(req_id)  # a request id seen before: its old answer is not this one's
    prompt = input_batch.token_ids_cpu[i, :input_batch.num_prompt_tokens[i]]
    cache.start_request(req_id, prompt)


def _medusa_propose(original):
    def propose(self, num_speculative_tokens, target_hidden_states, sampling_metadata, slot_mappings=None):
        """The first K Medusa heads (K the step's draft length): [batch, K] token ids."""
        k = _step_k(num_speculative_tokens, self.num_speculative_tokens, "Medusa")
        batch = target_hidden_states.shape[0]
        if k == 0:
            return torch.empty((batch, 0), dtype=torch.int64, device=target_hidden_states.device)
        heads = self.model(target_hidden_states)[:k]  # one residual block per head
        logits = self.model.compute_logits(heads)  # zips the blocks with their LM heads: K heads only
        return torch.stack([head.argmax(dim=-1) for head in logits], dim=1)

    return propose
