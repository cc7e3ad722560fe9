"""The project's draft LM as a Hugging Face model folder that vLLM's `draft_model` method loads.

    from decoder.engines.vllm.draft_folder import write_draft_folder, served_draft
    write_draft_folder("models/smollm2-135m/draft_lm", target_dir, "exports/smollm2-draft")  # for `planner export`
    folder = served_draft("models/smollm2-135m/draft_lm", target_dir)  # converted once into the cache, reused

The draft LM (decoder/guessers/draft.py) stores only its own layers and final norm
(`draft_lm.safetensors`, fp16, with `draft_lm.json`): it runs on the target's embedding and LM head.
vLLM's draft_model proposer shares neither with the target, so the folder carries them: its
`config.json` is the target's with `num_hidden_layers` cut to the draft's (and `layer_types` with
it), its `model.safetensors` holds the draft's tensors in the target's dtype plus the target's
`model.embed_tokens.weight` (and `lm_head.weight` when the target does not tie them), and the
target's tokenizer files are copied beside (vLLM drafts with the target's tokenizer; the folder is
complete on its own). `tree-planner-draft.json`, written last, records where it came from.

The draft's tensors must be the target's first layers by name and shape (a draft of another model
is refused in one line). The folder is written into a temporary sibling and renamed into place:
nothing half-written is left on an error. Pure numpy and safetensors: no torch, no transformers.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from planner.errors import UserError
from planner.jsonio import read_json

DRAFT_LM_WEIGHTS = "draft_lm.safetensors"  # decoder/torch_ops/draft_lm.py's file names and format
DRAFT_LM_CONFIG = "draft_lm.json"
DRAFT_LM_FORMAT = "tree-planner/draft-lm"
MARKER = "tree-planner-draft.json"  # written last: the folder is complete
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": None}  # config dtype -> numpy dtype (None: keep)


def is_project_draft(path: str | Path) -> bool:
    """Whether `path` holds the project's draft LM (layers only), not a Hugging Face model folder."""
    return (Path(path) / DRAFT_LM_CONFIG).is_file()


def write_draft_folder(draft_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
                       target_name: str | None = None) -> Path:
    """Write the draft LM in `draft_dir` as a Hugging Face folder `out_dir` for the target in
    `target_dir` (its converted Hugging Face folder); an existing `out_dir` is replaced. target_name:
    the target's registry name, checked against the one the draft LM was trained for."""
    from safetensors.numpy import save_file

    draft_dir, target_dir, out_dir = Path(draft_dir), Path(target_dir), Path(out_dir)
    n, meta = _draft_meta(draft_dir, target_name)
    config = _target_config(target_dir)
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= n <= total:
        raise UserError(f"{draft_dir / DRAFT_LM_CONFIG}: 'num_layers' {n} does not fit the target's "
                        f"{total} layers ({target_dir / 'config.json'})")
    target = _target_tensors(target_dir)
    draft = _read_safetensors(draft_dir / DRAFT_LM_WEIGHTS)
    want = {k: s for k, s in target.shapes.items() if _own_tensor(k, n)}
    got = {k: tuple(v.shape) for k, v in draft.items()}
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise UserError(f"{draft_dir / DRAFT_LM_WEIGHTS}: not a {n}-layer draft of {target_dir.name}"
                        f" (missing {missing[:2]}, unexpected {extra[:2]}, other shapes {wrong[:2]})")
    dtype = DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    tensors = {k: (v.astype(dtype) if dtype else v) for k, v in draft.items()}
    tensors[EMBEDDING] = target.get(EMBEDDING)
    tied = config.get("tie_word_embeddings", True)  # transformers' default for Llama-like configs
    if not tied:
        if HEAD not in target.shapes:
            raise UserError(f"{target_dir}: untied embeddings but no '{HEAD}' in its weights")
        tensors[HEAD] = target.get(HEAD)
    cfg = dict(config, num_hidden_layers=n)
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:n]
    cfg.pop("_name_or_path", None)
    record = {"format": "tree-planner/vllm-draft-folder", "draft_lm": str(draft_dir), "target": str(target_dir),
              "num_layers": n, "draft_sha256": _sha(draft_dir / DRAFT_LM_WEIGHTS), "draft_meta": meta,
              "tied_embeddings": bool(tied), "dtype": str(dtype or "as stored")}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary model folder
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file():
                shutil.copyfile(target_dir / name, tmp / name)
        (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def served_draft(draft_dir: str | Path, target_dir: str | Path, cache: str | Path | None = None,
                 target_name: str | None = None) -> Path:
    """A folder vLLM's draft_model loads for `draft_dir`: a Hugging Face folder as it is, the project's
    draft LM converted once into `cache` (default: the project's cache, vllm-drafts/), keyed by the
    draft's and the target's files, and reused."""
    draft_dir = Path(draft_dir)
    if not is_project_draft(draft_dir):
        if (draft_dir / "config.json").is_file():
            return draft_dir
        raise UserError(f"{draft_dir}: neither the project's draft LM ({DRAFT_LM_CONFIG}) nor a Hugging Face "
                        "model folder (config.json)")
    if cache is None:
        from decoder.engines.shipped import cache_dir

        cache = cache_dir() / "vllm-drafts"
    key = hashlib.sha256()
    for f in (draft_dir / DRAFT_LM_CONFIG, draft_dir / DRAFT_LM_WEIGHTS, Path(target_dir) / "config.json"):
        key.update(_sha(f).encode())
    weights = Path(target_dir) / "model.safetensors"
    key.update(str(weights.stat().st_size if weights.is_file() else 0).encode())
    out = Path(cache) / f"{Path(target_dir).name}-{key.hexdigest()[:16]}"
    if (out / MARKER).is_file():
        return out
    return write_draft_folder(draft_dir, target_dir, out, target_name)


def draft_for(model_name: str, model_dir: str | Path, draft: str | Path | None = None) -> Path | None:
    """The folder vLLM's draft_model loads when serving `model_name`: the user's `draft`, else the draft LM
    shipped for the model (checked to be a draft of it); None when neither exists."""
    from decoder.engines.models import shipped

    src = draft or shipped(model_name, "draft_lm")
    if src is None:
        return None
    return served_draft(src, model_dir, target_name=None if draft else model_name)


# ---------------------------------------------------------------------------------------------- reading

def _draft_meta(draft_dir: Path, target_name: str | None) -> tuple[int, dict]:
    cfg_path = draft_dir / DRAFT_LM_CONFIG
    if not cfg_path.is_file():
        raise UserError(f"{cfg_path}: file not found (the project's draft LM: {DRAFT_LM_CONFIG} and {DRAFT_LM_WEIGHTS})")
    cfg = read_json(cfg_path)
    n = cfg.get("num_layers") if isinstance(cfg, dict) else None
    if not isinstance(cfg, dict) or cfg.get("format") != DRAFT_LM_FORMAT or isinstance(n, bool) or not isinstance(n, int):
        raise UserError(f"{cfg_path}: expected format {DRAFT_LM_FORMAT!r} and an integer 'num_layers'")
    trained_for = cfg.get("target")
    if target_name and isinstance(trained_for, str) and trained_for != target_name:
        raise UserError(f"{cfg_path}: field 'target' is {trained_for!r}: a draft of another model than {target_name}")
    return n, {k: v for k, v in cfg.items() if isinstance(v, (str, int, float))}


def _target_config(target_dir: Path) -> dict:
    path = target_dir / "config.json"
    if not path.is_file():
        raise UserError(f"{target_dir}: not a Hugging Face model folder (no config.json)")
    cfg = read_json(path)
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise UserError(f"{path}: field 'model_type' missing (expected a Hugging Face model config)")
    return cfg


class _Tensors:
    """The target's tensors by name (several safetensors shards welcome), read one at a time."""

    def __init__(self, files: list[Path]):
        from safetensors import SafetensorError, safe_open

        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="np") as h:
                    for k in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                        self.where[k] = f
                        self.shapes[k] = tuple(h.get_slice(k).get_shape())
            except (SafetensorError, OSError, ValueError) as e:
                raise UserError(f"{f}: not a safetensors file ({str(e).splitlines()[0][:120]})") from None

    def get(self, name: str):
        from safetensors import safe_open

        if name not in self.where:
            raise UserError(f"{min(self.where.values()).parent}: no tensor '{name}' in the target's weights")
        with safe_open(str(self.where[name]), framework="np") as h:
            return h.get_tensor(name)


def _target_tensors(target_dir: Path) -> _Tensors:
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{target_dir}: no safetensors weights (the target's embedding goes into the draft folder)")
    return _Tensors(files)


def _read_safetensors(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if not path.is_file():
        raise UserError(f"{path}: file not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path}: not a safetensors file ({str(e).splitlines()[0][:120]})") from None


def _own_tensor(name: str, n: int) -> bool:
    """A draft LM's own tensor: a layer below n, or the final norm (decoder/torch_ops/draft_lm.py own_state)."""
    if name.startswith("model.norm."):
        return True
    parts = name.split(".")
    return name.startswith("model.layers.") and len(parts) > 2 and parts[2].isdigit() and int(parts[2]) < n


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _replace_dir(new: Path, out: Path) -> None:
    """Rename `new` to `out`, replacing a folder there (moved aside first, removed after)."""
    old = None
    if out.exists():
        if not out.is_dir():
            raise UserError(f"{out}: exists and is not a folder")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
