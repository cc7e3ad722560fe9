"""The decoder's adapter to the tree kernels: tree attention inside stock transformers models,
through the attention-function registry.

`enable_tree_attention(model)` registers the attention implementation "tree_triton" and switches
the model to it; no model code is forked. A tree step then calls the model with
`attention_mask=None` and `tree_parents=TreeMask` (see `prepare_tree`): transformers passes
unknown forward kwargs down to every attention call, and since "tree_triton" registers a mask
function that builds nothing for mask-less calls, no dense [n, C + n] mask exists anywhere.

Per attention call:
- tree step (tree_parents given): the Triton kernel on CUDA; elsewhere PyTorch SDPA with a bool
  mask unpacked from the tree (or the kernel / reference when the backend says so).
- other steps (prefill, one-token decode): PyTorch SDPA with transformers' own mask, or, when
  that mask is absent and the query block sits after a cache (a chunk), causal attention with
  the cache offset, which is a chain tree.

Limits: decoder models whose attention modules follow transformers' AttentionInterface (Llama,
Qwen2, Mistral...); no logit softcap; sliding windows only while the keys fit in the window
(`unsupported_reason(model)` says why a model cannot use the kernels). A 2D padding mask is
honoured on non-tree steps only.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F

from kernels import TreeMask, tree_attention, tree_mask

ATTN_NAME = "tree_triton"
BACKENDS = ("auto", "triton", "sdpa", "reference")
_BACKEND_ATTR = "_tree_attention_backend"


@lru_cache(maxsize=64)
def _cached_tree(parents: tuple[int, ...], device: str) -> TreeMask:
    return tree_mask(list(parents), device=device)


def prepare_tree(parents: TreeMask | torch.Tensor | Sequence[int], device: torch.device | str) -> TreeMask:
    """The tree's compact form on `device`, cached per tree shape (a planned tree repeats every step)."""
    if isinstance(parents, TreeMask):
        return parents
    if isinstance(parents, torch.Tensor):
        parents = parents.tolist()
    return _cached_tree(tuple(int(p) for p in parents), str(torch.device(device)))


def _chain(n: int, device: torch.device) -> TreeMask:
    return _cached_tree(tuple(range(-1, n - 1)), str(device))


def _sdpa(query, key, value, mask, scaling, is_causal=False):
    # query [B, H, n, d], key/value [B, H_kv, L, d]; returns [B, n, H, d] as transformers expects.
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, is_causal=is_causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous()


def _tree_step(query, key, value, tm: TreeMask, scaling: float, backend: str) -> torch.Tensor:
    B, H, n, D = query.shape
    prefix_len = key.shape[2] - n
    if backend == "auto":
        backend = "triton" if query.is_cuda else "sdpa"
    if backend == "sdpa":
        anc = tm.ancestors.to(query.device)
        visible = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device=query.device), anc], dim=1)
        return _sdpa(query, key, value, visible, scaling)
    out = torch.empty(B, n, H, D, dtype=query.dtype, device=query.device)  # written through a [B, H, n, d] view
    tree_attention(query, key, value, tm, prefix_len, backend=backend, out=out.transpose(1, 2), scale=scaling)
    return out


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tree_parents: TreeMask | torch.Tensor | Sequence[int] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, H, n, d], key/value [B, H_kv, L, d] (cache included)."""
    n, L = query.shape[2], key.shape[2]
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{ATTN_NAME} attention does not implement logit softcapping")
    window = kwargs.get("sliding_window")
    if window is not None and L > window:
        # below the window nothing is cut off (a query's farthest key is at most L - 1 positions back)
        raise ValueError(f"{ATTN_NAME} attention: {L} keys exceed the sliding window of {window}")
    backend = getattr(getattr(module, "config", None), _BACKEND_ATTR, "auto")
    if tree_parents is not None:
        tm = prepare_tree(tree_parents, query.device)
        if tm.n != n:
            raise ValueError(f"tree_parents has {tm.n} nodes but the step feeds {n} tokens")
        return _tree_step(query, key, value, tm, scaling, backend), None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
            attention_mask = attention_mask.to(query.dtype)
        return _sdpa(query, key, value, attention_mask, scaling), None
    if n == 1 or n == L:
        return _sdpa(query, key, value, None, scaling, is_causal=n > 1), None
    # A block of n tokens after a cache of L - n: causal with an offset is the chain tree.
    return _tree_step(query, key, value, _chain(n, query.device), scaling, backend), None


def _tree_mask_function(*, attention_mask=None, **kwargs):
    """Mask function for "tree_triton": padding masks go through sdpa's builder; mask-less calls get none."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register "tree_triton" with transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, tree_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, _tree_mask_function)


def unsupported_reason(model) -> str | None:
    """Why the tree kernels cannot serve `model`, or None when they can.

    Sliding-window models pass: the kernels serve them while the keys fit in the window (the
    decoder keeps its context below it) and raise past it.
    """
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not route attention through transformers' attention interface"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "attn_logit_softcapping", None):
        return f"{type(model).__name__} uses attention logit softcapping, which the tree kernel does not implement"
    return None


def enable_tree_attention(model, backend: str = "auto"):
    """Switch `model` to the tree kernels; returns the model.

    backend: "auto" (Triton on CUDA, SDPA with an unpacked tree mask elsewhere), "triton" (the
    kernel; on the CPU only under TRITON_INTERPRET=1), "sdpa", or "reference" (plain PyTorch).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    reason = unsupported_reason(model)
    if reason:
        raise ValueError(f"tree kernels: {reason}")
    register()
    model.set_attn_implementation(ATTN_NAME)
    setattr(model.config, _BACKEND_ATTR, backend)
    return model


def tree_backend(model) -> str:
    """The backend the kernels were last switched on with ("auto" when never): switching back keeps it."""
    return getattr(model.config, _BACKEND_ATTR, "auto")


def uses_tree_attention(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ATTN_NAME
