"""`planner autotune`: the main job on SmolLM2-135M-Instruct (or --model DIR with its guessers)."""
from __future__ import annotations

import argparse

from planner.engines import kind as engine_kind
from workflows.cli.engines import add_engine_argument
from workflows.cli.sampling import add_sampling_arguments, sampling_from_args
from workflows.mainjob.pipeline import GUESSERS, METHODS, AutotuneSettings

MAX_PROMPTS = 40  # held-out MT-bench questions: 16, split between acceptance and decoding
MAX_TOKENS = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = AutotuneSettings()
    ll = engine_kind("llama.cpp").defaults  # the help quotes the second engine's defaults beside the default's
    hf = engine_kind(d.engine).defaults
    vl = engine_kind("vllm").defaults
    p.add_argument("--model", default=d.model,
                   help="smollm2-135m (default), builtin (the 2.4 M toy), a preset name or a local model directory")
    p.add_argument("--guessers", default="auto",
                   help=f"comma-separated subset of {','.join(GUESSERS)}, or auto (default): every guesser shipped "
                        "for the model, and prompt lookup")
    p.add_argument("--prompt-tokens", default=None, metavar="DIR", help="PPD prompt tokens (default: shipped for the model)")
    p.add_argument("--draft", default=None, metavar="DIR", help="a draft LM (default: models/<model>/draft_lm where one ships; none does for SmolLM2)")
    p.add_argument("--parallelspec", default=None, metavar="DIR",
                   help="a ParallelSpec drafter, also run as a chain (default: models/<model>/parallelspec)")
    p.add_argument("--drafter", default=None, metavar="DIR",
                   help="a head you already have, in its released folder (EAGLE-1, EAGLE-3: yuhuili's or speculators' "
                        "layout; Medusa): raced alone and with prompt lookup on the hf engine, its method's draft length "
                        "planned per concurrency in vLLM (default: the EAGLE-3 head shipped for the model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"])
    p.add_argument("--out", default=None, metavar="DIR", help="run folder (default runs/<date>-<device>-<model>)")
    p.add_argument("--questions", default=d.questions, help="MT-bench style questions JSONL (held-out ones are used)")
    p.add_argument("--accept-prompts", type=int, default=None,
                   help=f"held-out prompts to measure acceptance on (default {hf.accept_prompts}; "
                        f"{vl.accept_prompts} with --engine vllm: half held-out questions, half input-repeating requests)")
    p.add_argument("--decode-prompts", type=int, default=None,
                   help=f"held-out prompts the plans race on (default {hf.decode_prompts}; {ll.decode_prompts} with --engine "
                        "llama.cpp)")
    p.add_argument("--turns", type=int, default=None, choices=[1, 2],
                   help=f"prompts per held-out question: 1 its first turn, 2 also its follow-up asked after an answer "
                        f"(the answers file beside --questions) (default {hf.turns}; {ll.turns} with --engine llama.cpp)")
    p.add_argument("--accept-tokens", type=int, default=d.accept_tokens,
                   help="tokens per prompt decoded for acceptance (greedily, or sampled with --temperature)")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help=f"new tokens per prompt when decoding (default {hf.decode_tokens}; {ll.decode_tokens} with --engine "
                        "llama.cpp)")
    p.add_argument("--max-input-length", type=int, default=None,
                   help=f"largest forward pass planned (and profiled) (default {hf.max_input_length}; "
                        f"{ll.max_input_length} with --engine llama.cpp)")
    p.add_argument("--context-length", type=int, default=d.context_length, help="KV-cache length for the profile")
    p.add_argument("--methods", default=",".join(METHODS), help="PPD's tree families: a subset of ppd,medusa,sequoia")
    p.add_argument("--budget", type=float, default=None, metavar="MINUTES",
                   help=f"bounds the whole run, loading to report (default {hf.budget_minutes:g}; {ll.budget_minutes:g} with "
                        f"--engine llama.cpp, {vl.budget_minutes:g} with --engine vllm); the race of the plans gets what "
                        "the other phases leave (vllm: the contenders it cannot fit are not raced, the planned "
                        "schedule first)")
    p.add_argument("--finalists", type=int, default=d.finalists,
                   help="(guesser, method) families whose best predicted plan races against plain decoding")
    p.add_argument("--neighbours", type=int, default=d.neighbours,
                   help="sizes either side of the best predicted plan that also race")
    p.add_argument("--sweep", type=int, default=d.sweep, help="sizes of the best predicted method spread over its range "
                                                               "that also race (0: none)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"runs of each (plan, prompt) in the race, the median counts (default {hf.rounds}; {ll.rounds} "
                        "with --engine llama.cpp, whose runs take a second)")
    add_engine_argument(p)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--profile", default=None, help="reuse this profile instead of measuring")
    p.add_argument("--accept", default=None, help="reuse this PPD acceptance file instead of measuring")
    p.add_argument("--profile-budget", type=float, default=None,
                   help=f"seconds of profiling at most (default {hf.profile_budget_s:g})")
    add_sampling_arguments(p, "tune for (and race) decoding")
    p.add_argument("--verify", default=None, choices=["coupled", "lossless", "typical"],
                   help="with --temperature, the rule raced and written into chosen.json: coupled (the hf engine's "
                        "default; position-keyed draws, every plan emits plain sampling's text with the same seed, so "
                        "the race compares them on one text and checks they match), lossless (recursive rejection; the "
                        "llama.cpp engine's default, whose plain decoding is its library's own sampler: the race "
                        "compares speeds only), or typical (Medusa's typical acceptance: faster, NOT distribution-exact; "
                        "chosen.json says so)")
    p.add_argument("--no-report", action="store_true", help="skip the plots")
    p.add_argument("--quiet", action="store_true")
    _serving_arguments(p)

def _serving_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a serving engine's main job (refused in one line on a step engine)."""
    g = p.add_argument_group("engines that serve (--engine vllm: workflows/mainjob/serving.py)")
    g.add_argument("--concurrency", default=None, metavar="LIST",
                   help="concurrent requests to plan and race for (default 1,2,4,8,16); --guessers picks vLLM's "
                        "proposers (auto: ngram, suffix, draft_model with a draft LM, and the head's eagle/eagle3/medusa "
                        "with --drafter or a shipped head), --decode-prompts / --decode-tokens the race's "
                        "requests and their length, --accept a reused acceptance record per proposer (comma list)")
    g.add_argument("--plugin", default="auto", choices=["auto", "on", "off"],
                   help="the project's vLLM plugin in the race's planned servers (auto: where scripts/setup_vllm.sh "
                        "installed it): a batch size scheduled at K = 0 then runs vLLM's plain path, and suffix takes a "
                        "schedule; off races and writes what vLLM does without it")
    g.add_argument("--workload", default=None, metavar="FILE",
                   help="the requests to serve: OpenAI chat-completions JSON lines, or ShareGPT JSON (default: the "
                        "held-out questions); even lines measure acceptance, odd lines race")



def _check(args, s: AutotuneSettings) -> None:
    import math

    from planner.errors import UserError
    from planner.tree import MAX_INPUT_LENGTH

    if not s.methods or any(m not in METHODS for m in s.methods):
        raise UserError(f"--methods: expected a comma-separated subset of {','.join(METHODS)}, got {args.methods!r}")
    if not s.guessers or any(g not in GUESSERS + ("auto",) for g in s.guessers):
        raise UserError(f"--guessers: expected auto or a comma-separated subset of {','.join(GUESSERS)}, got {args.guessers!r}")
    for name, top in (("accept_prompts", MAX_PROMPTS), ("decode_prompts", MAX_PROMPTS), ("accept_tokens", MAX_TOKENS),
                      ("decode_tokens", MAX_TOKENS), ("max_input_length", MAX_INPUT_LENGTH),
                      ("context_length", 32768), ("rounds", 100)):
        if not 1 <= getattr(s, name) <= top:
            raise UserError(f"--{name.replace('_', '-')}: must be an integer in 1..{top}, got {getattr(s, name)}")
    if s.neighbours < 0 or s.sweep < 0:
        raise UserError("--neighbours and --sweep: must be >= 0")
    if not 1 <= args.finalists <= 100:
        raise UserError(f"--finalists: must be an integer in 1..100, got {args.finalists}")
    if not (math.isfinite(s.budget_minutes) and 0.5 <= s.budget_minutes <= 24 * 60):
        raise UserError(f"--budget: expected minutes in 0.5..1440, got {s.budget_minutes}")
    if args.verify in ("typical", "coupled") and args.temperature <= 0:
        raise UserError(f"--verify {args.verify}: samples; give --temperature > 0 (at temperature 0 every rule is greedy)")
    sampling_from_args(args, verify=s.verify)
    if not (math.isfinite(s.profile_budget_s) and s.profile_budget_s > 0):
        raise UserError(f"--profile-budget: expected a positive number of seconds, got {s.profile_budget_s}")


def _settings(args) -> AutotuneSettings:
    """The flags as settings, the engine kind's defaults where a flag was left out (resolved once)."""
    from planner.guessers import kinds

    # each directory flag names one kind of files; every guesser kind reading such files takes it
    by_files = {"prompt_tokens": args.prompt_tokens, "draft_lm": args.draft, "parallelspec": args.parallelspec}
    head = args.drafter
    if head is not None:  # the head's kind reads its files: eagle-head (and lookup+eagle-head), or medusa-heads
        from decoder.guessers.heads import head_kind
        from planner.guessers import kind as guesser_kind

        by_files[guesser_kind(head_kind(head)).files] = head
    dirs = {k.name: by_files[k.files] for k in kinds(hybrids=False) if by_files.get(k.files)}
    engine = args.engine or AutotuneSettings.engine
    sampled_rule = engine_kind(engine).defaults.sampled_rule if args.temperature > 0 else "auto"
    return AutotuneSettings(
        engine=engine, model=args.model,
        guessers=tuple(g.strip() for g in args.guessers.split(",") if g.strip()), guesser_dirs=dirs,
        device=args.device, dtype=args.dtype, out=args.out, questions=args.questions,
        accept_prompts=engine_kind(engine).defaults.accept_prompts if args.accept_prompts is None else args.accept_prompts,
        decode_prompts=args.decode_prompts, turns=args.turns,
        accept_tokens=args.accept_tokens, decode_tokens=args.decode_tokens, max_input_length=args.max_input_length,
        context_length=args.context_length, methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        neighbours=args.neighbours, sweep=args.sweep, finalists=args.finalists, budget_minutes=args.budget,
        profile=args.profile, accept=args.accept, rounds=args.rounds, threads=args.threads, n_ctx=args.n_ctx,
        profile_budget_s=args.profile_budget, report=not args.no_report, progress=not args.quiet,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, verify=args.verify or sampled_rule,
    ).resolved()


def _refuse(args, s: AutotuneSettings) -> None:
    """What the engine has no use for, in one line, before any model loads."""
    from planner.errors import UserError
    from workflows.cli.engines import refuse_options
    from workflows.cli.inputs import check_guesser

    spec = s.kind
    refuse_options(spec, {"--device": args.device is not None, "--dtype": args.dtype is not None,
                          "--n-ctx": args.n_ctx is not None})
    for kind in list(s.guesser_dirs) + [g for g in s.guessers if g != "auto"]:
        check_guesser(spec, kind)
    if args.accept and not spec.caps.input_embeddings:
        raise UserError(f"--accept: reuses the acceptance of prompt tokens riding the target's pass, which --engine "
                        f"{spec.name} cannot run")


def _serving(args):
    """--engine ENGINE whose protocol is SERVING: the serving phases' settings (a draft length per concurrency,
    raced under load)."""
    from planner.errors import UserError
    from workflows.cli.engines import refuse_options
    from workflows.mainjob.serving import ServingSettings
    from workflows.mainjob.serving_plan import CONCURRENCY

    refuse_options(engine_kind(args.engine), {"--device": args.device is not None, "--n-ctx": args.n_ctx is not None})
    for flag, given in (("--prompt-tokens", args.prompt_tokens), ("--parallelspec", args.parallelspec),
                        ("--dtype", args.dtype), ("--turns", args.turns), ("--max-input-length", args.max_input_length),
                        ("--verify", args.verify)):
        if given is not None:
            raise UserError(f"{flag}: not with --engine {args.engine} (it serves vLLM's own proposers, fp32)")
    try:
        levels = tuple(int(x) for x in (args.concurrency or ",".join(map(str, CONCURRENCY))).split(","))
    except ValueError:
        raise UserError(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}") from None
    from profiler.vllm_accept import default_methods

    # auto: ngram, suffix, the draft LM where one is given or ships, the head given (--drafter) or shipped
    methods = default_methods(args.model, args.draft, args.drafter) if args.guessers == "auto" else \
        tuple(m.strip() for m in args.guessers.split(",") if m.strip())
    d = ServingSettings()
    return ServingSettings(engine=args.engine, model=args.model, out=args.out, concurrency=levels, workload=args.workload,
                           methods=methods, max_tokens=args.decode_tokens or d.max_tokens,
                           race_requests=args.decode_prompts or d.race_requests,
                           accept_requests=d.accept_requests if args.accept_prompts is None else args.accept_prompts,
                           rounds=args.rounds or d.rounds, budget_minutes=args.budget or d.budget_minutes,
                           profile=args.profile, accept=tuple(a for a in (args.accept or "").split(",") if a),
                           draft=args.draft, drafter=args.drafter,
                           plugin={"auto": None, "on": True, "off": False}[args.plugin],
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, quiet=args.quiet)


def _step(args) -> AutotuneSettings:
    """--engine ENGINE whose protocol is STEP: the settings, checked, and what the engine cannot use refused."""
    from planner.errors import UserError

    for flag, given in (("--concurrency", args.concurrency), ("--workload", args.workload),
                        ("--plugin", None if args.plugin == "auto" else args.plugin)):
        if given is not None:
            raise UserError(f"{flag}: only with a serving engine (--engine vllm); --engine {args.engine or 'hf'} "
                            "decodes one request at a time in this process")
    s = _settings(args)
    _check(args, s)
    _refuse(args, s)
    return s


def run(args) -> int:
    from planner.engines import SERVING, STEP
    from workflows.mainjob.pipeline import autotune

    kind = engine_kind(args.engine or AutotuneSettings.engine)
    summary = autotune({STEP: _step, SERVING: _serving}[kind.protocol](args))
    return 0 if summary.get("identical_to_greedy") is not False else 1
