"""Training an EAGLE-3 head (decoder/torch_ops/eagle.py) for a frozen target, with training-time test.

Data (training/teacher.py, cached once): token windows of the target's own answers, the target's top-k
next-token distribution at every position, and its features there (the residual streams entering the
head's three target layers, concatenated). Slot s of a window is token x_{s+1} beside g_s = fc(a_s).

Training-time test (EAGLE-3): the head is unrolled `steps` times. Step 0 is the teacher-forced pass:
slot s sees the slots up to s and predicts the target's distribution at s + 1. Step j > 0 continues the
chain of every slot s as decoding would after j accepted draft tokens: its input is the next true token
x_{s+1+j} beside the head's own step-(j-1) output at s (not the target's feature), and its attention
sees the step-0 slots up to s and its own chain's steps 1..j (the diagonal), never another chain's. It
predicts the target's distribution at s + 1 + j. So the head learns to draft on its own features, which
is what makes its later chain positions worth drafting.

Loss: sum over steps of decay^j * KL(teacher top-k || head) over the head's draft vocabulary (the
teacher renormalised on it), on the positions `weights` marks (the assistant's answers count fully).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoder.torch_ops.eagle import EagleHead
from training.drafters import kl_top_k, restricted_targets


@dataclass
class EagleTrainConfig:
    steps: int = 3000  # optimiser steps
    batch_size: int = 4  # windows per step
    ttt_steps: int = 4  # unrolled draft steps (EAGLE-3's training-time test)
    decay: float = 0.8  # weight of step j: decay ** j
    lr: float = 5e-4
    seed: int = 0
    ckpt_every: int = 100


def repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def chain_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                    diag_v: list[torch.Tensor]) -> torch.Tensor:
    """Step j's attention: q [B, nh, S, d] over the step-0 keys k0 [B, nh, S, d] causally (slot s sees 0..s) and
    over its own chain's keys diag_k[i] [B, nh, S, d] at the same slot (i = 1..j, the last is itself).
    Returns [B, S, nh * d]."""
    B, nh, S, d = q.shape
    scale = 1.0 / math.sqrt(d)
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, S, S]
    s0 = s0.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    sd = [(q * k).sum(-1, keepdim=True) * scale for k in diag_k]  # each [B, nh, S, 1]
    w = torch.softmax(torch.cat([s0, *sd], dim=-1).float(), dim=-1).to(q.dtype)
    out = w[..., :S] @ v0
    for i, v in enumerate(diag_v):
        out = out + w[..., S + i: S + i + 1] * v
    return out.transpose(1, 2).reshape(B, S, nh * d)


def eagle_loss(head: EagleHead, tokens: torch.Tensor, feats: torch.Tensor, top_ids: torch.Tensor,
               top_probs: torch.Tensor, weights: torch.Tensor, cfg: EagleTrainConfig) -> tuple[torch.Tensor, dict]:
    """tokens [B, T], feats [B, T, F], teacher top-k [B, T, k] (position t predicts x_{t+1}), weights [B, T]."""
    T = tokens.shape[1]
    S = T - 1
    draft_ids = head.target_ids()
    total, stats = 0.0, {}
    hidden = unrolled(head, tokens, feats, cfg.ttt_steps)
    for j, h in enumerate(hidden):
        n = h.shape[1]  # slots 0..n-1 predict positions 1+j .. n+j
        tpos = torch.arange(1 + j, 1 + j + n, device=tokens.device)
        cols, p = restricted_targets(top_ids[:, tpos], top_probs[:, tpos], draft_ids, head.arch.vocab_size)
        logq = F.log_softmax(head.draft_logits(h).float(), dim=-1).gather(-1, cols)  # [B, n, k]
        w = weights[:, tpos].float()
        kl = -((p * logq).sum(-1) * w).sum() / w.sum().clamp_min(1.0)
        total = total + cfg.decay ** j * kl
        stats[f"kl{j}"] = float(kl.detach())
    return total, stats


def unrolled(head: EagleHead, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Step j's logit inputs [B, S_j, H], S_j = T - 1 - j: slot s's chain after j accepted drafts, shapes shrinking
    as the window's tokens run out (the step-j token of slot s is x_{s+1+j})."""
    a = head.arch
    B, T = tokens.shape
    group = a.num_attention_heads // a.num_key_value_heads
    S = T - 1
    g = head.combine(feats[:, :S])  # [B, S, H]
    outs, keys, values = [], [], []
    k0 = v0 = None
    for j in range(min(steps, S)):
        n = S - j  # slots with a step-j token
        x, residual = head.layer_input(tokens[:, 1 + j: 1 + j + n], g[:, :n])
        pos = torch.arange(1 + j, 1 + j + n, device=tokens.device)[None].expand(B, -1)
        q, k, v = head.qkv(x, pos)
        k, v = repeat_kv(k, group), repeat_kv(v, group)
        if j == 0:
            k0, v0 = k, v
            attn = chain_attention(q, k0, v0, [], [])
        else:
            keys = [kk[:, :, :n] for kk in keys] + [k]
            values = [vv[:, :, :n] for vv in values] + [v]
            attn = chain_attention(q, k0[:, :, :n], v0[:, :, :n], keys, values)
        nxt, head_in = head.finish(attn, residual)
        outs.append(head_in)
        g = nxt
    return outs


@torch.no_grad()
def evaluate(head: EagleHead, data, depth: int = 4, ranks: int = 8, max_windows: int | None = None) -> dict:
    """Teacher-forced acceptance on held-out windows under the unrolled chain: accuracy[d][r] whether the head's
    rank-r guess at chain step d (after d true tokens drafted by itself) is the target's greedy token, on the
    weighted (answer) positions; top1[d] and the chain's conditional acceptance."""
    head.eval()
    hits = torch.zeros(depth, ranks, dtype=torch.float64)
    total = torch.zeros(depth, dtype=torch.float64)
    n = len(data) if max_windows is None else min(len(data), max_windows)
    ids = head.target_ids()
    for i in range(n):
        tok, feats = data.tokens[i: i + 1], data.hidden[i: i + 1].float()
        w = data.weights[i: i + 1] if getattr(data, "weights", None) is not None else torch.ones_like(tok)
        for j, h in enumerate(unrolled(head, tok, feats.to(head.fc.weight.dtype), depth)):
            m = h.shape[1]
            tpos = torch.arange(1 + j, 1 + j + m)
            guess = ids[head.draft_logits(h[0]).float().topk(ranks, -1).indices]  # [m, ranks]
            truth = data.top_ids[i, tpos, 0].long()
            keep = w[0, tpos] > 0.5
            hits[j] += ((guess == truth[:, None]) & keep[:, None]).double().sum(0)
            total[j] += keep.double().sum()
    acc = hits / total[:, None].clamp_min(1)
    return {"accuracy": [[round(float(v), 5) for v in row] for row in acc], "top1": [round(float(r[0]), 4) for r in acc],
            "positions": [int(t) for t in total]}
