"""The Hugging Face engine: any transformers causal LM behind decoder/engine.py's protocol.

    engine = HFEngine(model)                      # a loaded AutoModelForCausalLM, any device and dtype
    seq, _ = engine.start(prompt_ids)             # prefill all but the last token (the first root)
    logits, hidden = seq.score(StepInput(tokens, layout))   # root + tree in one forward
    seq.commit(verdict)                           # keep the accepted path, drop the rest

A tree step is one forward of n tokens after a KV cache of C tokens, with explicit position ids
and a 4D additive mask [1, 1, n, C + n] that lets a token see the cache and its own ancestors
(decoder/torch_ops/forward.py); on CUDA with the tree kernels switched on (decoder/engines/hf/attention.py) the tree
goes in as parents instead. A step whose profile found a longer forward cheaper is padded to it
(tokens nothing reads). The CPU's per-shape matmul paths (decoder/engines/hf/cpu_paths.py) stay installed on
the model's Linears, so every call through the engine runs them.
"""
from __future__ import annotations

import torch

from decoder.engine import Features, Scored, StepInput
from decoder.torch_ops.cache import compact_cache, crop_cache
from decoder.torch_ops.forward import pick_features, prefill, step_mask, tree_forward
from planner.errors import UserError


def model_eos_ids(model, eos_token_id=None) -> set[int]:
    """The model's end-of-sequence tokens (generation config first, then the model config), or the
    ones given (an id or a list of ids; False: none)."""
    if eos_token_id is None and model is not None:
        gc = getattr(model, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None or eos_token_id is False:
        return set()
    return {int(e) for e in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)}


class HFEngine:
    """A transformers model as the target engine. `tokenizer` (its chat template) and `loaded` (what the
    model spec named: decoder/engines/hf/load.py) come from the opener; a bare model has neither."""

    def __init__(self, model, tokenizer=None, loaded=None):
        from dataclasses import replace

        from planner.engines import kind

        self.model, self._tokenizer, self.loaded = model, tokenizer, loaded
        embed = model.get_input_embeddings()
        self.device, self.dtype = embed.weight.device, embed.weight.dtype
        self.vocab_size = int(embed.weight.shape[0])
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        cfg = model.config
        self.model_name = loaded.name if loaded else (getattr(cfg, "name_or_path", "") or getattr(cfg, "model_type", ""))
        self.caps = replace(kind("hf").caps, threads=torch.get_num_threads() if self.device.type == "cpu" else None)

    @property
    def tokenizer(self):
        """The model's tokenizer (its chat template), loaded on first use from the model's folder; None
        for a model without one (a preset's random weights)."""
        if self._tokenizer is None and self.loaded is not None and self.loaded.tokenizer_dir is not None:
            from decoder.engines.hf.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.loaded.tokenizer_dir)
        return self._tokenizer

    def torch_model(self):
        """The transformers model itself: this package's own (training passes, its timers)."""
        return self.model

    def open_drafter(self, path, label: str | None = None):
        """A draft model from `path` as a decoder/drafter.py DraftModel (caps.torch_modules): the project's
        draft LM (its layers on this model's embedding and head, decoder/torch_ops/draft_lm.py), a Hugging
        Face causal LM folder with this model's vocabulary, or an EAGLE-1 / EAGLE-3 head in its released
        layout, checked against this model tensor by tensor (decoder/torch_ops/heads.py)."""
        from decoder.torch_ops.heads import is_eagle_head

        if is_eagle_head(path):
            from decoder.torch_ops.heads import open_eagle

            return open_eagle(path, self.model, label)
        from decoder.torch_ops.draft import HFDraft
        from decoder.torch_ops.draft_lm import load_draft_model

        return HFDraft(load_draft_model(path, self.model), label or str(path))

    def open_heads(self, path):
        """Medusa heads (FasterDecoding's or vLLM's layout) checked against this model (decoder/torch_ops/heads.py)."""
        from decoder.torch_ops.heads import open_medusa

        return open_medusa(path, self.model)

    def training(self):
        """The passes training backpropagates through, on this model frozen (caps.torch_modules):
        decoder/engines/hf/training.py TrainingPasses."""
        from decoder.engines.hf.training import TrainingPasses

        return TrainingPasses(self.model)

    def token_modules(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(input embedding, LM head): the target's own modules, frozen, which drafters built on the target
        share instead of copying (ParallelSpec's, PPD prompt tokens' initial rows)."""
        return self.model.get_input_embeddings(), self.model.get_output_embeddings()

    def context_forwards(self, context: torch.Tensor):
        """Forwards of new tokens after `context` [C], prefilled once and cut back to it after each use
        (caps.torch_modules, as PEARL): profiler/overlap.py times PEARL's two sides with them
        (decoder/engines/hf/context_forwards.py)."""
        from decoder.engines.hf.context_forwards import ContextForwards

        return ContextForwards(self.model, context)

    def record(self) -> dict:
        """What files record about the target: the model, its weights and arithmetic, where it ran."""
        from decoder.engines.hf.load import config_hash, dtype_name

        lo = self.loaded
        return {"engine": self.caps.name, "model": self.model_name, "model_source": lo.source if lo else None,
                "has_weights": lo.has_weights if lo else None,
                "config_hash": lo.config_hash if lo else config_hash(self.model.config),
                "dtype": dtype_name(self.dtype), "device": self.device.type, "threads": self.caps.threads,
                "attention": getattr(self.model.config, "_attn_implementation", None)}

    def versions(self) -> dict:
        import transformers

        return {"torch": torch.__version__, "transformers": transformers.__version__}

    def close(self) -> None:
        """Nothing to release: the model is garbage-collected with the engine."""

    def reserve(self, tokens: int) -> None:
        """Nothing to do: transformers caches grow as they go (check_room checks the model's positions)."""

    @torch.inference_mode()
    def stock_generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, sampling=None, seed: int = 0):
        """transformers' own `model.generate` (greedy, or sampled with the same temperature, top-k and top-p),
        on stock F.linear (the matmul paths off for the call): the baseline a user would otherwise run.
        Returns (new tokens up to and including EOS, wall seconds with the prefill)."""
        import time

        from decoder.engines.hf.cpu_paths import set_paths_enabled

        ids = prompt_ids.reshape(1, -1).to(self.device)
        eos = sorted(self.eos_ids()) or None
        warp = {"do_sample": False}
        if sampling is not None and sampling.temperature > 0:
            warp = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k or None,
                    "top_p": sampling.top_p}
            torch.manual_seed(seed)
        set_paths_enabled(self.model, False)
        try:
            t0 = time.perf_counter()
            out = self.model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=eos,
                                      pad_token_id=(eos or [0])[0], **warp)
            seconds = time.perf_counter() - t0
        finally:
            set_paths_enabled(self.model, True)
        return out[0, ids.shape[1]:].tolist(), seconds

    def use_matmul_paths(self, table) -> None:
        """Install a profile's CPU matmul paths (a profile file, a table, or None: F.linear everywhere)."""
        from decoder.engines.hf.cpu_paths import remove_paths, use_profile_paths

        if table is None:
            remove_paths(self.model)
        else:
            use_profile_paths(self.model, table)

    def choose_matmul_paths(self, rows: list[int], context_length: int, budget_s: float, seed: int = 0,
                            progress: bool = True) -> dict:
        """Measure each Linear's fastest CPU matmul path per row count and leave them installed (the profile's
        "matmul_paths"; decoder/engines/hf/matmul_choice.py)."""
        from decoder.engines.hf.matmul_choice import choose_matmul_paths

        return choose_matmul_paths(self.model, rows, context_length, budget_s, seed=seed, progress=progress)

    def select_attention(self, attention: str) -> None:
        """auto (the Triton tree kernels on CUDA when triton is installed, else the dense mask), kernels, dense."""
        select_attention(self.model, attention)

    def check_lengths(self, input_lengths: list[int], context_length: int, batch_size: int = 1) -> None:
        """Every profiled forward must fit the model's positions and this machine's memory."""
        from decoder.engines.hf.memory import check_lengths

        check_lengths(input_lengths, context_length, self.max_positions, self.model, batch_size, self.device)

    @property
    def kernel_path(self) -> bool:
        """Attention through the Triton tree kernels: trees go in as parents, no dense mask."""
        return getattr(self.model.config, "_attn_implementation", None) == "tree_triton"

    def eos_ids(self) -> set[int]:
        return model_eos_ids(self.model)

    def start(self, prompt_ids: torch.Tensor, hidden: Features = False,
              pad_to: dict[int, int] | None = None) -> tuple["HFSequence", torch.Tensor | None]:
        from transformers import DynamicCache

        ids = prompt_ids.reshape(-1)
        prompt_hidden = None
        if ids.numel() > 1:
            out = prefill(self.model, ids[None, :-1], hidden=hidden)
            cache = out.cache
            prompt_hidden = None if out.hidden is None else out.hidden[0]  # [T-1, F]
        else:
            cache = DynamicCache(config=self.model.config)
        pad_to = {} if self.kernel_path or not pad_to else {int(k): int(v) for k, v in pad_to.items()}
        return HFSequence(self, cache, ids.numel() - 1, ids[-1:], pad_to), prompt_hidden

    def forward_timer(self, spec):
        """decoder.engine.TimerSpec: b rows, or one packed row (EMS-SD); on CUDA each length can be captured
        once as a CUDA graph and replayed (decoder/engines/hf/timer.py)."""
        from decoder.engines.hf.timer import HFForwardTimer

        return HFForwardTimer(self.model, spec.context_length, spec.batch_size, spec.tree, spec.packed,
                              spec.cuda_graphs, spec.seed)

    def batch_runner(self, layout: str, seqs: list, started: list["HFSequence"], want_hidden: bool):
        """The batched forward of decoder/batch.py over the sequences' own prefilled caches."""
        from decoder.engines.hf.batch import batch_runner

        caches = [s.cache if s.context_length else None for s in started]
        return batch_runner(self.model, layout, seqs, caches, want_hidden)

    @torch.inference_mode()
    def teacher_forced(self, ids: torch.Tensor, hidden: Features = False) -> Scored:
        """Logits (and the features asked for) at every position of a token sequence [T], no cache."""
        out = self.model(input_ids=ids.reshape(1, -1).to(self.device), output_hidden_states=bool(hidden), use_cache=False)
        feats = pick_features(out.hidden_states, hidden)
        return Scored(out.logits[0], None if feats is None else feats[0])

    def check_room(self, seq: "HFSequence", max_new_tokens: int, step_input: int) -> None:
        """The whole run must fit the model's positions (and a sliding window, which compaction cannot cross)."""
        T = seq.context_length + 1
        longest = T + max_new_tokens + max(step_input, *seq.pad_to.values(), 0)
        if self.max_positions is not None and longest > self.max_positions:
            raise UserError(f"model: prompt ({T}) + max_new_tokens ({max_new_tokens}) + step input ({step_input}) "
                            f"exceeds the model's {self.max_positions} positions")
        windows = [layer.sliding_window for layer in getattr(seq.cache, "layers", []) if getattr(layer, "is_sliding", False)]
        if windows and T + max_new_tokens + step_input >= min(windows):
            raise UserError(f"model: sliding window of {min(windows)} tokens: prompt ({T}) + max_new_tokens ({max_new_tokens}) "
                            f"+ step input ({step_input}) must stay below it (KV compaction keeps the whole context)")


class HFSequence:
    """One sequence's transformers cache. Invariant: the cache holds every token before the root."""

    def __init__(self, engine: HFEngine, cache, context_length: int, root: torch.Tensor, pad_to: dict[int, int]):
        self.engine, self.cache = engine, cache
        self.context_length = context_length
        self.root = root  # [1] long
        self.pad_to = pad_to

    def score(self, step: StepInput) -> Scored:
        args = self._inputs(step)
        out = tree_forward(self.engine.model, cache=self.cache, **args)
        n = step.layout.input_length
        logits = out.logits[0]  # [n or m, V]
        hidden = None if out.hidden is None else out.hidden[0]
        if logits.shape[0] > n:  # a padded step: the padding's rows are nobody's
            logits, hidden = logits[:n], None if hidden is None else hidden[:n]
        return Scored(logits, hidden)

    def _inputs(self, step: StepInput) -> dict:
        """The forward's keyword arguments for this step."""
        lay = step.layout
        C = self.context_length
        args = {"position_ids": lay.position_offsets + C, "hidden": step.hidden}
        if lay.input_length == 1:  # a lone token sees the whole cache and itself: no mask, as in generate
            args["attention_mask"] = None
        elif self.engine.kernel_path:  # the tree reaches the kernel as parents; no dense mask
            args.update(attention_mask=None, tree=_kernel_tree(lay, step.tokens.device))
        else:
            args["attention_mask"] = step_mask(lay.mask_block, C)
        if step.extra_embeds is not None:
            embed = self.engine.model.get_input_embeddings()
            x = torch.cat([embed(step.tokens), step.extra_embeds])[None]  # [1, n, hidden]
            args.update(input_ids=None, inputs_embeds=x)
        else:
            args.update(input_ids=step.tokens[None], inputs_embeds=None)
        m = self.pad_to.get(lay.input_length)
        if m and args["attention_mask"] is not None:
            _pad(args, self.root, m, C)
        return args

    def commit(self, verdict) -> None:
        # one launch for all layers on the kernel path; a verified path is increasing, so skip the index check's sync
        self.context_length = compact_cache(self.cache, self.context_length, verdict.path,
                                            kernel=self.engine.kernel_path, validate=False, nodes=verdict.nodes)
        self.root = verdict.root

    def rollback(self, length: int) -> None:
        crop_cache(self.cache, length)
        self.context_length = min(self.context_length, length)


def _kernel_tree(layout, device):
    if layout.kernel_tree is None:
        from decoder.engines.hf.attention import prepare_tree
        from kernels import parents_from_visibility

        layout.kernel_tree = prepare_tree(parents_from_visibility(layout.mask_block), device)
    return layout.kernel_tree


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


def select_attention(model, attention: str) -> None:
    """auto: the tree kernels where they pay (CUDA, triton installed, a model they serve), else as it is;
    kernels: the tree kernels or a one-line error; dense: the dense mask through SDPA (switching the
    kernels off when they were on)."""
    if attention not in ("auto", "kernels", "dense"):
        raise UserError(f"attention: expected auto, kernels or dense, got {attention!r}")
    if attention == "dense":
        from decoder.engines.hf.attention import uses_tree_attention

        if uses_tree_attention(model):
            model.set_attn_implementation("sdpa")
        return
    if attention == "auto":
        if model.get_input_embeddings().weight.device.type != "cuda":
            return
        try:
            import triton  # noqa: F401
        except ImportError:
            return
    from decoder.engines.hf.attention import enable_tree_attention, tree_backend, unsupported_reason, uses_tree_attention

    reason = unsupported_reason(model)
    if reason:
        if attention == "auto":
            return  # the dense mask serves every model the decoder supports
        raise UserError(f"attention='kernels': {reason}; use attention='dense'")
    if not uses_tree_attention(model):
        enable_tree_attention(model, backend=tree_backend(model))
