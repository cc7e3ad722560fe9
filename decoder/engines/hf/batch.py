"""The Hugging Face engine's batched forward (decoder/batch.py's two layouts on a transformers model).

packed (EMS-SD): one row, the cache is [ctx_0 | ctx_1 | ...] and attention runs per sequence
(`packed_attention_forward`, a registered transformers attention function); padded (the vanilla
baseline): b rows padded to the longest step input, every row's cache advancing by tau_max with
masked holes. Both take the sequences' own prefilled caches and give back per-sequence logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder.torch_ops.forward import kv, pick_features

PACKED_ATTENTION = "packed_sdpa"


def batch_runner(model, layout: str, seqs, caches, want_hidden: bool):
    """The runner of a batch: seqs (decoder.batch._Seq: index, context_length), caches: each
    sequence's prefilled transformers cache (None for an empty context)."""
    return (_Packed if layout == "packed" else _Padded)(model, seqs, caches, want_hidden)


def _step_input(model, s, p) -> torch.Tensor:
    """[n, hidden] embeddings of one sequence's step input (tree tokens, then PPD prompt slots)."""
    ids = torch.cat([s.root, p.tokens])
    x = model.get_input_embeddings()(ids)
    return torch.cat([x, p.extra_embeds.to(x.dtype)]) if p.extra_embeds is not None else x


# ---------------------------------------------------------------------------------------------- packed (EMS-SD)


class _Packed:
    """One row: the cache holds [ctx_0 | ctx_1 | ...]; `spans` are each live sequence's (start, length)."""

    def __init__(self, model, seqs: list, caches, want_hidden: bool):
        from transformers import DynamicCache

        self.model, self.want_hidden = model, want_hidden
        self.cache = DynamicCache(config=model.config)
        layers = [c.layers if c is not None else None for c in caches]
        self.spans: dict[int, tuple[int, int]] = {}
        start = 0
        for s, c in zip(seqs, caches):
            self.spans[s.index] = (start, s.context_length)
            start += s.context_length
        for li in range(model.config.num_hidden_layers):
            ks = [ly[li].keys for ly in layers if ly is not None]
            vs = [ly[li].values for ly in layers if ly is not None]
            if ks:
                self.cache.update(torch.cat(ks, dim=2), torch.cat(vs, dim=2), li)
        self.attn_before = getattr(model.config, "_attn_implementation", None)
        enable_packed_attention(model)

    def close(self) -> None:
        """Give the model back its attention implementation (packed switched it for the run)."""
        if getattr(self.model.config, "_attn_implementation", None) != self.attn_before:
            self.model.set_attn_implementation(self.attn_before)

    def forward(self, live, proposals, stats):
        xs = [_step_input(self.model, s, p) for s, p in zip(live, proposals)]
        n = [x.shape[0] for x in xs]
        pos = torch.cat([p.layout.position_offsets[0] + s.context_length for s, p in zip(live, proposals)])[None]
        segments = PackedSegments([self.spans[s.index] for s in live], n, [p.layout.mask_block for p in proposals],
                                  self.cache.get_seq_length())
        out = self.model(inputs_embeds=torch.cat(xs)[None], position_ids=pos, **kv(self.cache), use_cache=True,
                         packed_segments=segments, output_hidden_states=bool(self.want_hidden))
        stats.input_tokens.append(sum(n))
        stats.padded_inputs.append(0)
        stats.cache_holes.append(0)
        self.n = n
        logits = out.logits[0].split(n)
        hidden = pick_features(out.hidden_states, self.want_hidden)[0].split(n) if self.want_hidden else [None] * len(n)
        return logits, hidden

    def commit(self, live, proposals, verdicts, stats) -> None:
        """One gather: each sequence's context, then its accepted path; spans move accordingly."""
        S = self.spans_end()
        keep, start, new_spans = [], 0, {}
        offset = S
        for s, v, n in zip(live, verdicts, self.n):
            a, length = self.spans[s.index]
            keep.append(torch.arange(a, a + length))
            keep.append(torch.tensor(v.nodes, dtype=torch.long) + offset)
            new_spans[s.index] = (start, length + len(v.nodes))
            start += length + len(v.nodes)
            offset += n
        self._gather(torch.cat(keep))
        self.spans = new_spans

    def drop(self, finished: list) -> None:
        keep, start, spans = [], 0, {}
        for idx, (a, length) in sorted(self.spans.items(), key=lambda kv: kv[1][0]):
            if any(f.index == idx for f in finished):
                continue
            keep.append(torch.arange(a, a + length))
            spans[idx] = (start, length)
            start += length
        self._gather(torch.cat(keep) if keep else torch.zeros(0, dtype=torch.long))
        self.spans = spans

    def spans_end(self) -> int:
        return max((a + n for a, n in self.spans.values()), default=0)

    def _gather(self, keep: torch.Tensor) -> None:
        for layer in self.cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            idx = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)


@dataclass
class PackedSegments:
    """What packed attention needs: per live sequence its context span in the cache and its step
    input length, the [n_i, n_i] additive mask among its own step tokens, and the cache length
    before the step."""

    spans: list[tuple[int, int]]
    lengths: list[int]
    blocks: list[torch.Tensor]
    cache_length: int


def packed_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             packed_segments: PackedSegments | None = None, **kwargs):
    """Attention for a packed step: query [1, H, T_tot, d], key/value [1, H_kv, S + T_tot, d].
    Sequence i's tokens attend to its context span and its own step tokens only, one SDPA call per
    sequence (cost: its own context, not the batch's). Non-packed calls fall back to SDPA."""
    import torch.nn.functional as F

    if packed_segments is None:
        from decoder.engines.hf.attention import _sdpa

        if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
            attention_mask = attention_mask.to(query.dtype)
        return _sdpa(query, key, value, attention_mask, scaling, is_causal=attention_mask is None and query.shape[2] > 1), None
    seg = packed_segments
    S = seg.cache_length
    outs, q0 = [], 0
    for (a, length), n, block in zip(seg.spans, seg.lengths, seg.blocks):
        q = query[:, :, q0: q0 + n]
        k = torch.cat([key[:, :, a: a + length], key[:, :, S + q0: S + q0 + n]], dim=2)
        v = torch.cat([value[:, :, a: a + length], value[:, :, S + q0: S + q0 + n]], dim=2)
        mask = torch.zeros(n, length + n, dtype=query.dtype, device=query.device)
        mask[:, length:] = block.to(query.dtype)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                                   enable_gqa=q.shape[1] != k.shape[1]))
        q0 += n
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def enable_packed_attention(model) -> None:
    """Register the packed attention function and switch the model to it (SDPA for other calls)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)
    if getattr(model.config, "_attn_implementation", None) != PACKED_ATTENTION:
        model.set_attn_implementation(PACKED_ATTENTION)


def _no_mask(*, attention_mask=None, **kwargs):
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


# ---------------------------------------------------------------------------------------------- padded (vanilla)


class _Padded:
    """b rows padded to the longest step input; each row's cache advances by tau_max with holes."""

    def __init__(self, model, seqs: list, caches, want_hidden: bool):
        from transformers import DynamicCache

        self.model, self.want_hidden = model, want_hidden
        self.rows = {s.index: r for r, s in enumerate(seqs)}
        L = max(s.context_length for s in seqs)
        self.valid = torch.zeros(len(seqs), L, dtype=torch.bool)  # [b, L] real (not hole) cache slots
        self.cache = DynamicCache(config=model.config)
        for li in range(model.config.num_hidden_layers):
            ks, vs = [], []
            for r, (s, c) in enumerate(zip(seqs, caches)):
                k, v = _row_kv(c, li, s.context_length, L, model)
                ks.append(k)
                vs.append(v)
                self.valid[r, : s.context_length] = True
            self.cache.update(torch.cat(ks), torch.cat(vs), li)

    def close(self) -> None:
        pass

    def forward(self, live, proposals, stats):
        xs = [_step_input(self.model, s, p) for s, p in zip(live, proposals)]
        n = [x.shape[0] for x in xs]
        N = max(n)
        rows = [self.rows[s.index] for s in live]
        L = self.valid.shape[1]
        x = torch.zeros(len(self.rows), N, xs[0].shape[1], dtype=xs[0].dtype, device=xs[0].device)
        pos = torch.zeros(len(self.rows), N, dtype=torch.long, device=x.device)
        vis = torch.zeros(len(self.rows), N, L + N, dtype=torch.bool)
        vis[:, :, L + torch.arange(N)] = torch.eye(N, dtype=torch.bool)  # pad tokens (and idle rows) see themselves
        for s, p, xi, r in zip(live, proposals, xs, rows):
            m = xi.shape[0]
            x[r, :m] = xi
            pos[r, :m] = p.layout.position_offsets[0] + s.context_length
            vis[r, :m, :L] = self.valid[r]
            vis[r, :m, L: L + m] = p.layout.mask_block.cpu() == 0
        mask = torch.zeros(vis.shape, dtype=x.dtype).masked_fill_(~vis, torch.finfo(x.dtype).min)[:, None].to(x.device)
        out = self.model(inputs_embeds=x, position_ids=pos, attention_mask=mask, **kv(self.cache),
                         use_cache=True, output_hidden_states=bool(self.want_hidden))
        stats.input_tokens.append(len(self.rows) * N)
        stats.padded_inputs.append(len(self.rows) * N - sum(n))
        self.N = N
        logits = [out.logits[r, :m] for r, m in zip(rows, n)]
        feats = pick_features(out.hidden_states, self.want_hidden)
        hidden = [None if feats is None else feats[r, :m] for r, m in zip(rows, n)]
        return logits, hidden

    def commit(self, live, proposals, verdicts, stats) -> None:
        """Every row advances by tau_max: its accepted path moves to the front of the new slots,
        the rest of them become holes; rejected candidates leave the cache."""
        L = self.valid.shape[1]
        tau_max = max(len(v.nodes) for v in verdicts)
        b = len(self.rows)
        src = torch.zeros(b, tau_max, dtype=torch.long)  # which of the N new slots lands at L + j
        valid_new = torch.zeros(b, tau_max, dtype=torch.bool)
        for s, v in zip(live, verdicts):
            r = self.rows[s.index]
            src[r, : len(v.nodes)] = torch.tensor(v.nodes)
            valid_new[r, : len(v.nodes)] = True
        for layer in self.cache.layers:
            idx = (L + src).to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            k_new, v_new = layer.keys.gather(2, idx), layer.values.gather(2, idx)
            layer.keys = torch.cat([layer.keys[:, :, :L], k_new], dim=2)
            layer.values = torch.cat([layer.values[:, :, :L], v_new], dim=2)
        self.valid = torch.cat([self.valid, valid_new], dim=1)
        stats.cache_holes.append(int((~valid_new[[self.rows[s.index] for s in live]]).sum()))

    def drop(self, finished: list) -> None:
        """Finished rows leave: gather the remaining rows (the batch shrinks, nothing waits)."""
        keep = [r for idx, r in sorted(self.rows.items(), key=lambda kv: kv[1]) if all(f.index != idx for f in finished)]
        self.rows = {idx: keep.index(r) for idx, r in self.rows.items() if r in keep}
        sel = torch.tensor(keep, dtype=torch.long)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, sel.to(layer.keys.device))
            layer.values = layer.values.index_select(0, sel.to(layer.values.device))
        self.valid = self.valid[sel]


def _row_kv(cache, layer: int, length: int, L: int, model):
    """One sequence's prefilled K/V for a layer, right-padded to L slots (holes)."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = model.get_input_embeddings().weight
    k = torch.zeros(1, heads, L, head_dim, dtype=w.dtype, device=w.device)
    v = torch.zeros_like(k)
    if cache is not None and length:
        k[:, :, :length] = cache.layers[layer].keys
        v[:, :, :length] = cache.layers[layer].values
    return k, v
