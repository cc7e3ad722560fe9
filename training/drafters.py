"""Training drafters for a frozen target by distillation from its cached outputs (training/teacher.py).

- ParallelSpec drafter (decoder/guessers/parallel.py): group-wise. Every window's real slots (f_s, x_{s+1})
  run as a causal sequence; m sampled slots s each open a group of K masks at positions s+1..s+K,
  which see the real slots up to s and their own group's earlier masks, never another group's
  masks (the inference layout: decoder.guessers.parallel.slot_mask). Targets: slot s and mask j of group s
  learn the target's next-token distribution at position s+1+j (distance j+1 beyond the token
  x_{s+1}) and its feature f_{s+1+j}. Loss = KL(teacher top-k || drafter) + w_f SmoothL1(features),
  the KL over the drafter's head (restricted to frequent tokens when asked).
- Draft LM (decoder/guessers/draft.py, `DraftLM`): a few Llama layers of the target's shape on its frozen
  embedding and head; the same KL on every position.

Both: AdamW, cosine schedule, checkpoints every ckpt_every steps and on Ctrl-C, resume, a progress
bar, and an evaluation of teacher-forced acceptance per distance on held-out windows.
"""
from __future__ import annotations

import io
import math
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from decoder.engines.hf.training import draft_lm_features, trainable_state
from planner.errors import UserError
from planner.jsonio import atomic_write_bytes
from training.teacher import TeacherData

CHECKPOINT = "checkpoint.pt"


@dataclass
class DrafterConfig:
    steps: int = 2000
    batch_size: int = 4  # windows per step
    groups: int = 32  # ParallelSpec: mask groups sampled per window
    lr: float = 5e-4
    weight_decay: float = 0.0
    feature_weight: float = 0.5
    seed: int = 0
    ckpt_every: int = 100


@dataclass
class TrainResult:
    step: int
    losses: list[float]
    wall_s: float
    trained_parameters: int
    interrupted: bool = False
    evaluation: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- losses


def restricted_targets(top_ids: torch.Tensor, top_probs: torch.Tensor, head_ids: torch.Tensor | None, V: int) -> tuple:
    """Teacher top-k as (column index in the drafter's head, probability), renormalised over the
    tokens the head has; columns the head lacks get probability 0 (index 0, weight 0)."""
    ids, p = top_ids.long(), top_probs.float()
    if head_ids is not None and head_ids.numel():
        pos = torch.full((V,), -1, dtype=torch.long, device=ids.device)
        pos[head_ids] = torch.arange(head_ids.numel(), device=ids.device)
        col = pos[ids]
        p = torch.where(col >= 0, p, torch.zeros_like(p))
        ids = col.clamp_min(0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return ids, p


def kl_top_k(logits: torch.Tensor, cols: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """KL(teacher || drafter) up to the teacher's entropy: -sum_top-k p log q, mean over rows."""
    logq = F.log_softmax(logits.float(), dim=-1).gather(-1, cols)  # [..., k]
    return -(p * logq).sum(-1).mean()


# ---------------------------------------------------------------------------------------------- ParallelSpec


def group_layout(T: int, starts: torch.Tensor, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [T-1 + m K] and the additive-mask visibility [L, L] (bool) of the group-wise layout:
    real slots 0..T-2 (slot s at position s), then K masks per start s at positions s+1..s+K."""
    m = starts.numel()
    R = T - 1
    L = R + m * K
    pos = torch.cat([torch.arange(R, device=device), (starts[:, None] + torch.arange(1, K + 1, device=device)).reshape(-1)])
    visible = torch.zeros(L, L, dtype=torch.bool, device=device)
    visible[:R, :R] = torch.tril(torch.ones(R, R, dtype=torch.bool, device=device))
    rows = R + torch.arange(m * K, device=device)
    group = torch.arange(m * K, device=device) // K
    j = torch.arange(m * K, device=device) % K
    visible[rows[:, None], torch.arange(R, device=device)[None, :]] = torch.arange(R, device=device)[None, :] <= starts[group][:, None]
    same = (group[:, None] == group[None, :]) & (j[None, :] <= j[:, None])
    visible[R:, R:] = same
    return pos, visible


def parallel_batch(drafter, data: TeacherData, rows: torch.Tensor, K: int, groups: int, gen: torch.Generator):
    """Inputs, positions, mask and the targets of one group-wise batch."""
    tok = data.tokens[rows]  # [B, T]
    feats = data.hidden[rows].float()  # [B, T, H]
    B, T = tok.shape
    R = T - 1
    starts = torch.stack([torch.randperm(T - 1 - K, generator=gen)[:groups].sort().values for _ in range(B)])  # [B, m]
    real = drafter.real_inputs(feats[:, :R], tok[:, 1:])  # [B, R, H]
    masks = drafter.masks[None, None].expand(B, starts.shape[1], K, -1).reshape(B, -1, feats.shape[-1])
    inputs = torch.cat([real, masks], dim=1)
    pos_list, vis_list = zip(*(group_layout(T, starts[b], K, inputs.device) for b in range(B)))
    mask = torch.zeros(B, 1, *vis_list[0].shape).masked_fill_(~torch.stack(vis_list)[:, None], torch.finfo(torch.float32).min)
    # the position each slot predicts: slot s -> s + 1, mask j of group s -> s + 1 + j
    target_pos = torch.cat([torch.arange(1, R + 1)[None].expand(B, -1),
                            (starts[:, :, None] + 1 + torch.arange(1, K + 1)).reshape(B, -1)], dim=1)  # [B, L]
    return inputs, torch.stack(pos_list), mask, target_pos


def parallel_loss(drafter, data: TeacherData, rows: torch.Tensor, cfg: DrafterConfig, gen) -> tuple[torch.Tensor, dict]:
    K = drafter.num_masks
    inputs, pos, mask, tpos = parallel_batch(drafter, data, rows, K, cfg.groups, gen)
    hidden = drafter.run(inputs, pos, mask)  # [B, L, H]
    valid = tpos < data.tokens.shape[1]  # distances past the window's end have no target
    b = torch.arange(len(rows))[:, None].expand_as(tpos)
    tp = tpos.clamp(max=data.tokens.shape[1] - 1)
    # teacher at position t predicts x_{t+1}: slot s (predicting x_{s+2}) uses the teacher at s+1
    cols, p = restricted_targets(data.top_ids[rows][b, tp], data.top_probs[rows][b, tp], drafter.head_ids,
                                 drafter.target[1].weight.shape[0])
    logits = drafter.logits(hidden[valid])
    kl = kl_top_k(logits, cols[valid], p[valid])
    feat = F.smooth_l1_loss(hidden[valid].float(), data.hidden[rows][b, tp][valid].float())
    return kl + cfg.feature_weight * feat, {"kl": float(kl.detach()), "feature": float(feat.detach())}


@torch.no_grad()
def evaluate_parallel(drafter, data: TeacherData, K: int | None = None, starts_every: int = 8, full_head: bool = False) -> dict:
    """Teacher-forced acceptance on held-out windows: at sampled slots s, does the drafter's rank-r
    guess for distance d equal the target's greedy token at s+1+d? accuracy[d][r] (the planner's
    acceptance format, per rank); also with the chain (its own features)."""
    K = K if K is not None else drafter.num_masks
    ranks = drafter.top_k
    hits = torch.zeros(K + 1, ranks, dtype=torch.float64)
    total = torch.zeros(K + 1)
    for i in range(len(data)):
        T = data.tokens.shape[1]
        starts = torch.arange(0, T - 1 - K, starts_every)
        tok, feats = data.tokens[i:i + 1], data.hidden[i:i + 1].float()
        real = drafter.real_inputs(feats[:, : T - 1], tok[:, 1:])
        masks = drafter.masks[None, None].expand(1, starts.numel(), K, -1).reshape(1, -1, feats.shape[-1])
        pos, vis = group_layout(T, starts, K, real.device)
        mask = torch.zeros(1, 1, *vis.shape).masked_fill_(~vis[None, None], torch.finfo(torch.float32).min)
        hidden = drafter.run(torch.cat([real, masks], 1), pos[None], mask)[0]
        slot_rows = torch.cat([starts[:, None], (T - 1) + torch.arange(starts.numel())[:, None] * K + torch.arange(K)], 1)
        guesses = drafter.token_ids(drafter.logits(hidden[slot_rows], full=full_head).float().topk(ranks, -1).indices,
                                    full=full_head)
        truth_pos = starts[:, None] + 1 + torch.arange(1, K + 2)  # target position of the greedy token at distance d
        ok = truth_pos < T
        greedy = data.top_ids[i, (truth_pos - 1).clamp(max=T - 1), 0].long()  # teacher at t-1 predicts token t
        hits += ((guesses == greedy[..., None]) & ok[..., None]).double().sum(0)
        total += ok.sum(0)
    acc = (hits / total[:, None].clamp_min(1)).tolist()
    return {"accuracy": [[round(v, 5) for v in row] for row in acc], "top1": [round(r[0], 4) for r in acc],
            "positions": [int(t) for t in total]}


# ---------------------------------------------------------------------------------------------- draft LM


def draft_lm_loss(draft_model, head_ids, data: TeacherData, rows: torch.Tensor, cfg: DrafterConfig, gen) -> tuple:
    x = data.tokens[rows]
    hidden, w = draft_lm_features(draft_model, x)  # [B, T, H] after the final norm, the head [V, H]
    V = w.shape[0]
    w = w[head_ids] if head_ids is not None and head_ids.numel() else w
    cols, p = restricted_targets(data.top_ids[rows], data.top_probs[rows], head_ids, V)
    kl = kl_top_k(hidden @ w.T, cols, p)
    return kl, {"kl": float(kl.detach())}


@torch.no_grad()
def evaluate_draft_lm(draft_model, data: TeacherData, ranks: int = 8, depth: int = 4) -> dict:
    """Teacher-forced per-rank accuracy of the draft LM's next-token guess against the target's
    greedy token (a positional acceptance row, as a draft model gives), and the chain acceptance
    per depth under the independence model."""
    hits = torch.zeros(ranks, dtype=torch.float64)
    n = 0
    for i in range(len(data)):
        logits = draft_model(input_ids=data.tokens[i:i + 1]).logits[0, :-1]  # [T-1, V]
        greedy = data.top_ids[i, :-1, 0].long()
        hits += (logits.float().topk(ranks, -1).indices == greedy[:, None]).double().sum(0)
        n += greedy.numel()
    row = (hits / max(n, 1)).tolist()
    return {"positional": [round(v, 5) for v in row], "top1": round(row[0], 4), "positions": n}


# ---------------------------------------------------------------------------------------------- the loop


def _save_checkpoint(path: Path, module, opt, gen_state, step: int, losses, wall: float, cfg: DrafterConfig) -> None:
    buf = io.BytesIO()
    torch.save({"state": trainable_state(module),
                "opt": opt.state_dict(), "gen": gen_state, "step": step, "losses": losses, "wall_s": wall,
                "config": asdict(cfg)}, buf)
    atomic_write_bytes(path, buf.getvalue())


def train(module, params: list, loss_fn, data: TeacherData, out_dir, cfg: DrafterConfig, resume: bool = False,
          progress: bool = True, desc: str = "train drafter", on_checkpoint=None) -> TrainResult:
    """The shared loop: loss_fn(rows, gen) -> (loss, stats). Checkpoints the module's whole state;
    on_checkpoint(step), when given, runs at every checkpoint (a held-out evaluation for a learning curve)."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, losses, wall_before = 0, [], 0.0
    ckpt = out_dir / CHECKPOINT
    if resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False, map_location="cpu")
        module.load_state_dict(st["state"], strict=False)
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, losses, wall_before = st["step"], st["losses"], st["wall_s"]
    trained = sum(p.numel() for p in params)
    t0, interrupted = time.time(), False
    gen_state = gen.get_state()
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, disable=not progress, dynamic_ncols=True)
    try:
        while step < cfg.steps:
            gen_state = gen.get_state()  # a step cut short redraws the same batch on resume
            rows = torch.randint(0, len(data), (cfg.batch_size,), generator=gen)
            for g in opt.param_groups:
                g["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
            loss, stats = loss_fn(rows, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            losses.append(round(float(loss.detach()), 5))
            bar.update(1)
            bar.set_postfix({k: f"{v:.3f}" for k, v in stats.items()})
            if step % cfg.ckpt_every == 0 and step < cfg.steps:
                _save_checkpoint(ckpt, module, opt, gen.get_state(), step, losses, wall_before + time.time() - t0, cfg)
                if on_checkpoint is not None:
                    on_checkpoint(step)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    wall = wall_before + time.time() - t0
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the checkpoint
    try:
        _save_checkpoint(ckpt, module, opt, gen_state if interrupted else gen.get_state(), step, losses, wall, cfg)
    finally:
        signal.signal(signal.SIGINT, old)
    return TrainResult(step, losses, wall, trained, interrupted)


def check_config(cfg: DrafterConfig) -> None:
    for name in ("steps", "batch_size", "groups", "ckpt_every"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(cfg, name)}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise UserError(f"--lr: must be a positive number, got {cfg.lr}")
