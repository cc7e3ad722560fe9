"""Loading guessers by kind: planner/guessers.py registers the kinds, this module builds them.

    g = load_guesser("lookup", LoadRequest(engine))
    g = load_guesser("eagle-head", LoadRequest(engine, path="models/smollm2-135m/eagle3", top_k=4, depth=6))
    spec = kind_of(g)            # the GuesserKind a guesser object was loaded as

Every loader takes one `LoadRequest` and returns a guesser (decoder/guesser.py's protocol); the
engine is checked first, so a kind the engine cannot run is refused in one line before any file
is read (decoder/engine.py `refuse`). The loaded guesser carries `kind` (its kind's name) and
`source_dir` (its files, None for none), which plans and run records write down.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from decoder.engine import Needs, refuse
from planner.errors import UserError
from planner.guessers import GuesserKind, kind, kind_of_record


@dataclass
class LoadRequest:
    """What a loader may use: the target engine, the guesser's files, and its sizes."""

    target: object  # the engine the guesser will run against (decoder/engine.py), or a bare model
    path: str | None = None  # its files (None: no files, or the caller found none)
    top_k: int | None = None  # guesses per node a plan may use (None: the guesser's files' or its default)
    depth: int | None = None  # chain length without a plan (None: the guesser's default)
    options: dict = field(default_factory=dict)  # kind-specific: ensemble, random prompt tokens, num_tokens...
    label: str = "guesser"


def needs(spec: GuesserKind) -> Needs:
    return Needs(hidden_states=spec.needs_hidden, input_embeddings=spec.needs_embeddings, trees=False,
                 hf_model=spec.needs_torch)


def resolve(loader):
    """A registry entry's loader: the callable itself, or 'module:function' imported on first use."""
    if callable(loader):
        return loader
    module, _, name = str(loader).partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UserError(f"guesser loader {loader!r}: cannot be imported ({e})") from None


def load_guesser(name: str, request: LoadRequest):
    """The guesser of kind `name`, checked against the target engine first."""
    spec = kind(name)
    caps = getattr(request.target, "caps", None)
    if caps is not None:
        refuse(caps, spec.name, needs(spec))
    if spec.files is not None and request.path is None and not spec.hybrid and "random" not in request.options:
        raise UserError(f"--guesser {spec.name}: needs its {spec.files} directory; give {spec.name}:DIR")
    if spec.hybrid:
        request = LoadRequest(request.target, request.path, request.top_k, request.depth,
                              {**request.options, "kind": spec}, request.label)
    g = resolve(spec.loader)(request)
    g.kind = spec.name
    g.source_dir = request.path
    return g


def kind_of(guesser) -> GuesserKind:
    """The kind a guesser object is (set when loaded; for one built directly, from its class)."""
    name = getattr(guesser, "kind", None)
    if isinstance(name, str):
        return kind(name)
    passes = "one" if getattr(guesser, "mode", None) == "parallel" else "depth"
    spec = kind_of_record({"kind": type(guesser).__name__, "draft_passes": passes})
    if spec is None:
        raise UserError(f"guesser {type(guesser).__name__}: not a registered kind (planner/guessers.py)")
    return spec
