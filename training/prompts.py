"""PPD prompt-token training: the base model is frozen, only the P x E prompt embeddings learn.

One step, for a batch of token windows x [B, T]:
  1. prefix pass (no grad) over x: teacher logits [B, T, V] and a KV cache of T tokens;
  2. m random insertion points i per window (PPD's random insertion). After each one a block of
     P*E prompt tokens is appended, slot (j, e) at position i + j + 1. One more forward pass over
     all B x m blocks at once, on top of the cache, with a block-diagonal 4D mask: a block sees
     x[0..i] and, inside itself, `prompt_block_mask` (the decoder's ensemble mask);
  3. student distribution for distance d = j + 1: softmax of the E copies' averaged logits; its
     target is the teacher's next-token distribution at position i + d (which predicts
     x[i + d + 1]), exactly what the decoder asks of the prompt token at distance d;
  4. loss = sum_d w_d KL(teacher_d || student_d), w_d = decay^(d-1) (Medusa-style decay that
     PPD follows; decay 0.8 by default), averaged over insertion points.

Evaluation uses the same pass without gradients and scores the ranked guesses of each distance
against the teacher's argmax at i + d: accuracy[d][r] is the planner's acceptance matrix.

The model is an engine that lends its torch modules (caps.torch_modules: the loss backpropagates through
it), or a bare transformers model (the hf engine's); its two passes are the engine's own (Engine.training():
decoder/engines/hf/training.py, training/teacher.py `training_passes`).
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

from decoder.guessers.prompt_tokens import PromptTokens
from decoder.layout import prompt_block_mask
from planner.errors import UserError
from planner.jsonio import atomic_write_bytes, atomic_write_json
from training.teacher import training_passes
from training.data import (  # noqa: F401 (re-exported)
    DEFAULT_DATA,
    held_out_question,
    load_corpus,
    read_texts,
    token_windows,
)

CHECKPOINT_NAME = "checkpoint.pt"


# ---------------------------------------------------------------- the forward pass with inserted prompt tokens


def sample_insertions(batch: int, seq_len: int, num_prompt_tokens: int, m: int, generator: torch.Generator) -> torch.Tensor:
    """[B, m] sorted distinct insertion points i in [0, T - 1 - P] (targets at i + P must exist)."""
    hi = seq_len - num_prompt_tokens  # number of legal points
    if hi < 1:
        raise UserError(f"sequence length {seq_len} too short for {num_prompt_tokens} prompt tokens")
    m = min(m, hi)
    pts = torch.stack([torch.randperm(hi, generator=generator)[:m] for _ in range(batch)])
    return pts.sort(dim=1).values


def insertion_mask(inserts: torch.Tensor, seq_len: int, num_prompt_tokens: int, ensemble: int, dtype) -> torch.Tensor:
    """Additive mask [B, 1, m*P*E, T + m*P*E] for the prompt blocks appended after a cache of T tokens.

    Block k (after position inserts[b, k]) sees x[0 .. inserts[b, k]] and its own block through
    `prompt_block_mask`; blocks never see each other.
    """
    B, m = inserts.shape
    S = num_prompt_tokens * ensemble
    prefix = torch.arange(seq_len, device=inserts.device)[None, None, :] <= inserts[:, :, None]  # [B, m, T]
    prefix = prefix[:, :, None, :].expand(B, m, S, seq_len).reshape(B, m * S, seq_len)
    block = prompt_block_mask(num_prompt_tokens, ensemble).to(inserts.device)  # [S, S]
    own = torch.block_diag(*([block] * m))  # [m*S, m*S]
    visible = torch.cat([prefix, own[None].expand(B, -1, -1)], dim=2)  # [B, m*S, T + m*S]
    mask = torch.zeros(visible.shape, dtype=dtype, device=inserts.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None]


def prompt_forward(passes, embeddings: torch.Tensor, ensemble: int, x: torch.Tensor, inserts: torch.Tensor):
    """embeddings [P*E, hidden] (prompt_tokens.embeddings layout), x [B, T], inserts [B, m]
    -> (student logits [B, m, P, V] averaged over the E copies, teacher logits [B, T, V]).

    Gradients flow only into `embeddings`: the prefix pass runs without them, and its cache is a
    constant for the prompt pass.
    """
    B, T = x.shape
    m = inserts.shape[1]
    E = ensemble
    P = embeddings.shape[0] // E
    H = embeddings.shape[1]
    inputs = embeddings[None, None].expand(B, m, P * E, H).reshape(B, m * P * E, H)
    offsets = torch.arange(P * E, device=x.device) // E + 1  # slot (j, e) sits at i + j + 1
    positions = (inserts[:, :, None] + offsets).reshape(B, m * P * E)
    mask = insertion_mask(inserts, T, P, E, inputs.dtype)
    logits, teacher = passes.prompt_pass(x, inputs, positions, mask)  # [B, m*P*E, V], [B, T, V]
    student = logits.view(B, m, P, E, -1).mean(dim=3)  # [B, m, P, V]
    return student, teacher


def teacher_targets(teacher: torch.Tensor, inserts: torch.Tensor, num_prompt_tokens: int) -> torch.Tensor:
    """Teacher logits [B, m, P, V] at positions i + d, d = 1..P."""
    B, m = inserts.shape
    pos = (inserts[:, :, None] + torch.arange(1, num_prompt_tokens + 1, device=inserts.device)).reshape(B, -1)
    return teacher.gather(1, pos[:, :, None].expand(-1, -1, teacher.shape[-1])).view(B, m, num_prompt_tokens, -1)


def distance_weights(num_prompt_tokens: int, decay: float) -> torch.Tensor:
    return decay ** torch.arange(num_prompt_tokens, dtype=torch.float32)  # w_d = decay^(d-1)


def distill_loss(student: torch.Tensor, target: torch.Tensor, weights: torch.Tensor):
    """student, target [B, m, P, V] logits -> (sum_d w_d mean KL_d, KL per distance [P])."""
    log_q = F.log_softmax(student.float(), dim=-1)
    log_p = F.log_softmax(target.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B, m, P]
    per_distance = kl.mean(dim=(0, 1))  # [P]
    return (weights.to(per_distance.device) * per_distance).sum(), per_distance.detach()


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model, prompt_tokens: PromptTokens, windows: torch.Tensor, ranks: int = 10, stride: int = 4,
             batch_size: int = 8, device=None) -> dict:
    """Per-distance, per-rank accuracy against the base model's greedy token at i + d, insertion
    points every `stride` positions of each held-out window. Returns {'accuracy': [P][ranks],
    'top1': [P], 'top5': [P], 'kl': [P], 'count': n}."""
    passes = training_passes(model)
    P = prompt_tokens.num_prompt_tokens
    device = device or windows.device
    T = windows.shape[1]
    pts = torch.arange(0, T - P, stride)
    hits = torch.zeros(P, ranks, dtype=torch.float64)
    kl_sum = torch.zeros(P, dtype=torch.float64)
    count = 0
    for b in range(0, windows.shape[0], batch_size):
        x = windows[b : b + batch_size].to(device)
        inserts = pts[None].expand(x.shape[0], -1).to(device)
        emb = prompt_tokens.embeddings.to(device=device, dtype=passes.dtype)
        student, teacher = prompt_forward(passes, emb, prompt_tokens.ensemble, x, inserts)
        target = teacher_targets(teacher, inserts, P)  # [B, m, P, V]
        greedy = target.argmax(-1)  # [B, m, P]
        r = min(ranks, student.shape[-1])  # a vocabulary smaller than the ranks asked
        guesses = student.topk(r, dim=-1).indices  # [B, m, P, r]
        hits[:, :r] += (guesses == greedy[..., None]).double().sum(dim=(0, 1)).cpu()
        _, kl = distill_loss(student, target, torch.ones(P))
        kl_sum += kl.double().cpu() * greedy.shape[0] * greedy.shape[1]
        count += greedy.shape[0] * greedy.shape[1]
    acc = hits / max(count, 1)
    return {
        "accuracy": [[round(v, 5) for v in row] for row in acc.tolist()],
        "top1": [round(v, 4) for v in acc[:, 0].tolist()],
        "top5": [round(v, 4) for v in acc[:, :5].sum(1).tolist()],
        "kl": [round(v, 4) for v in (kl_sum / max(count, 1)).tolist()],
        "count": count,
    }


# ---------------------------------------------------------------- training


@dataclass
class TrainConfig:
    num_prompt_tokens: int = 3
    ensemble: int = 1
    steps: int = 300
    batch_size: int = 8
    inserts: int = 32  # insertion points per window per step
    lr: float = 1e-2  # PPD: cosine schedule from 0.01, no warmup
    decay: float = 0.8
    seed: int = 0
    ckpt_every: int = 50
    eval_ranks: int = 10
    eval_stride: int = 4


@dataclass
class TrainResult:
    prompt_tokens: PromptTokens
    step: int
    losses: list[float]
    wall_s: float
    trained_parameters: int
    evaluation: dict = field(default_factory=dict)
    interrupted: bool = False


def init_prompt_tokens(model, P: int, E: int, seed: int) -> PromptTokens:
    """Initialised from ordinary token embeddings (PPD): copies of random vocabulary rows, in fp32."""
    pt = PromptTokens.random(model, P, E, seed=seed)
    return pt.float()


def _save_checkpoint(path: Path, pt: PromptTokens, opt, gen_state: torch.Tensor, step: int, losses, wall: float, cfg: TrainConfig):
    buf = io.BytesIO()
    torch.save({"embeddings": pt.embeddings.detach().cpu(), "opt": opt.state_dict(), "gen": gen_state,
                "step": step, "losses": losses, "wall_s": wall, "config": asdict(cfg)}, buf)
    atomic_write_bytes(path, buf.getvalue())


def train_prompt_tokens(model, train_windows: torch.Tensor, out_dir, config: TrainConfig | None = None,
                        resume: bool = False, device=None, progress: bool = True, meta: dict | None = None) -> TrainResult:
    """Train P x E prompt tokens for `model` on train_windows [N, T]; checkpoints to out_dir/checkpoint.pt
    every config.ckpt_every steps (and on Ctrl-C), resumes from it with resume=True, and saves the
    final PromptTokens (decoder/guessers/prompt_tokens.py format) into out_dir."""
    from tqdm import tqdm

    passes = training_passes(model)  # an engine's (caps.torch_modules) or a bare model's: the loss backpropagates through it
    cfg = config or TrainConfig()
    out_dir = Path(out_dir)
    device = torch.device(device or passes.device)
    P, E = cfg.num_prompt_tokens, cfg.ensemble
    if train_windows.ndim != 2 or train_windows.shape[0] == 0:
        raise UserError("prompt-token training: no training windows (data shorter than one window?)")
    T = train_windows.shape[1]

    pt = init_prompt_tokens(model, P, E, cfg.seed).to(device)
    model_dtype = passes.dtype
    opt = torch.optim.Adam([pt.embeddings], lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, losses, wall_before = 0, [], 0.0
    ckpt = out_dir / CHECKPOINT_NAME
    if resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False, map_location="cpu")
        got = (st["config"]["num_prompt_tokens"], st["config"]["ensemble"])
        if got != (P, E):
            raise UserError(f"{ckpt}: checkpoint has P={got[0]}, E={got[1]}, asked P={P}, E={E}")
        with torch.no_grad():
            pt.embeddings.copy_(st["embeddings"].to(device))
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, losses, wall_before = st["step"], st["losses"], st["wall_s"]
    trained = sum(p.numel() for p in pt.parameters() if p.requires_grad)
    assert trained == P * E * pt.hidden_size
    assert not passes.trainable()
    weights = distance_weights(P, cfg.decay).to(device)

    t0 = time.time()
    interrupted = False
    gen_state = gen.get_state()
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train prompts P={P} E={E}", disable=not progress, dynamic_ncols=True)
    try:
        while step < cfg.steps:
            gen_state = gen.get_state()  # a step cut short by Ctrl-C redraws the same batch on resume
            rows = torch.randint(0, train_windows.shape[0], (cfg.batch_size,), generator=gen)
            x = train_windows[rows].to(device)  # [B, T]
            inserts = sample_insertions(x.shape[0], T, P, cfg.inserts, gen).to(device)  # [B, m]
            for g in opt.param_groups:
                g["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
            # fp32 master embeddings, cast to the model's dtype for the pass
            student, teacher = prompt_forward(passes, pt.embeddings.to(model_dtype), E, x, inserts)
            loss, per_d = distill_loss(student, teacher_targets(teacher, inserts, P), weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            losses.append(round(loss.item(), 5))
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", kl=",".join(f"{v:.2f}" for v in per_d.tolist()))
            if step % cfg.ckpt_every == 0 and step < cfg.steps:
                _save_checkpoint(ckpt, pt, opt, gen.get_state(), step, losses, wall_before + time.time() - t0, cfg)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    wall = wall_before + time.time() - t0
    # Always checkpoint at the end: after Ctrl-C to keep the work done, after the last step so that
    # --resume with more steps continues. Ignore a second Ctrl-C while writing.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _save_checkpoint(ckpt, pt, opt, gen_state if interrupted else gen.get_state(), step, losses, wall, cfg)
    finally:
        signal.signal(signal.SIGINT, old)
    pt.meta.update(meta or {})
    pt.meta["training"] = {
        "steps": step, "wall_s": round(wall, 1), "trained_parameters": trained, "config": asdict(cfg),
        "final_loss_mean_last20": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4) if losses else None,
    }
    if not interrupted:
        pt.save(out_dir)
    return TrainResult(pt, step, losses, wall, trained, interrupted=interrupted)


def write_acceptance(path, evaluation: dict, label: str) -> None:
    """The planner's acceptance format (planner/accept.py) plus provenance fields."""
    atomic_write_json(path, {"accuracy": evaluation["accuracy"], "kind": "ppd-prompt-tokens", "source": label,
                             "top1": evaluation["top1"], "top5": evaluation["top5"], "count": evaluation["count"]})
