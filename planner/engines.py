"""The engine registry: one `EngineKind` per target engine, with what it can do and its defaults.

    spec = kind("llama.cpp")
    spec.caps.trees, spec.caps.batches        # what it can do: the rest of the code asks these
    spec.defaults.decode_tokens               # what the main job uses when the user says nothing
    spec.refuses                              # options it has no use for, each with why

Beside planner/guessers.py (the proposers), this is the scorers' half: an engine is one subpackage
under decoder/engines/ plus one `register(EngineKind(...))` here. The opener is named as
"module:function" and imported only when the engine is opened (decoder/engines/registry.py), so the
planner, and `planner plan`, never import torch or an engine's library. No module outside this
registry and the engine's own package compares an engine's name (tests/test_architecture.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from planner.errors import UserError


STEP, SERVING = "step", "serving"  # the two engine protocols (EngineKind.protocol)


@dataclass(frozen=True)
class EngineCaps:
    """What an engine can do; guessers and workflows ask these instead of comparing engine names."""

    name: str  # the engine's name in plan files and on the command line
    hidden_states: bool  # returns the target's last hidden state per input (ParallelSpec, PPD training)
    input_embeddings: bool  # takes inputs that are not vocabulary tokens (PPD prompt tokens)
    trees: bool  # scores a tree (tokens sharing ancestors) in one forward; False: one chain per step
    batches: bool  # decodes several sequences in one forward (decoder/batch.py)
    threads: int | None = None  # CPU threads the engine computes with (None: the library's choice)
    torch_modules: bool = False  # lends its torch modules: the draft LM and ParallelSpec share its embedding
    #                              and head, PEARL and MTAD run its model beside a drafter's, training backpropagates
    matmul_paths: bool = False  # chooses each Linear's CPU matmul path per input length when profiling
    tree_kernels: bool = False  # has the Triton tree-attention kernels (select_attention: auto, kernels, dense)
    stock_plain: bool = False  # its library's own generation is its fastest plain decoding: a plain decision runs it
    devices: tuple[str, ...] = ("cpu",)  # where it runs ("cuda" also takes "cuda:N")
    server: bool = False  # a serving program in its own environment: profiled, measured and raced through
    #                       its HTTP API under concurrent load, never stepped from this process


@dataclass(frozen=True)
class EngineDefaults:
    """What differs by engine in the main job and the commands: data, not branches. An engine that
    decodes ten times faster affords longer races; a chain-only engine whose forward grows with every
    token plans short chains."""

    decode_tokens: int = 32  # new tokens per race prompt
    rounds: int = 1  # runs of each (plan, prompt) in the race; the median counts
    budget_minutes: float = 4.0  # the whole main job
    decode_prompts: int = 16  # held-out prompts the plans race on
    accept_prompts: int = 8  # held-out prompts the acceptance is measured on
    turns: int = 2  # prompts per held-out question (2: its follow-up too)
    max_input_length: int = 64  # largest forward planned and profiled
    context_lengths: tuple[int, ...] = (128,)  # the profile's contexts; the first is the one planned with
    dynamic_sizes: tuple[int, ...] | None = None  # per-step plans' size limits (None: the planner's own spread)
    max_finalists: int = 100  # families racing at most
    sampled_rule: str = "coupled"  # the main job's verification rule under sampling (planner/sampling.py)
    profile_budget_s: float = 45.0  # profiling at most this long in the main job
    profile_context_lengths: tuple[int, ...] = (256,)  # `planner profile`'s contexts when none is given
    profile_time_budget_s: float | None = None  # `planner profile`'s budget (None: 15 s on the CPU, 120 s on a GPU)
    n_ctx: int | None = None  # fixed context engines: the smallest context opened (None: no fixed context)
    spinning_threads: bool = False  # its threads spin at barriers: on a machine busier than its cores, run 1
    schedule_off_ratio: float = 1.0  # a serving engine's draft length 0 inside a per-batch-size schedule, in
    #                                  tokens/s over plain's (1: the same as no speculative config)


@dataclass(frozen=True)
class EngineKind:
    name: str
    summary: str
    opener: str  # "module:function" taking a decoder.engines.registry.EngineRequest, returning the engine
    caps: EngineCaps
    defaults: EngineDefaults = field(default_factory=EngineDefaults)
    refuses: tuple[tuple[str, str], ...] = ()  # (option, why): options the engine has no use for
    requires: str | None = None  # the module its library is imported as; missing: installed on first use
    install: str | None = None  # the command that installs that library (scripts/install_engine.sh NAME)
    compares: bool = False  # the main job of another engine times this one's stock plain decoding beside it
    serves: tuple[str, ...] = ()  # serving programs whose plans are priced on this engine's profile (planner export)
    stock: str = "its library's own generation"  # what `stock_generate` runs, as reports name the baseline

    def why_not(self, option: str) -> str | None:
        return dict(self.refuses).get(option)

    @property
    def protocol(self) -> str:
        """How the main job and the commands drive this engine, read once from its caps: STEP (decoder/engine.py's
        Engine, stepped in this process) or SERVING (decoder/serving.py's ServingEngine: a server per config,
        measured through its HTTP API). workflows/mainjob/phases.py picks each phase's implementation by it."""
        return SERVING if self.caps.server else STEP


_KINDS: dict[str, EngineKind] = {}


def register(spec: EngineKind) -> EngineKind:
    if spec.name in _KINDS:
        raise ValueError(f"engine {spec.name!r} is registered twice")
    if spec.caps.name != spec.name:
        raise ValueError(f"engine {spec.name!r}: caps.name is {spec.caps.name!r}")
    _KINDS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Tests that register a toy engine take it out again."""
    _KINDS.pop(name, None)


def kind(name: str) -> EngineKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise UserError(f"--engine {name}: expected one of {', '.join(names())}") from None


def names() -> list[str]:
    return list(_KINDS)


def kinds() -> list[EngineKind]:
    return list(_KINDS.values())


DEFAULT = "hf"

register(EngineKind(
    "hf", "Hugging Face transformers: any causal LM, fp32/bf16/fp16, CPU or CUDA, trees with a 4D mask or the "
          "Triton tree kernels, batches (EMS-SD), the CPU matmul paths",
    "decoder.engines.hf.open:open_engine",
    EngineCaps("hf", hidden_states=True, input_embeddings=True, trees=True, batches=True, torch_modules=True,
               matmul_paths=True, tree_kernels=True, devices=("cpu", "cuda")),
    EngineDefaults(),
    stock="transformers' generate",
    refuses=(("--n-ctx", "transformers models size their cache as they go"),
             ("--quant", "it loads the model's own weights (a random-filled GGUF is llama.cpp's)")),
))

register(EngineKind(
    "llama.cpp", "llama.cpp through llama-cpp-python: the model's GGUF file on the CPU, chains (its batches round "
                 "like single tokens only in the build scripts/install_engine.sh makes)",
    "decoder.engines.llama_cpp.open:open_engine",
    EngineCaps("llama.cpp", hidden_states=False, input_embeddings=False, trees=False, batches=False,
               stock_plain=True),
    EngineDefaults(decode_tokens=96, rounds=3, budget_minutes=10.0, decode_prompts=8, turns=1, max_input_length=16,
                   context_lengths=(128, 512), dynamic_sizes=(4, 8, 15), max_finalists=8, sampled_rule="lossless",
                   n_ctx=256, spinning_threads=True, profile_context_lengths=(128, 512), profile_time_budget_s=30.0),
    refuses=(("--device", "llama.cpp runs on the CPU here"),
             ("--dtype", "a GGUF file carries its own weight types"),
             ("--cuda-graphs", "llama.cpp runs on the CPU here"),
             ("--plot", "plot its profile with `planner report`"),
             ("--attention tree", "its attention is llama.cpp's own"),
             ("--layout packed", "it decodes one sequence at a time"),
             ("--batch-sizes", "it decodes one sequence at a time"),
             ("--matmul-paths", "the CPU matmul paths are the hf engine's; llama.cpp has its own kernels"),
             ("--profile", "the CPU matmul paths are the hf engine's; llama.cpp has its own kernels")),
    requires="llama_cpp", install="scripts/install_engine.sh llama.cpp", compares=True, serves=("llama-server",),
    stock="llama.cpp's Llama.generate",
))

register(EngineKind(
    "vllm", "vLLM's CPU build as a server (its own environment, scripts/setup_vllm.sh): concurrent requests, "
            "its own proposers (ngram, suffix, draft_model) and draft lengths per batch-size range",
    "decoder.engines.vllm.open:open_engine",
    EngineCaps("vllm", hidden_states=False, input_embeddings=False, trees=False, batches=True, stock_plain=True,
               server=True),
    # the serving main job's (workflows/mainjob/serving.py): 15 minutes on 2 cores fit the profile, the
    # acceptance, plain and the planned schedule (vLLM server starts are about 45 s each); a fresh run with
    # every stock contender raced took 36 min (--budget 40)
    # vLLM 0.32 keeps its speculative path where a schedule's K is 0: 14 such rows raced here against
    # plain on another server measured 0.81-1.07x, median 0.92 (docs/results.md), so the planner prices it so
    # (py-spy: sampled, its rejection sampler's recovery draw is 8.5 % of the worker; greedy, 1.4 %);
    # acceptance on the acceptance half's 16 prompts: its 8 questions' two turns, one per MT-bench category as
    # in the race's 16 (8 took 4 categories, none of coding and extraction, where lookup accepts most)
    EngineDefaults(decode_tokens=32, rounds=1, budget_minutes=15.0, decode_prompts=16, accept_prompts=16, turns=2,
                   max_input_length=9, sampled_rule="lossless", schedule_off_ratio=0.92),
    refuses=(("--device", "vLLM's CPU build runs on the CPU here"),
             ("--n-ctx", "vLLM sizes its KV cache itself (VLLM_CPU_KVCACHE_SPACE)"),
             ("--quant", "it serves the model's own weights"),
             ("--attention tree", "vLLM verifies chains with its own attention"),
             ("--matmul-paths", "the CPU matmul paths are the hf engine's"),
             ("--profile", "the CPU matmul paths are the hf engine's")),
    stock="vLLM plain (the same server without --speculative-config)",
))
