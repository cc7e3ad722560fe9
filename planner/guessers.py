"""The guesser registry: every kind of guesser, registered once, with what it needs and how it is planned.

    from planner.guessers import kind, kinds
    spec = kind("lookup")            # GuesserKind: its loader, needs, sampling, planning hooks
    [k.name for k in kinds()]        # every registered kind, in registration order

A kind's name is what tree files (settings.guesser), acceptance files (guesser.kind) and the
command line (--guesser KIND[:PATH]) call it; nothing else in the project compares kind names: a
module asks the kind's fields instead (does it need hidden states, how many drafting passes does it
pay per step, which static plan families fit it, ...). The loader is a dotted path
("module:function") that the decoder resolves when the guesser is needed, so this module stays at
the ground floor (numpy only) and every package can read the registry.

Adding a guesser is one module with the guesser (decoder/guesser.py's protocol, and optionally a
per-step source for dynamic plans) plus one `register(GuesserKind(...))` here or in a caller
(tests/test_registry.py registers a toy one in a few lines and decodes with it).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.errors import UserError

PLAIN = "plain"  # the kind that guesses nothing: plain decoding (autotune's fallback, the race's baseline arm)

LOOKUP = "lookup"  # prompt lookup: the kind the n-gram exports and llama.cpp's main job name
LOOKUP_SIGNAL = "lookup"  # the confidence signal of a text match (match length and follow count)
SIGNALS = ("q", LOOKUP_SIGNAL, "none")  # what a per-step plan reads from a candidate: the drafter's probability, lookup's match
PASSES = ("none", "one", "depth")  # drafting passes a step pays: none (lookup, PPD), one (ParallelSpec), one per level


@dataclass(frozen=True)
class GuesserKind:
    """One kind of guesser: what the engine must give it, what it costs, how plans are made for it."""

    name: str
    summary: str  # one line for --help and docs
    loader: str | Callable  # "module:function" (or the function): load(LoadRequest) -> a guesser
    files: str | None = None  # its trained files' directory name under models/<model>/ (None: no files)
    # what it needs of the target engine (decoder/engine.py refuses what an engine lacks)
    needs_hidden: bool = False  # the target's last hidden states (ParallelSpec, chain)
    needs_embeddings: bool = False  # non-token input embeddings (PPD prompt tokens)
    needs_torch: bool = False  # the target's torch modules: embedding, LM head (ParallelSpec, the draft LM)
    branches: bool = True  # its proposals can have siblings (a chain-only engine runs chains)
    samples: bool = False  # under temperature > 0 it draws its candidates from a distribution q
    # planning hooks
    signal: str = "q"  # per-step plans: the candidate's confidence signal
    passes: str = "depth"  # drafting passes per step (cost model: draft_s x passes)
    static: tuple[str, ...] = ()  # static plan families that fit it (planner plan / autotune)
    measure_shape: tuple[int, int] | None = None  # (depth, width) of the comb its acceptance is measured on
    members: tuple[str, ...] = ()  # a hybrid's kinds, lookup first
    loop: str | None = None  # "module:name" of the strategy it decodes with in the one loop (PEARL's rounds); None: Steps
    record_names: tuple[str, ...] = ()  # older acceptance files' guesser.kind values that mean this kind
    autotune: bool = True  # raced by `planner autotune` when its files ship for the model
    guesses: bool = True  # False: it guesses nothing (plain decoding: a plain decision runs the engine's fastest plain)
    export: str | None = None  # serving engines' method it maps to (planner/export.py); None with files: this
    # project's own drafter, which no engine loads

    def __post_init__(self):
        if self.signal not in SIGNALS or self.passes not in PASSES:
            raise ValueError(f"guesser kind {self.name}: signal in {SIGNALS}, passes in {PASSES}")

    @property
    def hybrid(self) -> bool:
        return bool(self.members)

    @property
    def dynamic(self) -> bool:
        """Per-step (dynamic) plans can model it: a confidence signal per candidate."""
        return self.signal != "none" and self.loop is None


_KINDS: dict[str, GuesserKind] = {}


def register(spec: GuesserKind, replace: bool = False) -> GuesserKind:
    if spec.name in _KINDS and not replace:
        raise ValueError(f"guesser kind {spec.name!r} is registered already")
    for m in spec.members:
        if m not in _KINDS:
            raise ValueError(f"hybrid {spec.name}: member {m!r} is not registered")
    _KINDS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def kinds(*, hybrids: bool = True) -> list[GuesserKind]:
    return [k for k in _KINDS.values() if hybrids or not k.hybrid]


def names(*, hybrids: bool = True) -> list[str]:
    return [k.name for k in kinds(hybrids=hybrids)]


def kind(name: str, what: str = "--guesser") -> GuesserKind:
    """The registered kind, or a one-line error listing the choices."""
    spec = _KINDS.get(str(name))
    if spec is None:
        raise UserError(f"{what} {name}: expected one of {', '.join(_KINDS)}")
    return spec


def kind_of_record(record: dict | None) -> GuesserKind | None:
    """The kind an acceptance file's 'guesser' record names (its kind, or an older file's class name)."""
    rec = record or {}
    name = rec.get("kind")
    if name in _KINDS:
        return _KINDS[name]
    for spec in _KINDS.values():
        if name in spec.record_names:
            if spec.record_names == ("ParallelDrafter",):  # one drafter class, two modes: its pass count tells
                if (rec.get("draft_passes") == "one") != (spec.passes == "one"):
                    continue
            return spec
    return None


def hybrid_of(member: str, drafter: str) -> GuesserKind | None:
    """The registered hybrid of lookup-like `member` and `drafter`, if any."""
    return next((k for k in _KINDS.values() if k.members == (member, drafter)), None)


# ---------------------------------------------------------------------------------------------- the kinds

register(GuesserKind(
    PLAIN, "no guesses: plain decoding through the same loop (autotune's plain decision)",
    "decoder.guesser:load_plain", signal="none", passes="none", branches=False, autotune=False, guesses=False))
register(GuesserKind(
    "ppd", "PPD prompt tokens: trained input embeddings guess several distances in the target's own pass",
    "decoder.guessers.prompt_tokens:load", files="prompt_tokens", needs_embeddings=True, needs_torch=True,
    passes="none", static=("ppd", "medusa", "sequoia"), record_names=("PromptTokens",)))
register(GuesserKind(
    "draft", "a draft LM (the project's, on the target's embedding and head, or any HF model with the vocabulary)",
    "decoder.guessers.draft:load", files="draft_lm", needs_torch=True, samples=True, passes="depth",
    static=("chain", "medusa", "sequoia"), measure_shape=(6, 4), record_names=("DraftModelGuesser",),
    export="draft_model"))
register(GuesserKind(
    "parallelspec", "the ParallelSpec drafter: one pass guesses every distance (a Cartesian tree)",
    "decoder.guessers.parallel:load", files="parallelspec", needs_hidden=True, needs_torch=True, passes="one",
    static=("chain", "medusa"), record_names=("ParallelDrafter",)))
register(GuesserKind(
    "chain", "the ParallelSpec drafter run as a chain: one token per pass, its own feature as the next input",
    "decoder.guessers.parallel:load_chain", files="parallelspec", needs_hidden=True, needs_torch=True, passes="depth",
    static=("chain",), measure_shape=(6, 4), record_names=("ParallelDrafter",)))
register(GuesserKind(
    "eagle-head", "an EAGLE-1 or EAGLE-3 head in its released layout (yuhuili, speculators): chains, trees, per-step trees",
    "decoder.guessers.heads:load_eagle", files="eagle3", needs_hidden=True, needs_torch=True, samples=True,
    passes="depth", static=("chain", "medusa", "sequoia"), measure_shape=(6, 4), export="eagle3"))
register(GuesserKind(
    "medusa-heads", "Medusa heads (FasterDecoding's or vLLM's layout): one guess list per distance (a Cartesian tree)",
    "decoder.guessers.heads:load_medusa", files="medusa", needs_hidden=True, needs_torch=True, signal="none",
    passes="one", static=("chain", "medusa"), export="medusa"))
register(GuesserKind(
    LOOKUP, "prompt lookup: what followed the last matching n-gram of the text so far (no model)",
    "decoder.guessers.lookup:load", signal=LOOKUP_SIGNAL, passes="none", branches=False, static=("chain",),
    measure_shape=(6, 1), record_names=("PromptLookupGuesser",), export="ngram"))
register(GuesserKind(
    "oracle", "the oracle: knows the target's continuation (tests and ceilings, not for decoding new text)",
    "decoder.guessers.oracle:load", signal="none", passes="none", autotune=False))
for _drafter in ("draft", "parallelspec", "chain", "ppd", "eagle-head"):
    _d = _KINDS[_drafter]
    register(GuesserKind(
        f"lookup+{_drafter}", f"prompt lookup's continuation and {_drafter}'s candidates in one per-step tree",
        "decoder.guessers.dynamic:load_hybrid", files=_d.files, needs_hidden=_d.needs_hidden, needs_embeddings=_d.needs_embeddings,
        needs_torch=_d.needs_torch, samples=_d.samples, passes=_d.passes, members=("lookup", _drafter),
        export="ngram"))
register(GuesserKind(
    "pearl", "PEARL: the draft LM drafts the next window while the target verifies (two jobs, split cores)",
    "decoder.guessers.draft:load", files="draft_lm", needs_torch=True, samples=True, signal="none", passes="depth",
    loop="decoder.guessers.pearl:Pearl", export="draft_model"))
register(GuesserKind(
    "mtad", "MTAD: the draft LM's beam drafts accepted jointly (not lossless: off unless asked for)",
    "decoder.guessers.mtad:load", files="draft_lm", needs_torch=True, samples=True, signal="none", passes="depth",
    autotune=False))
del _drafter, _d
