"""Plain PyTorch references for the kernels: the definition each kernel is tested against.

Written for clarity, not speed: a dense mask, fp32 math, a Python loop over tree nodes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def ancestor_matrix_ref(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[n, n] bool, True where column j is row i itself or one of its ancestors."""
    parents = [int(p) for p in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: tree tokens must follow their parent (-1 <= p < i)")
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def tree_visibility_ref(parents: torch.Tensor | Sequence[int], prefix_len: int) -> torch.Tensor:
    """[n, prefix_len + n] bool: every query sees the prefix, and its ancestors and itself in the tree."""
    anc = ancestor_matrix_ref(parents)
    return torch.cat([torch.ones(anc.shape[0], prefix_len, dtype=torch.bool), anc], dim=1)


def tree_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    parents: torch.Tensor | Sequence[int],
    prefix_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """q [B, H, n, d], k/v [B, H_kv, prefix_len + n, d] -> out [B, H, n, d] in q's dtype; fp32 math.

    scale defaults to 1 / sqrt(d).
    """
    B, H, n, D = q.shape
    H_kv = k.shape[1]
    visible = tree_visibility_ref(parents, prefix_len).to(q.device)  # [n, C + n]
    kf = k.float().repeat_interleave(H // H_kv, dim=1)  # [B, H, C + n, d]
    vf = v.float().repeat_interleave(H // H_kv, dim=1)
    scores = q.float() @ kf.transpose(-1, -2) * (scale if scale is not None else D**-0.5)  # [B, H, n, C + n]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vf).to(q.dtype)


def kv_compact_ref(
    layers_k: Sequence[torch.Tensor], layers_v: Sequence[torch.Tensor], prefix_len: int, accepted_idx: torch.Tensor
) -> None:
    """In place, every layer: rows prefix_len + accepted_idx[t] move to prefix_len + t (t < m).

    Each tensor is [B, H_kv, L, d]. Gather first, then copy, so overlapping moves are safe.
    """
    idx = accepted_idx.to(torch.int64)
    m = idx.shape[0]
    for t in list(layers_k) + list(layers_v):
        rows = t[:, :, prefix_len + idx.to(t.device)].clone()  # [B, H_kv, m, d]
        t[:, :, prefix_len : prefix_len + m] = rows
