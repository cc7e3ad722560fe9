"""Tree attention for one decoding step, as a Triton kernel.

Queries are the n tree tokens; keys and values are the cache (C prefix tokens, all visible)
followed by the n tree tokens, of which query i sees only its ancestors and itself. The tree
reaches the kernel as ancestor bitmasks, int32 words [n, ceil(n / 32)] (bit j of row i set when
tree token j is i or one of its ancestors), so no [n, C + n] mask is ever materialised.

Grouped-query attention: the G = H / H_kv query heads that share one KV head are packed into the
rows of one program (row = g * n + i), so a small tree (n = 16) still fills a 64-row tile and
every K/V block is loaded once per KV head instead of once per query head. When a small tree
leaves the GPU half idle over a long prefix, the prefix is split over several programs whose
partial softmaxes a second small kernel combines (flash-decoding).

Triton is optional: without it (or on the CPU without TRITON_INTERPRET=1) `tree_attention`
runs the plain PyTorch reference, unless backend="triton" is asked for, which raises.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from kernels.reference import tree_attention_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # kernels stay importable without triton: the reference still works
    triton = None


@dataclass(frozen=True)
class TreeMask:
    """The compact form of one tree shape, built once and reused for every step with that shape."""

    parents: torch.Tensor  # [n] int64, -1 for tokens hanging off the prefix
    bits: torch.Tensor  # [n, ceil(n / 32)] int32, ancestor-or-self bitmask per tree token (the kernel's input)
    ancestors: torch.Tensor  # [n, n] bool, the same relation unpacked (for the SDPA fallback)

    @property
    def n(self) -> int:
        return self.parents.shape[0]


def ancestor_bitmask(parents: torch.Tensor, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits [n, ceil(n / 32)] int32, ancestors [n, n] bool), built on parents' device without a loop over nodes.

    Pointer doubling: after round r, row i holds its ancestors up to distance 2^r and jump[i] is
    its 2^r-th ancestor, so ceil(log2(n)) + 1 rounds of row gathers cover any depth.
    """
    parents = parents.to(torch.int64)
    n = parents.shape[0]
    dev = parents.device
    idx = torch.arange(n, device=dev)
    if validate and n and not bool(((parents >= -1) & (parents < idx)).all()):
        bad = int(torch.nonzero(~((parents >= -1) & (parents < idx)))[0, 0])
        raise ValueError(f"parents[{bad}] = {int(parents[bad])}: tree tokens must follow their parent (-1 <= p < i)")
    sink = n  # row n stands for "above the prefix": no bits, jumps to itself
    jump = torch.where(parents < 0, torch.full_like(parents, sink), parents)
    jump = torch.cat([jump, torch.tensor([sink], device=dev)])  # [n + 1]
    anc = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=dev)  # column n absorbs the sink
    anc[idx, idx] = True
    anc[idx, jump[:n]] = True
    for _ in range(max(1, math.ceil(math.log2(max(n, 2)))) + 1):
        anc = anc | anc[jump]
        jump = jump[jump]
    anc = anc[:n, :n]
    words = (n + 31) // 32
    padded = torch.zeros(n, words * 32, dtype=torch.int64, device=dev)
    padded[:, :n] = anc.to(torch.int64)
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=dev), torch.arange(32, device=dev))
    packed = (padded.view(n, words, 32) * weights).sum(-1)  # [n, words], 0 .. 2^32 - 1
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # reinterpret as signed int32
    return packed.to(torch.int32), anc


def tree_mask(parents: torch.Tensor | Sequence[int], device: torch.device | str | None = None) -> TreeMask:
    """Validate `parents` and build its bitmask once; pass the result to `tree_attention` every step."""
    if not isinstance(parents, torch.Tensor):
        parents = torch.tensor(list(parents), dtype=torch.int64)
    if parents.ndim != 1:
        raise ValueError(f"parents must be 1-D [n], got shape {tuple(parents.shape)}")
    parents = parents.to(device=device if device is not None else parents.device, dtype=torch.int64)
    bits, anc = ancestor_bitmask(parents)
    return TreeMask(parents=parents, bits=bits, ancestors=anc)


def parents_from_visibility(visible: torch.Tensor) -> list[int]:
    """Recover `parents` from an [n, n] visibility block among the step's tokens (bool, or an
    additive float mask: 0 visible, very negative hidden), e.g. a decoder's existing mask.

    Raises ValueError when the block is not "ancestors and self" of some tree in topological
    order, since the kernel could not express it.
    """
    if visible.ndim != 2 or visible.shape[0] != visible.shape[1]:
        raise ValueError(f"visibility block must be [n, n], got shape {tuple(visible.shape)}")
    if visible.dtype != torch.bool:
        visible = visible > torch.finfo(visible.dtype).min / 2
    visible = visible.cpu()
    n = visible.shape[0]
    earlier = visible & torch.ones(n, n, dtype=torch.bool).tril(-1)  # [n, n] strictly before the diagonal
    idx = torch.arange(n).expand(n, n)
    parents = torch.where(earlier, idx, -1).max(dim=1).values if n else torch.zeros(0, dtype=torch.int64)
    if n and not torch.equal(ancestor_bitmask(parents, validate=False)[1].cpu(), visible):
        raise ValueError("visibility block is not the ancestor relation of a tree in topological order")
    return parents.tolist()


if triton is not None:

    @triton.jit
    def _tree_attn_fwd(
        Q, K, V, Out, Bits, Mid, Lse,  # Mid [S, B, H, n, d] / Lse [S, B, H, n] fp32: per-split partials
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_on, stride_od,
        stride_bits,
        N_BATCH, H_KV, N_TREE, PREFIX, qk_scale,  # qk_scale = log2(e) * scale: softmax in base 2
        SPLIT_SIZE, NUM_SPLITS,  # prefix keys per split (a multiple of BLOCK_N), number of splits
        SPLIT: tl.constexpr,  # NUM_SPLITS > 1: write partials for _split_combine instead of Out
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        DOT_F32: tl.constexpr,  # the CPU interpreter's tl.dot is wrong for bf16: upcast there
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = pid_bh // H_KV
        kvh = pid_bh % H_KV

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (query head in group g, tree token i)
        row_ok = rows < GROUP * N_TREE
        g = rows // N_TREE
        i = rows % N_TREE
        h = kvh * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM

        q = tl.load(
            Q + b * stride_qb + h[:, None] * stride_qh + i[:, None] * stride_qn + d[None, :] * stride_qd,
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        if DOT_F32:
            q = q.to(tl.float32)
        k_base = K + b * stride_kb + kvh * stride_kh
        v_base = V + b * stride_vb + kvh * stride_vh

        # A finite floor instead of -inf keeps exp2(m_i - m_new) defined for rows that have seen no key yet.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Prefix: every query sees every cached key, so only the sequence end is masked. With
        # splits (flash-decoding), program pid_s covers one slice of it.
        lo = pid_s * SPLIT_SIZE
        hi = tl.minimum(lo + SPLIT_SIZE, PREFIX)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            kt = tl.load(k_base + cols[None, :] * stride_kn + d[:, None] * stride_kd,
                         mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            if DOT_F32:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(v_base + cols[:, None] * stride_vn + d[None, :] * stride_vd,
                         mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            if DOT_F32:
                vb = vb.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=DOT_PRECISION)
            m_i = m_new

        # Tree part: topological order means no query sees a key after itself, so the loop stops
        # at the block's last token; visibility comes from one bitmask word per (query, key).
        # The last split also takes the tree part.
        tree_hi = tl.max(tl.where(row_ok, i, 0), 0) + 1
        tree_hi = tl.where(pid_s == NUM_SPLITS - 1, tree_hi, 0)
        for start in range(0, tree_hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            col_ok = j < N_TREE
            words = tl.load(Bits + i[:, None] * stride_bits + (j[None, :] // 32),
                            mask=row_ok[:, None] & col_ok[None, :], other=0)
            visible = ((words >> (j[None, :] % 32)) & 1) != 0
            kt = tl.load(k_base + (PREFIX + j)[None, :] * stride_kn + d[:, None] * stride_kd,
                         mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            if DOT_F32:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(v_base + (PREFIX + j)[:, None] * stride_vn + d[None, :] * stride_vd,
                         mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_F32:
                vb = vb.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=DOT_PRECISION)
            m_i = m_new

        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only: every real row sees itself
        out = acc / l_i[:, None]
        if SPLIT:
            flat = ((pid_s * N_BATCH + b) * (H_KV * GROUP) + h) * N_TREE + i  # row of [S, B, H, n]
            tl.store(Lse + flat, m_i + tl.math.log2(l_i), mask=row_ok)
            tl.store(Mid + flat[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        else:
            tl.store(
                Out + b * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_on + d[None, :] * stride_od,
                out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
            )

    @triton.jit
    def _split_combine(
        Mid, Lse, Out,
        stride_ob, stride_oh, stride_on, stride_od,
        H, N_TREE, ROWS, NUM_SPLITS,  # ROWS = B * H * n
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flattened (b, h, i)
        r_ok = r < ROWS
        b = r // (H * N_TREE)
        h = (r // N_TREE) % H
        i = r % N_TREE
        d = tl.arange(0, BLOCK_D)
        ok = r_ok[:, None] & (d < HEAD_DIM)[None, :]
        m = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
        l = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for sp in range(0, NUM_SPLITS):
            lse = tl.load(Lse + sp * ROWS + r, mask=r_ok, other=-1.0e30)
            o = tl.load(Mid + (sp * ROWS + r)[:, None] * HEAD_DIM + d[None, :], mask=ok, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.math.exp2(m - m_new)
            w = tl.math.exp2(lse - m_new)
            acc = acc * alpha[:, None] + w[:, None] * o
            l = l * alpha + w
            m = m_new
        l = tl.where(l == 0.0, 1.0, l)
        tl.store(Out + b[:, None] * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_on + d[None, :] * stride_od,
                 (acc / l[:, None]).to(Out.dtype.element_ty), mask=ok)

    # Decorated while TRITON_INTERPRET=1 was set: the kernel then runs on CPU tensors.
    INTERPRETED = type(_tree_attn_fwd).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def triton_available(device: torch.device) -> bool:
    """True when the Triton kernel can run on tensors of `device` in this process."""
    if triton is None:
        return False
    return device.type == "cuda" or (INTERPRETED and device.type == "cpu")


def _as_tree_mask(parents, n: int, device: torch.device) -> TreeMask:
    tm = parents if isinstance(parents, TreeMask) else tree_mask(parents, device=device)
    if tm.n != n:
        raise ValueError(f"parents has {tm.n} entries but q has {n} tree tokens")
    if tm.bits.device != device:
        tm = TreeMask(parents=tm.parents.to(device), bits=tm.bits.to(device), ancestors=tm.ancestors.to(device))
    return tm


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    parents: torch.Tensor | Sequence[int] | TreeMask,
    prefix_len: int,
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of n tree tokens over a cache prefix plus the tree; returns out [B, H, n, d].

    q: [B, H, n, d]; k, v: [B, H_kv, prefix_len + n, d] with H a multiple of H_kv; any strides.
    parents: [n] parent index of each tree token within the tree (-1: hangs off the prefix), in
    topological order, or a prebuilt `TreeMask` (saves rebuilding the bitmask every step).
    backend: "auto" (Triton on CUDA, or on the CPU under TRITON_INTERPRET=1; else the PyTorch
    reference), "triton" (raise if it cannot run) or "reference".
    out: optional [B, H, n, d] tensor (any strides, e.g. a transposed [B, n, H, d] buffer) to write into.
    scale: softmax scale, 1 / sqrt(d) when None.
    num_splits: split the prefix over this many programs per row block and combine their partial
    softmaxes (flash-decoding); None picks a number that fills the GPU when the tree is small
    and the prefix long (always 1 under the interpreter).
    """
    B, H, n, D = q.shape
    Bk, H_kv, L, Dk = k.shape
    if v.shape != k.shape or Bk != B or Dk != D:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if H % H_kv:
        raise ValueError(f"query heads {H} are not a multiple of key/value heads {H_kv}")
    if L != prefix_len + n:
        raise ValueError(f"k has {L} positions, expected prefix_len + n = {prefix_len} + {n}")
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be auto, triton or reference, got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and triton_available(q.device))
    if use_triton and not triton_available(q.device):
        raise RuntimeError(
            "tree_attention: the Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            "triton is imported for CPU tensors" + ("" if triton is not None else " (triton is not installed)")
        )
    if not use_triton:
        tm_parents = parents.parents if isinstance(parents, TreeMask) else parents
        res = tree_attention_ref(q, k, v, tm_parents, prefix_len, scale=scale)
        if out is None:
            return res
        out.copy_(res)
        return out

    tm = _as_tree_mask(parents, n, q.device)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    if n == 0:
        return out
    group = H // H_kv
    rows = group * n
    cfg = launch_config(q.dtype, D, rows)
    block_m, block_n, block_d = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_D"]
    programs = triton.cdiv(rows, block_m) * B * H_kv
    if num_splits is None:
        num_splits = _auto_splits(programs, prefix_len, q.device)
    split_size = triton.cdiv(triton.cdiv(max(prefix_len, 1), max(num_splits, 1)), block_n) * block_n
    num_splits = max(1, triton.cdiv(prefix_len, split_size))  # no empty splits
    if num_splits > 1:
        mid = torch.empty(num_splits, B, H, n, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, B, H, n, dtype=torch.float32, device=q.device)
    else:
        mid = lse = out  # unused
    grid = (triton.cdiv(rows, block_m), B * H_kv, num_splits)
    _tree_attn_fwd[grid](
        q, k, v, out, tm.bits, mid, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        tm.bits.stride(0),
        B, H_kv, n, prefix_len, math.log2(math.e) * (scale if scale is not None else 1.0 / math.sqrt(D)),
        split_size, num_splits, SPLIT=num_splits > 1,
        GROUP=group, HEAD_DIM=D, **cfg,
    )
    if num_splits > 1:
        block_r = 16
        _split_combine[(triton.cdiv(B * H * n, block_r),)](
            mid, lse, out, *out.stride(), H, n, B * H * n, num_splits,
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_R=block_r,
        )
    return out


def launch_config(dtype: torch.dtype, head_dim: int, rows: int) -> dict:
    """Tile sizes and launch options of the attention kernel for `rows` = (H / H_kv) * n query rows."""
    fp32 = dtype == torch.float32
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    return dict(
        BLOCK_M=16 if rows <= 16 else 32 if rows <= 32 else 64,
        BLOCK_N=32 if fp32 else 64,  # fp32 tiles take twice the shared memory
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if fp32 else "tf32",  # fp32 inputs: no silent tf32 rounding
        DOT_F32=INTERPRETED and dtype == torch.bfloat16,
        num_warps=4 if block_d <= 64 else 8,
        num_stages=1 if fp32 else 2,
    )


@lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _auto_splits(programs: int, prefix_len: int, device: torch.device) -> int:
    """Enough prefix splits to give every SM about two programs, each split at least 512 keys."""
    if device.type != "cuda" or prefix_len < 1024:
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), prefix_len // 512))
