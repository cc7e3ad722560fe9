"""Decoder: executes plans on a Hugging Face causal LM, with any guesser, in one decoding loop.

    from decoder import PromptTokens, generate

Layout (docs/layout.md): `loop` (the step loop: propose, score, verify, commit), `guesser` (the
guesser protocol), `registry` (loading a guesser by kind, planner/guessers.py), the target engines
behind `engine` (`hf_engine`, `llama_engine`), `verify` (warping and the verification rules), `layout`,
`forward`, `cache`, `attention`; the guessers `prompt_tokens` (PPD), `draft`, `parallel`, `lookup`,
`oracle`; per-step trees `dynamic` over `pool`; `pearl`, `mtad` and `batch` around the loop.
Names are imported lazily so that importing `decoder` costs nothing until a name is used.
"""
import importlib

_EXPORTS = {
    "generate": "decoder.loop",
    "generate_plain": "decoder.loop",
    "GenerateOutput": "decoder.output",
    "DecodeStats": "decoder.output",
    "PromptTokens": "decoder.guessers.prompt_tokens",
    "prompt_block_mask": "decoder.layout",
    "Guesser": "decoder.guesser",
    "Proposal": "decoder.guesser",
    "StepOutcome": "decoder.guesser",
    "OracleGuesser": "decoder.guessers.oracle",
    "DraftModelGuesser": "decoder.guessers.draft",
    "PromptLookupGuesser": "decoder.guessers.lookup",
    "ParallelDrafter": "decoder.guessers.parallel",
    "MTADGuesser": "decoder.guessers.mtad",
    "generate_mtad": "decoder.guessers.mtad",
    "generate_pearl": "decoder.guessers.pearl",
    "PearlOutput": "decoder.guessers.pearl",
    "PearlStats": "decoder.guessers.pearl",
    "plan_layout": "decoder.layout",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'decoder' has no attribute {name!r}")
