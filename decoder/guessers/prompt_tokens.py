"""PPD prompt tokens: trainable input embeddings whose outputs guess tokens further ahead.

Layout. `embeddings` is [P * E, hidden], P = num_prompt_tokens, E = ensemble, index
`j * E + e` for distance j + 1 (0-based j) and ensemble copy e: distance-major, so the first
k distances of a node are the first k * E rows. Logits of the E copies of one distance are
averaged (PPD appendix B.5.1).

Mask. Prompt tokens appended after a position u all see u and its past; among themselves, copy
(j, e) sees (j', e) for j' <= j: each ensemble group is its own causal chain. The same block is
used by the decoder (after every tree node) and by prompt-token training (after every insertion
point): `prompt_block_mask` (decoder/layout.py).

Under a dynamic plan (decoder/guessers/dynamic.py) `PPDSource` offers the guesses as a Cartesian pool and
puts the prompt tokens after every chosen node.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from decoder.guesser import DecodeContext, DistanceGuesser, StepOutcome
from decoder.guessers.pool import POOL_WIDTH, Decider, Pool, Source, cartesian
from decoder.layout import (
    StepLayout,
    layout_for,
    prompt_block_mask,  # noqa: F401  (re-exported: the mask lives with the layouts)
)
from decoder.torch_ops.modules import model_meta, token_modules
from planner.dynamic import DynamicSpec, GuesserModel, q_bins
from planner.errors import UserError
from planner.jsonio import atomic_write_bytes, read_json
from planner.tree import MAX_PROMPT_TOKENS

WEIGHTS_NAME = "prompt_tokens.safetensors"
MAX_ENSEMBLE = 16  # E copies per prompt token
CONFIG_NAME = "prompt_tokens.json"
FORMAT = "tree-planner/prompt-tokens"


class PromptTokens(DistanceGuesser, nn.Module):
    """P x E prompt-token embeddings; also the decoder's guesser (top_k guesses per distance)."""

    def __init__(self, num_prompt_tokens: int, ensemble: int, hidden_size: int, top_k: int = 10, meta: dict | None = None):
        super().__init__()
        if not (1 <= num_prompt_tokens <= MAX_PROMPT_TOKENS and 1 <= ensemble <= MAX_ENSEMBLE):
            raise UserError(f"prompt tokens: need num_prompt_tokens in 1..{MAX_PROMPT_TOKENS} and ensemble in "
                            f"1..{MAX_ENSEMBLE}, got {num_prompt_tokens}, {ensemble}")
        self.num_prompt_tokens = num_prompt_tokens
        self.ensemble = ensemble
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.meta = dict(meta or {})
        self.embeddings = nn.Parameter(torch.zeros(num_prompt_tokens * ensemble, hidden_size))  # [P*E, hidden]

    # guesser protocol (decoder/guesser.py, DistanceGuesser)
    @property
    def num_distances(self) -> int:
        return self.num_prompt_tokens

    def input_embeddings(self) -> torch.Tensor:
        return self.embeddings

    def guess(self, prompt_logits: torch.Tensor | None, next_root_pos: int, k: int) -> torch.Tensor:
        """prompt_logits [k, E, V] of the prompt tokens after the last accepted node -> [k, top_k] token ids."""
        return prompt_logits.float().mean(dim=1).topk(self.top_k, dim=-1).indices

    def dynamic_source(self, gm: GuesserModel, spec: DynamicSpec, target, prompt_ids: torch.Tensor,
                       ctx: DecodeContext, sampled: bool) -> "PPDSource":
        return PPDSource(gm, self, spec, ctx)

    @classmethod
    def random(cls, target, num_prompt_tokens: int, ensemble: int = 1, seed: int = 0, top_k: int = 10) -> "PromptTokens":
        """Untrained prompt tokens: copies of the input embeddings of random vocabulary tokens. target: the
        engine (Engine.token_modules) or a bare transformers model."""
        emb = token_modules(target)[0].weight  # [V, hidden]
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, emb.shape[0], (num_prompt_tokens * ensemble,), generator=g)
        pt = cls(num_prompt_tokens, ensemble, emb.shape[1], top_k=min(top_k, emb.shape[0]), meta=model_meta(target))
        with torch.no_grad():
            pt.embeddings.copy_(emb.detach()[ids.to(emb.device)].float().cpu())
        return pt.to(device=emb.device, dtype=emb.dtype)

    def save(self, directory) -> Path:
        from safetensors.torch import save

        directory = Path(directory)
        config = {
            "format": FORMAT,
            "num_prompt_tokens": self.num_prompt_tokens,
            "ensemble": self.ensemble,
            "hidden_size": self.hidden_size,
            "top_k": self.top_k,
            "layout": "embeddings[j * ensemble + e]: distance j+1, ensemble copy e",
            **self.meta,
        }
        data = save({"embeddings": self.embeddings.detach().float().cpu().contiguous()})
        atomic_write_bytes(directory / WEIGHTS_NAME, data)
        atomic_write_bytes(directory / CONFIG_NAME, (json.dumps(config, indent=1) + "\n").encode())
        return directory

    @classmethod
    def load(cls, directory, model=None, top_k: int | None = None) -> "PromptTokens":
        """Trained prompt tokens from `directory`, fitted to `model` (the engine or a bare transformers model)
        when given: its hidden size checked, on its device and dtype."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        directory = Path(directory)
        cfg_path, w_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        cfg = read_json(cfg_path)
        if not isinstance(cfg, dict):
            raise UserError(f"{cfg_path}: expected a JSON object")
        for key, top in (("num_prompt_tokens", MAX_PROMPT_TOKENS), ("ensemble", MAX_ENSEMBLE), ("hidden_size", 1 << 16)):
            if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or not 1 <= cfg[key] <= top:
                raise UserError(f"{cfg_path}: field '{key}' must be an integer in 1..{top}, got {cfg.get(key)!r}")
        try:
            tensors = load(w_path.read_bytes())
        except FileNotFoundError:
            raise UserError(f"{w_path}: file not found") from None
        except (SafetensorError, ValueError) as e:
            raise UserError(f"{w_path}: not a safetensors file ({e})") from None
        w = tensors.get("embeddings")
        P, E, H = cfg["num_prompt_tokens"], cfg["ensemble"], cfg["hidden_size"]
        if w is None or tuple(w.shape) != (P * E, H):
            got = None if w is None else list(w.shape)
            raise UserError(f"{w_path}: tensor 'embeddings' has shape {got}, expected [{P * E}, {H}] from {cfg_path.name}")
        meta = {k: v for k, v in cfg.items() if k in ("model", "model_config_hash", "training")}
        pt = cls(P, E, H, top_k=top_k or int(cfg.get("top_k", 10)), meta=meta)
        with torch.no_grad():
            pt.embeddings.copy_(w)
        if model is not None:
            emb = token_modules(model)[0].weight
            if emb.shape[1] != H:
                raise UserError(f"{cfg_path}: field 'hidden_size' is {H}, the model's hidden size is {emb.shape[1]}")
            pt.top_k = min(pt.top_k, emb.shape[0])
            pt = pt.to(device=emb.device, dtype=emb.dtype)
        return pt


class PPDSource(Source):
    """PPD prompt tokens in a dynamic plan: every tree node carries D prompt tokens, so whichever
    node ends the accepted path, its prompt tokens' logits give the next step's guesses for D
    distances, offered as a Cartesian pool."""

    kind = "ppd"

    def __init__(self, gm: GuesserModel, g: PromptTokens, spec: DynamicSpec, ctx: DecodeContext):
        super().__init__(gm)
        self.D, self.E = g.num_distances, g.ensemble
        self.input_per_node = self.input_fixed = 1 + self.D * self.E
        self.table = g.input_embeddings().detach().to(device=ctx.device, dtype=ctx.dtype)  # [D * E, hidden]
        self.width = min(POOL_WIDTH, g.top_k)
        self.guess: tuple[np.ndarray, np.ndarray] | None = None  # (q, tokens) [D, width]
        self.spec = spec

    def layout(self, paths, top_k: int, ctx: DecodeContext) -> StepLayout:
        counts = (self.D,) * (len(paths) + 1)
        return layout_for(paths, max(top_k, 1), ctx.dtype, ctx.device, prompt_count=counts, ensemble=self.E)

    def extra_embeds(self, lay: StepLayout) -> torch.Tensor:
        return self.table[lay.slot_embedding]

    def extend(self, pool: Pool, root: torch.Tensor, session: Decider) -> None:
        if self.guess is None:
            return
        q, toks = self.guess
        D, K = q.shape
        depth = np.repeat(np.arange(1, D + 1), K)
        bins = q_bins(q.reshape(-1))
        cells = self.model.cells(depth, np.tile(np.arange(K), D), bins).reshape(D, K)
        c = session.c_of(self.kind, cells.reshape(-1)).reshape(D, K)
        cartesian(pool, self.kind, c, toks, cells, self.spec.max_size, bins.reshape(D, K))

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        lay = outcome.proposal.layout
        last = outcome.verdict.nodes[-1]
        slots = lay.slot_index[last, : self.D]  # [D, E]
        probs = torch.softmax(outcome.logits[slots].float().mean(dim=1), dim=-1)  # [D, V]
        top = probs.topk(self.width, dim=-1)
        both = torch.stack([top.values, top.indices.float()]).cpu().numpy()
        self.guess = (both[0], both[1].astype(np.int64))


def load(request) -> PromptTokens:
    """The registry's loader (planner/guessers.py): trained prompt tokens from request.path, or, with
    options["random"] = P, untrained ones (P random vocabulary embeddings, options["ensemble"] copies)."""
    model = request.target
    random_p = request.options.get("random")
    if request.path is None and random_p is not None:
        return PromptTokens.random(model, random_p, ensemble=request.options.get("ensemble", 1), top_k=request.top_k or 10)
    return PromptTokens.load(request.path, model=model, top_k=request.top_k)
