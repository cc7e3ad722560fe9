"""Decoder: runs a planned tree with a guesser (PPD prompt tokens, an oracle) on a Hugging Face causal LM.

    from decoder import PromptTokens, generate

Names are imported lazily so that `planner` subcommands in this package start without torch.
"""
import importlib

_EXPORTS = {
    "generate": "decoder.step",
    "generate_plain": "decoder.step",
    "GenerateOutput": "decoder.step",
    "DecodeStats": "decoder.step",
    "PromptTokens": "decoder.prompt_tokens",
    "prompt_block_mask": "decoder.prompt_tokens",
    "Guesser": "decoder.guessers",
    "OracleGuesser": "decoder.guessers",
    "build_plan_buffers": "decoder.buffers",
    "measure_accuracy": "decoder.acceptance",
    "measure_transitions": "decoder.acceptance",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'decoder' has no attribute {name!r}")
