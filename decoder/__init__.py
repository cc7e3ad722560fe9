"""Decoder: executes plans on any registered engine, with any guesser, in one decoding loop.

    from decoder import api                       # open_engine, load_plan, generate (decoder/api.py)
    from decoder import PromptTokens, generate    # the loop and the guessers, for library callers

Layout (docs/layout.md): the core `loop` (the one `generate`: plain, a plan's Steps of propose, score,
verify, commit, the engine's Stock generation, PEARL's rounds), `guesser` (the proposer's
protocol), `engine` (the scorer's protocol) and `verify` (the rejection sampler); `config`
(DecodeConfig), `layout`, `noise`, `output`, `batch`; the proposers in `guessers/` (with their loader
`guessers/registry.py`); the engines in `engines/` (one subpackage each, opened by
`engines/registry.py`). Names are imported lazily so that importing `decoder` costs nothing until a
name is used.
"""
import importlib

_EXPORTS = {
    "generate": "decoder.loop",
    "Steps": "decoder.loop",
    "Stock": "decoder.loop",
    "Pearl": "decoder.guessers.pearl",
    "GenerateOutput": "decoder.output",
    "DecodeStats": "decoder.output",
    "PromptTokens": "decoder.guessers.prompt_tokens",
    "prompt_block_mask": "decoder.layout",
    "Guesser": "decoder.guesser",
    "Proposal": "decoder.guesser",
    "PlainGuesser": "decoder.guesser",
    "StepOutcome": "decoder.guesser",
    "OracleGuesser": "decoder.guessers.oracle",
    "DraftModelGuesser": "decoder.guessers.draft",
    "PromptLookupGuesser": "decoder.guessers.lookup",
    "ParallelDrafter": "decoder.guessers.parallel",
    "MTADGuesser": "decoder.guessers.mtad",
    "PearlStats": "decoder.guessers.pearl",
    "plan_layout": "decoder.layout",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'decoder' has no attribute {name!r}")
