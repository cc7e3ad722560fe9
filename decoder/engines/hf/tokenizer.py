"""Loading a model's tokenizer (with its chat template) from its folder: transformers' job, so the hf
engine's. HFEngine.tokenizer loads it lazily for an opened model; callers that need only the tokenizer
(vLLM's race prompts, which another process decodes) load it here without loading the model."""
from __future__ import annotations

from pathlib import Path


def load_tokenizer(folder: str | Path, local_only: bool = False):
    """The transformers tokenizer saved in `folder`; local_only: never look beyond the folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=local_only)
