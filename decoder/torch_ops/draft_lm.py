"""The project's draft LM: a small Llama of the target's shape on the target's own embedding and LM head
(frozen, shared, never copied), so it has the target's tokenizer and stores only its own layers; and any
Hugging Face causal LM folder with the target's vocabulary. The hf engine opens either as a drafter
(HFEngine.open_drafter -> decoder/torch_ops/draft.py HFDraft); training builds and saves them.

    draft = build_draft_lm(target_model, num_layers=2)      # started from the target's first layers
    save_draft_lm(draft, "models/x/draft_lm", meta)          # draft_lm.safetensors + draft_lm.json
    draft = load_draft_model("models/x/draft_lm", target_model)
"""
from __future__ import annotations

import json

DRAFT_LM_WEIGHTS = "draft_lm.safetensors"
DRAFT_LM_CONFIG = "draft_lm.json"
DRAFT_LM_FORMAT = "tree-planner/draft-lm"


def build_draft_lm(target, num_layers: int = 2, init_from: tuple[int, ...] | None = None):
    """A Llama of `num_layers` layers of the target's shape that shares the target's embedding and
    LM head (frozen, never copied): it has the target's tokenizer and stores only its own layers.
    init_from: target layer indices to start from (default: the first ones)."""
    from transformers import AutoModelForCausalLM

    cfg = type(target.config).from_dict(target.config.to_dict())
    cfg.num_hidden_layers = num_layers
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = cfg.layer_types[:num_layers]
    draft = AutoModelForCausalLM.from_config(cfg, dtype=next(target.parameters()).dtype)
    draft.model.embed_tokens = target.get_input_embeddings()
    draft.lm_head = target.get_output_embeddings()
    src = init_from or tuple(range(num_layers))
    for i, j in enumerate(src):
        draft.model.layers[i].load_state_dict(target.model.layers[j].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    return draft.to(target.device).eval()


def own_state(draft) -> dict:
    """The draft LM's own tensors (its layers and final norm), without the target's shared ones."""
    return {k: v for k, v in draft.state_dict().items() if k.startswith("model.layers.") or k.startswith("model.norm.")}


def save_draft_lm(draft, directory, meta: dict | None = None):
    from pathlib import Path

    from safetensors.torch import save

    from planner.jsonio import atomic_write_bytes

    directory = Path(directory)
    tensors = {k: v.detach().half().cpu().contiguous() for k, v in own_state(draft).items()}
    cfg = {"format": DRAFT_LM_FORMAT, "num_layers": draft.config.num_hidden_layers, **(meta or {})}
    atomic_write_bytes(directory / DRAFT_LM_WEIGHTS, save(tensors))
    atomic_write_bytes(directory / DRAFT_LM_CONFIG, (json.dumps(cfg, indent=1) + "\n").encode())
    return directory


def load_draft_model(path, target):
    """A drafter for `target` from a directory: the project's draft LM (layers only, on the target's
    embedding and head) or any Hugging Face causal LM directory with the target's vocabulary."""
    from pathlib import Path

    from safetensors import SafetensorError
    from safetensors.torch import load

    from planner.jsonio import read_json

    path = Path(path)
    if (path / DRAFT_LM_CONFIG).is_file():
        cfg = read_json(path / DRAFT_LM_CONFIG)
        n = cfg.get("num_layers") if isinstance(cfg, dict) else None
        if cfg.get("format") != DRAFT_LM_FORMAT or not isinstance(n, int) or not 1 <= n <= target.config.num_hidden_layers:
            raise UserError(f"{path / DRAFT_LM_CONFIG}: expected format {DRAFT_LM_FORMAT!r} and 'num_layers' in "
                            f"1..{target.config.num_hidden_layers}")
        try:
            tensors = load((path / DRAFT_LM_WEIGHTS).read_bytes())
        except FileNotFoundError:
            raise UserError(f"{path / DRAFT_LM_WEIGHTS}: file not found") from None
        except (SafetensorError, ValueError) as e:
            raise UserError(f"{path / DRAFT_LM_WEIGHTS}: not a safetensors file ({e})") from None
        draft = build_draft_lm(target, n)
        want = own_state(draft)
        if set(tensors) != set(want) or any(tensors[k].shape != want[k].shape for k in want):
            raise UserError(f"{path / DRAFT_LM_WEIGHTS}: tensors do not fit a {n}-layer draft of this target")
        draft.load_state_dict({k: v.to(want[k].dtype) for k, v in tensors.items()}, strict=False)
        return draft.eval()
    if (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=next(target.parameters()).dtype, local_files_only=True)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: cannot load a draft model ({str(e).splitlines()[0]})") from None
        return model.to(target.device).eval()
    raise UserError(f"{path}: neither a draft LM ({DRAFT_LM_CONFIG}) nor a Hugging Face model directory (config.json)")
