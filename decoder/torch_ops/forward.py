"""The tree forward pass, shared by the decoder (which runs it) and the profiler (which times it).

One decoding step feeds n new tokens after a KV cache of C tokens. Tree token i sees the whole
cache and its own ancestors within the tree (and itself); this is expressed as a 4D additive
mask [B, 1, n, C + n] plus explicit position ids, which stock transformers accepts without any
change to model code.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


def tree_attention_mask(
    ancestors, prefix_len: int, dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """Additive 4D mask [1, 1, n, prefix_len + n] from the [n, n] bool ancestor matrix
    (planner.tree.ancestor_matrix; numpy or torch): 0 where visible, the dtype's minimum elsewhere."""
    visible = torch.as_tensor(ancestors).cpu()
    block = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return step_mask(block.to(device), prefix_len)


def step_mask(mask_block: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """The step's additive 4D mask [1, 1, n, prefix_len + n] from its [n, n] block among the tree
    tokens: the whole prefix is visible. Built on the block's device, as the decoder does every step."""
    n = mask_block.shape[0]
    mask = torch.zeros(1, 1, n, prefix_len + n, dtype=mask_block.dtype, device=mask_block.device)
    mask[..., prefix_len:] = mask_block
    return mask


def _cache_keyword() -> str:
    """transformers renamed the forward's KV-cache argument from `past_key_values` to `cache` (the
    old name warns and goes in 5.40); the GPU machines' 5.17 knows only the old one."""
    import inspect

    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


_CACHE_KEYWORD: list[str] = []


def kv(cache) -> dict:
    """The KV cache as the forward's keyword argument: model(input_ids=x, **kv(cache), use_cache=True)."""
    if not _CACHE_KEYWORD:
        _CACHE_KEYWORD.append(_cache_keyword())
    return {_CACHE_KEYWORD[0]: cache}


class ForwardOut(NamedTuple):
    logits: torch.Tensor  # [B, n, V] (prefill: [B, 1, V], the last position only)
    hidden: torch.Tensor | None  # [B, n, F] the features asked for (decoder.engine.Features), when asked
    cache: object  # the transformers cache the pass extended


def pick_features(hidden_states: tuple, features) -> torch.Tensor | None:
    """The features a drafter reads (decoder.engine.Features) from transformers' `hidden_states`, which hold
    the embeddings' output, then each layer's output: entry i < L is the residual stream entering layer i,
    entry L the last layer's output after the final norm. True: that last entry [..., H]; layer ids: the
    streams entering those layers, concatenated in the order given [..., k H] (EAGLE-3's fc input)."""
    if not features:
        return None
    if features is True:
        return hidden_states[-1]
    return torch.cat([hidden_states[i] for i in features], dim=-1)


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, hidden=False) -> ForwardOut:
    """Run the prompt [B, T] through the model into a new cache.

    Only the last position's logits are computed: the decoder needs no others, and [T, V] logits
    of a long prompt cost memory and time for nothing.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, **kv(cache), use_cache=True, logits_to_keep=1, output_hidden_states=bool(hidden))
    return ForwardOut(out.logits, pick_features(out.hidden_states, hidden), cache)


@torch.inference_mode()
def tree_forward(model, input_ids: torch.Tensor | None, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache, inputs_embeds: torch.Tensor | None = None, tree=None, hidden=False) -> ForwardOut:
    """One forward pass of n tree tokens [B, n] over `cache`; returns logits [B, n, V] (and, with `hidden`
    a decoder.engine.Features spec, the features [B, n, F] drafters read of the target).

    Pass `inputs_embeds` [B, n, hidden] (and input_ids=None) when some inputs are not vocabulary
    tokens (PPD prompt tokens). The cache grows by n entries; the caller keeps the accepted ones
    (decoder) or resets it to the prefix (profiler).
    `tree`: for a model switched to the tree kernels (decoder.engines.hf.attention.enable_tree_attention),
    the step's tree as a kernels.TreeMask (decoder.engines.hf.attention.prepare_tree) instead of the dense
    `attention_mask` (then None); the caller knows which path it runs, so this module never
    imports the kernels (and triton) itself.
    """
    extra = {} if tree is None else {"tree_parents": tree}
    out = model(
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        position_ids=position_ids,
        attention_mask=attention_mask,
        **kv(cache),
        use_cache=True,
        output_hidden_states=bool(hidden),
        **extra,
    )
    return ForwardOut(out.logits, pick_features(out.hidden_states, hidden), cache)
