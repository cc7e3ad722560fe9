"""Random-weight heads written in each released layout (decoder/torch_ops/heads.py reads them), for the tests.

Each writer stores the tensors under the names the layout's own releases use, so a test reads the same
bytes a user's download would hold: EAGLE-1 (yuhuili, with Vicuna's fc.bias), EAGLE-3 (yuhuili), the
speculators form, Medusa as FasterDecoding saves it (medusa_lm_head.pt) and as vLLM converts it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from decoder.torch_ops.heads import save_eagle3
from decoder.torch_ops.eagle import EAGLE1, EAGLE3, EagleArch, EagleHead


def target_shape(target) -> tuple[int, int, int, int, int]:
    """(H, intermediate, heads, kv heads, vocabulary) of a transformers Llama target."""
    c = target.config
    return c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size


def random_head(target, kind: str, draft_vocab: int | None = None, seed: int = 0, scale: float = 1.0) -> EagleHead:
    H, I, nh, nkv, V = target_shape(target)
    L = target.config.num_hidden_layers
    aux = (2, L // 2, L - 3) if L > 4 else tuple(range(min(3, L)))
    arch = EagleArch(kind, H, I, nh, nkv, H // nh, 1e-6, V, draft_vocab or V, rope={"rope_theta": 10000.0},
                     aux_layers=aux if kind == EAGLE3 else (), target_hidden_size=H if kind == EAGLE3 else 0,
                     fc_bias=kind == EAGLE1)
    torch.manual_seed(seed)
    head = EagleHead(arch)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, scale / p.shape[1] ** 0.5)
        if kind == EAGLE3 and arch.draft_vocab_size != V:
            ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[: arch.draft_vocab_size].sort().values
            head.d2t.copy_(ids - torch.arange(arch.draft_vocab_size))
    return head


def trained_like_head(target, draft_vocab: int | None = None, noise: float = 0.02, seed: int = 0) -> EagleHead:
    """An EAGLE-3 head started from the target (decoder.torch_ops.eagle.eagle3_from_target) and perturbed: on a
    tiny target it guesses right often, so the tests exercise accepted paths. draft_vocab: the target's ids it
    keeps, the ones its greedy text uses most."""
    from decoder.torch_ops.eagle import eagle3_from_target

    H, _, _, _, V = target_shape(target)
    L = target.config.num_hidden_layers
    aux = (2, L // 2, L - 3) if L > 4 else tuple(range(min(3, L)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        text = torch.randint(1, V, (4, 24), generator=g)
        freq = torch.bincount(target(input_ids=text).logits.argmax(-1).reshape(-1), minlength=V).float()
    ids = freq.topk(draft_vocab or V).indices.sort().values
    head = eagle3_from_target(target, aux, ids)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.add_(noise * torch.randn(p.shape, generator=g) * p.abs().mean())
    head.share("target_embedding", None)
    return head


def _llama_config(a: EagleArch, **extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
            "num_key_value_heads": a.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": a.rms_norm_eps,
            "vocab_size": a.vocab_size, "rope_theta": 10000.0, "hidden_act": "silu", **extra}


def _layer_tensors(head: EagleHead, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"{prefix}self_attn.{name}.weight"] = getattr(head, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"{prefix}mlp.{name}.weight"] = getattr(head, name).weight
    out[f"{prefix}post_attention_layernorm.weight"] = head.post_attention_layernorm.weight
    return out


def _save(directory: Path, config: dict, tensors: dict, name: str = "model.safetensors") -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / name))
    return directory


def write_eagle1(head: EagleHead, directory) -> Path:
    """yuhuili's EAGLE-1 layout as a PyTorch pickle (pytorch_model.bin), fc.bias as the Vicuna heads carry it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias, **_layer_tensors(head, "layers.0.")}
    (directory / "config.json").write_text(json.dumps(_llama_config(head.arch)))
    torch.save({k: v.detach().clone() for k, v in tensors.items()}, directory / "pytorch_model.bin")
    return directory


def write_eagle3(head: EagleHead, directory) -> Path:
    return save_eagle3(head, directory)


def write_speculators(head: EagleHead, directory, embedding: torch.Tensor) -> Path:
    a = head.arch
    tensors = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight,
               "embed_tokens.weight": embedding, **_layer_tensors(head, "layers.0."),
               "layers.0.input_layernorm.weight": head.input_layernorm.weight,
               "layers.0.hidden_norm.weight": head.hidden_norm.weight}
    if a.draft_vocab_size != a.vocab_size:
        tensors["d2t"] = head.d2t
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": _llama_config(a), "draft_vocab_size": a.draft_vocab_size,
              "norm_before_residual": a.norm_before_residual,
              "eagle_aux_hidden_state_layer_ids": list(a.aux_layers),
              "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]}}}
    return _save(Path(directory), config, tensors)


def random_medusa(target, heads: int = 3, layers: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """FasterDecoding's names: {h}.{l}.linear.{weight,bias}, {h}.{layers}.weight."""
    H, _, _, _, V = target_shape(target)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for h in range(heads):
        for l in range(layers):
            out[f"{h}.{l}.linear.weight"] = torch.randn(H, H, generator=g) / H ** 0.5
            out[f"{h}.{l}.linear.bias"] = torch.randn(H, generator=g) * 0.1
        out[f"{h}.{layers}.weight"] = target.lm_head.weight.detach().clone() + 0.05 * torch.randn(V, H, generator=g)
    return out


def write_medusa(tensors: dict, directory, heads: int, layers: int) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                       "base_model_name_or_path": "target"}))
    torch.save(tensors, directory / "medusa_lm_head.pt")
    return directory


def write_medusa_vllm(tensors: dict, directory, heads: int, layers: int, hidden: int, vocab: int) -> Path:
    renamed = {}
    for name, t in tensors.items():
        p = name.split(".")
        renamed[f"lm_heads.{p[0]}.weight" if p[1] == str(layers) else f"blocks.{p[0]}.layers.{p[1]}.{p[3]}"] = t
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": heads, "num_hidden_layers": layers,
              "hidden_size": hidden, "vocab_size": vocab, "medusa_fc_bias": True}
    return _save(Path(directory), config, renamed)
