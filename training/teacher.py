"""The target's outputs on training windows, computed once and cached: what drafters distil from.

For every position t of every window: the target's last hidden state f_t (after the final norm,
the feature EAGLE-style drafters read and regress) and the top-k of its next-token distribution
(ids and probabilities; the rest of the mass is not stored). Drafters train against these for
many epochs, so the target runs over the data once. Chunks of windows are written as they finish
(safetensors, fp16 features), so an interrupted run keeps them and the next run continues.

Cache: <cache dir>/teacher/<key>/, key = hash of the target's config, the windows and the options.
The target is an engine that lends its torch modules (caps.torch_modules), or a bare transformers model
(the hf engine's); its passes are the engine's own (Engine.training(): decoder/engines/hf/training.py).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decoder.engines.registry import as_engine
from decoder.engines.shipped import cache_dir
from planner.errors import UserError
from planner.jsonio import atomic_write_bytes

CHUNK = 32  # windows per file


@dataclass
class TeacherData:
    tokens: torch.Tensor  # [N, T] long
    top_ids: torch.Tensor  # [N, T, k] int32: the target's k likeliest next tokens at each position
    top_probs: torch.Tensor  # [N, T, k] fp16, their probabilities
    hidden: torch.Tensor | None  # [N, T, H] fp16 last hidden states, when asked

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def subset(self, rows: torch.Tensor) -> "TeacherData":
        return TeacherData(self.tokens[rows], self.top_ids[rows], self.top_probs[rows],
                           None if self.hidden is None else self.hidden[rows])


def training_passes(target):
    """The target's training passes (Engine.training()), the target frozen: an engine that lends its torch
    modules, or a bare transformers model (the hf engine's)."""
    engine = as_engine(target)
    if not engine.caps.torch_modules:
        raise UserError(f"--engine {engine.caps.name}: lends no torch modules to train through")
    return engine.training()


def _key(passes, windows: torch.Tensor, k: int, hidden: bool) -> str:
    h = hashlib.sha256()
    h.update(passes.architecture_hash().encode())
    h.update(windows.numpy().tobytes())
    h.update(f"k={k} hidden={hidden} dtype={passes.dtype}".encode())
    return h.hexdigest()[:20]


@torch.inference_mode()
def _chunk(passes, x: torch.Tensor, k: int, hidden: bool, batch_size: int) -> dict:
    ids, probs, feats = [], [], []
    for b in range(0, x.shape[0], batch_size):
        logits, last = passes.teacher(x[b: b + batch_size], hidden)
        top = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [B, T, k]
        ids.append(top.indices.int().cpu())
        probs.append(top.values.half().cpu())
        if hidden:
            feats.append(last.half().cpu())
    chunk = {"tokens": x.cpu(), "top_ids": torch.cat(ids), "top_probs": torch.cat(probs)}
    if hidden:
        chunk["hidden"] = torch.cat(feats)
    return chunk


def teacher_data(target, windows: torch.Tensor, k: int = 32, hidden=True, batch_size: int = 4,
                 progress: bool = True, root: Path | None = None) -> TeacherData:
    """The target's top-k and (optionally) features on windows [N, T], from the cache when there."""
    from safetensors.torch import load, save
    from tqdm import tqdm

    passes = training_passes(target)
    folder = (root or cache_dir() / "teacher") / _key(passes, windows, k, hidden)
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}  # filled chunk by chunk: features run to GBs, so no second copy is made
    t0 = time.time()
    starts = range(0, windows.shape[0], CHUNK)
    features = _features_file(folder, windows.shape[0]) if hidden else None
    for i in tqdm(starts, desc=f"teacher outputs (cache {folder.name})", unit="chunk", disable=not progress):
        f = folder / f"part-{i // CHUNK:05d}.safetensors"
        if f.is_file():
            part = load(f.read_bytes())
        else:
            part = _chunk(passes, windows[i: i + CHUNK], k, hidden, batch_size)
            atomic_write_bytes(f, save({n: t.contiguous() for n, t in part.items()}))
        for name, t in part.items():
            if name == "hidden":  # on disk, mapped: the page cache holds it, and gives it back under pressure
                features = features if features is not None else _features_file(folder, windows.shape[0], t)
                if not features.complete:
                    features.write(i, t)
                continue
            if name not in out:
                out[name] = t.new_empty((windows.shape[0], *t.shape[1:]))
            out[name][i: i + t.shape[0]] = t
        del part
    data = TeacherData(out["tokens"].long(), out["top_ids"], out["top_probs"], features.tensor() if hidden else None)
    data.wall_s = time.time() - t0
    return data


class _FeaturesFile:
    """The features of every window [N, T, F] fp16 in one file beside the chunks, mapped into memory: GBs for an
    EAGLE-3 head's three streams, which a training run beside other jobs should not hold in anonymous memory."""

    def __init__(self, path: Path, shape: tuple[int, ...] | None):
        self.path, self.shape = path, shape
        self.done = path.with_suffix(".done")
        self.complete = self.done.is_file() and shape is not None
        self.array = None

    def write(self, i: int, t: torch.Tensor) -> None:
        import numpy as np

        if self.array is None:
            self.array = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.float16, shape=self.shape)
        self.array[i: i + t.shape[0]] = t.numpy()

    def tensor(self) -> torch.Tensor:
        import numpy as np

        if self.array is not None:
            self.array.flush()
            self.done.write_text("complete\n")
        mapped = np.load(self.path, mmap_mode="c")  # copy-on-write: a tensor may be written without touching the file
        return torch.from_numpy(mapped)


def _features_file(folder: Path, n: int, first: torch.Tensor | None = None) -> _FeaturesFile | None:
    """The mapped features file of this cache: complete from an earlier run, or to fill (shape from the first chunk)."""
    import numpy as np

    path = folder / "hidden.npy"
    if (folder / "hidden.done").is_file() and path.is_file():
        shape = tuple(np.load(path, mmap_mode="r").shape)
        return _FeaturesFile(path, shape)
    if first is None:
        return None
    return _FeaturesFile(path, (n, *first.shape[1:]))


def frequent_vocab(data: TeacherData, size: int) -> torch.Tensor:
    """The `size` tokens the target predicts most (top-1 counts, then top-k mass), sorted by id:
    a drafter's restricted LM head."""
    V = int(data.top_ids.max()) + 1
    counts = torch.bincount(data.top_ids[..., 0].reshape(-1).long(), minlength=V).double()
    mass = torch.zeros(V, dtype=torch.float64).index_add_(0, data.top_ids.reshape(-1).long(),
                                                          data.top_probs.reshape(-1).double())
    score = counts + 1e-3 * mass  # ties (and never-top-1 tokens) by probability mass
    return score.topk(min(size, V)).indices.sort().values


def coverage(data: TeacherData, head_ids: torch.Tensor) -> float:
    """Fraction of positions whose greedy next token the restricted head can propose."""
    keep = torch.zeros(int(max(int(data.top_ids.max()), int(head_ids.max()))) + 1, dtype=torch.bool)
    keep[head_ids] = True
    return float(keep[data.top_ids[..., 0].long()].float().mean())
