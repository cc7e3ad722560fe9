"""Simulated latency profiles: L(n) for a GPU this machine does not have, computed, not measured.

An additive roofline (time adds; it fits the published curves better than max(memory, compute),
see docs/simulated-gpus.md, section 'The model'):

    GPU(n, b) = t0 + layers * t_layer
              + (weight bytes + b * context * KV bytes per token) / (eta_m * bandwidth)
              + FLOPs(n * b tokens, attention over context + n) / (eta_c * FLOP/s)

- graphs: an engine with CUDA graphs and fused kernels (gpt-fast, SGLang, TensorRT-LLM): L = GPU.
- eager: Hugging Face eager code, launched kernel by kernel from Python; the host sets a floor:
  L = max(floor_s + per_layer_s * layers, GPU(1)) + GPU(n) - GPU(1).

Datasheet figures and fitted constants live in simulated_gpus.json (sources inside); the fit is
scripts/fit_simulated_gpus.py against planner/published_latency.json. The model's architecture
comes from a Hugging Face config dict (the engines' presets, decoder/engines/presets/), counted here as plain numbers.
Numpy only: the planner imports no torch.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from planner.errors import UserError

GPUS_PATH = Path(__file__).resolve().parent / "simulated_gpus.json"
ENGINES = ("graphs", "eager")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MEMORY_USABLE = 0.9  # the rest: CUDA context, allocator slack, activations
FORMULA = {
    "graphs": "L(n,b) = t0 + layers*t_layer + (weight_bytes + b*context*kv_bytes_per_token)/(eta_m*bandwidth) "
              "+ flops(n*b tokens, attention over context+n)/(eta_c*flops_per_s)",
    "eager": "L(n,b) = max(floor_s + per_layer_s*layers, GPU(1,b)) + GPU(n,b) - GPU(1,b), GPU = the graphs formula",
}
MAX_BATCH_SIZE = 4096  # sequences in one simulated forward pass
MAX_CONTEXT = 1 << 20


# ---------------------------------------------------------------------------------------------
# architecture


@dataclass(frozen=True)
class Architecture:
    """What the roofline needs of a decoder-only transformer, as plain numbers."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # input embedding and LM head share one matrix
    gated_mlp: bool = True  # SwiGLU (3 matrices) or a plain MLP (2)
    qkv_bias: bool = False
    max_positions: int | None = None

    @property
    def layer_params(self) -> int:
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden
        if self.qkv_bias:
            attn += q_out + 2 * kv_out
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return attn + mlp + 2 * self.hidden  # two norms

    @property
    def params(self) -> int:
        """All parameters, a tied embedding counted once."""
        embed = self.vocab * self.hidden
        return self.layers * self.layer_params + embed * (1 if self.tied else 2) + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters every token multiplies through (the embedding lookup reads one row: left out)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def flops(self, n, batch: int, context: int):
        """Forward FLOPs of b sequences feeding n tokens each over a cache of `context`: 2 per
        multiply-add through the weights and the LM head (logits for every input token, as a tree
        needs), plus attention QK^T and AV over context + n keys (a tree mask is not exploited)."""
        n = np.asarray(n, dtype=np.float64)
        weights = 2.0 * n * batch * self.matmul_params
        attention = 4.0 * self.layers * self.heads * self.head_dim * n * (context + n) * batch
        return weights + attention


_CONFIG_TYPES = ("llama", "mistral", "qwen2", "qwen3", "opt")


def architecture_from_config(config: dict, name: str, label: str = "config") -> Architecture:
    """The Architecture of a Hugging Face config dict (llama, mistral, qwen2, qwen3, opt)."""
    if not isinstance(config, dict):
        raise UserError(f"{label}: expected a JSON object (a Hugging Face model config)")
    kind = config.get("model_type")
    if kind not in _CONFIG_TYPES:
        raise UserError(f"{label}: field 'model_type' is {kind!r}; the simulator counts {', '.join(_CONFIG_TYPES)}")

    def field(key: str, default=None) -> int:
        x = config.get(key, default)
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise UserError(f"{label}: field '{key}' must be a positive integer, got {x!r}")
        return x

    hidden, heads = field("hidden_size"), field("num_attention_heads")
    if kind == "opt":
        intermediate, kv_heads, head_dim, gated, bias = field("ffn_dim"), heads, hidden // heads, False, True
        if config.get("word_embed_proj_dim", hidden) != hidden:
            raise UserError(f"{label}: field 'word_embed_proj_dim' differs from 'hidden_size' (projected OPT "
                            "embeddings are not counted)")
    else:
        intermediate, kv_heads = field("intermediate_size"), field("num_key_value_heads", heads)
        head_dim = config.get("head_dim") or hidden // heads
        head_dim = field("head_dim", head_dim)
        gated, bias = True, kind == "qwen2" or bool(config.get("attention_bias"))
    if heads % kv_heads:
        raise UserError(f"{label}: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})")
    tied = config.get("tie_word_embeddings", kind == "opt")
    max_pos = config.get("max_position_embeddings")
    return Architecture(name, field("num_hidden_layers"), hidden, heads, kv_heads, head_dim, intermediate,
                        field("vocab_size"), bool(tied), gated, bias,
                        max_pos if isinstance(max_pos, int) and not isinstance(max_pos, bool) else None)


# ---------------------------------------------------------------------------------------------
# GPUs


@dataclass(frozen=True)
class GPU:
    name: str
    label: str
    memory_gib: float
    bandwidth_gb_s: float
    flops: dict  # dtype -> dense FLOP/s
    source: str
    eta_m: float  # achieved fraction of the datasheet bandwidth
    eta_c: float  # achieved fraction of the datasheet FLOP/s
    t0_s: float  # fixed cost of a step
    t_layer_s: float  # per-layer cost a fused engine still pays (launch gaps, small kernels)
    constants_from: str  # the GPU whose fitted constants these are (itself when fitted on its own points)


@dataclass(frozen=True)
class Eager:
    floor_s: float
    per_layer_s: float


CONSTANTS = ("eta_m", "eta_c", "t0_s", "t_layer_s")


def _number(obj: dict, key: str, label: str, lo: float = 0.0, hi: float = math.inf) -> float:
    x = obj.get(key)
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not lo <= x <= hi:
        raise UserError(f"{label}: field '{key}' must be a number in [{lo}, {hi}], got {x!r}")
    return float(x)


def load_gpu_table(path: str | Path = GPUS_PATH) -> tuple[dict[str, GPU], Eager]:
    """Every GPU of the table (constants resolved through 'constants_from') and the eager floor."""
    from planner.jsonio import read_json

    data = read_json(path)
    label = str(path)
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict) or not isinstance(data.get("eager"), dict):
        raise UserError(f"{label}: expected an object with 'gpus' and 'eager'")
    raw = data["gpus"]
    out = {}
    for name, g in raw.items():
        where = f"{label}: gpus.{name}"
        if not isinstance(g, dict):
            raise UserError(f"{where}: expected an object")
        owner = g.get("constants_from", name)
        if owner not in raw or any(k not in raw[owner] for k in CONSTANTS):
            raise UserError(f"{where}: field 'constants_from' must name a GPU of the table with {', '.join(CONSTANTS)}")
        flops = g.get("flops")
        if not isinstance(flops, dict) or set(flops) != set(DTYPE_BYTES):
            raise UserError(f"{where}: field 'flops' must give {', '.join(DTYPE_BYTES)}")
        c = raw[owner]
        out[name] = GPU(name, str(g.get("label", name)), _number(g, "memory_gib", where, 1),
                        _number(g, "bandwidth_gb_s", where, 1), {k: _number(flops, k, where + ".flops", 1) for k in flops},
                        str(g.get("source", "")), _number(c, "eta_m", where, 0.01, 1), _number(c, "eta_c", where, 0.01, 1),
                        _number(c, "t0_s", where, 0, 1), _number(c, "t_layer_s", where, 0, 1), owner)
    e = data["eager"]
    return out, Eager(_number(e, "floor_s", f"{label}: eager", 0, 1), _number(e, "per_layer_s", f"{label}: eager", 0, 1))


def get_gpu(name: str) -> GPU:
    gpus, _ = load_gpu_table()
    if name not in gpus:
        raise UserError(f"--simulate: unknown GPU '{name}' (known: {', '.join(gpus)}; see --list-gpus)")
    return gpus[name]


def gpu_lines() -> list[str]:
    """`planner profile --list-gpus`: one line per GPU with its datasheet figures and source."""
    gpus, _ = load_gpu_table()
    out = [f"{'name':<11} {'memory':>7} {'bandwidth':>10} {'bf16/fp16 dense':>16}  {'constants':<14}  source"]
    for g in gpus.values():
        fitted = "fitted" if g.constants_from == g.name else f"from {g.constants_from}"
        out.append(f"{g.name:<11} {g.memory_gib:>4g} GiB {g.bandwidth_gb_s:>5g} GB/s {g.flops['bf16'] / 1e12:>8.1f} TFLOP/s"
                   f"  {fitted:<14}  {g.source}")
    return out


# ---------------------------------------------------------------------------------------------
# the model


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPE_BYTES:
        raise UserError(f"--dtype: expected one of {', '.join(DTYPE_BYTES)}, got '{dtype}'")
    return dtype


def gpu_time(arch: Architecture, gpu: GPU, dtype: str, n, batch: int, context: int):
    """The graphs engine's step (seconds) at input length n (scalar or array)."""
    b = DTYPE_BYTES[check_dtype(dtype)]
    data = arch.matmul_params * b + batch * context * arch.kv_bytes_per_token(b)
    compute = arch.flops(n, batch, context)
    out = (gpu.t0_s + arch.layers * gpu.t_layer_s + data / (gpu.eta_m * gpu.bandwidth_gb_s * 1e9)
           + compute / (gpu.eta_c * gpu.flops[dtype]))
    return float(out) if np.ndim(out) == 0 else out


def latency(arch: Architecture, gpu: GPU, dtype: str, n, batch: int = 1, context: int = 256,
            engine: str = "graphs", eager: Eager | None = None):
    """Simulated forward latency (seconds) of b sequences feeding n tokens each."""
    if engine not in ENGINES:
        raise UserError(f"--engine: expected one of {', '.join(ENGINES)}, got '{engine}'")
    t = gpu_time(arch, gpu, dtype, n, batch, context)
    if engine == "graphs":
        return t
    eager = eager or load_gpu_table()[1]
    t1 = gpu_time(arch, gpu, dtype, 1, batch, context)
    out = max(eager.floor_s + eager.per_layer_s * arch.layers, t1) + np.asarray(t) - t1
    return float(out) if np.ndim(out) == 0 else out


def memory_bytes(arch: Architecture, dtype: str, batch: int, positions: int) -> tuple[float, float]:
    """(weights, KV cache) bytes for b sequences of `positions` cached tokens."""
    b = DTYPE_BYTES[check_dtype(dtype)]
    return float(arch.params * b), float(batch * positions * arch.kv_bytes_per_token(b))


def check_fits(arch: Architecture, gpu: GPU, dtype: str, batch_sizes, context: int, max_length: int) -> None:
    """Refuse sizes the GPU could not hold: weights plus the KV cache of the largest batch at
    context + the longest input must fit in MEMORY_USABLE of its memory."""
    b = max(batch_sizes)
    weights, kv = memory_bytes(arch, dtype, b, context + max_length)
    have = gpu.memory_gib * 2**30 * MEMORY_USABLE
    if weights + kv > have:
        gib = 2**30
        raise UserError(f"--batch-sizes/--context-length: {arch.name} in {dtype} needs {(weights + kv) / gib:.1f} GiB "
                        f"(weights {weights / gib:.1f} + KV cache {kv / gib:.1f} for batch {b} x {context} + "
                        f"{max_length} tokens), more than {gpu.name}'s {gpu.memory_gib:g} GiB allows "
                        f"({MEMORY_USABLE:.0%} usable)")


def simulate_profile(arch: Architecture, gpu: GPU, dtype: str, engine: str, input_lengths, context: int,
                     batch_sizes, config_hash: str | None = None, model_source: str = "preset") -> dict:
    """A profile file in the profiler's schema (planner.profile loads it), computed, marked "simulated"."""
    lengths = [int(n) for n in input_lengths]
    sizes = [int(b) for b in batch_sizes]
    if not lengths or lengths[0] < 1 or any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise UserError("--input-lengths: expected increasing positive lengths")
    if any(not 1 <= b <= MAX_BATCH_SIZE for b in sizes):
        raise UserError(f"--batch-sizes: expected integers in 1..{MAX_BATCH_SIZE}, got {sizes}")
    if not 1 <= context <= MAX_CONTEXT:
        raise UserError(f"--context-length: expected 1..{MAX_CONTEXT}, got {context}")
    if arch.max_positions is not None and context + lengths[-1] > arch.max_positions:
        raise UserError(f"--input-lengths/--context-length: context {context} + input length {lengths[-1]} is beyond "
                        f"{arch.name}'s max_position_embeddings ({arch.max_positions})")
    check_fits(arch, gpu, dtype, sizes, context, lengths[-1])
    _, eager = load_gpu_table()
    series = []
    for b in sizes:
        lat = [float(x) for x in np.atleast_1d(latency(arch, gpu, dtype, np.asarray(lengths), b, context, engine, eager))]
        series.append({"batch_size": b, "input_lengths": lengths, "latency_s": lat,
                       "fit": {"kind": "piecewise_linear", "method": "simulated (additive roofline)",
                               "input_lengths": lengths, "latency_s": lat}})
    mark = simulated_mark(arch, gpu, dtype, engine, eager)
    first = series[0]
    return {
        "input_lengths": lengths, "latency_s": first["latency_s"], "fit": first["fit"],
        "batch_size": first["batch_size"], "series": series,
        "device": f"simulated:{gpu.name}", "device_name": f"{gpu.label} (simulated, {engine})",
        "model": arch.name, "model_source": model_source, "has_weights": False,
        **({"config_hash": config_hash} if config_hash else {}),
        "dtype": dtype, "context_length": context, "layout": "padded",
        "simulated": mark,
    }


def simulated_mark(arch: Architecture, gpu: GPU, dtype: str, engine: str, eager: Eager) -> dict:
    """The "simulated" record: enough to recompute every number of the file."""
    constants = {k: getattr(gpu, k) for k in CONSTANTS}
    if engine == "eager":
        constants.update(eager_floor_s=eager.floor_s, eager_per_layer_s=eager.per_layer_s)
    return {
        "gpu": gpu.name, "gpu_label": gpu.label, "engine": engine, "dtype": dtype,
        "formula": FORMULA[engine],
        "bandwidth_gb_s": gpu.bandwidth_gb_s, "flops_per_s": gpu.flops[dtype], "memory_gib": gpu.memory_gib,
        "constants": constants, "constants_from": gpu.constants_from,
        "architecture": asdict(arch),
        "counts": {"params": arch.params, "matmul_params": arch.matmul_params,
                   "kv_bytes_per_token": arch.kv_bytes_per_token(DTYPE_BYTES[dtype])},
        "sources": {"gpu": gpu.source, "table": str(GPUS_PATH.name), "fit": "scripts/fit_simulated_gpus.py, "
                    "planner/published_latency.json; errors in docs/simulated-gpus.md"},
        "note": "computed by `planner profile --simulate`, not measured: predictions for a GPU this machine does not have",
    }


# ---------------------------------------------------------------------------------------------
# marks on profiles and plans


def simulated_of(source_or_data: dict) -> dict | None:
    """The "simulated" record of a profile file's data or a LatencyProfile's source (None: measured)."""
    mark = source_or_data.get("simulated") if isinstance(source_or_data, dict) else None
    return mark if isinstance(mark, dict) else None


def describe(mark: dict) -> str:
    """'SIMULATED h100-sxm (graphs, bf16)': how labels and notes name a simulated profile."""
    return f"SIMULATED {mark.get('gpu', '?')} ({mark.get('engine', '?')}, {mark.get('dtype', '?')})"


def refuse_to_measure(profile, what: str = "planner autotune") -> None:
    """A command that measures decoding on this machine against a profile's predictions must not
    take a simulated profile: the predictions are for another GPU."""
    mark = simulated_of(getattr(profile, "source", profile))
    if mark is not None:
        where = getattr(profile, "source", {}).get("file", "profile")
        raise UserError(f"{where}: is a simulated profile ({describe(mark)}); {what} measures decoding on this machine "
                        "and needs a profile measured here (plan with it instead: planner plan --profile FILE)")
