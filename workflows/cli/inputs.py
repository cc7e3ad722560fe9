"""Inputs shared by the commands that run a model: model and guesser options, prompt files,
prompt formatting.

Light imports only at top level: torch and transformers load inside the functions.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from decoder.engines.models import SHIPPED_DIR, shipped  # noqa: F401 (re-exported: the commands' home for it)
from planner.errors import UserError

REPO = Path(__file__).resolve().parents[2]
SHARED_DIR = REPO / ".." / "shared"
DEFAULT_QUESTIONS = SHARED_DIR / "data" / "mt_bench_questions.jsonl"
DEFAULT_PROMPTS = DEFAULT_QUESTIONS  # the prompts decode and accept read by default
DEFAULT_GUESSER = "ppd"  # --guesser's default (planner/guessers.py names the kinds)


def held_out_questions(questions_path: str) -> list[str]:
    """First turns of the MT-bench questions held out of all training (training.splits owns the splits)."""
    from training.splits import tuning_questions

    return [text for _, text in tuning_questions(questions_path)]


def held_out_prompts(questions_path: str, n_accept: int, n_decode: int, turns: int = 1) -> tuple[list, list]:
    """The held-out questions split in two disjoint sets (acceptance, race): training.splits;
    turns=2 adds each question's follow-up (a training.splits.Chat) after it."""
    from training.splits import accept_and_race

    return accept_and_race(questions_path, n_accept, n_decode, turns)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="smollm2-135m (default), builtin (the project's 2.4 M toy model), a preset name, a local "
                        "Hugging Face model directory, or a config.json")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"], help="default: bf16 on GPU, fp32 on CPU")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt-tokens", metavar="DIR", default=None,
                   help="trained prompt tokens (prompt_tokens.safetensors + .json; default: the ones shipped for "
                        "the model, models/<model>/prompt_tokens)")
    g.add_argument("--random-prompt-tokens", type=int, metavar="P", default=None,
                   help="untrained prompt tokens: P random vocabulary embeddings (output is still exact; few accepted)")
    p.add_argument("--guesser", default=None, metavar="KIND[:PATH]",
                   help="what proposes the candidates: ppd[:DIR] (PPD prompt tokens, default), draft:DIR (a draft "
                        "LM: `planner train-drafter --kind draft-lm` or any Hugging Face model directory), parallelspec[:DIR] "
                        "(the ParallelSpec drafter), chain[:DIR] (the same drafter, one token per pass), lookup "
                        "(prompt lookup, no model). Without a path: the one shipped for the model, models/<model>/...; "
                        "decode's default: the guesser the plan was made for (autotune records it), else ppd")
    p.add_argument("--drafter", default=None, metavar="DIR",
                   help="a drafter you already have, in its released folder: an EAGLE-1 or EAGLE-3 head (yuhuili's or "
                        "vllm-project/speculators' layout) or Medusa heads (FasterDecoding's or vLLM's); checked against "
                        "the model tensor by tensor. Alone it is --guesser eagle-head:DIR or medusa-heads:DIR; with --guesser "
                        "lookup+eagle-head it is that hybrid's head")
    p.add_argument("--ensemble", type=int, default=1, help="with --random-prompt-tokens: copies per prompt token (E)")
    p.add_argument("--top-k-guesses", type=int, default=10, help="guesses per distance (ranks a plan may use)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="JSONL with 'turns' (MT-bench; first turn), 'text' or 'prompt' per line, or a .txt with one "
                        "prompt per line (default ../shared/data/mt_bench_questions.jsonl)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--no-progress", action="store_true")


def read_prompts(path, limit: int | None = None) -> list[str]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found (a prompts file: JSONL or one prompt per line)") from None
    except (IsADirectoryError, UnicodeDecodeError, OSError) as e:
        raise UserError(f"{path}: cannot read as text ({type(e).__name__})") from None
    out = []
    jsonl = path.suffix in (".jsonl", ".json")
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        if not jsonl:
            out.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {i + 1}: not valid JSON ({e.msg})") from None
        value = None
        if isinstance(row, dict):
            turns = row.get("turns")
            value = turns[0] if isinstance(turns, list) and turns else row.get("text", row.get("prompt"))
        if not isinstance(value, str):
            raise UserError(f"{path}: line {i + 1}: expected an object with 'turns', 'text' or 'prompt' (a string)")
        out.append(value)
    if limit is not None:
        out = out[:limit]
    if not out:
        raise UserError(f"{path}: no prompts")
    return out


def open_everything(args, spec, plan=None, context: int | None = None, default_guesser: str | None = None):
    """-> (engine, guesser): the engine --engine (or the plan) names, opened once here, and the guesser
    --guesser names, built against it (the registry refuses in one line what the engine cannot run,
    before any file is read)."""
    from workflows.cli.engines import open_from_args

    if args.num_prompts is not None and args.num_prompts < 1:
        raise UserError("--num-prompts: expected a positive integer")
    if args.ensemble < 1 or args.top_k_guesses < 1:
        raise UserError("--ensemble and --top-k-guesses: expected positive integers")
    name = drafter_guesser(args) or getattr(args, "guesser", None) or default_guesser or default_guesser_for(spec.caps)
    check_guesser(spec, name)
    engine = open_from_args(args, spec, context=context)
    return engine, make_guesser(args, engine, name)


def drafter_guesser(args) -> str | None:
    """--drafter DIR as a guesser spec KIND:DIR (the head's layout says eagle or medusa), or with --guesser
    naming a hybrid of that kind, the hybrid on this head; None without --drafter."""
    from decoder.guessers.heads import head_kind
    from planner.guessers import kind

    folder = getattr(args, "drafter", None)
    if folder is None:
        return None
    head = head_kind(folder)
    given = getattr(args, "guesser", None)
    if given is None:
        return f"{head}:{folder}"
    k, path = parse_guesser(given)
    if path is not None or kind(k).members[1:] != (head,):
        raise UserError(f"--drafter {folder} is {'an EAGLE head' if head == 'eagle-head' else 'Medusa heads'}: with --guesser "
                        f"give a hybrid on it (lookup+{head}) without a path, or leave --guesser out")
    return f"{k}:{folder}"


DEFAULT_GUESSERS = ("ppd", "lookup")  # --guesser's default: the first of these the engine can run


def default_guesser_for(caps) -> str:
    from decoder.engine import lacking
    from decoder.guessers.registry import needs
    from planner.guessers import kind

    return next((g for g in DEFAULT_GUESSERS if not lacking(caps, needs(kind(g)))), DEFAULT_GUESSERS[-1])


def check_guesser(spec, name: str) -> None:
    """The engine kind's refusal of --guesser, before the engine opens (decoder/engine.py refuse)."""
    from decoder.engine import refuse
    from decoder.guessers.registry import needs
    from planner.guessers import kind

    k, _ = parse_guesser(name)
    refuse(spec.caps, k, needs(kind(k)))


def parse_guesser(spec: str) -> tuple[str, str | None]:
    """--guesser KIND[:PATH] -> (kind, path or None); the kinds are the registry's (planner/guessers.py)."""
    from planner.guessers import kind, names

    name, _, path = str(spec).partition(":")
    try:
        k = kind(name)
    except UserError:
        raise UserError(f"--guesser {spec}: expected KIND[:PATH] with KIND one of {', '.join(names())}") from None
    if k.files is None and path:
        raise UserError(f"--guesser {name} takes no path ({k.summary.split(':')[0]} has no files)")
    return k.name, path or None


def make_guesser(args, engine, spec: str | None = None):
    """The guesser `spec` (default --guesser) names, with its files (a path, else the ones shipped for a
    named model), built by the registry's loader (decoder/guessers/registry.py) against the engine."""
    from decoder.engines.models import default_model_spec
    from decoder.guessers.registry import LoadRequest, load_guesser
    from planner.guessers import kind

    name, path = parse_guesser(spec or getattr(args, "guesser", None) or DEFAULT_GUESSER)
    model = getattr(args, "model", None) or default_model_spec()
    named = model == engine.model_name  # a named model (not a folder): its guessers ship under models/<name>/
    k = kind(name)
    pt_flags = args.prompt_tokens or args.random_prompt_tokens
    if pt_flags and not k.needs_embeddings:
        raise UserError(f"--prompt-tokens / --random-prompt-tokens belong to a guesser with prompt tokens "
                        f"(ppd, lookup+ppd), not {name}")
    options = {}
    if k.needs_embeddings:
        path = path or args.prompt_tokens
        if path is None and args.random_prompt_tokens is not None:
            options = {"random": args.random_prompt_tokens, "ensemble": args.ensemble}
        elif path is None:
            found = shipped(model, k.files) if named else None
            if found is None:
                raise UserError(f"--model {model}: no prompt tokens ship for it; pass --prompt-tokens DIR (train them "
                                "with `planner train-prompts`) or --random-prompt-tokens P (untrained, output still exact)")
            path = str(found)
    elif k.files is not None and path is None:
        found = shipped(model, k.files) if named else None
        if found is None:
            raise UserError(f"--guesser {name}: no {k.files} ships for model {model}; give {name}:DIR "
                            "(train one with `planner train-drafter`)")
        path = str(found)
    request = LoadRequest(engine, path, top_k=args.top_k_guesses, options=options, label=str(path or name))
    return load_guesser(name, request)


def encode(engine, texts: list) -> list:
    """Chat-formatted token ids (the autotune's format) with the engine's tokenizer; without one (a
    preset's random weights), UTF-8 bytes mod the vocabulary."""
    import torch

    if engine.tokenizer is not None:
        return encode_prompts(engine.tokenizer, texts)
    flat = ["\n".join(t.turns) if hasattr(t, "turns") else t for t in texts]
    return [torch.tensor([b % engine.vocab_size for b in t.encode()] or [0], dtype=torch.long) for t in flat]


def encode_prompts(tokenizer, texts: list) -> list:
    """Each prompt up to where the assistant's answer starts: a text as one user turn, a
    training.splits.Chat as its conversation, in the model's chat template (SmolLM2: its system
    prompt and <|im_start|> turns). A tokenizer without a chat template (the built-in model) gets
    the format it was trained on, "USER: ... ASSISTANT: ...</s>USER: ... ASSISTANT:"."""
    import torch

    out = []
    for t in texts:
        messages = t.messages() if hasattr(t, "messages") else [{"role": "user", "content": t.strip()}]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            bos = tokenizer.bos_token_id
            said = "".join(f"USER: {q['content']} ASSISTANT: {a['content']}</s>" for q, a in zip(messages[0::2], messages[1::2]))
            ids = ([bos] if bos is not None else []) + tokenizer(f"{said}USER: {messages[-1]['content']} ASSISTANT:",
                                                                 add_special_tokens=False)["input_ids"]
        out.append(torch.tensor(list(ids), dtype=torch.long))
    return out
