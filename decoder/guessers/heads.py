"""The heads users already have as guessers: the registry's loaders for kinds `eagle-head` (EAGLE-1 and EAGLE-3
heads in yuhuili's or speculators' layout) and `medusa-heads` (FasterDecoding's or vLLM's Medusa).

The engine reads a head against its own model (Engine.open_drafter, Engine.open_heads: the hf engine's
decoder/torch_ops/heads.py checks every tensor); a bare transformers model, which tests and training hand
over directly, is read the same way here. What a folder is (`head_kind`, `serving_method`) needs its config
and tensor names only.
"""
from __future__ import annotations

from decoder.torch_ops.heads import head_kind, head_layout, serving_method  # noqa: F401 (re-exported: the CLI asks)


def open_eagle(path, target, label: str | None = None):
    """An EAGLE head as a decoder/drafter.py DraftModel for `target`: an engine (it reads the head against
    its model) or a bare transformers model."""
    if hasattr(target, "caps"):
        return target.open_drafter(path, label)
    from decoder.torch_ops.heads import open_eagle as read

    return read(path, target, label)


def open_heads(path, target):
    """Medusa heads for `target`, an engine or a bare transformers model."""
    if hasattr(target, "caps"):
        return target.open_heads(path)
    from decoder.torch_ops.heads import open_medusa

    return open_medusa(path, target)


def load_eagle(request):
    """The registry's loader for kind 'eagle-head' (planner/guessers.py): any EAGLE-1/3 layout in request.path."""
    from decoder.guessers.draft import DraftModelGuesser

    drafter = open_eagle(request.path, request.target, str(request.path))
    depth = request.depth if request.depth is not None else 3
    return DraftModelGuesser(drafter, top_k=request.top_k or 8, depth=depth, label=str(request.path))


def load_medusa(request):
    """The registry's loader for kind 'medusa-heads': FasterDecoding's or vLLM's Medusa heads in request.path."""
    from decoder.guessers.medusa import MedusaGuesser

    return MedusaGuesser(open_heads(request.path, request.target), top_k=request.top_k or 8, label=str(request.path))
