"""Random-filled GGUF files of preset architectures: profile llama.cpp on a model size without its weights.

    path = random_gguf("llama-3.2-1b")      # $TREE_PLANNER_CACHE/gguf/llama-3.2-1b-Q4_K.gguf, written once
    remove_random_gguf("llama-3.2-1b")

A Llama-architecture file with the preset's shapes (decoder/engines/presets/*.json: hidden size, layers, heads,
key-value heads, feed-forward size, vocabulary, tied embeddings) and every matrix in one common 4-bit
type, Q4_K by default (the type most GGUF files ship in, llama.cpp's repacked AVX2 path) or Q4_0 / Q4_1.
The blocks are random bytes with small, normal fp16 scales, so the forward runs on finite numbers and
llama.cpp does the same work as on real weights: its CPU speed does not depend on the values. The
tokenizer is a placeholder SentencePiece vocabulary of the preset's size. Tensors stream to a temporary
file that is renamed into place, so an interrupted write leaves nothing.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from decoder.engines.shipped import cache_dir
from planner.errors import UserError
from planner.jsonio import read_json

QTYPES = ("Q4_K", "Q4_0", "Q4_1")
SCALE = 1e-3  # fp16 block scale: weights of order 0.01, a normal fp16 number (no subnormal slow paths)


def gguf_dir() -> Path:
    return cache_dir() / "gguf"


def random_gguf_path(preset: str, qtype: str = "Q4_K") -> Path:
    return gguf_dir() / f"{preset}-{qtype}.gguf"


def _shapes(cfg: dict, label: str, block: int) -> dict:
    """The preset's Llama shapes, checked: a one-line error names the missing or bad field."""
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    out = {}
    for k in need:
        v = cfg.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{label}: field '{k}' must be a positive integer for a GGUF file, got {v!r}")
        out[k] = v
    out["num_key_value_heads"] = int(cfg.get("num_key_value_heads") or out["num_attention_heads"])
    out["head_dim"] = int(cfg.get("head_dim") or out["hidden_size"] // out["num_attention_heads"])
    out["tie"] = bool(cfg.get("tie_word_embeddings", False))
    out["rope_theta"] = float(cfg.get("rope_theta", 10000.0))
    out["eps"] = float(cfg.get("rms_norm_eps", 1e-5))
    out["context"] = int(cfg.get("max_position_embeddings", 4096))
    if out["hidden_size"] % block or out["intermediate_size"] % block or (out["head_dim"] * out["num_attention_heads"]) % block:
        raise UserError(f"{label}: hidden, feed-forward and attention sizes must be multiples of {block} (the 4-bit "
                        "type's block); try --quant Q4_0")
    return out


def _tensors(s: dict) -> list[tuple[str, tuple[int, int] | tuple[int], bool]]:
    """(GGUF name, shape as [rows, columns] or [n], quantised?) in file order."""
    H, F, V = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    out = [("token_embd.weight", (V, H), True), ("output_norm.weight", (H,), False)]
    if not s["tie"]:
        out.append(("output.weight", (V, H), True))
    for i in range(s["num_hidden_layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (H,), False), (b + "attn_q.weight", (q, H), True),
                (b + "attn_k.weight", (kv, H), True), (b + "attn_v.weight", (kv, H), True),
                (b + "attn_output.weight", (H, q), True), (b + "ffn_norm.weight", (H,), False),
                (b + "ffn_gate.weight", (F, H), True), (b + "ffn_up.weight", (F, H), True),
                (b + "ffn_down.weight", (H, F), True)]
    return out


def _blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8: random quant blocks with their fp16 scales set to SCALE."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = cols // block
    data = rng.integers(0, 256, size=(rows, n, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(SCALE).tobytes(), dtype=np.uint8)
    data[:, :, 0:2] = scale  # d
    if qtype != gguf.GGMLQuantizationType.Q4_0:
        data[:, :, 2:4] = scale  # Q4_1: m; Q4_K: dmin
    return data.reshape(rows, n * size)


def _vocab(writer, V: int) -> None:
    """A SentencePiece vocabulary of V tokens: unknown, BOS, EOS, the 256 byte tokens, then fillers."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(V - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (V - 259)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens[:V])
    writer.add_token_scores([0.0] * V)
    writer.add_token_types(types[:V])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def random_gguf(preset: str, qtype: str = "Q4_K", progress: bool = True, seed: int = 0) -> Path:
    """The preset's random-filled GGUF file, written on first use into the cache."""
    import gguf

    from decoder.engines.models import PRESET_DIR, preset_names

    if qtype not in QTYPES:
        raise UserError(f"--quant: expected one of {', '.join(QTYPES)}, got {qtype!r}")
    cfg_file = PRESET_DIR / f"{preset}.json"
    if "/" in preset or not cfg_file.is_file():
        raise UserError(f"unknown model preset '{preset}' (presets: {', '.join(preset_names())})")
    out = random_gguf_path(preset, qtype)
    if out.is_file():
        return out
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    s = _shapes(read_json(cfg_file), str(cfg_file), gguf.GGML_QUANT_SIZES[qt][0])
    tensors = _tensors(s)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    total = sum(r * c for _, shape, quant in tensors if quant for r, c in [shape])
    if progress:
        gib = total * gguf.GGML_QUANT_SIZES[qt][1] / gguf.GGML_QUANT_SIZES[qt][0] / 2**30
        print(f"writing {out} (random {qtype} weights, {gib:.1f} GiB, once)...", file=sys.stderr)
    rng = np.random.default_rng(seed)
    try:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_name(f"{preset} (random weights)")
        w.add_context_length(s["context"])
        w.add_embedding_length(s["hidden_size"])
        w.add_block_count(s["num_hidden_layers"])
        w.add_feed_forward_length(s["intermediate_size"])
        w.add_head_count(s["num_attention_heads"])
        w.add_head_count_kv(s["num_key_value_heads"])
        w.add_key_length(s["head_dim"])
        w.add_value_length(s["head_dim"])
        w.add_rope_dimension_count(s["head_dim"])
        w.add_rope_freq_base(s["rope_theta"])
        w.add_layer_norm_rms_eps(s["eps"])
        w.add_vocab_size(s["vocab_size"])
        _vocab(w, s["vocab_size"])
        for name, shape, quant in tensors:
            if quant:
                row = shape[1] // gguf.GGML_QUANT_SIZES[qt][0] * gguf.GGML_QUANT_SIZES[qt][1]  # bytes per row
                w.add_tensor_info(name, (shape[0], row), np.dtype(np.uint8), shape[0] * row, raw_dtype=qt)
            else:
                w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, quant in tensors:
            w.write_tensor_data(_blocks(shape[0], shape[1], qt, rng) if quant else np.ones(shape, dtype=np.float32))
        w.close()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def remove_random_gguf(preset: str | None = None) -> list[Path]:
    """Delete the cached random files of one preset (every quant type), or all of them."""
    gone = []
    for f in sorted(gguf_dir().glob("*.gguf")) if gguf_dir().is_dir() else []:
        if preset is None or f.name.rsplit("-", 1)[0] == preset:
            f.unlink()
            gone.append(f)
    return gone
