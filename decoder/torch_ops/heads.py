"""The drafters users already have: EAGLE-1, EAGLE-3 and Medusa heads in their released layouts, read and
checked against a transformers target (the hf engine's model, or a bare one in tests and training).

    drafter = open_eagle("path/to/head", model)        # an EAGLE-1/3 head as a decoder/drafter.py DraftModel
    heads = open_medusa("path/to/medusa", model)       # Medusa heads (decoder/guessers/medusa.py runs them)

Layouts read (tensor names as vLLM 0.32 loads them; H the head's width, Ht the target's, V the target's
vocabulary, Vd a draft vocabulary):
  eagle        EAGLE-1 (yuhuili/EAGLE-*): a one-layer Llama config; fc.weight [H, 2H] (+ fc.bias),
               layers.0.self_attn.{q,k,v,o}_proj, layers.0.mlp.{gate,up,down}_proj,
               layers.0.post_attention_layernorm; no input norm, no final norm; the target's embedding
               and LM head (embed_tokens too in some releases)
  eagle3       EAGLE-3 (yuhuili/EAGLE3-*): architectures LlamaForCausalLMEagle3 (or LlamaForCausalLM) with
               draft_vocab_size; midlayer.* (q, k, v over 2H), midlayer.hidden_norm, midlayer.input_layernorm,
               norm, fc.weight [H, k Ht] over k target layers (eagle_config.eagle_aux_hidden_state_layer_ids,
               default the streams entering layers 2, L/2, L-3), lm_head [Vd, H] (absent: the target's,
               Vd = V), d2t [Vd] (target id = draft id + d2t), t2d [V]
  speculators  vllm-project/speculators (speculators_model_type "eagle3", transformer_layer_config,
               eagle_aux_hidden_state_layer_ids): EAGLE-3 named layers.0.*, with embed_tokens
  medusa       FasterDecoding's medusa_lm_head.pt ({h}.{l}.linear.{weight,bias}, {h}.{L}.weight) with
               medusa_num_heads / medusa_num_layers, or vLLM's converted folder (model_type medusa,
               blocks.{h}.layers.{l}.*, lm_heads.{h}.weight)
Every tensor is checked against the target before anything runs: a missing, unexpected or misshapen one
is refused in one line naming it (vLLM leaves a missing EAGLE tensor uninitialised without a word).
`save_eagle3` writes the released EAGLE-3 layout (the project's trained head ships in it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from decoder.torch_ops.eagle import EAGLE1, EAGLE3, EagleArch, EagleDraft, EagleHead, MedusaHeads
from planner.errors import UserError

LAYOUTS = ("eagle", "eagle3", "speculators", "medusa", "medusa-vllm")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "medusa_lm_head.safetensors", "medusa_lm_head.pt")
MAX_HEADS = 16  # Medusa heads; released ones have 3-5


@dataclass
class HeadFolder:
    """A head's folder as read: its layout, config and tensors (names as stored)."""

    path: Path
    layout: str
    config: dict
    tensors: dict[str, torch.Tensor]
    weights: Path  # the file the tensors came from


@dataclass(frozen=True)
class Target:
    """What a head is checked against: the target's width, vocabulary and depth."""

    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def of(cls, model) -> "Target":
        cfg = model.config
        return cls(int(cfg.hidden_size), int(model.get_input_embeddings().weight.shape[0]), int(cfg.num_hidden_layers))


# ---------------------------------------------------------------------------------------------- reading


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load

            return load(path.read_bytes())
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except Exception as e:  # noqa: BLE001 (safetensors and torch raise many kinds for a bad file)
        raise UserError(f"{path}: not a readable weights file ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a dictionary of tensors")
    return state


def _layout(config: dict, names: set[str]) -> str:
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "eagle3":
            raise UserError(f"config.json: field 'speculators_model_type' is {config['speculators_model_type']!r}; "
                            "this project reads speculators' eagle3 heads")
        return "speculators"
    if config.get("model_type") == "medusa":
        return "medusa-vllm"
    if any(k.startswith("medusa") for k in config) or any(n.split(".")[0].isdigit() for n in names):
        return "medusa"
    archs = " ".join(config.get("architectures") or [])
    if "Eagle3" in archs or any(n.startswith("midlayer.") for n in names) or "draft_vocab_size" in config:
        return "eagle3"
    return "eagle"


def _tensor_names(path: Path) -> dict[str, torch.Tensor]:
    """The stored names (values empty) without reading the weights, where the format allows (safetensors)."""
    if path.suffix != ".safetensors":
        return _read_tensors(path)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: torch.empty(0) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable weights file ({str(e).splitlines()[0][:120]})") from None


def read_head(path, names_only: bool = False) -> HeadFolder:
    """A head folder's layout, config and tensors (names_only: the names, with empty tensors); a one-line error
    for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--drafter {path}: not a directory (a head's folder: config.json and its weights)")
    cfg_file = path / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise UserError(f"{cfg_file}: file not found (a released head ships its config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{cfg_file}: expected a JSON object")
    weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if weights is None:
        raise UserError(f"{path}: no weights file (expected one of {', '.join(WEIGHT_FILES)})")
    tensors = _tensor_names(weights) if names_only else _read_tensors(weights)
    return HeadFolder(path, _layout(config, set(tensors)), config, tensors, weights)


def _int(cfg: dict, key: str, where: str, default=None) -> int:
    v = cfg.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UserError(f"{where}: field {key!r} must be a positive integer, got {v!r}")
    return v


def _rope(cfg: dict) -> dict:
    """The config's rope fields as a transformers LlamaConfig takes them."""
    keys = ("rope_parameters", "rope_theta", "rope_scaling")
    return {k: cfg[k] for k in keys if cfg.get(k) is not None}


# ---------------------------------------------------------------------------------------------- EAGLE


def eagle_arch(folder: HeadFolder, target: Target) -> EagleArch:
    """The head's architecture from its config, checked against the target."""
    where = f"{folder.path / 'config.json'}"
    cfg = dict(folder.config)
    if folder.layout == "speculators":
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise UserError(f"{where}: field 'transformer_layer_config' must be an object (a Llama layer's config)")
        cfg = {**layer, **{k: v for k, v in cfg.items() if k != "transformer_layer_config"}}
    eagle_cfg = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    H = _int(cfg, "hidden_size", where)
    nh = _int(cfg, "num_attention_heads", where)
    kind = EAGLE1 if folder.layout == "eagle" else EAGLE3
    V = _int(cfg, "vocab_size", where, target.vocab_size)
    if V != target.vocab_size:
        raise UserError(f"{where}: vocab_size {V}, the target's vocabulary has {target.vocab_size} tokens "
                        "(a head drafts in its target's vocabulary)")
    if kind == EAGLE1 and H != target.hidden_size:
        raise UserError(f"{where}: hidden_size {H}, the target's is {target.hidden_size} (EAGLE-1 reads the "
                        "target's last hidden state as it is)")
    aux: tuple[int, ...] = ()
    if kind == EAGLE3:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
        L = target.num_layers
        aux = tuple(ids) if ids else (2, L // 2, L - 3)
        # the stream entering layer i; vLLM also allows L (the last layer's output before the final norm), which
        # transformers does not return, so a head reading it is refused rather than fed the normed state
        if not all(isinstance(i, int) and 0 <= i < L for i in aux) or len(set(aux)) != len(aux):
            raise UserError(f"{where}: eagle_aux_hidden_state_layer_ids {list(aux)}: expected distinct layer ids "
                            f"in 0..{L - 1} (the streams entering the target's {L} layers)")
        aux = tuple(sorted(aux))  # vLLM captures them in layer order, whatever order the config lists
    Ht = int(cfg.get("target_hidden_size") or target.hidden_size) if kind == EAGLE3 else 0
    if kind == EAGLE3 and Ht != target.hidden_size:
        raise UserError(f"{where}: target_hidden_size {Ht}, the target's hidden size is {target.hidden_size} "
                        "(the head was trained for another target)")
    norm_residual = cfg.get("norm_before_residual", folder.layout == "speculators")
    return EagleArch(
        kind=kind, hidden_size=H, intermediate_size=_int(cfg, "intermediate_size", where), num_attention_heads=nh,
        num_key_value_heads=_int(cfg, "num_key_value_heads", where, nh),
        head_dim=_int(cfg, "head_dim", where, H // nh), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        vocab_size=V, draft_vocab_size=_int(cfg, "draft_vocab_size", where, V) if kind == EAGLE3 else V,
        rope=_rope(cfg), max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        hidden_act=str(cfg.get("hidden_act", "silu")), aux_layers=aux,
        target_hidden_size=Ht,
        fc_bias="fc.bias" in folder.tensors, qkv_bias=bool(cfg.get("attention_bias", False)),
        norm_before_residual=bool(norm_residual), norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        fc_norm=bool(cfg.get("fc_norm", False)), norm_output=bool(cfg.get("norm_output", False)))


def _layer_prefix(layout: str) -> str:
    return "midlayer." if layout == "eagle3" else "layers.0."


def eagle_names(a: EagleArch, layout: str) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Stored tensor name -> (shape, required) of a head in `layout` (EagleHead's own name is the mapping's)."""
    p = _layer_prefix(layout)
    H, hd, I = a.hidden_size, a.head_dim, a.intermediate_size
    qkv_in = 2 * H if a.kind == EAGLE3 else H
    out = {
        "fc.weight": ((H, a.fc_in), True),
        f"{p}self_attn.q_proj.weight": ((a.num_attention_heads * hd, qkv_in), True),
        f"{p}self_attn.k_proj.weight": ((a.num_key_value_heads * hd, qkv_in), True),
        f"{p}self_attn.v_proj.weight": ((a.num_key_value_heads * hd, qkv_in), True),
        f"{p}self_attn.o_proj.weight": ((H, a.num_attention_heads * hd), True),
        f"{p}mlp.gate_proj.weight": ((I, H), True),
        f"{p}mlp.up_proj.weight": ((I, H), True),
        f"{p}mlp.down_proj.weight": ((H, I), True),
        f"{p}post_attention_layernorm.weight": ((H,), True),
        "embed_tokens.weight": ((a.vocab_size, H), a.kind == EAGLE3 and H != a.target_hidden_size),
    }
    if a.fc_bias:
        out["fc.bias"] = ((H,), True)
    if a.qkv_bias:
        for n, rows in (("q", a.num_attention_heads), ("k", a.num_key_value_heads), ("v", a.num_key_value_heads)):
            out[f"{p}self_attn.{n}_proj.bias"] = ((rows * hd,), True)
    if a.kind == EAGLE3:
        smaller = a.draft_vocab_size != a.vocab_size
        out.update({
            f"{p}input_layernorm.weight": ((H,), True),
            f"{p}hidden_norm.weight": ((H,), True),
            "norm.weight": ((H,), True),
            "lm_head.weight": ((a.draft_vocab_size, H), smaller),
            "d2t": ((a.draft_vocab_size,), smaller),
            "t2d": ((a.vocab_size,), False),
        })
        if a.norm_before_fc:
            out["input_norm.weight"] = ((a.fc_in,), True)
        if a.fc_norm:
            out.update({f"fc_norm.{i}.weight": ((a.target_hidden_size,), True) for i in range(len(a.aux_layers))})
    else:
        out[f"{p}input_layernorm.weight"] = ((H,), False)  # EAGLE-1 has none; a stored one is ignored, as vLLM does
    return out


def check_tensors(folder: HeadFolder, want: dict[str, tuple[tuple[int, ...], bool]], what: str) -> None:
    """Every required tensor present and every stored one expected, each of its shape: else one line naming it."""
    f = folder.weights
    for name, (shape, required) in want.items():
        t = folder.tensors.get(name)
        if t is None:
            if required:
                raise UserError(f"{f}: tensor {name} is missing ({what} needs it, shape {list(shape)})")
            continue
        if tuple(t.shape) != shape:
            raise UserError(f"{f}: tensor {name} has shape {list(t.shape)}, expected {list(shape)} ({what})")
    extra = sorted(set(folder.tensors) - set(want))
    if extra:
        raise UserError(f"{f}: unexpected tensor {extra[0]} for {what}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def build_eagle(folder: HeadFolder, target_model) -> EagleHead:
    """The head with its stored tensors, sharing the target's embedding and head where it has none of its own."""
    target = Target.of(target_model)
    a = eagle_arch(folder, target)
    what = f"an {'EAGLE-3' if a.kind == EAGLE3 else 'EAGLE-1'} head ({folder.layout} layout) for a target of hidden size " \
           f"{target.hidden_size} and {target.vocab_size} tokens"
    check_tensors(folder, eagle_names(a, folder.layout), what)
    if a.kind == EAGLE3 and folder.tensors.get("d2t") is not None:
        ids = torch.arange(a.draft_vocab_size) + folder.tensors["d2t"].long()
        if int(ids.min()) < 0 or int(ids.max()) >= a.vocab_size:
            raise UserError(f"{folder.weights}: tensor d2t maps draft ids outside the target's {a.vocab_size} tokens")
    head = EagleHead(a)
    p = _layer_prefix(folder.layout)
    own = {}
    for name, t in folder.tensors.items():
        key = name[len(p):] if name.startswith(p) else name
        key = key.replace("self_attn.", "").replace("mlp.", "").replace("fc_norm.", "fc_norms.")
        own[key] = t
    own.pop("t2d", None)
    if a.kind == EAGLE1:
        own.pop("input_layernorm.weight", None)
    embed = own.pop("embed_tokens.weight", None)
    dtype = next(target_model.parameters()).dtype
    missing, unexpected = head.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v.long()
                                                for k, v in own.items()}, strict=False)
    allowed = {"lm_head.weight", "d2t"} | {k for k in head.state_dict() if k.startswith("rotary.")}
    assert not unexpected and set(missing) <= allowed, (missing, unexpected)  # check_tensors ran first
    head.to(device=target_model.device, dtype=dtype)
    head.share("target_embedding", target_model.get_input_embeddings() if embed is None else
               torch.nn.Embedding.from_pretrained(embed.to(device=target_model.device, dtype=dtype)))
    if a.kind == EAGLE1:
        head.share("target_head", target_model.get_output_embeddings())
    elif "lm_head.weight" not in own:
        head.share("lm_head", target_model.get_output_embeddings())  # Vd = V: the target's own head, as vLLM does
    return head.eval()


def open_eagle(path, model, label: str | None = None) -> EagleDraft:
    """An EAGLE-1 or EAGLE-3 head in any released layout as a drafter for the transformers target `model`."""
    folder = read_head(path)
    if folder.layout.startswith("medusa"):
        raise UserError(f"{path}: Medusa heads, not an EAGLE head (use --guesser medusa-heads:{path})")
    return EagleDraft(build_eagle(folder, model), label or str(path))


def open_medusa(path, model) -> MedusaHeads:
    """Medusa heads in FasterDecoding's or vLLM's layout for the transformers target `model`."""
    folder = read_head(path)
    if not folder.layout.startswith("medusa"):
        raise UserError(f"{path}: an EAGLE head, not Medusa heads (use --guesser eagle-head:{path})")
    return build_medusa(folder, model)


def save_eagle3(head: EagleHead, directory, meta: dict | None = None, t2d: bool = True) -> Path:
    """The released EAGLE-3 layout (yuhuili's names, fp16): config.json and model.safetensors, loadable by
    vLLM, SGLang and TensorRT-LLM; the target's embedding is not stored, nor its head when shared (Vd = V)."""
    from safetensors.torch import save

    from planner.jsonio import atomic_write_bytes

    a = head.arch
    if a.kind != EAGLE3:
        raise ValueError("save_eagle3: an EAGLE-3 head")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = {"q_proj": "self_attn.", "k_proj": "self_attn.", "v_proj": "self_attn.", "o_proj": "self_attn.",
             "gate_proj": "mlp.", "up_proj": "mlp.", "down_proj": "mlp."}
    tensors = {}
    for k, v in head.state_dict().items():
        if k.startswith("rotary.") or k == "d2t":  # the target's shared modules are not in the head's state
            continue
        first = k.split(".")[0]
        if first in names:
            k = "midlayer." + names[first] + k
        elif first in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            k = "midlayer." + k
        elif first == "fc_norms":
            k = k.replace("fc_norms.", "fc_norm.")
        tensors[k] = v.detach().half().cpu().contiguous()
    if a.draft_vocab_size != a.vocab_size:
        tensors["d2t"] = head.d2t.long().cpu().contiguous()
        if t2d:
            mask = torch.zeros(a.vocab_size, dtype=torch.bool)
            mask[head.target_ids().cpu()] = True
            tensors["t2d"] = mask
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": a.rms_norm_eps, "vocab_size": a.vocab_size, "draft_vocab_size": a.draft_vocab_size,
        "max_position_embeddings": a.max_position_embeddings, "hidden_act": a.hidden_act,
        "tie_word_embeddings": False, "torch_dtype": "float16", "target_hidden_size": a.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(a.aux_layers), "use_aux_hidden_state": True},
        **a.rope, **({"tree_planner": meta} if meta else {}),
    }
    atomic_write_bytes(directory / "model.safetensors", save(tensors))
    atomic_write_bytes(directory / "config.json", (json.dumps(config, indent=1) + "\n").encode())
    return directory


# ---------------------------------------------------------------------------------------------- Medusa


def build_medusa(folder: HeadFolder, target_model) -> MedusaHeads:
    target = Target.of(target_model)
    where = f"{folder.path / 'config.json'}"
    cfg = folder.config
    vllm_form = folder.layout == "medusa-vllm"
    heads = _int(cfg, "num_heads" if vllm_form else "medusa_num_heads", where)
    layers = _int(cfg, "num_hidden_layers" if vllm_form else "medusa_num_layers", where, 1)
    if heads > MAX_HEADS or layers > 8:
        raise UserError(f"{where}: {heads} heads of {layers} layers; at most {MAX_HEADS} heads of 8 layers")
    H, V = target.hidden_size, target.vocab_size
    if vllm_form and cfg.get("truncated_vocab_size") not in (None, V):
        raise UserError(f"{where}: truncated_vocab_size {cfg['truncated_vocab_size']}: a truncated Medusa vocabulary "
                        "needs its token_map, which vLLM's converted checkpoints do not carry; use the full vocabulary")
    bias = any(n.endswith("bias") for n in folder.tensors)
    want = {}
    for h in range(heads):
        for layer in range(layers):
            w, b = ((f"blocks.{h}.layers.{layer}.weight", f"blocks.{h}.layers.{layer}.bias") if vllm_form else
                    (f"{h}.{layer}.linear.weight", f"{h}.{layer}.linear.bias"))
            want[w] = ((H, H), True)
            if bias:
                want[b] = ((H,), True)
        want[f"lm_heads.{h}.weight" if vllm_form else f"{h}.{layers}.weight"] = ((V, H), True)
    what = f"{heads} Medusa heads of {layers} layers for a target of hidden size {H} and {V} tokens"
    check_tensors(folder, want, what)
    m = MedusaHeads(H, V, heads, layers, bias)
    state = {}
    for name, t in folder.tensors.items():
        parts = name.split(".")
        if vllm_form:
            key = (f"heads.{parts[1]}.weight" if parts[0] == "lm_heads" else f"blocks.{parts[1]}.{parts[3]}.{parts[4]}")
        else:
            key = (f"heads.{parts[0]}.weight" if parts[1] == str(layers) else f"blocks.{parts[0]}.{parts[1]}.{parts[3]}")
        state[key] = t
    dtype = next(target_model.parameters()).dtype
    m.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return m.to(device=target_model.device, dtype=dtype).eval()


# ---------------------------------------------------------------------------------------------- what a folder is


def head_layout(path) -> str:
    """A head folder's layout from its config and tensor names alone (a released head's weights can be GBs)."""
    return read_head(Path(path), names_only=True).layout


def head_kind(path) -> str:
    """The guesser kind a head folder is run as: 'eagle-head' or 'medusa-heads' (`--drafter DIR`)."""
    return "medusa-heads" if head_layout(path).startswith("medusa") else "eagle-head"


def serving_method(path) -> str:
    """The serving engines' method for a head folder: eagle (EAGLE-1), eagle3 or medusa."""
    layout = head_layout(path)
    return "medusa" if layout.startswith("medusa") else "eagle" if layout == "eagle" else "eagle3"


def is_eagle_head(path) -> bool:
    """Whether a folder holds an EAGLE-1 or EAGLE-3 head rather than a draft model (which an engine's
    open_drafter also takes): an EAGLE config, or EAGLE's fc beside layers not under a model's prefix."""
    p = Path(path)
    if not (p / "config.json").is_file() or (p / "draft_lm.json").is_file():
        return False
    try:
        folder = read_head(p, names_only=True)
    except UserError:
        return False
    cfg, names = folder.config, set(folder.tensors)
    if folder.layout.startswith("medusa"):
        return False
    marked = "speculators_model_type" in cfg or "Eagle" in " ".join(cfg.get("architectures") or []) or \
        "draft_vocab_size" in cfg
    return marked or ("fc.weight" in names and not any(n.startswith("model.") for n in names))
