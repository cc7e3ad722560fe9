"""`planner profile`: measure forward latency versus input length and write a profile JSON.

Light imports only at top level: torch and transformers load inside run().
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

from planner.errors import UserError
from profiler.lengths import DEFAULT_LENGTHS_SPEC, parse_lengths
from workflows.cli.engines import add_engine_argument


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


BATCH_SIZES_DEFAULT = ["1"]  # by identity: --engine vllm has its own default when none is given


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
    p.add_argument("--context-lengths", default=None, metavar="C,C,...",
                   help="several context lengths to time at; the first is the profile's (default: --context-length, "
                        "or the engine's own: 256 for hf, 128,512 for llama.cpp)")
    p.add_argument("--quant", default=None, choices=["Q4_K", "Q4_0", "Q4_1"],
                   help="--engine llama.cpp with a preset: the 4-bit type of its random-filled GGUF (default Q4_K)")
    p.add_argument("--remove-cached", action="store_true",
                   help="delete the random-filled GGUF files of --model (every preset without --model) and exit")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"],
                   help="default: bf16 (fp16 without bf16 support) on GPU, fp32 on CPU")
    p.add_argument("--context-length", type=_positive(int), default=256,
                   help="tokens already in the KV cache (default 256; the llama.cpp engine's own default is 128,512)")
    p.add_argument("--input-lengths", default=DEFAULT_LENGTHS_SPEC,
                   help="N, START:STOP or START:STOP:STEP (STOP inclusive), comma-separated "
                        f"(default {DEFAULT_LENGTHS_SPEC})")
    p.add_argument("--batch-sizes", "--batch-size", dest="batch_size", nargs="+", default=BATCH_SIZES_DEFAULT,
                   help="one or more batch sizes, e.g. 1,2,4,8 or 1 4 (default 1; 1,2,4,8,16 with --engine vllm)")
    p.add_argument("--time-budget", type=_positive(float), default=None,
                   help="seconds of measuring in total (default 15 on CPU, 120 on GPU, 30 with --engine llama.cpp)")
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
    p.add_argument("--matmul-paths", default=None, choices=["auto", "off"],
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
    p.add_argument("--temperature", type=float, default=0.0,
                   help="--engine vllm: the decoding steps' sampling, as the served requests will use (a sampled "
                        "step verifies drafts under it, more work than greedy; default 0, greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="--engine vllm: with --temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="--engine vllm: with --temperature (default 0, off)")
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


def _select_path(engine, attention: str) -> None:
    """The attention path to time: tree is the decoder's tree kernels (Triton on CUDA), as decoding
    runs them when switched on; sdpa the dense mask."""
    if attention == "sdpa":
        return
    try:
        engine.select_attention("kernels")
    except UserError as e:
        raise UserError(f"--attention {attention}: {str(e).split(': ', 1)[-1]}; profile with --attention sdpa") from None


def run(args) -> int:
    from decoder.engines.models import default_model_spec, preset_names

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
        if args.engine not in (None, "graphs", "eager"):
            raise UserError(f"--engine {args.engine}: not with --simulate (there: graphs or eager)")
        return _simulate(args)
    if args.engine in ("graphs", "eager"):
        raise UserError(f"--engine {args.engine}: only with --simulate GPU (a measured profile times what this machine runs)")
    from workflows.cli.engines import engine_kind, refuse_options

    spec = engine_kind(args)
    refuse_options(spec, _given(args))
    from planner.engines import SERVING, STEP

    return {STEP: _stepped, SERVING: _serving}[spec.protocol](args, spec)


def _stepped(args, spec) -> int:
    """A step engine's L(n), timed in this process through its forward timer."""
    from decoder.engines.models import default_model_spec

    for name, default in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0)):
        if getattr(args, name) != default:
            raise UserError(f"--{name.replace('_', '-')}: only with --engine vllm (a forward's time here does not "
                            "depend on the sampling)")
    profile_spec, out = _spec(args, spec), _output(args)
    for opt, path in (("-o", out), ("--plot", args.plot)):
        _check_writable(opt, Path(path) if path else Path("profiles") / "x")
    if args.cuda_graphs and args.device == "cpu":
        raise UserError("--cuda-graphs: needs a CUDA device, but --device is cpu")
    return _measure(args, spec, profile_spec, out, args.model or default_model_spec())


def _given(args) -> dict[str, bool]:
    """The options set away from their defaults, by the names an engine kind refuses them under."""
    return {"--device": args.device is not None, "--dtype": args.dtype is not None, "--cuda-graphs": args.cuda_graphs,
            "--plot": args.plot is not None, "--attention tree": args.attention != "sdpa",
            "--layout packed": args.layout != "padded", "--batch-sizes": args.batch_size != ["1"],
            "--matmul-paths": args.matmul_paths is not None, "--quant": args.quant is not None,
            "--n-ctx": args.n_ctx is not None}


def _spec(args, spec):
    """What to measure, from the flags and the engine's own defaults."""
    from profiler.measure import ProfileSpec

    lengths = parse_lengths(args.input_lengths)
    if args.context_lengths:
        contexts = tuple(parse_batch_sizes([args.context_lengths]))  # positive integers, order kept
    elif args.context_length != 256:
        contexts = (args.context_length,)
    else:
        contexts = spec.defaults.profile_context_lengths
    if max(contexts) > 65536 or (args.time_budget or 0) > 86400:
        raise UserError("--context-lengths: at most 65536; --time-budget: at most 86400 s")
    if args.matmul_max_rows > 1024 or (args.matmul_budget or 0) > 86400:
        raise UserError("--matmul-max-rows: at most 1024; --matmul-budget: at most 86400 s")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise UserError(f"--plot: expected a .png file name, got '{args.plot}'")
    return ProfileSpec(tuple(lengths), contexts, tuple(parse_batch_sizes(args.batch_size)),
                       args.time_budget or spec.defaults.profile_time_budget_s, args.layout, args.cuda_graphs,
                       args.min_repeats, args.max_repeats, args.target_ci, args.warmup, args.seed,
                       matmul_paths=args.matmul_paths or "auto", matmul_budget_s=args.matmul_budget,
                       matmul_max_rows=args.matmul_max_rows, progress=not args.no_progress)


def _output(args) -> Path | None:
    return Path(args.output) if args.output else None


def _measure(args, spec, profile_spec, out: Path | None, model: str) -> int:
    from planner.engines import DEFAULT
    from profiler.measure import check_spec, profile_engine
    from workflows.cli.engines import open_from_args

    need = max(profile_spec.context_lengths) + max(profile_spec.input_lengths) + 1
    notes: list[str] = []
    engine = open_from_args(args, spec, context=need, weights=False, busy=True, say=notes.append)
    _select_path(engine, args.attention)
    check_spec(engine, profile_spec)  # a refusal before any note: one line
    for line in notes:
        print(line, file=sys.stderr)
    r = engine.record()
    print(f"profiling {r['model']} ({r.get('model_source')}, {'weights' if r.get('has_weights') else 'random weights'}) "
          f"with the {spec.name} engine on {engine.device} ({engine.caps.threads or 'default'} threads): "
          f"{len(profile_spec.input_lengths)} lengths {min(profile_spec.input_lengths)}..{max(profile_spec.input_lengths)}, "
          f"batch {list(profile_spec.batch_sizes)}, context {', '.join(map(str, profile_spec.context_lengths))}",
          file=sys.stderr)
    profile = profile_engine(engine, profile_spec)
    tag = "" if spec.name == DEFAULT else f"-{spec.name}"
    out = out or Path("profiles") / f"{device_slug(profile)}{tag}-{r['model']}.json"
    _write(profile, out, args.plot)
    _report(profile, out)
    return 0


def _write(profile: dict, out: Path, plot: str | None) -> None:
    """The profile (atomically) and its plot; a failed write is one line."""
    from planner.jsonio import atomic_write_json

    try:
        atomic_write_json(out, profile)
        if plot:
            from profiler.plot import plot_profile

            plot_profile(profile, plot)
    except OSError as e:
        raise UserError(f"{e.filename or out}: cannot write ({e.strerror})") from None


# Options a serving engine's step profile has no use for: (attribute, default, why).
SERVING_UNUSED = (("dtype", None, "it runs fp32, as the server and the race do"),
                  ("threads", None, "vLLM binds its own threads"),
                  ("layout", "padded", "vLLM batches sequences itself"),
                  ("warmup", 1, "the first 2 counted steps of each point are dropped"),
                  ("max_repeats", 50, "each point has --min-repeats repeats"), ("target_ci", 0.02, "same"),
                  ("matmul_budget", None, "the CPU matmul paths are the hf engine's"),
                  ("matmul_max_rows", 16, "the CPU matmul paths are the hf engine's"),
                  ("cuda_graphs", False, "vLLM's CPU build runs on the CPU here"))


def _serving(args, spec) -> int:
    """A serving engine: its own step time per batch size and draft length, measured in its own
    environment (profiler/vllm_profile.py); --input-lengths are 1 + K."""
    from profiler.vllm_profile import ServingProfileSpec, check_spec, profile_serving, table_lines
    from workflows.cli.engines import open_from_args

    for name, default, why in SERVING_UNUSED:
        if getattr(args, name) != default:
            raise UserError(f"--{name.replace('_', '-')}: not with --engine {spec.name} ({why})")
    contexts = parse_batch_sizes([args.context_lengths]) if args.context_lengths else [args.context_length]
    if len(contexts) > 1:
        raise UserError(f"--context-lengths: one with --engine {spec.name} (each context needs its own engines)")
    defaults = ServingProfileSpec()
    ks = (defaults.draft_lengths if args.input_lengths == DEFAULT_LENGTHS_SPEC
          else tuple(n - 1 for n in parse_lengths(args.input_lengths)))
    sizes = defaults.batch_sizes if args.batch_size is BATCH_SIZES_DEFAULT else tuple(parse_batch_sizes(args.batch_size))
    pspec = ServingProfileSpec(ks, sizes, contexts[0], args.time_budget or defaults.time_budget_s,
                               repeats=args.min_repeats, seed=args.seed, progress=not args.no_progress,
                               temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    check_spec(pspec)
    engine = open_from_args(args, spec, server_ok=True)
    if pspec.temperature > 0:  # sampled verification is right on vLLM's CPU build only with the plugin's fix
        from workflows.mainjob.serving_plan import plugin_on

        pspec = dataclasses.replace(pspec, plugin=plugin_on(engine, None, lambda line: None))
    out = _output(args) or Path("profiles") / f"cpu-{spec.name}-{engine.model_name}.json"
    for opt, path in (("-o", out), ("--plot", args.plot)):
        _check_writable(opt, Path(path) if path else out)
    profile = profile_serving(engine, pspec)
    _write(profile, out, args.plot)
    print("\n".join(table_lines(profile)), file=sys.stderr)
    stops = profile.get("incomplete", [])
    cut = sum(s["reason"] == "time budget" for s in stops)
    print(f"wrote {out}: {len(profile['points'])} points in {profile['wall_s']:.0f} s"
          + (f"; the time budget left {cut} out (its 'incomplete' lists them)" if cut else ""), file=sys.stderr)
    if any(s["reason"] == "interrupted" for s in stops):
        print(f"interrupted: kept the points measured so far in {out}", file=sys.stderr)
        raise KeyboardInterrupt
    failed = [s for s in stops if s["reason"] == "worker failed"]
    if failed:
        raise UserError(f"vLLM {failed[0]['engine']} worker {failed[0]['error']}; stopped there and kept the "
                        f"{len(profile['points'])} points measured so far in {out}")
    return 0


def _report(profile: dict, out: Path) -> None:
    n, lat = profile["input_lengths"], profile["latency_s"]
    print(f"wrote {out}: L({n[0]}) = {lat[0] * 1e3:.3f} ms, L({n[-1]}) = {lat[-1] * 1e3:.3f} ms "
          f"({profile['shape']}, context {profile['context_length']}), {sum(profile['repeats'])} samples in "
          f"{profile['wall_s']:.1f} s", file=sys.stderr)
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
            f"out of memory {where} (batch size {stop['batch_size']}, context {profile['context_length']}); "
            f"stopped there and kept the {kept} points measured so far in {out}"
        )


# Options that steer a measurement; a simulated profile has none to steer.
MEASURING_OPTIONS = (("device", None), ("time_budget", None), ("cuda_graphs", False), ("threads", None),
                     ("plot", None), ("attention", "sdpa"), ("layout", "padded"), ("matmul_paths", None))


def _simulate(args) -> int:
    """`--simulate GPU`: the profile computed by planner.simulate, in the measured profile's schema."""
    from decoder.engines.models import default_model_spec
    from planner.jsonio import atomic_write_json, read_json, writable_target
    from planner.simulate import architecture_from_config, get_gpu, gpu_lines, simulate_profile

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
    from decoder.engines.models import BUILTIN_DIR, PRESET_DIR, preset_names

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
