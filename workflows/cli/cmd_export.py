"""`planner export --engine ENGINE PLAN -o FILE`: a plan -> a serving engine's speculative-decoding settings."""
from __future__ import annotations

import argparse
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
          verifies chains only: K is the best chain per range, planned as a chain. Prompt-lookup
          plans set ngram's prompt_lookup_min/max or suffix decoding's thresholds from the plan's
          measurements; --race times the candidates in vLLM itself (docs/vllm.md). A config with a
          K = 0 range, or a schedule for suffix / medusa, needs the project's vLLM plugin
          (vllm_plugin/): "env" then holds its switch, TREE_PLANNER_VLLM_PLUGIN=1, and the command
          line starts with it; --plugin off writes what stock vLLM runs instead.
  sglang  --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens,
          and per batch size (EAGLE, EAGLE3) --speculative-adaptive with a config file keyed by
          the lowest batch size of each range, written next to FILE as STEM.adaptive.json.
  trtllm  speculative_config: max_draft_len, max_total_draft_tokens, draft_len_schedule keyed
          by the highest batch size of each range, or one EAGLE-2 dynamic tree. FILE.yaml:
          the engine-ready YAML for --extra_llm_api_options (notes and basis as comments).
  hf      transformers assisted generation (batch size 1): num_assistant_tokens with the
          "constant" schedule, or prompt lookup (prompt_lookup_num_tokens).

--method defaults to what the plan's recorded guesser implies: prompt lookup (alone or in a
hybrid) -> ngram, or for vLLM suffix decoding when the plan chooses its tree per step; a draft LM
or PEARL -> draft_model; medusa plans -> medusa, sequoia -> draft_model.
Draft lengths are planned as chains per batch size with the acceptance statistics and the
latency profile the plan was made with (its provenance; unchanged files only) or --accept /
--profile; without them, the plan's tree depths are written, with a note.
Output (except trtllm YAML): {"format": "tree-planner/export", "engine", the engine's objects
("speculative_config" and, where the plugin is needed, "env"; "server_args" + "adaptive_config";
"generation_config"), "command_line", "notes", "basis"}.
"""

EPILOG = """\
examples:
  planner export --engine vllm trees/medusa-batched.json --method eagle3 --draft-model yuhuili/EAGLE3-LLaMA3.1-Instruct-8B -o exports/vllm.json
  planner export --engine sglang trees/medusa-batched.json --method eagle --draft-model DRAFT -o exports/sglang.json
  planner export --engine trtllm trees/medusa-batched.json --method eagle3 --draft-model DRAFT -o exports/trtllm.yaml
  planner export --engine hf trees/medusa-vicuna-7b-n63.json --method ngram --ngram-max 3 -o exports/hf.json
  planner export --engine vllm runs/RUN/chosen.json --race -o exports/vllm.json   # the main job's decision
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
                   help="the engine's drafter: ngram, suffix, medusa, eagle, eagle3, draft_model, mtp "
                        "(what the engine offers; default: medusa for medusa plans, draft_model for sequoia plans "
                        "and hf)")
    p.add_argument("--draft-model", metavar="PATH", help="the drafter's weights (medusa, eagle, eagle3, draft_model)")
    p.add_argument("--drafter", metavar="DIR",
                   help="a head in its released folder (EAGLE-1, EAGLE-3, Medusa): without PLAN, its settings are planned "
                        "from its acceptance (--accept, default DIR/accept_heldout.json) and --profile: vLLM's chain per "
                        "batch size, SGLang's grown tree, TensorRT-LLM's eagle_choices or dynamic tree; with PLAN, the "
                        "method and --draft-model it implies")
    p.add_argument("--draft-ms", type=float, default=None,
                   help="--drafter: a head pass's cost in ms (default: the acceptance record's draft_s, which "
                        "`planner accept --drafter DIR` measures)")
    p.add_argument("--accept", metavar="FILE[:NAME]", help="acceptance statistics for the chains (default: the plan's)")
    p.add_argument("--profile", metavar="FILE",
                   help="latency profile with a series per planned batch size (default: the plan's)")
    p.add_argument("--max-batch-size", type=int, default=None, metavar="N",
                   help="the last range reaches up to N (default 4096)")
    p.add_argument("--ngram-min", type=int, default=None, metavar="N", help="ngram: shortest n-gram matched (vllm)")
    p.add_argument("--ngram-max", type=int, default=None, metavar="N",
                   help="ngram: longest n-gram matched (vllm prompt_lookup_max, hf max_matching_ngram_size)")
    p.add_argument("--plugin", choices=["on", "off"], default="on",
                   help="vllm: serve with the project's vLLM plugin where the config needs it (default on: a K = 0 "
                        "range is vLLM's plain path, suffix and medusa take a schedule); off: stock vLLM")
    p.add_argument("--race", action="store_true",
                   help="vllm: time the planned config, its other lookup method and vLLM's own ngram and suffix "
                        "settings in vLLM (scripts/setup_vllm.sh) on the race prompts and write the fastest")
    p.add_argument("--race-prompts", type=int, default=6, metavar="N", help="race prompts (default 6, at most 40)")
    p.add_argument("--race-tokens", type=int, default=64, metavar="N", help="new tokens per race prompt (default 64)")
    p.add_argument("--model", default="smollm2-135m", help="--race: the target model (a name or a folder)")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr (notes are still printed)")


def run(args) -> int:
    from planner.errors import UserError
    from planner.export import DEFAULT_MAX_BATCH_SIZE, ExportOptions, basis, build, check_engine, resolve_method
    from planner.jsonio import writable_target
    from planner.tree import load_tree

    if args.plan_opt and args.plan and args.plan_opt != args.plan:
        raise UserError("PLAN: give it once (positional or --plan)")
    plan_path = args.plan or args.plan_opt
    if plan_path is None and args.drafter is not None:
        return _head_export(args)
    if plan_path is None:
        raise UserError("PLAN is required: a tree file from `planner plan` or autotune (positional or --plan)")
    if args.drafter is not None:  # the head as the plan's drafter: its engine method and folder
        from decoder.guessers.heads import serving_method

        method_given, folder = args.method, args.drafter
        args = argparse.Namespace(**{**vars(args), "method": method_given or serving_method(folder),
                                     "draft_model": args.draft_model or folder})
    if args.engine == "llama-server":
        return _llama_server(args, plan_path)
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
    plan = load_tree(plan_path)
    method = resolve_method(engine, plan, args.method, args.draft_model)
    max_b = args.max_batch_size or DEFAULT_MAX_BATCH_SIZE
    notes: list[str] = _hybrid_notes(plan, engine, method) if args.method is None else []
    ranges, chains, accept, profiles, sources = _draft_ranges(args, plan, plan_path, engine, method, max_b, notes)
    lookup = _lookup(plan, engine, method, ranges, accept, profiles, notes)
    draft_model = _draft_folder(args.draft_model, plan, method, out, notes)
    opts = ExportOptions(engine, method, draft_model, args.ngram_min, args.ngram_max, str(adaptive_path),
                         str(out) if yaml_out else None, chains_planned=chains is not None, lookup=lookup,
                         plugin=args.plugin == "on")
    result = build(plan, ranges, opts, basis(plan, str(plan_path), ranges, chains, sources), notes)
    if args.race:
        _race(args, plan, ranges, accept, profiles, opts, result)
    written = _write(result, out, yaml_out, adaptive_path)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if not args.quiet:
        cfg = result.settings.get("speculative_config") or {}
        sched = cfg.get("num_speculative_tokens_per_batch_size") or ([[1, ranges[-1].hi, cfg["num_speculative_tokens"]]]
                                                                     if "num_speculative_tokens" in cfg else None)
        ks = ", ".join(f"{lo}-{hi}: {k}" for lo, hi, k in sched) if sched else \
            ", ".join(f"{r.lo}-{r.hi}: {r.k}" for r in ranges)
        print(f"wrote {', '.join(written)} ({engine}, {method}); draft length by batch size {ks}", file=sys.stderr)
    return 0


def _head_export(args) -> int:
    """--drafter DIR without a plan: the head's settings planned from its acceptance and a profile
    (planner/export_heads.py), written as the other exports are."""
    from decoder.guessers.heads import serving_method
    from planner.accept import load_acceptance
    from planner.errors import UserError
    from planner.export import DEFAULT_MAX_BATCH_SIZE, check_engine
    from planner.export_heads import head_basis, head_export
    from planner.jsonio import read_json, writable_target
    from planner.profile import load_batch_profiles

    if args.output is None:
        raise UserError(f"-o FILE is required for --engine {args.engine}")
    if args.profile is None:
        raise UserError("--drafter without PLAN plans from a latency profile: give --profile FILE (`planner profile`, "
                        "with --batch-sizes for a draft length per batch size)")
    engine = check_engine(args.engine)
    out = writable_target(args.output)
    method = args.method or serving_method(args.drafter)
    accept_file = args.accept or str(Path(args.drafter) / "accept_heldout.json")
    accept = load_acceptance(accept_file)
    draft_s = args.draft_ms / 1e3 if args.draft_ms is not None else _draft_s(read_json(accept_file.split(":")[0]), accept_file)
    profiles = load_batch_profiles(args.profile)
    result = head_export(engine, method, args.drafter, accept, profiles, draft_s,
                         args.max_batch_size or DEFAULT_MAX_BATCH_SIZE, args.plugin == "on")
    result.basis = head_basis(accept_file, args.profile, accept, profiles, draft_s)
    yaml_out = engine == "trtllm" and out.suffix in (".yaml", ".yml")
    written = _write(result, out, yaml_out, out.with_name(out.stem + ".adaptive.json"))
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if not args.quiet:
        print(f"wrote {', '.join(written)} ({engine}, {method}, head {args.drafter})", file=sys.stderr)
    return 0


def _draft_s(record: dict, label: str) -> float:
    from planner.errors import UserError

    g = record.get("guesser") if isinstance(record, dict) else None
    s = g.get("draft_s") if isinstance(g, dict) else None
    if not isinstance(s, (int, float)) or s < 0:
        raise UserError(f"{label}: no 'guesser.draft_s' (a head pass's cost): measure it with `planner accept --drafter "
                        "DIR` or give --draft-ms")
    return float(s)


def _race(args, plan, ranges, accept, profiles, opts, result) -> None:
    """--race: the candidates in vLLM itself, one engine each, on the race prompts; the fastest
    (token-identical to vLLM plain) replaces the planned config, with the measurements as notes."""
    import dataclasses

    from planner.errors import UserError
    from planner.export import TARGETS, build
    from planner.vllm_plugin import vllm_serving
    from workflows.export.vllm import RACE_DEFAULTS, race, race_prompts

    if not TARGETS[opts.engine].runs_here:
        raise UserError("--race times configs in vLLM: it needs --engine vllm")
    planned = {f"planned ({opts.method})": result.settings["speculative_config"]}
    if opts.method in LOOKUP_METHODS:  # the other lookup method, planned the same way
        other = next(m for m in LOOKUP_METHODS if m != opts.method)
        o = dataclasses.replace(opts, method=other, lookup=_lookup(plan, "vllm", other, ranges, accept, profiles, []))
        planned[f"planned ({other})"] = build(plan, ranges, o, {}, []).settings["speculative_config"]
    candidates = {"vLLM plain": None, **planned, **RACE_DEFAULTS}
    model, prompts, warmup = race_prompts(args.model, args.race_prompts)
    measured = race(model, candidates, prompts, warmup, args.race_tokens, plugin=opts.plugin)
    ok = {k: v for k, v in measured.items() if "error" not in v and v["identical"]}
    if "vLLM plain" not in ok:
        raise UserError(f"--race: vLLM plain decoding did not run: {measured['vLLM plain'].get('error', 'no result')}")
    best = max(ok, key=lambda k: ok[k]["tokens_per_s"])
    table = "; ".join(f"{k} {v['tokens_per_s']:.1f} tokens/s" if "error" not in v else f"{k} failed ({v['error']})"
                      for k, v in measured.items())
    if best == "vLLM plain":
        raise UserError(f"--race: vLLM plain decoding was fastest on {len(prompts)} race prompts ({table}): "
                        "no speculative config to write")
    cfg = candidates[best]
    planned_notes = vllm_serving(result.settings["speculative_config"], opts.plugin)[2]
    env, result.command_line, serve_notes = vllm_serving(cfg, opts.plugin)
    result.settings = {"speculative_config": cfg, **({"env": env} if env else {})}
    result.notes = [n for n in result.notes if n not in planned_notes] + serve_notes
    result.notes.append(f"raced in vLLM on {len(prompts)} race prompts x {args.race_tokens} tokens: {table}; "
                        f"wrote the fastest, {best}")
    result.basis["race"] = {"prompts": len(prompts), "tokens": args.race_tokens, "chosen": best,
                            "candidates": {k: candidates[k] for k in measured}, "measured": measured}


def _hybrid_notes(plan, engine: str, method: str) -> list[str]:
    """What the implied method leaves out of a plan (a hybrid's drafter, a per-step tree)."""
    from planner.export import plan_guesser

    guesser = plan_guesser(plan) or ""
    notes = []
    if "+" in guesser and method in LOOKUP_METHODS:
        notes.append(f"{guesser.split('+')[1]} drafter of the {guesser} plan dropped: {engine} runs one drafting "
                     "method and cannot load this project's drafter; wrote the prompt-lookup half")
    if plan.method == "dynamic":
        how = ("suffix decoding drafts as far as its match is likely, a per-step length"
               if method == "suffix" else "the draft length is fixed per batch-size range")
        notes.append(f"per-step trees dropped: {engine} drafts one chain a step; {how}")
    return notes


def _lookup(plan, engine: str, method: str, ranges, accept, profiles, notes: list[str]) -> dict:
    """vLLM's ngram / suffix parameters from the plan's measurements (planner.export.lookup_settings)."""
    from planner.export import MEASURED_NGRAMS, TARGETS, lookup_settings

    if not TARGETS[engine].lookup_keys or method not in LOOKUP_METHODS:
        return {}
    k = ranges[0].k or max(r.k for r in ranges)
    if accept is None or profiles is None:
        if method == "ngram":
            return {"prompt_lookup_min": MEASURED_NGRAMS[0], "prompt_lookup_max": MEASURED_NGRAMS[1]}
        notes.append("suffix decoding's thresholds left at vLLM's defaults (no acceptance and profile to set them)")
        return {}
    model = plan.dynamic.guessers.get("lookup") if plan.dynamic is not None else None
    cfg, why = lookup_settings(method, k, accept, profiles[min(profiles)], getattr(model, "calibration", None))
    notes += why
    return cfg


def _llama_server(args, plan_path: str) -> int:
    """The llama-server command line the plan maps to (planner/export_llama.py), printed; -o also writes it."""
    from decoder.engines.llama_cpp.lib import check_threads
    from planner.export_llama import llama_server_export
    from planner.jsonio import atomic_write_json, writable_target
    from planner.tree import load_tree

    out = writable_target(args.output) if args.output else None
    plan = load_tree(plan_path)
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


def _draft_folder(draft: str | None, plan, method: str, out: Path, notes: list[str]) -> str | None:
    """--draft-model naming the project's draft LM (layers on the target's embedding and head): written
    beside the output as a Hugging Face folder that engines' draft_model methods load (OUT_STEM.draft/)."""
    from decoder.engines.vllm.draft_folder import is_project_draft, write_draft_folder

    if draft is None or method != "draft_model" or not is_project_draft(draft):
        return draft
    from decoder.engines.models import DEFAULT_MODEL, resolve_spec

    model = plan.provenance.get("model") if isinstance(plan.provenance.get("model"), str) else DEFAULT_MODEL
    _, source, target_dir = resolve_spec(model)
    folder = write_draft_folder(draft, target_dir, out.with_name(out.stem + ".draft"), target_name=model)
    notes.append(f"the project's draft LM {draft} written as a model folder at {folder} (its layers with the "
                 f"target's embedding and head, the target's tokenizer)")
    return str(folder.resolve())


def _plan_model_file(plan) -> str:
    found = _plan_profile(plan).get("model_file")
    if isinstance(found, str):
        return found
    from decoder.engines.shipped import gguf_file

    return str(gguf_file("smollm2-135m"))


def _plan_threads(plan) -> int | None:
    t = _plan_profile(plan).get("threads")
    return t if isinstance(t, int) else None


def _check_numbers(args) -> None:
    from planner.errors import UserError
    from planner.tree import MAX_BATCH_SIZE

    if not 1 <= args.race_prompts <= 40 or not 1 <= args.race_tokens <= 1024:
        raise UserError("--race-prompts must be in 1..40 and --race-tokens in 1..1024")
    for name in ("max_batch_size", "ngram_min", "ngram_max"):
        v = getattr(args, name)
        if v is not None and not 1 <= v <= MAX_BATCH_SIZE:
            raise UserError(f"--{name.replace('_', '-')} must be in 1..{MAX_BATCH_SIZE}, got {v}")
    if args.ngram_min is not None and args.ngram_max is not None and args.ngram_min > args.ngram_max:
        raise UserError(f"--ngram-min {args.ngram_min} is above --ngram-max {args.ngram_max}")


def _draft_ranges(args, plan, plan_path: str, engine: str, method: str, max_b: int, notes: list[str]):
    """Chains planned per batch size when acceptance and profile are at hand, else tree depths."""
    from planner.batch import ContextCost, plan_chain_schedule
    from planner.export import ranges_from_depths, ranges_from_schedule

    accept, profiles, sources = _inputs(args, plan, plan_path, method, notes)
    if accept is None or profiles is None:
        return ranges_from_depths(plan, max_b), None, None, None, sources
    from planner.export import TARGETS

    sizes = _planned_sizes(plan, profiles) if TARGETS[engine].batch_schedule else [1]
    layout = (plan.schedule[0].layout if plan.schedule else None) or "packed"
    context = ContextCost(plan.settings.get("kv_latency_s", 0.0), plan.settings.get("new_tokens", 128))
    chains = plan_chain_schedule(accept, profiles, sizes, _guessing(plan, accept, method), layout, context)
    return ranges_from_schedule(chains, max_b), chains, accept, profiles, sources


def _planned_sizes(plan, profiles) -> list[int]:
    """The plan's own batch sizes, else every batch size the profile measured (a per-step or
    single-tree plan says nothing about batches; the profile's series do)."""
    if not plan.schedule:
        return sorted(profiles)
    return [p["batch_size"] for e in plan.schedule for p in (e.points or [{"batch_size": e.batch_sizes[0]}])]


def _guessing(plan, accept, method: str):
    from planner.cost import Guessing, default_guessing

    recorded = plan.settings.get("guessing")
    if isinstance(recorded, dict):
        keys = ("prompt_tokens", "ensemble", "draft_s", "draft_passes")
        return Guessing(**{k: recorded[k] for k in keys if k in recorded})
    model = _dynamic_model(plan, method)
    if model is not None:
        return Guessing(draft_s=model.draft_s, draft_passes=model.draft_passes)
    return default_guessing(plan.method, accept)


def _dynamic_model(plan, method: str):
    """A per-step plan's model of the guesser the engine will run (its prompt lookup for the
    lookup methods, else its drafter), or None."""
    if plan.dynamic is None:
        return None
    guessers = plan.dynamic.guessers
    want = "lookup" if method in LOOKUP_METHODS else next((k for k in guessers if k != "lookup"), "lookup")
    return guessers.get(want) or next(iter(guessers.values()))


LOOKUP_METHODS = ("ngram", "suffix")


def _inputs(args, plan, plan_path: str, method: str, notes: list[str]):
    """(acceptance, profiles by batch size, their sources): the options', else the plan's own
    (a per-step plan's acceptance rows for the guesser the engine runs; files when they are
    unchanged); (None, None, ...) with a note when either is missing."""
    from planner.accept import Acceptance, load_acceptance
    from planner.profile import load_batch_profiles

    model = None if args.accept else _dynamic_model(plan, method)
    acc_spec = args.accept or (None if model is not None else _recorded(plan, "acceptance", notes))
    prof_path = args.profile or _recorded(plan, "profile", notes)
    if prof_path is None and plan.dynamic is not None and plan.dynamic.profiled:
        profiles, prof_record = _step_cost_profile(plan), {"file": str(plan_path), "field": "dynamic.step_cost_s"}
    elif prof_path is not None:
        profiles = load_batch_profiles(prof_path)
        src = next(iter(profiles.values())).source
        prof_record = {k: src[k] for k in ("file", "sha256")}
        if isinstance(src.get("simulated"), dict):
            prof_record["simulated"] = {k: src["simulated"].get(k) for k in ("gpu", "engine", "dtype")}
    else:
        profiles = prof_record = None
    if (acc_spec is None and model is None) or profiles is None:
        notes.append("draft lengths are the plan's tree depths, not planned as chains (give --accept and --profile "
                     "to plan them)")
        return None, None, {"acceptance": _shown(plan.provenance.get("acceptance") or plan.provenance.get("accept")),
                            "profile": _shown(plan.provenance.get("profile"))}
    if model is not None:
        source = {"file": str(plan_path), "field": f"dynamic.guessers.{model.kind}.prior", "label": model.kind}
        accept = Acceptance(model.prior.copy(), False, source)
    else:
        accept = load_acceptance(acc_spec)
    return accept, profiles, {"acceptance": accept.provenance(), "profile": prof_record,
                              "profile_batch_sizes": sorted(profiles)}


def _step_cost_profile(plan) -> dict:
    """A per-step plan's own step costs (L(n) + overhead at n = 1..) as a batch-size-1 profile."""
    from planner.profile import profile_from_json

    costs = plan.dynamic.step_cost_s
    data = {"input_lengths": list(range(1, len(costs) + 1)), "latency_s": list(costs)}
    return {1: profile_from_json(data, label="the plan's dynamic.step_cost_s")}


def _shown(record):
    """A provenance record as the basis shows it: dicts and strings as they are, lists joined."""
    return ", ".join(map(str, record)) if isinstance(record, list) else record


def _recorded(plan, kind: str, notes: list[str]) -> str | None:
    """The plan's own acceptance or profile file, when it is still there and unchanged. Plans
    record it in three forms: {"file", "sha256", "name"} (planner plan), a path string (autotune,
    under "accept" for the acceptance), a list of KIND=PATH specs (planner plan dynamic)."""
    keys = ("acceptance", "accept") if kind == "acceptance" else ("profile",)
    rec = next((plan.provenance[k] for k in keys if plan.provenance.get(k)), None)
    if isinstance(rec, list):
        rec = rec[0] if len(rec) == 1 else None  # several guessers' files: which one is ambiguous
        rec = rec.partition("=")[2] or rec if isinstance(rec, str) else rec
    if isinstance(rec, str):
        rec = {"file": rec}
    path = rec.get("file") if isinstance(rec, dict) else None
    if not isinstance(path, str) or not path:
        notes.append(f"the plan records no {kind} file")
        return None
    name = rec.get("name")
    if kind == "acceptance" and ":" in path and not Path(path).is_file():  # FILE:NAME as typed
        path, _, name = path.rpartition(":")
    if not Path(path).is_file():
        notes.append(f"the plan's {kind} file {path} is not there")
        return None
    if rec.get("sha256") and hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] != rec["sha256"]:
        notes.append(f"the plan's {kind} file {path} changed since planning (sha256 differs)")
        return None
    return f"{path}:{name}" if kind == "acceptance" and name else path


def _write(result, out: Path, yaml_out: bool, adaptive_path: Path) -> list[str]:
    from planner.export import basis_lines
    from planner.jsonio import to_yaml
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
