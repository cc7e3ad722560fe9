"""The Hugging Face engine's forward timer: what `profiler/measure.py` times for `HFEngine`.

One sample = reset the cache to the same C-token prefix tensors (untimed), then one forward of n
new tokens with a tree-shaped 4D mask (node i under node (i-1)//TREE_BRANCHING) or a chain, and
explicit position ids: exactly the pass the decoder runs each step. Batches are b rectangular rows
or, after `packed_layout`, one packed row of b sequences (EMS-SD, decoder/batch.py). On CUDA a
length can be captured once as a CUDA graph and replayed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder.engine import is_oom
from decoder.torch_ops.forward import kv, prefill, tree_attention_mask, tree_forward
from planner.tree import ancestor_matrix, tree_depths
from planner.errors import UserError

TREE_BRANCHING = 4  # stand-in tree shape: node i hangs under node (i-1)//4


@dataclass
class TreeInput:
    """Inputs of one tree forward: ids [B, n], position ids [B, n], mask [B, 1, n, C + n], and the
    parents [n] for a model switched to the tree kernels (which ignore the dense mask)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    parents: list[int]
    segments: object = None  # packed layout: decoder.engines.hf.batch.PackedSegments (one row, b sequences)


def packed_input(x: TreeInput, batch_size: int, context_length: int) -> TreeInput:
    """The same b trees packed into one row after b contexts of C tokens (EMS-SD's layout)."""
    from decoder.engines.hf.batch import PackedSegments

    b, n = x.input_ids.shape
    C = context_length
    block = x.mask[0, 0, :, C:]  # [n, n] additive, the tree among its own tokens
    seg = PackedSegments([(i * C, C) for i in range(b)], [n] * b, [block] * b, b * C)
    return TreeInput(x.input_ids.reshape(1, b * n), x.position_ids.reshape(1, b * n), None, x.parents, seg)


def pack_cache(cache) -> None:
    """A [b, H, C, d] cache of b equal-length contexts as one row [1, H, b C, d] (segment i = rows i C ..)."""
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        b, H, C, d = layer.keys.shape
        layer.keys = layer.keys.permute(1, 0, 2, 3).reshape(1, H, b * C, d)
        layer.values = layer.values.permute(1, 0, 2, 3).reshape(1, H, b * C, d)


def make_tree_input(n: int, batch_size: int, context_length: int, vocab: int, dtype, device, gen,
                    tree: bool = True) -> TreeInput:
    parents = [-1] + [(i - 1) // TREE_BRANCHING if tree else i - 1 for i in range(1, n)]
    depth = torch.tensor(tree_depths(parents), dtype=torch.long)
    mask = tree_attention_mask(ancestor_matrix(parents), context_length, dtype, device)  # [1, 1, n, C + n]
    ids = torch.randint(0, vocab, (batch_size, n), generator=gen).to(device)
    pos = (context_length + depth).expand(batch_size, n).to(device)
    return TreeInput(ids, pos, mask.expand(batch_size, -1, -1, -1), parents)


class Runner:
    """Runs one length's forward over a cache of C tokens, eagerly or as a replayed CUDA graph.

    Before every pass the cache is reset to the same C-token prefix tensors, which this object
    keeps alive: captured graphs read them, so they must never be freed or rewritten.
    """

    def __init__(self, model, cache, cuda_graphs: bool):
        self.model, self.cache, self.cuda_graphs = model, cache, cuda_graphs
        self.kernel_path = getattr(model.config, "_attn_implementation", None) == "tree_triton"
        self.prefix = [(layer.keys, layer.values) for layer in cache.layers]  # [B, H_kv, C, head_dim] each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def reset(self) -> None:
        for layer, (k, v) in zip(self.cache.layers, self.prefix):
            layer.keys, layer.values = k, v

    def forward(self, x: TreeInput) -> None:
        if x.segments is not None:  # packed batch: per-sequence attention (decoder.batch)
            self.model(input_ids=x.input_ids, position_ids=x.position_ids, **kv(self.cache), use_cache=True,
                       packed_segments=x.segments)
        elif self.kernel_path:  # the decoder's kernel path: the tree as parents, no dense mask
            from decoder.engines.hf.attention import prepare_tree

            tree = prepare_tree(x.parents, x.input_ids.device)
            tree_forward(self.model, x.input_ids, x.position_ids, None, self.cache, tree=tree)
        else:
            tree_forward(self.model, x.input_ids, x.position_ids, x.mask, self.cache)

    def warm(self, n: int, x: TreeInput, times: int) -> None:
        """`times` untimed passes; with CUDA graphs, then capture (warm-up on a side stream first,
        as graph capture requires)."""
        if not self.cuda_graphs:
            for _ in range(times):
                self.reset()
                self.forward(x)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(times, 2)):
                self.reset()
                self.forward(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.reset()
        try:
            with torch.cuda.graph(graph):
                self.forward(x)
        except RuntimeError as e:
            if is_oom(e):
                raise
            raise UserError(f"--cuda-graphs: capture failed at input length {n} ({str(e).splitlines()[0]})") from None
        finally:
            self.reset()
        self.graphs[n] = graph

    def sample_fn(self, n: int, x: TreeInput):
        """The thing to time: a graph replay, or one eager pass (the reset happens here, untimed)."""
        if self.cuda_graphs:
            return self.graphs[n].replay
        self.reset()
        return lambda: self.forward(x)


class HFForwardTimer:
    """Forwards of n new tokens after a random C-token context, for the profiler (engine.forward_timer).
    Construction prefills the context (an out-of-memory error propagates); `warm(n)` builds the
    input for n and runs it untimed (and captures a CUDA graph when asked); `sample(n)` resets the
    cache (untimed) and returns the forward to time."""

    def __init__(self, model, context_length: int, batch_size: int = 1, tree: bool = True, packed: bool = False,
                 cuda_graphs: bool = False, seed: int = 0):
        self.model, self.C, self.b, self.tree, self.packed = model, context_length, batch_size, tree, packed
        self.attn_before = getattr(model.config, "_attn_implementation", None)
        if packed:
            from decoder.engines.hf.batch import enable_packed_attention

            enable_packed_attention(model)
        self.description = (f"node i under node (i-1)//{TREE_BRANCHING}" if tree else "a chain of n tokens") + \
            "; position ids = context_length + depth" + ("; b sequences packed in one row" if packed else "")
        embed = model.get_input_embeddings()
        self.dtype, self.device = embed.weight.dtype, embed.weight.device
        self.vocab = int(embed.weight.shape[0])
        self.gen = torch.Generator().manual_seed(seed)
        ctx = torch.randint(0, self.vocab, (batch_size, context_length), generator=self.gen).to(self.device)
        cache = prefill(model, ctx).cache
        if packed:
            pack_cache(cache)
        self.runner = Runner(model, cache, cuda_graphs)
        self.inputs: dict[int, TreeInput] = {}

    def warm(self, n: int, times: int = 1) -> None:
        x = make_tree_input(n, self.b, self.C, self.vocab, self.dtype, self.device, self.gen, tree=self.tree)
        self.inputs[n] = packed_input(x, self.b, self.C) if self.packed else x
        self.runner.warm(n, self.inputs[n], times)

    def sample(self, n: int):
        if n not in self.inputs:
            self.warm(n, 0)
        return self.runner.sample_fn(n, self.inputs[n])

    def drop(self, n: int) -> None:
        """Forget length n (after an out-of-memory error there) and restore the prefix."""
        self.inputs.pop(n, None)
        self.runner.graphs.pop(n, None)
        self.runner.reset()

    def close(self) -> None:
        """The packed layout switched the model's attention for the measurement: switch it back."""
        if getattr(self.model.config, "_attn_implementation", None) != self.attn_before:
            self.model.set_attn_implementation(self.attn_before)
        self.inputs.clear()
        self.runner.graphs.clear()
