"""`planner export --engine ENGINE PLAN -o FILE`: a plan -> a serving engine's speculative-decoding settings."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

DESCRIPTION = """\
Turn a plan (a tree file from `planner plan`, with a batch-size schedule when planned with
--batch-sizes) into a serving engine's speculative-decoding settings: the closest setting the
engine can express, one note per thing it cannot (on stderr and in the output), and the
measured basis beside it.

engines:
  vllm    --speculative-config JSON: num_speculative_tokens and, per batch-size range,
          num_speculative_tokens_per_batch_size [[first, last, K], ...] (K = 0: off). vLLM
          verifies chains only: K is the best chain per range, planned as a chain.
  sglang  --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens,
          and per batch size (EAGLE, EAGLE3) --speculative-adaptive with a config file keyed by
          the lowest batch size of each range, written next to FILE as STEM.adaptive.json.
  trtllm  speculative_config: max_draft_len, max_total_draft_tokens, draft_len_schedule keyed
          by the highest batch size of each range, or one EAGLE-2 dynamic tree. FILE.yaml:
          the engine-ready YAML for --extra_llm_api_options (notes and basis as comments).
  hf      transformers assisted generation (batch size 1): num_assistant_tokens with the
          "constant" schedule, or prompt lookup (prompt_lookup_num_tokens).

Draft lengths are planned as chains per batch size with the acceptance statistics and the
latency profile the plan was made with (its provenance; unchanged files only) or --accept /
--profile; without them, the plan's tree depths are written, with a note.
Output (except trtllm YAML): {"format": "tree-planner/export", "engine", the engine's objects
("speculative_config", "server_args" + "adaptive_config", "generation_config"),
"command_line", "notes", "basis"}.
"""

EPILOG = """\
examples:
  planner export --engine vllm trees/medusa-batched.json --method eagle3 --draft-model yuhuili/EAGLE3-LLaMA3.1-Instruct-8B -o exports/vllm.json
  planner export --engine sglang trees/medusa-batched.json --method eagle --draft-model DRAFT -o exports/sglang.json
  planner export --engine trtllm trees/medusa-batched.json --method eagle3 --draft-model DRAFT -o exports/trtllm.yaml
  planner export --engine hf trees/medusa-vicuna-7b-n63.json --method ngram --ngram-max 3 -o exports/hf.json
"""


def add_arguments(p) -> None:
    import argparse

    p.description = DESCRIPTION
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("plan", metavar="PLAN", nargs="?", help="tree file written by `planner plan`")
    p.add_argument("--plan", dest="plan_opt", metavar="PLAN", help="the same as the positional PLAN")
    p.add_argument("--engine", metavar="ENGINE", help="vllm, sglang, trtllm, hf or llama-server")
    p.add_argument("-o", "--output", metavar="FILE", help="where to write (atomically; required except for llama-server, "
                                                         "which prints its command line)")
    p.add_argument("--model-file", metavar="GGUF", help="llama-server: the model (default: the plan's, else SmolLM2's GGUF)")
    p.add_argument("--threads", type=int, default=None, help="llama-server: threads (default: the plan's, else the cores)")
    p.add_argument("--draft-p-min", type=float, default=None, help="llama-server with a draft model: --spec-draft-p-min")
    p.add_argument("--method", metavar="NAME",
                   help="the engine's drafter: ngram, medusa, eagle, eagle3, draft_model, mtp, mlp_speculator, suffix "
                        "(what the engine offers; default: medusa for medusa plans, draft_model for sequoia plans "
                        "and hf)")
    p.add_argument("--draft-model", metavar="PATH", help="the drafter's weights (medusa, eagle, eagle3, draft_model)")
    p.add_argument("--accept", metavar="FILE[:NAME]", help="acceptance statistics for the chains (default: the plan's)")
    p.add_argument("--profile", metavar="FILE",
                   help="latency profile with a series per planned batch size (default: the plan's)")
    p.add_argument("--max-batch-size", type=int, default=None, metavar="N",
                   help="the last range reaches up to N (default 4096)")
    p.add_argument("--ngram-min", type=int, default=None, metavar="N", help="ngram: shortest n-gram matched (vllm)")
    p.add_argument("--ngram-max", type=int, default=None, metavar="N",
                   help="ngram: longest n-gram matched (vllm prompt_lookup_max, hf max_matching_ngram_size)")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr (notes are still printed)")


def run(args) -> int:
    from planner.errors import UserError
    from planner.export import DEFAULT_MAX_BATCH_SIZE, ExportOptions, basis, build, check_engine, resolve_method
    from planner.jsonio import writable_target
    from planner.tree import load_tree

    if args.plan_opt and args.plan and args.plan_opt != args.plan:
        raise UserError("PLAN: give it once (positional or --plan)")
    args.plan = args.plan or args.plan_opt
    if args.plan is None:
        raise UserError("PLAN is required: a tree file from `planner plan` or autotune (positional or --plan)")
    if args.engine == "llama-server":
        return _llama_server(args)
    if args.engine is None:
        raise UserError("--engine is required: one of vllm, sglang, trtllm, hf, llama-server")
    if args.output is None:
        raise UserError(f"-o FILE is required for --engine {args.engine}")
    engine = check_engine(args.engine)
    _check_numbers(args)
    out = writable_target(args.output)
    yaml_out = engine == "trtllm" and out.suffix in (".yaml", ".yml")
    adaptive_path = out.with_name(out.stem + ".adaptive.json")
    if engine == "sglang":
        writable_target(adaptive_path)
    plan = load_tree(args.plan)
    method = resolve_method(engine, plan.method, args.method, args.draft_model)
    max_b = args.max_batch_size or DEFAULT_MAX_BATCH_SIZE
    notes: list[str] = []
    ranges, chains, sources = _draft_ranges(args, plan, engine, max_b, notes)
    opts = ExportOptions(engine, method, args.draft_model, args.ngram_min, args.ngram_max, str(adaptive_path),
                         str(out) if yaml_out else None, chains_planned=chains is not None)
    result = build(plan, ranges, opts, basis(plan, str(args.plan), ranges, chains, sources), notes)
    written = _write(result, out, yaml_out, adaptive_path)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if not args.quiet:
        ks = ", ".join(f"{r.lo}-{r.hi}: {r.k}" for r in ranges)
        print(f"wrote {', '.join(written)} ({engine}, {method}); draft length by batch size {ks}", file=sys.stderr)
    return 0


def _llama_server(args) -> int:
    """The llama-server command line the plan maps to (planner/export_llama.py), printed; -o also writes it."""
    from decoder.llama_engine import check_threads
    from planner.export_llama import llama_server_export
    from planner.jsonio import atomic_write_json, writable_target
    from planner.tree import load_tree

    out = writable_target(args.output) if args.output else None
    plan = load_tree(args.plan)
    model = args.model_file or _plan_model_file(plan)
    threads = check_threads(args.threads or _plan_threads(plan))
    result = llama_server_export(plan, model, threads, draft_model=args.draft_model, draft_p_min=args.draft_p_min)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(result.command_line)
    if out is not None:
        atomic_write_json(out, result.to_json())
        if not args.quiet:
            print(f"wrote {out}", file=sys.stderr)
    return 0


def _plan_profile(plan) -> dict:
    from planner.jsonio import read_json

    rec = plan.provenance.get("profile")
    path = rec.get("file") if isinstance(rec, dict) else rec
    try:
        return read_json(path) if isinstance(path, str) and Path(path).is_file() else {}
    except Exception:  # noqa: BLE001 (an unreadable profile only loses the defaults)
        return {}


def _plan_model_file(plan) -> str:
    found = _plan_profile(plan).get("model_file")
    if isinstance(found, str):
        return found
    from profiler.registry import gguf_file

    return str(gguf_file("smollm2-135m"))


def _plan_threads(plan) -> int | None:
    t = _plan_profile(plan).get("threads")
    return t if isinstance(t, int) else None


def _check_numbers(args) -> None:
    from planner.errors import UserError
    from planner.tree import MAX_BATCH_SIZE

    for name in ("max_batch_size", "ngram_min", "ngram_max"):
        v = getattr(args, name)
        if v is not None and not 1 <= v <= MAX_BATCH_SIZE:
            raise UserError(f"--{name.replace('_', '-')} must be in 1..{MAX_BATCH_SIZE}, got {v}")
    if args.ngram_min is not None and args.ngram_max is not None and args.ngram_min > args.ngram_max:
        raise UserError(f"--ngram-min {args.ngram_min} is above --ngram-max {args.ngram_max}")


def _draft_ranges(args, plan, engine: str, max_b: int, notes: list[str]):
    """Chains planned per batch size when acceptance and profile are at hand, else tree depths."""
    from planner.batch import ContextCost, plan_chain_schedule
    from planner.export import ranges_from_depths, ranges_from_schedule

    accept, profiles, sources = _inputs(args, plan, notes)
    if accept is None or profiles is None:
        return ranges_from_depths(plan, max_b), None, sources
    sizes = [1] if engine == "hf" else _planned_sizes(plan)
    layout = (plan.schedule[0].layout if plan.schedule else None) or "packed"
    context = ContextCost(plan.settings.get("kv_latency_s", 0.0), plan.settings.get("new_tokens", 128))
    chains = plan_chain_schedule(accept, profiles, sizes, _guessing(plan, accept), layout, context)
    return ranges_from_schedule(chains, max_b), chains, sources


def _planned_sizes(plan) -> list[int]:
    if not plan.schedule:
        return [1]
    return [p["batch_size"] for e in plan.schedule for p in (e.points or [{"batch_size": e.batch_sizes[0]}])]


def _guessing(plan, accept):
    from planner.cost import Guessing, default_guessing

    recorded = plan.settings.get("guessing")
    if isinstance(recorded, dict):
        keys = ("prompt_tokens", "ensemble", "draft_s", "draft_passes")
        return Guessing(**{k: recorded[k] for k in keys if k in recorded})
    return default_guessing(plan.method, accept)


def _inputs(args, plan, notes: list[str]):
    """(acceptance, profiles by batch size, their sources): the options', else the plan's own
    files when they are unchanged (same sha256); (None, None, ...) with a note otherwise."""
    from planner.accept import load_acceptance
    from planner.profile import load_batch_profiles

    acc_spec = args.accept or _recorded(plan, "acceptance", notes)
    prof_path = args.profile or _recorded(plan, "profile", notes)
    if acc_spec is None or prof_path is None:
        notes.append("draft lengths are the plan's tree depths, not planned as chains (give --accept and --profile "
                     "to plan them)")
        return None, None, {"acceptance": plan.provenance.get("acceptance"), "profile": plan.provenance.get("profile")}
    accept = load_acceptance(acc_spec)
    profiles = load_batch_profiles(prof_path)
    src = next(iter(profiles.values())).source
    record = {k: src[k] for k in ("file", "sha256")}
    if isinstance(src.get("simulated"), dict):
        record["simulated"] = {k: src["simulated"].get(k) for k in ("gpu", "engine", "dtype")}
    return accept, profiles, {"acceptance": dict(accept.source), "profile": record,
                              "profile_batch_sizes": sorted(profiles)}


def _recorded(plan, kind: str, notes: list[str]) -> str | None:
    rec = plan.provenance.get(kind) or {}
    path = rec.get("file")
    if not path:
        notes.append(f"the plan records no {kind} file")
        return None
    if not Path(path).is_file():
        notes.append(f"the plan's {kind} file {path} is not there")
        return None
    if rec.get("sha256") and hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] != rec["sha256"]:
        notes.append(f"the plan's {kind} file {path} changed since planning (sha256 differs)")
        return None
    return f"{path}:{rec['name']}" if kind == "acceptance" and rec.get("name") else path


def _write(result, out: Path, yaml_out: bool, adaptive_path: Path) -> list[str]:
    from planner.export import basis_lines, to_yaml
    from planner.jsonio import atomic_write_bytes, atomic_write_json

    written = []
    adaptive = result.settings.get("adaptive_config")
    if adaptive is not None:  # first: the main file names it
        atomic_write_json(adaptive_path, adaptive)
        written.append(str(adaptive_path))
    if yaml_out:
        header = [f"planner export for TensorRT-LLM: pass this file as {result.command_line}"]
        comments = header + [f"note: {n}" for n in result.notes] + basis_lines(result.basis)
        atomic_write_bytes(out, to_yaml({"speculative_config": result.settings["speculative_config"]}, comments).encode())
    else:
        atomic_write_json(out, result.to_json())
    written.insert(0, str(out))
    return written
