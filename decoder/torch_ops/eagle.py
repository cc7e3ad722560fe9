"""EAGLE heads in torch: EAGLE-1 and EAGLE-3 as drafters (decoder/drafter.py), and Medusa heads.

An EAGLE head is one decoder layer that reads, beside each token x_p, a feature of the target at p - 1
and predicts the next token and its own feature there, which feeds the next draft token:

  EAGLE-1   x = fc([emb(x_p); f_{p-1}])          f: the target's last hidden state (after its norm)
            h = x + attn(x); out = h + mlp(post_norm(h))    (no input norm, no final norm)
            logits = target_head(out); the next input feature is out
  EAGLE-3   g = fc([a_2; a_{L/2}; a_{L-3}])       a_i: the residual stream entering target layer i
            r = g; x = [input_norm(emb(x_p)); hidden_norm(g)]  (q, k, v read 2H inputs)
            r = r + attn(x); pre = r + mlp(post_norm(r))
            logits = lm_head(norm(pre)) over a draft vocabulary, target id = draft id + d2t[draft id];
            the next input feature is pre (the pre-norm output)

as vLLM 0.32 runs them (model_executor/models/llama_eagle.py, llama_eagle3.py), including its
position convention (token x_p at position p - 1) and EAGLE-3's variants (norm_before_residual,
norm_before_fc, fc_norm, norm_output). Loading released checkpoints and checking them against a target is
decoder/torch_ops/heads.py's; this module is only the arithmetic, its KV cache and the drafter protocol.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from decoder.drafter import DraftPass

EAGLE1, EAGLE3 = "eagle", "eagle3"


@dataclass(frozen=True)
class EagleArch:
    """What a head's config says (decoder/torch_ops/heads.py reads it from each released layout)."""

    kind: str  # EAGLE1 | EAGLE3
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    rope: dict = field(default_factory=dict)  # a transformers LlamaConfig's rope fields (rope_parameters)
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose entering streams fc reads, sorted
    target_hidden_size: int = 0  # EAGLE-3: width of each aux stream (the target's hidden size)
    fc_bias: bool = False  # EAGLE-1 releases for Vicuna / LLaMA-2 carry fc.bias
    qkv_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    @property
    def fc_in(self) -> int:
        return 2 * self.hidden_size if self.kind == EAGLE1 else self.target_hidden_size * len(self.aux_layers)

    def llama_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=1, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
                           hidden_act=self.hidden_act, **self.rope)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., m, d] with cos, sin [..., m, d] (Llama's half-split convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class EagleHead(nn.Module):
    """The head's own tensors, named as vLLM and the EAGLE releases name them (`midlayer` is EAGLE-3's layer)."""

    def __init__(self, arch: EagleArch):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.arch = a = arch
        H, nh, nkv, hd = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        qkv_in = 2 * H if a.kind == EAGLE3 else H
        self.fc = nn.Linear(a.fc_in, H, bias=a.fc_bias)
        self.q_proj = nn.Linear(qkv_in, nh * hd, bias=a.qkv_bias)
        self.k_proj = nn.Linear(qkv_in, nkv * hd, bias=a.qkv_bias)
        self.v_proj = nn.Linear(qkv_in, nkv * hd, bias=a.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.gate_proj = nn.Linear(H, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, a.rms_norm_eps)
        if a.kind == EAGLE3:
            self.input_layernorm = RMSNorm(H, a.rms_norm_eps)
            self.hidden_norm = RMSNorm(H, a.rms_norm_eps)
            self.norm = RMSNorm(H, a.rms_norm_eps)
            self.lm_head = nn.Linear(H, a.draft_vocab_size, bias=False)
            if a.norm_before_fc:
                self.input_norm = RMSNorm(a.fc_in, a.rms_norm_eps)
            if a.fc_norm:
                self.fc_norms = nn.ModuleList(RMSNorm(a.target_hidden_size, a.rms_norm_eps) for _ in a.aux_layers)
            self.register_buffer("d2t", torch.zeros(a.draft_vocab_size, dtype=torch.long))
        self.rotary = LlamaRotaryEmbedding(a.llama_config())
        self.act = getattr(F, a.hidden_act)
        self.share("target_embedding", None)  # the target's, shared (or the head's own copy)
        self.share("target_head", None)  # EAGLE-1's head: the target's

    def share(self, name: str, module: nn.Module | None) -> None:
        """Use one of the target's modules without owning it: not a submodule, so the head's state_dict, .to()
        and optimiser never see it (an EAGLE-3 head without its own lm_head shares the target's as lm_head)."""
        if name in self._modules:
            del self._modules[name]
        self.__dict__[name] = module

    # ------------------------------------------------------------------ the arithmetic

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., F] as the layer's input feature [..., H] (EAGLE-3: fc over the
        three streams; EAGLE-1 reads the last hidden state as it is)."""
        if self.arch.kind == EAGLE1:
            return features
        if self.arch.norm_before_fc:
            features = self.input_norm(features)
        if self.arch.fc_norm:
            chunks = features.chunk(len(self.arch.aux_layers), dim=-1)
            features = torch.cat([n(c) for n, c in zip(self.fc_norms, chunks)], dim=-1)
        return self.fc(features)

    def layer_input(self, tokens: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [..., qkv_in], residual [..., H]) of tokens [...] with their input features [..., H]."""
        emb = self.target_embedding(tokens).to(feature.dtype)
        if self.arch.kind == EAGLE1:
            x = self.fc(torch.cat([emb, feature], dim=-1))
            return x, x
        if self.arch.norm_before_residual:
            h = self.hidden_norm(feature)
            return torch.cat([self.input_layernorm(emb), h], dim=-1), h
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], dim=-1), feature

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, m, qkv_in], positions [B, m] -> q [B, nh, m, hd], k, v [B, nkv, m, hd], rotated."""
        a = self.arch
        B, m, _ = x.shape
        q = self.q_proj(x).view(B, m, a.num_attention_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, m, a.num_key_value_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, m, a.num_key_value_heads, a.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, (positions - 1).clamp_min(0))  # vLLM: token x_p at position p - 1
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output [B, m, nh * hd] and the residual -> (the next input feature, the head's logit input)."""
        r = residual + self.o_proj(attn)
        x = self.post_attention_layernorm(r)
        out = r + self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        if self.arch.kind == EAGLE1:
            return out, out
        normed = self.norm(out)
        return (normed if self.arch.norm_output else out), normed

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> logits over the head's own vocabulary [..., Vd]."""
        return self.target_head(x) if self.arch.kind == EAGLE1 else self.lm_head(x)

    def target_ids(self) -> torch.Tensor:
        """[Vd] the target id of each draft id."""
        return torch.arange(self.arch.draft_vocab_size, device=self.d2t.device) + self.d2t

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[m, H] -> logits over the target's vocabulary [m, V]; ids outside the draft vocabulary get -inf."""
        z = self.draft_logits(x)
        if self.arch.kind == EAGLE1 or self.arch.draft_vocab_size == self.arch.vocab_size:
            return z
        full = z.new_full((z.shape[0], self.arch.vocab_size), float("-inf"))
        full[:, self.target_ids()] = z
        return full


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [B, nh, m, hd], k, v [B, nkv, L, hd], visible [m, L] bool -> [B, m, nh * hd] (grouped-query, the
    kv heads shared by the kernel rather than copied per pass)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible.to(q.device), enable_gqa=q.shape[1] != k.shape[1])
    B, nh, m, hd = out.shape
    return out.transpose(1, 2).reshape(B, m, nh * hd)


class EagleDraft:
    """An EAGLE head as a drafter (decoder/drafter.py): it reads the target's features, so no tree node
    it was fed with a predicted feature is kept."""

    reuse_tree_kv = False

    def __init__(self, head: EagleHead, label: str = "EAGLE head"):
        self.head = head.eval()
        self.label = label
        self.vocab_size = head.arch.vocab_size
        self.features = True if head.arch.kind == EAGLE1 else tuple(head.arch.aux_layers)

    @torch.inference_mode()  # callers outside a decode (the calibration replay) hold no grad-free context
    def combine(self, features: torch.Tensor) -> torch.Tensor:
        return self.head.combine(features.to(self.head.fc.weight.dtype))

    @torch.inference_mode()
    def open(self, prompt_ids: torch.Tensor, prompt_inputs: torch.Tensor | None) -> "EagleState":
        """prompt_inputs [T-1, H]: combined features; token x_p (p = 1..T-2) is fed with the one at p - 1."""
        state = EagleState(self.head)
        ids = prompt_ids.reshape(-1)
        if ids.numel() > 2:
            pos = torch.arange(1, ids.numel() - 1, device=ids.device)
            state.forward(ids[1:-1], pos, None, prompt_inputs[: ids.numel() - 2], last_only=True)
        return state


class EagleState:
    """One sequence's cache of the head's single layer: keys and values [1, nkv, length, hd], in buffers that
    grow by doubling, so a pass writes its rows in place instead of copying the whole cache."""

    def __init__(self, head: EagleHead, capacity: int = 256):
        self.head = head
        a = head.arch
        w = head.fc.weight
        self.kbuf = torch.zeros(1, a.num_key_value_heads, capacity, a.head_dim, dtype=w.dtype, device=w.device)
        self.vbuf = torch.zeros_like(self.kbuf)
        self.length = 0

    @property
    def k(self) -> torch.Tensor:
        return self.kbuf[:, :, : self.length]

    @property
    def v(self) -> torch.Tensor:
        return self.vbuf[:, :, : self.length]

    def _room(self, m: int) -> None:
        need = self.length + m
        if need > self.kbuf.shape[2]:
            cap = max(need, 2 * self.kbuf.shape[2])
            for name in ("kbuf", "vbuf"):
                old = getattr(self, name)
                new = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
                new[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, new)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None,
                features: torch.Tensor | None, last_only: bool = False) -> DraftPass:
        h = self.head
        x, residual = h.layer_input(tokens[None], features[None].to(self.kbuf.dtype))  # [1, m, *]
        q, k, v = h.qkv(x, positions[None])
        L, m = self.length, tokens.numel()
        self._room(m)
        self.kbuf[:, :, L: L + m] = k
        self.vbuf[:, :, L: L + m] = v
        self.length = L + m
        if visible is None:  # a causal chain after the whole cache
            visible = torch.ones(m, L + m, dtype=torch.bool).tril(L)
        nxt, head_in = h.finish(attend(q, self.k, self.v, visible), residual)
        rows = head_in[0, -1:] if last_only else head_in[0]
        return DraftPass(h.logits(rows), nxt[0])

    def keep(self, base: int, rows: list[int]) -> None:
        src = base + torch.tensor(rows, dtype=torch.long, device=self.kbuf.device)
        n = len(rows)
        # advanced indexing copies first, so overlapping source and destination are safe
        self.kbuf[:, :, base: base + n] = self.kbuf[:, :, src]
        self.vbuf[:, :, base: base + n] = self.vbuf[:, :, src]
        self.length = base + n


# ---------------------------------------------------------------------------------------------- Medusa


class MedusaHeads(nn.Module):
    """Medusa: head h maps the target's last hidden state at the last accepted token to the token h + 1
    places beyond the next one, through `layers` residual blocks x + SiLU(W x + b) and its own head (or a
    shared one). FasterDecoding's and vLLM's checkpoints differ only in names (decoder/torch_ops/heads.py)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, bias: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias)
                                                  for _ in range(num_layers)) for _ in range(num_heads))
        self.heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., num_heads, V] logits."""
        out = []
        for block, head in zip(self.blocks, self.heads):
            x = hidden
            for lin in block:
                x = x + F.silu(lin(x))
            out.append(head(x))
        return torch.stack(out, dim=-2)


# ---------------------------------------------------------------------------------------------- a new head


@torch.no_grad()
def eagle3_from_target(model, aux_layers: tuple[int, ...], draft_ids: torch.Tensor) -> EagleHead:
    """A new EAGLE-3 head for a transformers Llama-family target, started where training converges fastest:
    fc reads the last of the three streams as it is (the others at zero), the layer is the target's last
    layer (q, k, v read the stream half; the embedding half starts small), the final norm is the target's
    and the LM head is the target's head restricted to `draft_ids` (sorted target ids, the draft vocabulary)."""
    c = model.config
    H, nh = c.hidden_size, c.num_attention_heads
    V = model.get_input_embeddings().weight.shape[0]
    rope = {"rope_parameters": dict(c.rope_parameters)} if getattr(c, "rope_parameters", None) else {}
    arch = EagleArch(EAGLE3, H, c.intermediate_size, nh, c.num_key_value_heads, getattr(c, "head_dim", None) or H // nh,
                     c.rms_norm_eps, V, int(draft_ids.numel()), rope=rope,
                     max_position_embeddings=c.max_position_embeddings, hidden_act=c.hidden_act,
                     aux_layers=tuple(sorted(aux_layers)), target_hidden_size=H)
    head = EagleHead(arch).to(next(model.parameters()).dtype)
    last = model.model.layers[-1]
    k = len(aux_layers)
    head.fc.weight.zero_()
    head.fc.weight[:, (k - 1) * H:] = torch.eye(H)
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(last.self_attn, name).weight
        getattr(head, name).weight.copy_(torch.cat([0.1 * w, w], dim=1))
    head.o_proj.weight.copy_(last.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(head, name).weight.copy_(getattr(last.mlp, name).weight)
    head.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
    head.input_layernorm.weight.copy_(last.input_layernorm.weight)
    head.hidden_norm.weight.copy_(last.input_layernorm.weight)
    head.norm.weight.copy_(model.model.norm.weight)
    head.lm_head.weight.copy_(model.get_output_embeddings().weight[draft_ids])
    head.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
    head.share("target_embedding", model.get_input_embeddings())
    return head
