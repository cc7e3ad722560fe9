"""KV-cache compaction after verification, as one Triton launch for all layers.

Verification accepts a root-to-node path of m tree tokens; their K and V rows sit at scattered
positions prefix_len + accepted_idx[t] in every layer's cache and must end up contiguous at
prefix_len + t. The layers are separate tensors (transformers' DynamicCache keeps one per
layer), so the kernel gets a table of their base addresses instead of a stacked copy.

The move is in place and safe because accepted_idx is strictly increasing (a path in topological
order): accepted_idx[t] >= t, so by the time row t is written every source row a program still
has to read lies at or after t. One program owns all m rows of one (tensor, batch, head, d-chunk)
and walks them in tiles of increasing t; within a tile a barrier separates the loads from the
stores, because a destination row of one thread can be another thread's source row.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.reference import kv_compact_ref

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_TL_DTYPES = {}
if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

    @triton.jit
    def _kv_compact(
        Ptrs, Idx,  # Ptrs: [2 * layers] int64 base addresses (all K tensors, then all V); Idx: [m]
        k_sb, k_sh, k_sl, k_sd,
        v_sb, v_sh, v_sl, v_sd,
        N_LAYERS, H_KV, PREFIX, M,
        HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr,
    ):
        pid_t = tl.program_id(0)  # which layer tensor
        pid_bh = tl.program_id(1)
        pid_d = tl.program_id(2)
        b = pid_bh // H_KV
        h = pid_bh % H_KV
        is_k = pid_t < N_LAYERS
        stride_b = tl.where(is_k, k_sb, v_sb)
        stride_h = tl.where(is_k, k_sh, v_sh)
        stride_l = tl.where(is_k, k_sl, v_sl)
        stride_d = tl.where(is_k, k_sd, v_sd)
        base = tl.load(Ptrs + pid_t).to(tl.pointer_type(DTYPE)) + b * stride_b + h * stride_h
        d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        for start in range(0, M, BLOCK_T):
            t = start + tl.arange(0, BLOCK_T)
            t_ok = t < M
            src = tl.load(Idx + t, mask=t_ok, other=0) + PREFIX
            ok = t_ok[:, None] & d_ok[None, :]
            rows = tl.load(base + src[:, None] * stride_l + d[None, :] * stride_d, mask=ok)  # [BLOCK_T, BLOCK_D]
            # Row t of the tile may be row accepted_idx[t'] of another thread: all loads land first.
            tl.debug_barrier()
            tl.store(base + (PREFIX + t)[:, None] * stride_l + d[None, :] * stride_d, rows, mask=ok)

    INTERPRETED = type(_kv_compact).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def _as_list(x: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    # A stacked [layers, B, H_kv, L, d] tensor is a list of views sharing one storage.
    return list(x.unbind(0)) if isinstance(x, torch.Tensor) else list(x)


def kv_compact(
    layers_k: Sequence[torch.Tensor] | torch.Tensor,
    layers_v: Sequence[torch.Tensor] | torch.Tensor,
    prefix_len: int,
    accepted_idx: torch.Tensor,
    *,
    backend: str = "auto",
    validate: bool = True,
) -> int:
    """Move the accepted tree rows to prefix_len .. prefix_len + m - 1 in every layer, in place.

    layers_k, layers_v: lists of [B, H_kv, L, d] tensors (or stacked [layers, B, H_kv, L, d]),
    all with the same shape, dtype and device (all K share strides, all V share strides). accepted_idx: [m] strictly increasing
    indices within the tree part (row prefix_len + accepted_idx[t] moves to prefix_len + t).
    Returns the new valid length prefix_len + m; rows after it are stale (crop the cache).
    backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else PyTorch), "triton", "reference".
    validate: check accepted_idx on the host (one device sync); turn off on the hot path.
    """
    ks, vs = _as_list(layers_k), _as_list(layers_v)
    tensors = ks + vs
    if len(ks) != len(vs) or not tensors:
        raise ValueError(f"need the same nonzero number of K and V layers, got {len(ks)} and {len(vs)}")
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError("all K and V layer tensors must share shape, dtype and device")
    for group in (ks, vs):
        if any(t.stride() != group[0].stride() for t in group):
            raise ValueError("all K layer tensors must share strides, and so must all V layer tensors")
    if first.ndim != 4:
        raise ValueError(f"layer tensors must be [B, H_kv, L, d], got shape {tuple(first.shape)}")
    idx = accepted_idx.to(device=first.device, dtype=torch.int64)
    m = idx.shape[0]
    L = first.shape[2]
    if validate and m:
        host = idx.tolist()
        if host[0] < 0 or any(b <= a for a, b in zip(host, host[1:])) or prefix_len + host[-1] >= L:
            raise ValueError(f"accepted_idx must be strictly increasing within [0, {L - prefix_len}), got {host}")
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be auto, triton or reference, got {backend!r}")
    dev = first.device
    can_triton = triton is not None and first.dtype in _TL_DTYPES and (dev.type == "cuda" or (INTERPRETED and dev.type == "cpu"))
    use_triton = backend == "triton" or (backend == "auto" and can_triton)
    if use_triton and not can_triton:
        raise RuntimeError("kv_compact: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 for CPU) of fp32/fp16/bf16")
    if m == 0:
        return prefix_len
    if not use_triton:
        with torch.inference_mode():  # cache tensors are usually inference tensors; in-place is fine there
            kv_compact_ref(ks, vs, prefix_len, idx)
        return prefix_len + m

    B, H_kv, _, D = first.shape
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=dev)
    block_d = min(triton.next_power_of_2(D), 128)
    block_t = min(triton.next_power_of_2(m), 32)
    grid = (len(tensors), B * H_kv, triton.cdiv(D, block_d))
    _kv_compact[grid](
        ptrs, idx, *ks[0].stride(), *vs[0].stride(), len(ks), H_kv, prefix_len, m,
        HEAD_DIM=D, BLOCK_T=block_t, BLOCK_D=block_d, DTYPE=_TL_DTYPES[first.dtype],
    )
    return prefix_len + m
