"""What training needs of the hf engine's torch modules (caps.torch_modules): training backpropagates
through a frozen transformers target, so its passes over the target are this package's, handed out by
the engine (HFEngine.training() -> TrainingPasses), and training/ never reaches into the model.

    passes = engine.training()                                        # the target frozen, in eval mode
    logits, feats = passes.teacher(windows, hidden=True)              # the teacher's outputs (training/teacher.py)
    prompt_logits, prefix_logits = passes.prompt_pass(x, embeds, positions, mask)   # PPD (training/prompts.py)
    drafter = passes.parallel_drafter(num_masks, head_ids, top_k)     # ParallelSpec from the target's last layer
    draft = passes.draft_lm(num_layers)                               # the project's draft LM on its embedding and head
    params = draft_lm_parameters(draft)                               # the draft LM's own layers and final norm
    hidden, head = draft_lm_features(draft, x)                        # its final hidden states and LM head
"""
from __future__ import annotations

import torch

from decoder.torch_ops.forward import kv
from decoder.engines.hf.load import config_hash


def architecture_hash(model) -> str:
    """The model's architecture fingerprint (decoder.engines.hf.load.config_hash of its own config):
    what caches of its outputs are keyed by."""
    return config_hash(model.config)


def teacher_pass(model, input_ids: torch.Tensor, hidden) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's logits [B, T, V] on windows [B, T] (any device: moved to the model's) and, with `hidden`
    (decoder.engine.Features), those features [B, T, F]: True the last hidden state after the final norm
    (what ParallelSpec regresses), layer ids the streams entering those layers (an EAGLE-3 head's input)."""
    from decoder.torch_ops.forward import pick_features

    dev = model.get_input_embeddings().weight.device
    out = model(input_ids=input_ids.to(dev), output_hidden_states=bool(hidden))
    return out.logits, pick_features(out.hidden_states, hidden)


def prompt_pass(model, input_ids: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PPD prompt-token training's two passes of the frozen target: the prefix x [B, T] without gradients
    into a KV cache, then the input embeddings [B, L, H] after it at `position_ids` [B, L] under the additive
    mask [B, 1, L, T + L]. Returns (the embeddings' logits [B, L, V], the prefix's logits [B, T, V]);
    gradients reach only `embeds`, since the cache is a constant for the second pass."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        prefix = model(input_ids=input_ids, **kv(cache), use_cache=True).logits
    out = model(inputs_embeds=embeds, position_ids=position_ids, attention_mask=attention_mask, **kv(cache),
                use_cache=True)
    return out.logits, prefix


def parallel_drafter_for(target, num_masks: int, head_ids: torch.Tensor | None, top_k: int):
    """A ParallelSpec drafter of the target's shape on its frozen embedding and head, started from the
    target's last layer and final norm (its features are what the drafter's slots carry), masks ~ N(0, 0.02)."""
    from decoder.guessers.parallel import ParallelDrafter, arch_of

    d = ParallelDrafter(arch_of(target.config), num_masks, head_ids, top_k=top_k).attach(target)
    with torch.no_grad():
        d.body.layers[0].load_state_dict(target.model.layers[-1].state_dict())
        d.body.norm.load_state_dict(target.model.norm.state_dict())
        d.masks.normal_(std=0.02)
    return d


def draft_lm_parameters(draft) -> list[torch.nn.Parameter]:
    """The draft LM's own parameters (its layers and final norm; decoder/torch_ops/draft_lm.py build_draft_lm), without
    the target's embedding and head it shares: what training updates."""
    return [p for n, p in draft.named_parameters() if n.startswith(("model.layers.", "model.norm."))]


def draft_lm_features(draft, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the draft LM's last hidden state [B, T, H] after its final norm, with gradients, its LM head's
    weight [V, H]): the loss applies the head itself, restricted to the frequent tokens when asked."""
    return draft.model(input_ids=input_ids).last_hidden_state, draft.get_output_embeddings().weight


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's trainable tensors by name (a drafter around transformers layers; the target's frozen
    modules it shares are left out): what a checkpoint keeps."""
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k in trainable}


class TrainingPasses:
    """The frozen target's passes training backpropagates through (HFEngine.training(), caps.torch_modules)."""

    def __init__(self, model):
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype

    def architecture_hash(self) -> str:
        return architecture_hash(self.model)

    def teacher(self, input_ids: torch.Tensor, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return teacher_pass(self.model, input_ids, hidden)

    def prompt_pass(self, input_ids: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return prompt_pass(self.model, input_ids, embeds, position_ids, attention_mask)

    def parallel_drafter(self, num_masks: int, head_ids: torch.Tensor | None, top_k: int):
        return parallel_drafter_for(self.model, num_masks, head_ids, top_k)

    def draft_lm(self, num_layers: int, init_from: tuple[int, ...] | None = None):
        from decoder.torch_ops.draft_lm import build_draft_lm

        return build_draft_lm(self.model, num_layers, init_from)

    def eagle3_head(self, aux_layers: tuple[int, ...], draft_ids: torch.Tensor):
        """A new EAGLE-3 head on the target's embedding, started from its last layer, final norm and head
        (decoder/torch_ops/eagle.py eagle3_from_target)."""
        from decoder.torch_ops.eagle import eagle3_from_target

        return eagle3_from_target(self.model, aux_layers, draft_ids)

    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def trainable(self) -> bool:
        """Whether any of the target's parameters would take a gradient (training checks it never does)."""
        return any(p.requires_grad for p in self.model.parameters())
