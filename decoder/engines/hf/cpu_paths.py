"""CPU matmul paths per input length: every nn.Linear runs, at each row count M (= batch x input
length), the kernel path the profiler measured fastest for its weight shape at that M.

    from decoder.engines.hf.cpu_paths import use_profile_paths
    use_profile_paths(model, "profiles/cpu-smollm2-135m.json")   # or a MatmulPathTable; None: off

Paths (all fp32 in, fp32 out; only the summation order differs, never the precision):
  linear    F.linear(x, W), what the model runs by default (no extra memory)
  t         x @ Wt with Wt = W.t().contiguous() kept beside W (one extra copy of W)
  onednn    oneDNN's prepacked weight, torch.ops.mkldnn._linear_pointwise (one extra packed copy)
  chunked   F.linear over 4096-row blocks of W, concatenated (views of W: no extra memory); for
            very tall weights (the LM head), where MKL's gemm blocks badly at a few rows
Why several: on the 2-core AVX2 EPYC this project runs on, MKL's default path for a few rows is
1.8-3x slower than the best one, and which one is best changes with M and the shape
(bench/results/cpu_paths.md). The choice is measured by decoder/engines/hf/matmul_choice.py and stored in
the profile ("matmul_paths", planner/profile.py); this module only installs it.

Installing sets an instance `forward` on each Linear (its type, parameters and state_dict stay as
they are); `remove_paths` restores the class forward and frees the extra layouts. Rows outside
the table, other devices and autograd calls go through F.linear. The layouts are copies of the
weight: each call checks that the weight and bias are the tensors they were built from, unchanged
(same objects, storage and version counter), and rebuilds them when not, so `load_state_dict`, an
in-place edit under no_grad and a replaced parameter are seen; after `.to(dtype)` or `.to(device)`
to a dtype or device the table was not measured for, the Linear falls back to F.linear (a later
`.to` back rebuilds the paths). Writes through `.data` bypass the version counter: call
`refresh_paths(model)` after them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from planner.errors import UserError
from planner.matmul_paths import MATMUL_PATHS, MatmulPathTable, load_matmul_paths

CHUNK_ROWS = 4096  # output rows per block of the chunked path (576 x 4096 fp32 = 9.4 MB)
_ATTR = "_cpu_paths"


@dataclass
class LinearPaths:
    """One Linear's extra weight layouts and its dispatch table (index M -> callable or None), and
    the weight and bias they were built from (objects and stamp: storage pointer and version)."""

    by_rows: dict  # M -> path, as the profile chose it for this Linear's shape
    table_dtype: str | None  # the dtype the table was measured in (None: any)
    table: list = field(default_factory=list)
    layouts: dict = field(default_factory=dict)  # layout name -> tensor
    enabled: bool = True  # False: F.linear everywhere, layouts kept (the profiler's default-vs-chosen timing)
    weight: object = None
    bias: object = None
    stamp: tuple = ()

    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.layouts.values())

    def current(self, m: torch.nn.Linear) -> bool:
        """Is `m`'s weight (and bias) still what the layouts were built from? (Every call: cheap.)"""
        p, w, b = m._parameters, self.weight, self.bias
        return (p["weight"] is w and p.get("bias") is b and _stamp(w) == self.stamp[0]
                and (b is None or _stamp(b) == self.stamp[1]))


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    """Storage pointer and in-place write counter: a .to() to another dtype or device, a
    load_state_dict or an in-place edit changes one. Inference tensors keep no counter."""
    return t.data_ptr(), (-1 if t.is_inference() else t._version)


def _dtype_name(dtype: torch.dtype) -> str | None:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype)


def _nbytes(t: torch.Tensor) -> int:
    if t.is_mkldnn:  # opaque tensor: its element count is the dense one
        return t.numel() * 4
    return t.numel() * t.element_size()


def make_layout(weight: torch.Tensor, path: str) -> torch.Tensor | None:
    """The extra tensor a path reads (None for paths that read W itself)."""
    w = weight.detach()
    if path == "t":
        return w.t().contiguous()  # [in, out]
    if path == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w)
    return None


def path_fn(path: str, weight: torch.Tensor, bias: torch.Tensor | None, layout: torch.Tensor | None):
    """fn(x [..., in]) -> [..., out] computing x W^T (+ b) the way `path` does."""
    w = weight.detach()
    b = None if bias is None else bias.detach()
    if path == "linear":
        return lambda x: F.linear(x, w, b)
    if path == "t":
        if b is None:
            return lambda x: torch.matmul(x, layout)
        return lambda x: torch.addmm(b, x.reshape(-1, x.shape[-1]), layout).view(*x.shape[:-1], -1)
    if path == "onednn":
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, layout, b, "none", [], "")
    if path == "chunked":
        starts = range(0, w.shape[0], CHUNK_ROWS)
        blocks = [(w[s: s + CHUNK_ROWS], None if b is None else b[s: s + CHUNK_ROWS]) for s in starts]
        return lambda x: torch.cat([F.linear(x, wb, bb) for wb, bb in blocks], dim=-1)
    raise ValueError(f"unknown matmul path {path!r} (known: {', '.join(MATMUL_PATHS)})")


def path_available(path: str, device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu":
        return path == "linear"
    if path == "onednn":
        return torch.backends.mkldnn.is_available() and dtype == torch.float32
    return True


def _dispatching_forward(module: torch.nn.Linear):
    K = module.in_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        lp = module.__dict__[_ATTR]
        if not lp.current(module):  # new weights, dtype or device: rebuild (or fall back to F.linear)
            lp = _build(module, lp.by_rows, lp.table_dtype, {}, lp.enabled)
        M = x.numel() // K
        fn = lp.table[M] if M < len(lp.table) else None
        if fn is None or not lp.enabled or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, module.weight, module.bias)
        return fn(x)

    return forward


def _build(m: torch.nn.Linear, by_rows: dict, table_dtype: str | None, shared: dict, enabled: bool = True) -> LinearPaths:
    """`m`'s layouts and dispatch table from its current weight, set on `m`; an empty table (F.linear
    everywhere) when its device or dtype is not the table's. shared: (weight ptr, path) -> layout,
    so tied weights get one layout."""
    w, b = m._parameters["weight"], m._parameters.get("bias")
    lp = LinearPaths(by_rows, table_dtype, enabled=enabled, weight=w, bias=b,
                     stamp=(_stamp(w), None if b is None else _stamp(b)))
    m.__dict__[_ATTR] = lp
    usable = w.device.type == "cpu" and (table_dtype is None or table_dtype == _dtype_name(w.dtype))
    if not usable or not all(path_available(p, w.device, w.dtype) for p in by_rows.values()):
        return lp
    for path in sorted(set(by_rows.values())):
        key = (w.data_ptr(), path)
        if key not in shared:
            shared[key] = make_layout(w, path)
        if shared[key] is not None:
            lp.layouts[path] = shared[key]
    fns = {p: path_fn(p, w, b, lp.layouts.get(p)) for p in set(by_rows.values()) if p != "linear"}
    lp.table = [None] * (max(by_rows) + 1)
    for M, p in by_rows.items():
        lp.table[M] = fns.get(p)
    return lp


def linears(model) -> list[tuple[str, torch.nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def install_paths(model, table: MatmulPathTable) -> int:
    """Switch every Linear whose (out, in) shape the table lists to its per-M paths; returns the
    bytes of extra weight layouts this allocated. Replaces any paths installed before."""
    remove_paths(model)
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if dev.type != "cpu":
        return 0
    shared: dict[tuple[int, str], torch.Tensor | None] = {}  # tied weights (embedding / LM head) get one layout
    for _, m in linears(model):
        by_rows = table.paths_for((m.out_features, m.in_features))
        if not by_rows or all(p == "linear" for p in by_rows.values()):
            continue
        bad = [p for p in set(by_rows.values()) if not path_available(p, dev, dtype)]
        if bad:
            raise UserError(f"matmul_paths: path '{bad[0]}' is not available for {dtype} on this build of torch")
        _build(m, by_rows, table.dtype, shared)
        m.forward = _dispatching_forward(m)
    return installed_bytes(model)


def refresh_paths(model) -> None:
    """Rebuild every installed Linear's layouts from its current weight (after writes through
    `.data`, which the version check cannot see)."""
    shared: dict = {}
    for _, m in linears(model):
        lp = m.__dict__.get(_ATTR)
        if lp is not None:
            _build(m, lp.by_rows, lp.table_dtype, shared, lp.enabled)


def remove_paths(model) -> None:
    for _, m in linears(model):
        if _ATTR in m.__dict__:
            del m.__dict__[_ATTR]
            m.__dict__.pop("forward", None)
    model.__dict__.pop("_cpu_paths_table", None)


def set_paths_enabled(model, enabled: bool) -> None:
    """Switch installed paths off (F.linear) and on again without rebuilding their layouts."""
    for _, m in linears(model):
        if _ATTR in m.__dict__:
            m.__dict__[_ATTR].enabled = enabled


def installed_bytes(model) -> int:
    """Bytes of the extra layouts installed now (a layout tied weights share counts once)."""
    seen = {}
    for _, m in linears(model):
        lp = m.__dict__.get(_ATTR)
        for t in lp.layouts.values() if lp is not None else ():
            seen[id(t)] = _nbytes(t)
    return sum(seen.values())


def use_profile_paths(model, profile: str | Path | MatmulPathTable | None) -> MatmulPathTable | None:
    """The one call for decoding: install the matmul paths a profile chose (a profile file, a loaded
    table, or None to remove them). A profile without "matmul_paths", or measured on another
    device or dtype than the model's, installs nothing (returns None)."""
    if profile is None:
        remove_paths(model)
        return None
    table = profile if isinstance(profile, MatmulPathTable) else load_matmul_paths(profile)
    if table is None:
        remove_paths(model)
        return None
    p = next(model.parameters())
    if p.device.type != "cpu" or (table.dtype is not None and table.dtype != _dtype_name(p.dtype)):
        remove_paths(model)
        return None
    if getattr(model, "_cpu_paths_table", None) != (table.rows, table.shapes):
        install_paths(model, table)
        model._cpu_paths_table = (table.rows, table.shapes)
    return table
