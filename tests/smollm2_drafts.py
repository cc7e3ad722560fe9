"""Draft LMs in the project's format (decoder/torch_ops/draft_lm.py) made for SmolLM2 on the fly, for the tests
that check how a draft LM is written and loaded (no trained draft LM ships: the EAGLE-3 head replaced it)."""
from __future__ import annotations

from pathlib import Path


def smollm2_draft_lm(folder: Path, layers: int = 2) -> Path:
    """The target's last `layers` layers and final norm on its embedding and head: with every layer it is the
    target itself, so a server that drafts with it accepts every draft."""
    from decoder.engines.hf.load import load_model
    from decoder.torch_ops.draft_lm import build_draft_lm, save_draft_lm

    model = load_model("smollm2-135m", device="cpu", dtype="fp32").model
    n = model.config.num_hidden_layers
    draft = build_draft_lm(model, layers, init_from=tuple(range(n - layers, n)))
    save_draft_lm(draft, folder, {"target": "smollm2-135m"})
    return Path(folder)
