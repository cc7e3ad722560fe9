"""Opening the hf engine (planner/engines.py's opener for "hf").

    engine = open_engine(EngineRequest(model="smollm2-135m", threads=2))

The model is loaded by decoder/engines/hf/load.py (weights from its folder, or random weights from a
config for latency profiles when request.weights is False), its tokenizer comes from the same folder
on first use, and torch computes with request.threads on the CPU.
"""
from __future__ import annotations


def open_engine(request):
    """An HFEngine on the model request.model names (decoder.engines.registry.EngineRequest)."""
    import torch

    from decoder.engines.hf.engine import HFEngine
    from decoder.engines.hf.load import load_model
    from decoder.engines.models import default_model_spec

    if request.threads:
        torch.set_num_threads(request.threads)
    loaded = load_model(request.model or default_model_spec(), device=request.device, dtype=request.dtype,
                        weights=request.weights)
    return HFEngine(loaded.model, loaded=loaded)
