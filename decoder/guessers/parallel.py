"""ParallelSpec: one small drafter pass guesses k + 1 tokens (docs/seed-systems.md, section 'ParallelSpec').

    drafter = ParallelDrafter.load("models/smollm2-135m/parallelspec")
    out = generate(target, ids, plan="trees/ps.json", guesser=drafter)   # medusa tree over drafter ranks

The drafter is one Llama decoder layer of the target's shape (EAGLE-style input: a linear map of
[target feature f_s ; embedding of token s+1] per real slot), the target's frozen embedding and LM
head, and K learned [MASK] inputs. One pass over the new real slots and k masks yields k + 1
distributions: the last real slot's for distance 1 beyond the root, mask j's for distance j + 1.
Guesses per distance do not depend on the path (a Cartesian tree, as Medusa's and PPD's), so the
target verifies a medusa tree over the drafter's ranks; guesses are deterministic top-k, so
verification is greedy or the point-mass lossless rule. Masks never stay in the drafter's cache.

mode="chain" runs the same drafter autoregressively (EAGLE's chain: one token per pass, its own
predicted feature as the next slot's input), the baseline ParallelSpec claims to beat.

Under a dynamic plan (decoder/guessers/dynamic.py) `ParallelSource` drives the same session's passes: the
one-pass guesses as a Cartesian pool, or the chain level by level with a stop decision per level.

Slot layout (training, training/parallel.py, uses the same): real slot s pairs f_s with x_{s+1}
and sits at position s; mask j of the group opened by slot s sits at position s + j and sees the
real slots up to s and its own group's masks up to j. head_ids: an optional restricted LM head
(the most frequent tokens), sorted vocabulary ids; None is the full head.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from decoder.torch_ops.body import body_cache, llama_body, run_body
from decoder.torch_ops.cache import crop_cache
from decoder.torch_ops.modules import token_modules
from decoder.guesser import DecodeContext, DistanceGuesser, Proposal, StepOutcome
from decoder.guessers.pool import POOL_WIDTH, Decider, Pool, Source, cartesian
from decoder.layout import layout_for
from decoder.noise import aimed_top_k
from planner.dynamic import DynamicSpec, GuesserModel, q_bins
from planner.errors import UserError
from planner.jsonio import atomic_write_bytes, read_json
from planner.tree import PPD, Tree

WEIGHTS_NAME = "parallel_drafter.safetensors"
CONFIG_NAME = "parallel_drafter.json"
FORMAT = "tree-planner/parallel-drafter"
MODES = ("parallel", "chain")


ARCH_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "rms_norm_eps", "max_position_embeddings", "rope_parameters", "hidden_act")


def arch_of(target_config) -> dict:
    d = target_config.to_dict()
    return {k: d[k] for k in ARCH_KEYS if k in d}


class ParallelDrafter(DistanceGuesser, nn.Module):
    """The drafter's own weights (fc, K masks, one layer, final norm) and the guesser around them."""

    needs_hidden = True

    def __init__(self, arch: dict, num_masks: int = 4, head_ids: torch.Tensor | None = None, top_k: int = 8,
                 mode: str = "parallel", meta: dict | None = None):
        super().__init__()
        if mode not in MODES:
            raise UserError(f"parallel drafter: mode must be one of {', '.join(MODES)}, got {mode!r}")
        H = arch["hidden_size"]
        self.arch, self.num_masks, self.top_k, self.mode = dict(arch), num_masks, top_k, mode
        self.meta = dict(meta or {})
        self.fc = nn.Linear(2 * H, H)
        self.masks = nn.Parameter(torch.zeros(num_masks, H))
        self.body = llama_body(self.arch)  # one layer of the target's shape (decoder/torch_ops/body.py)
        self.register_buffer("head_ids", head_ids if head_ids is not None else torch.zeros(0, dtype=torch.long),
                             persistent=False)
        self.target = None  # (embedding [V, H], LM head weight [V, H]) of the target, frozen, attached at begin

    # ------------------------------------------------------------------ the network

    def attach(self, target) -> "ParallelDrafter":
        """Share the target's frozen embedding and LM head (never copied, never trained): the engine's
        (Engine.token_modules) or a bare transformers model's."""
        embedding, head = token_modules(target)
        if embedding.weight.shape[1] != self.arch["hidden_size"]:
            raise UserError(f"parallel drafter: hidden size {self.arch['hidden_size']}, the target's is "
                            f"{embedding.weight.shape[1]}")
        self.target = (embedding, head)
        return self

    def real_inputs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """[..., H] features and [...] next tokens -> [..., H] slot inputs."""
        emb = self.target[0](next_tokens).to(features.dtype)
        return self.fc(torch.cat([features, emb], dim=-1))

    def run(self, inputs: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache=None):
        """inputs [B, L, H] -> hidden [B, L, H] after the final norm (the drafter's predicted features)."""
        return run_body(self.body, inputs, position_ids, attention_mask, cache)

    def logits(self, hidden: torch.Tensor, full: bool = False) -> torch.Tensor:
        """Head logits [..., V'] over the restricted vocabulary (head_ids), or all [..., V] with full."""
        w = self.target[1].weight
        if self.head_ids.numel() and not full:
            w = self._restricted_head(w)
        return hidden.to(w.dtype) @ w.T

    def _restricted_head(self, w: torch.Tensor) -> torch.Tensor:
        """The head's rows for head_ids [V', H], gathered once per weight version: gathering on every pass
        would copy as many bytes as the restricted matmul reads, halving what the restriction saves."""
        key = (w.data_ptr(), w._version, w.dtype, w.device, self.head_ids.data_ptr())
        if getattr(self, "_head_key", None) != key:
            self._head_w, self._head_key = w.detach()[self.head_ids].contiguous(), key
        return self._head_w

    def token_ids(self, ranks: torch.Tensor, full: bool = False) -> torch.Tensor:
        """Head positions -> vocabulary ids (the full head's positions are the ids)."""
        return self.head_ids[ranks] if self.head_ids.numel() and not full else ranks

    # ------------------------------------------------------------------ guesser protocol

    @property
    def num_distances(self) -> int:
        return self.num_masks + 1 if self.mode == "parallel" else 16

    ensemble = 1

    def input_embeddings(self):
        return None  # guesses come from the drafter's own pass, not from target inputs

    def check(self, plan: Tree | None, label: str = "plan") -> None:
        if plan is None:
            return  # a chain of num_masks + 1
        if plan.method == PPD:
            raise UserError(f"{label}: a ppd plan needs PPD prompt tokens; the parallel drafter runs medusa trees")
        super().check(plan, label)

    def begin(self, target, plan: Tree | None, prompt_ids: torch.Tensor, ctx: DecodeContext) -> "ParallelSession":
        if ctx.prompt_hidden is None and prompt_ids.numel() > 1:
            raise UserError("parallel drafter: the decoder did not return the target's hidden states")
        self._open(target, ctx)
        depth = plan.depth if plan is not None else self.num_masks + 1
        nodes = tuple(plan.states[0].nodes) if plan is not None else tuple((0,) * d for d in range(1, depth + 1))
        if self.mode == "chain" and any(r for p in nodes for r in p[:-1]):
            # each pass continues the rank-0 draft, so a sibling can only be a leaf (a comb)
            raise UserError(f"{ctx.label}: the chain drafter continues its rank-0 draft only: give a chain plan, "
                            "or a comb (other ranks on leaves only)")
        return ParallelSession(self, nodes, depth, prompt_ids.reshape(-1), ctx)

    def dynamic_source(self, gm: GuesserModel, spec: DynamicSpec, target, prompt_ids: torch.Tensor,
                       ctx: DecodeContext, sampled: bool) -> "ParallelSource":
        self._open(target, ctx)
        return ParallelSource(gm, self, spec, prompt_ids, ctx)

    def _open(self, target, ctx: DecodeContext) -> None:
        """The target's embedding and head attached, the drafter on the decoding device."""
        self.attach(target)
        self.to(device=ctx.device)

    # ------------------------------------------------------------------ files

    def save(self, directory) -> Path:
        from safetensors.torch import save

        directory = Path(directory)
        tensors = {k: v.detach().half().cpu().contiguous() for k, v in self.state_dict().items()
                   if not k.startswith("body.embed_tokens")}
        tensors["head_ids"] = self.head_ids.int().cpu().contiguous()
        config = {"format": FORMAT, "arch": self.arch, "num_masks": self.num_masks, "top_k": self.top_k, **self.meta}
        atomic_write_bytes(directory / WEIGHTS_NAME, save(tensors))
        atomic_write_bytes(directory / CONFIG_NAME, (json.dumps(config, indent=1) + "\n").encode())
        return directory

    @classmethod
    def load(cls, directory, mode: str = "parallel", top_k: int | None = None) -> "ParallelDrafter":
        from safetensors import SafetensorError
        from safetensors.torch import load

        directory = Path(directory)
        cfg = read_json(directory / CONFIG_NAME)
        if not isinstance(cfg, dict) or cfg.get("format") != FORMAT or not isinstance(cfg.get("arch"), dict):
            raise UserError(f"{directory / CONFIG_NAME}: field 'format' must be {FORMAT!r} with an 'arch' object")
        K = cfg.get("num_masks")
        if not isinstance(K, int) or not 1 <= K <= 16:
            raise UserError(f"{directory / CONFIG_NAME}: field 'num_masks' must be an integer in 1..16")
        try:
            tensors = load((directory / WEIGHTS_NAME).read_bytes())
        except FileNotFoundError:
            raise UserError(f"{directory / WEIGHTS_NAME}: file not found") from None
        except (SafetensorError, ValueError) as e:
            raise UserError(f"{directory / WEIGHTS_NAME}: not a safetensors file ({e})") from None
        head = tensors.pop("head_ids", torch.zeros(0)).long()
        meta = {k: v for k, v in cfg.items() if k not in ("format", "arch", "num_masks", "top_k")}
        d = cls(cfg["arch"], K, head if head.numel() else None, top_k or int(cfg.get("top_k", 8)), mode, meta)
        missing, unexpected = d.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
        missing = [k for k in missing if not k.startswith("body.embed_tokens")]
        if missing or unexpected:
            raise UserError(f"{directory / WEIGHTS_NAME}: tensors do not fit the drafter (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]})")
        return d.eval()


class ParallelSession:
    """The drafter's cache holds real slots only; each step feeds the slots of the accepted path.

    The passes (`parallel_pass`, `chain`) serve the static trees here and the per-step pools of
    dynamic plans (`ParallelSource`), which may skip a step's pass: its pending slots then wait and
    the next step's slots join them."""

    def __init__(self, d: ParallelDrafter, nodes, depth: int, prompt_ids: torch.Tensor, ctx: DecodeContext):
        self.d, self.ctx, self.depth = d, ctx, depth
        self.layout = layout_for(nodes, d.top_k, ctx.dtype, ctx.device)
        self.max_input_length = self.layout.input_length
        self.cache = body_cache(d.body)
        T = prompt_ids.numel()
        # pending real slots: (features [m, H], next tokens [m], positions [m]); the prompt's first
        self.pending = (ctx.prompt_hidden, prompt_ids[1:], torch.arange(T - 1, device=prompt_ids.device)) if T > 1 else None
        self.fed = False  # the pending slots went into this step's pass

    @torch.inference_mode()
    def propose(self, root: torch.Tensor) -> Proposal:
        if self.pending is None:  # a one-token prompt: nothing to condition on yet, so no guesses
            return Proposal(layout_for((), 1, self.ctx.dtype, self.ctx.device), root.new_empty(0))
        real, pos = self.take_pending()
        if self.d.mode == "parallel":
            logits = self.d.logits(self.parallel_pass(real, pos))  # [depth, V']
            guesses = self.d.token_ids(logits.float().topk(self.d.top_k, dim=-1).indices)
        else:
            guesses = self._chain(real, pos)
        tokens = guesses.reshape(-1)[self.layout.cand_index]  # [N]
        return Proposal(self.layout, tokens, guesses=guesses)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending real slots as drafter inputs [1, m, H] and their positions [m], fed this step."""
        feats, nxt, pos = self.pending
        self.fed = True
        return self.d.real_inputs(feats, nxt)[None], pos

    def parallel_pass(self, real: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One pass over the new real slots and depth - 1 masks -> hidden [depth, H] for distances 1..depth."""
        k = self.depth - 1
        m, C = real.shape[1], self.cache.get_seq_length()
        x = torch.cat([real, self.d.masks[:k][None].to(real.dtype)], dim=1)  # [1, m + k, H]
        last = int(pos[-1])
        positions = torch.cat([pos, last + torch.arange(1, k + 1, device=pos.device)])[None]
        mask = slot_mask(m, k, C, real.dtype, real.device)
        hidden = self.d.run(x, positions, mask, self.cache)[0]  # [m + k, H]
        crop_cache(self.cache, C + m)  # masks never stay
        return hidden[m - 1:]

    def chain(self, real: torch.Tensor, pos: torch.Tensor, level) -> None:
        """Up to depth passes, one token each, the drafter's own output as the next slot's feature.
        level(d, hidden [1, H]) reads distance d + 1's pass and returns the token [1] the chain
        continues with, or None to stop (a dynamic plan's per-level decision)."""
        C = self.cache.get_seq_length()
        x, positions = real, pos[None]
        for d in range(self.depth):
            hidden = self.d.run(x, positions, None, self.cache)[0, -1:]  # [1, H]
            token = level(d, hidden)
            if token is None or d + 1 == self.depth:
                break
            x = self.d.real_inputs(hidden, token)[None]  # (predicted feature, guessed token)
            positions = positions[:, -1:] + 1
        crop_cache(self.cache, C + real.shape[1])  # speculative slots never stay

    def _chain(self, real: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """depth passes along the rank-0 guesses -> guesses [depth, top_k]."""
        rows = []

        def level(d: int, hidden: torch.Tensor) -> torch.Tensor:
            ids = self.d.token_ids(self.d.logits(hidden).float().topk(self.d.top_k, dim=-1).indices)  # [1, top_k]
            rows.append(ids)
            return ids[:, 0]

        self.chain(real, pos, level)
        return torch.cat(rows)

    def commit(self, outcome: StepOutcome) -> None:
        """The accepted path's real slots: (target feature at node u, the next accepted token or the new root)."""
        path = outcome.verdict.nodes
        toks = torch.cat([outcome.proposal.tokens.new_zeros(1), outcome.proposal.tokens])  # [num_tree], root slot unused
        nxt = [int(toks[u]) for u in path[1:]] + [outcome.verdict.emitted[-1]]
        C0 = outcome.context_length - len(path)  # the root's position
        depth = outcome.proposal.layout.position_offsets[0, path].to(torch.long)
        idx = torch.tensor(path, device=outcome.hidden.device)
        new = (outcome.hidden[idx], torch.tensor(nxt, device=idx.device), C0 + depth.to(idx.device))
        if self.pending is not None and not self.fed:  # a skipped pass: its slots still wait, these join them
            new = tuple(torch.cat([a, b]) for a, b in zip(self.pending, new))
        self.pending, self.fed = new, False


class ParallelSource(Source):
    """The ParallelSpec drafter in a dynamic plan: one pass guesses every distance (a Cartesian
    pool); chain mode: one pass per distance along its rank-0 draft (a comb), stopping when a level
    would not pay. Either skips its pass when even the best guess would not pay."""

    def __init__(self, gm: GuesserModel, d: ParallelDrafter, spec: DynamicSpec, prompt_ids: torch.Tensor,
                 ctx: DecodeContext):
        super().__init__(gm)
        self.kind = "chain" if d.mode == "chain" else "parallelspec"
        depth = d.num_masks + 1 if d.mode == "parallel" else min(spec.max_depth, 16)
        nodes = tuple((0,) * i for i in range(1, depth + 1))
        self.s = ParallelSession(d, nodes, depth, prompt_ids.reshape(-1), ctx)
        self.d, self.depth, self.spec = d, depth, spec
        self.width = min(POOL_WIDTH, d.top_k)

    def _guesses(self, hidden: torch.Tensor, distance: int) -> tuple[np.ndarray, np.ndarray]:
        """hidden [k, H] (distances `distance`.. beyond the root) -> top-width probabilities and token
        ids [k, width] on the host (one copy). Under coupled sampling the ranks are the top-width of
        log q + g, q the drafter's warped distribution and g the noise the target's draw at that
        distance will use (decoder/noise.py); the probabilities stay the softmax's, the calibrated signal."""
        logits = self.d.logits(hidden).float()  # [k, V']
        probs = torch.softmax(logits, dim=-1)
        noise = self.s.ctx.noise
        if noise is None:
            top = probs.topk(self.width, dim=-1)
            ranks, values = top.indices, top.values
        else:
            head = self.d.head_ids.cpu() if self.d.head_ids.numel() else None  # head position -> token id
            first = noise.cursor + distance - 1
            ranks = aimed_top_k(logits, self.s.ctx.sampling, noise, list(range(first, first + logits.shape[0])),
                                self.width, self.d.target[1].weight.shape[0], head)
            values = probs.gather(-1, ranks)
        ids = self.d.token_ids(ranks)
        both = torch.stack([values, ids.float()]).cpu().numpy()
        return both[0], both[1].astype(np.int64)

    def _cells(self, q: np.ndarray, depth0: int) -> tuple[np.ndarray, np.ndarray]:
        """(flat cells, q bins) [D, K] of a guess matrix whose first row is distance depth0 + 1."""
        D, K = q.shape
        depth = np.repeat(np.arange(depth0 + 1, depth0 + D + 1), K)
        rank = np.tile(np.arange(K), D)
        bins = q_bins(q.reshape(-1))
        return self.model.cells(depth, rank, bins).reshape(D, K), bins.reshape(D, K)

    def extend(self, pool: Pool, root: torch.Tensor, session: Decider) -> None:
        if self.s.pending is None:
            return
        gm = self.model
        if not session.worth_level(pool, session.top1(self.kind, 1), gm.draft_s):
            return  # the pass would not pay: the pending slots wait for the next pass
        t0 = time.perf_counter()
        real, pos = self.s.take_pending()
        if self.d.mode == "chain":
            return self._extend_chain(pool, real, pos, session, t0)
        q, toks = self._guesses(self.s.parallel_pass(real, pos), 1)  # [depth, width]
        pool.passes_s += time.perf_counter() - t0
        pool.sunk_s += gm.draft_s
        cells, sig = self._cells(q, 0)
        c = session.c_of(self.kind, cells.reshape(-1)).reshape(cells.shape)
        cartesian(pool, self.kind, c, toks, cells, self.spec.max_size, sig)

    def _extend_chain(self, pool: Pool, real: torch.Tensor, pos: torch.Tensor, session: Decider, t0: float) -> None:
        """The rank-0 draft with its ranked siblings as leaves, one level per pass while the next pays."""
        gm = self.model
        parent, P = -1, 1.0

        def level(d: int, hidden: torch.Tensor) -> torch.Tensor | None:
            nonlocal parent, P, t0
            q, toks = self._guesses(hidden, d + 1)  # [1, width]
            pool.passes_s += time.perf_counter() - t0
            pool.sunk_s += gm.draft_s
            cells, sig = self._cells(q, d)
            c = session.c_of(self.kind, cells.reshape(-1))
            head = parent
            for r in range(self.width):
                i = pool.add(int(toks[0, r]), head, float(c[r]), (self.kind, int(cells[0, r]), int(sig[0, r])), r)
                if r == 0:
                    parent = i
            P *= float(c[0])
            if d + 1 >= self.depth or not session.worth_level(pool, P * session.top1(self.kind, d + 2), gm.draft_s):
                return None
            t0 = time.perf_counter()
            return torch.tensor([int(toks[0, 0])], device=hidden.device)

        self.s.chain(real, pos, level)

    def commit(self, outcome: StepOutcome, pool: Pool, accepted: list[int]) -> None:
        self.s.commit(outcome)


def slot_mask(m: int, k: int, C: int, dtype, device) -> torch.Tensor:
    """[1, 1, m + k, C + m + k] additive mask: real slots causal over the cache and each other;
    masks see every real slot and the masks before them (one group)."""
    n = m + k
    visible = torch.ones(n, C + n, dtype=torch.bool, device=device)
    block = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
    visible[:, C:] = block
    mask = torch.zeros(n, C + n, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def load(request) -> ParallelDrafter:
    """The registry's loader (planner/guessers.py): the ParallelSpec drafter, one pass per step."""
    return ParallelDrafter.load(request.path, mode="parallel", top_k=request.top_k)


def load_chain(request) -> ParallelDrafter:
    """The registry's loader for the same drafter run as a chain (one token per pass)."""
    return ParallelDrafter.load(request.path, mode="chain", top_k=request.top_k)
