"""Triton kernels for a tree decoding step, each with a plain PyTorch reference.

- `tree_attention(q, k, v, parents, prefix_len)`: attention of n tree tokens over a cache prefix
  and their ancestors, the tree given as ancestor bitmasks (`tree_mask`), no dense mask.
- `kv_compact(layers_k, layers_v, prefix_len, accepted_idx)`: move the accepted path's K/V rows
  after the prefix in every layer, one launch.
- `decoder.engines.hf.attention`: the "tree_triton" attention implementation for transformers models.

Importing this package needs neither triton nor CUDA: without them the functions run their
references (backend="auto") or raise (backend="triton").
"""
from kernels.kv_compact import kv_compact
from kernels.reference import (
    ancestor_matrix_ref,
    kv_compact_ref,
    tree_attention_ref,
    tree_visibility_ref,
)
from kernels.tree_attention import (
    TreeMask,
    ancestor_bitmask,
    parents_from_visibility,
    tree_attention,
    tree_mask,
    triton_available,
)

__all__ = [
    "TreeMask",
    "ancestor_bitmask",
    "ancestor_matrix_ref",
    "kv_compact",
    "kv_compact_ref",
    "parents_from_visibility",
    "tree_attention",
    "tree_attention_ref",
    "tree_mask",
    "tree_visibility_ref",
    "triton_available",
]
