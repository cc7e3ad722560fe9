"""`planner profile`: measure forward latency versus input length and write a profile JSON.

Light imports only at top level: torch and transformers load inside run().
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from planner.errors import UserError
from profiler.lengths import DEFAULT_LENGTHS_SPEC, parse_lengths
from workflows.cli.llama_target import add_engine_argument


def parse_batch_sizes(values: list[str]) -> list[int]:
    """'--batch-size 1 4' or '--batch-size 1,4': positive integers, order kept, duplicates dropped."""
    out: list[int] = []
    for v in values:
        for part in str(v).split(","):
            try:
                b = int(part)
            except ValueError:
                b = 0
            if b < 1:
                raise UserError(f"--batch-sizes: expected positive integers, got '{part}'")
            if b not in out:
                out.append(b)
    return out


def _positive(kind):
    def conv(s: str):
        try:
            x = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got '{s}'") from None
        if x <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got '{s}'")
        return x

    return conv


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="smollm2-135m (default; its architecture with random weights when the registry package is "
                        "missing), a preset name (see --list-models), a local Hugging Face model directory, or a "
                        "config.json")
    p.add_argument("--list-models", action="store_true", help="print the preset names and exit")
    p.add_argument("--simulate", default=None, metavar="GPU",
                   help="compute the profile for this GPU instead of measuring (an additive roofline fitted to "
                        "published measurements; the file is marked \"simulated\"); see --list-gpus")
    p.add_argument("--list-gpus", action="store_true", help="print the GPUs --simulate knows, with datasheet figures")
    add_engine_argument(p, extra=("graphs", "eager"))
    p.add_argument("--context-lengths", default="128,512", metavar="C,C,...",
                   help="--engine llama.cpp: context lengths to time at; the first is the profile's (default 128,512)")
    p.add_argument("--quant", default="Q4_K", choices=["Q4_K", "Q4_0", "Q4_1"],
                   help="--engine llama.cpp with a preset: the 4-bit type of its random-filled GGUF (default Q4_K)")
    p.add_argument("--remove-cached", action="store_true",
                   help="delete the random-filled GGUF files of --model (every preset without --model) and exit")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"],
                   help="default: bf16 (fp16 without bf16 support) on GPU, fp32 on CPU")
    p.add_argument("--context-length", type=_positive(int), default=256, help="tokens already in the KV cache (default 256)")
    p.add_argument("--input-lengths", default=DEFAULT_LENGTHS_SPEC,
                   help="N, START:STOP or START:STOP:STEP (STOP inclusive), comma-separated "
                        f"(default {DEFAULT_LENGTHS_SPEC})")
    p.add_argument("--batch-sizes", "--batch-size", dest="batch_size", nargs="+", default=["1"],
                   help="one or more batch sizes, e.g. 1,2,4,8 or 1 4 (default 1)")
    p.add_argument("--time-budget", type=_positive(float), default=None,
                   help="seconds of measuring in total (default 15 on CPU, 120 on GPU)")
    p.add_argument("--min-repeats", type=_positive(int), default=5)
    p.add_argument("--max-repeats", type=_positive(int), default=50)
    p.add_argument("--target-ci", type=_positive(float), default=0.02,
                   help="a length is done when its median's 95%% CI half-width is within this fraction (default 0.02)")
    p.add_argument("--warmup", type=_positive(int), default=1, help="untimed passes per length before measuring")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "tree"],
                   help="sdpa: dense 4D mask through PyTorch SDPA (default); tree: the project's tree-attention "
                        "kernels (decoder.engines.hf.attention, Triton on CUDA), as the decoder runs them when switched on")
    p.add_argument("--layout", default="padded", choices=["padded", "packed"],
                   help="with --batch-size > 1: padded (b rectangular rows, default) or packed (one row of b "
                        "sequences with per-sequence attention: EMS-SD's layout, decoder.batch)")
    p.add_argument("--matmul-paths", default="auto", choices=["auto", "off"],
                   help="auto (CPU): first measure each Linear weight shape's fastest matmul path (F.linear, a "
                        "transposed copy, oneDNN prepacked, chunked) at every input length up to --matmul-max-rows, "
                        "check them on the whole forward, store them in the profile ('matmul_paths') and time L(n) "
                        "with them; `planner decode --profile` installs the same paths. off: F.linear only")
    p.add_argument("--matmul-budget", type=_positive(float), default=None,
                   help="seconds for choosing the matmul paths (default: --time-budget)")
    p.add_argument("--matmul-max-rows", type=_positive(int), default=16,
                   help="largest input length (rows) given its own matmul paths (default 16; longer ones run F.linear)")
    p.add_argument("--cuda-graphs", action="store_true", help="time CUDA-graph replays (GPU only)")
    p.add_argument("--threads", type=_positive(int), default=None, help="CPU threads for torch (default: torch's choice, or 1 when the load average exceeds the core count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also plot latency versus input length")
    p.add_argument("-o", "--output", default=None, help="output JSON (default profiles/<device>-<model>.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def device_slug(profile: dict) -> str:
    """'cpu', or the GPU's name in lower case with dashes (e.g. nvidia-h100-80gb-hbm3)."""
    if profile["device"] != "cuda":
        return profile["device"]
    return re.sub(r"[^a-z0-9.]+", "-", profile["device_name"].lower()).strip("-")


def _check_writable(opt: str, path: Path) -> None:
    """Fail before measuring, not after, when the output cannot be written."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if path.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"{opt} {path}: cannot write there")


def _select_path(model, attention: str) -> None:
    """The attention path to time: auto is the decoder's own choice (the Triton tree kernels on
    CUDA for models they serve, the dense mask elsewhere), so a profile times what decoding runs."""
    from decoder.loop import select_attention

    if attention == "sdpa":
        return
    try:
        select_attention(model, "kernels" if attention == "tree" else "auto")
    except UserError as e:
        raise UserError(f"--attention {attention}: {str(e).split(': ', 1)[-1]}; profile with --attention sdpa") from None


def run(args) -> int:
    from decoder.engines.hf.load import default_model_spec, preset_names

    if args.list_models:
        print("\n".join(preset_names()))
        return 0
    if args.remove_cached:
        from decoder.engines.llama_cpp.gguf_random import remove_random_gguf

        gone = remove_random_gguf(args.model)
        print(f"removed {len(gone)} random-filled GGUF file(s): {', '.join(str(g) for g in gone) or 'none cached'}",
              file=sys.stderr)
        return 0
    if args.list_gpus or args.simulate:
        if args.engine in ("hf", "llama.cpp"):
            raise UserError(f"--engine {args.engine}: not with --simulate (there: graphs or eager)")
        return _simulate(args)
    if args.engine in ("graphs", "eager"):
        raise UserError(f"--engine {args.engine}: only with --simulate GPU (a measured profile times what this machine runs)")
    if args.engine == "llama.cpp":
        return _llama(args)
    lengths = parse_lengths(args.input_lengths)
    if args.matmul_max_rows > 1024 or (args.matmul_budget or 0) > 86400:
        raise UserError("--matmul-max-rows: at most 1024; --matmul-budget: at most 86400 s")
    batch_sizes = parse_batch_sizes(args.batch_size)
    if args.plot and not args.plot.lower().endswith(".png"):
        raise UserError(f"--plot: expected a .png file name, got '{args.plot}'")
    for opt, path in (("-o", args.output), ("--plot", args.plot)):
        _check_writable(opt, Path(path) if path else Path("profiles") / "x")

    import torch

    from planner.jsonio import atomic_write_json
    from profiler.measure import check_lengths, profile_model
    from decoder.engines.hf.load import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = args.model or default_model_spec()
    device = args.device
    if args.cuda_graphs and device == "cpu":
        raise UserError("--cuda-graphs: needs a CUDA device, but --device is cpu")
    loaded = load_model(spec, device=device, dtype=args.dtype, weights=False)
    _select_path(loaded.model, args.attention)
    check_lengths(lengths, args.context_length, getattr(loaded.model.config, "max_position_embeddings", None),
                  loaded.model, max(batch_sizes))
    print(f"profiling {loaded.name} ({loaded.source}, {'weights' if loaded.has_weights else 'random weights'}) on "
          f"{next(loaded.model.parameters()).device}: {len(lengths)} lengths {lengths[0]}..{lengths[-1]}, "
          f"batch {batch_sizes}, context {args.context_length}", file=sys.stderr)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if loaded.model.device.type == "cpu" and load > (os.cpu_count() or 1):
        # Oversubscribed: torch's threads wait on each other at every op (seen here: 1 s instead of
        # 10 ms per pass with 2 threads at load 8), so unless asked otherwise measure with one.
        if not args.threads and torch.get_num_threads() > 1:
            torch.set_num_threads(1)
            print(f"note: the machine is busy (load {load:.1f} on {os.cpu_count()} cores): measuring with 1 thread "
                  "(pass --threads to choose); timings will be noisy", file=sys.stderr)
        else:
            print(f"note: the machine is busy (load {load:.1f} on {os.cpu_count()} cores): timings will be noisy",
                  file=sys.stderr)
    profile = profile_model(
        loaded, lengths, context_length=args.context_length, batch_sizes=batch_sizes, time_budget_s=args.time_budget,
        cuda_graphs=args.cuda_graphs, progress=not args.no_progress, min_repeats=args.min_repeats,
        max_repeats=args.max_repeats, target_rel_ci=args.target_ci, warmup=args.warmup, seed=args.seed,
        layout=args.layout, matmul_paths=args.matmul_paths, matmul_budget_s=args.matmul_budget,
        matmul_max_rows=args.matmul_max_rows,
    )
    out = Path(args.output) if args.output else Path("profiles") / f"{device_slug(profile)}-{loaded.name}.json"
    try:
        atomic_write_json(out, profile)
        if args.plot:
            from profiler.plot import plot_profile

            plot_profile(profile, args.plot)
    except OSError as e:
        raise UserError(f"{e.filename or out}: cannot write ({e.strerror})") from None
    n, lat = profile["input_lengths"], profile["latency_s"]
    print(f"wrote {out}: L({n[0]}) = {lat[0] * 1e3:.3f} ms, L({n[-1]}) = {lat[-1] * 1e3:.3f} ms, "
          f"{sum(profile['repeats'])} samples in {profile['wall_s']:.1f} s", file=sys.stderr)
    mp = profile.get("matmul_paths")
    if mp:
        kept = [M for M, k in zip(mp["whole_model"]["rows"], mp["whole_model"]["kept"]) if k] if "whole_model" in mp else []
        print(f"matmul paths: own paths at input lengths {kept or 'none'} (F.linear elsewhere), extra weight "
              f"layouts {mp['extra_bytes'] / 2**20:.0f} MiB, chosen in {mp['wall_s']:.1f} s", file=sys.stderr)
    for stop in profile.get("incomplete", []):
        if stop["reason"] == "interrupted":
            print(f"interrupted: kept the points measured so far in {out}", file=sys.stderr)
            raise KeyboardInterrupt
        kept = sum(len(s["input_lengths"]) for s in profile["series"])
        where = "filling the cache" if stop.get("at") == "prefill" else f"at input length {stop['input_length']}"
        raise UserError(
            f"out of memory {where} (batch size {stop['batch_size']}, context {args.context_length}); "
            f"stopped there and kept the {kept} points measured so far in {out}"
        )
    return 0


def _llama(args) -> int:
    """--engine llama.cpp: L(n) of the model's GGUF file for chains (and trees, where the engine scores
    them) at each --context-lengths, every row's logits; profiler/llama_profile.py."""
    from planner.jsonio import atomic_write_json
    from profiler.llama_profile import profile_llama
    from workflows.cli.llama_target import open_llama, refuse_hf_only

    refuse_hf_only(args, {"--device": args.device, "--dtype": args.dtype, "--cuda-graphs": args.cuda_graphs,
                          "--plot": args.plot, "--attention tree": args.attention != "sdpa",
                          "--layout packed": args.layout != "padded", "--batch-sizes": args.batch_size != ["1"]})
    lengths = parse_lengths(args.input_lengths)
    contexts = parse_batch_sizes([args.context_lengths])  # positive integers, order kept
    if max(contexts) > 65536 or (args.time_budget or 0) > 86400:
        raise UserError("--context-lengths: at most 65536; --time-budget: at most 86400 s")
    out = Path(args.output) if args.output else None
    _check_writable("-o", out or Path("profiles") / "x")
    target = open_llama(args.model, args.threads, max(args.n_ctx, max(contexts) + max(lengths) + 1), args.quant,
                        progress=not args.no_progress)
    print(f"profiling {target.name} in llama.cpp ({target.engine.threads} threads): {len(lengths)} lengths "
          f"{lengths[0]}..{lengths[-1]}, contexts {contexts}", file=sys.stderr)
    profile = profile_llama(target.engine, lengths, contexts, args.time_budget or 30.0, args.min_repeats,
                            args.max_repeats, args.target_ci, args.warmup, args.seed, not args.no_progress,
                            target.record())
    out = out or Path("profiles") / f"cpu-llama.cpp-{target.name}.json"
    atomic_write_json(out, profile)
    n, lat = profile["input_lengths"], profile["latency_s"]
    print(f"wrote {out}: L({n[0]}) = {lat[0] * 1e3:.3f} ms, L({n[-1]}) = {lat[-1] * 1e3:.3f} ms "
          f"({profile['shapes'][0]['shape']}, context {profile['context_length']}), {profile['wall_s']:.1f} s",
          file=sys.stderr)
    if profile.get("incomplete"):
        print(f"interrupted: kept the points measured so far in {out}", file=sys.stderr)
        raise KeyboardInterrupt
    return 0


# Options that steer a measurement; a simulated profile has none to steer.
MEASURING_OPTIONS = (("device", None), ("time_budget", None), ("cuda_graphs", False), ("threads", None),
                     ("plot", None), ("attention", "sdpa"), ("layout", "padded"))


def _simulate(args) -> int:
    """`--simulate GPU`: the profile computed by planner.simulate, in the measured profile's schema."""
    from planner.jsonio import atomic_write_json, read_json, writable_target
    from planner.simulate import architecture_from_config, get_gpu, gpu_lines, simulate_profile
    from decoder.engines.hf.load import default_model_spec

    if args.list_gpus:
        print("\n".join(gpu_lines()))
        return 0
    for name, default in MEASURING_OPTIONS:
        if getattr(args, name) != default:
            raise UserError(f"--{name.replace('_', '-')}: not with --simulate (nothing is measured)")
    gpu = get_gpu(args.simulate)
    spec = args.model or default_model_spec()
    name, source, config_file = _config_file(spec)
    arch = architecture_from_config(read_json(config_file), name, str(config_file))
    engine = args.engine or "graphs"
    dtype = args.dtype or "bf16"
    out = Path(args.output) if args.output else Path("profiles") / f"sim-{gpu.name}-{engine}-{name}.json"
    writable_target(out)
    profile = simulate_profile(arch, gpu, dtype, engine, parse_lengths(args.input_lengths), args.context_length,
                               parse_batch_sizes(args.batch_size), model_source=source)
    import datetime

    profile["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    profile["settings"] = {"command": "planner profile " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["profile"]
                                                                    else sys.argv[1:])}
    atomic_write_json(out, profile)
    n, lat = profile["input_lengths"], profile["latency_s"]
    print(f"wrote {out}: SIMULATED {gpu.name} ({engine}, {dtype}), {name}: L({n[0]}) = {lat[0] * 1e3:.3f} ms, "
          f"L({n[-1]}) = {lat[-1] * 1e3:.3f} ms (predicted, not measured)", file=sys.stderr)
    return 0


def _config_file(spec: str) -> tuple[str, str, Path]:
    """(name, source, config.json) of a preset, the built-in model, a model directory or a config file,
    read as JSON only (no transformers: a simulated profile takes well under a second)."""
    from decoder.engines.hf.load import BUILTIN_DIR, PRESET_DIR, preset_names

    if "/" not in spec and (PRESET_DIR / f"{spec}.json").is_file():
        return spec, "preset", PRESET_DIR / f"{spec}.json"
    if spec == "builtin":
        return spec, "dir", BUILTIN_DIR / "config.json"
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: directory has no config.json (expected a Hugging Face model directory)")
        return path.resolve().name, "dir", path / "config.json"
    if path.is_file():
        return (path.resolve().parent.name if path.name == "config.json" else path.stem), "config", path
    if "/" in spec or spec.endswith(".json"):
        raise UserError(f"{spec}: file not found (expected a preset name, a model directory or a config.json)")
    raise UserError(f"unknown model preset '{spec}' (presets: {', '.join(preset_names())}; or pass a model "
                    "directory or config.json)")
