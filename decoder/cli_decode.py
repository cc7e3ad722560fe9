"""`planner decode`: decode prompts with a planned tree, optionally next to plain decoding.

Light imports only at top level: torch, transformers and the decoder load inside run().
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from planner.errors import UserError

REPO = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO / ".." / "shared"
DEFAULT_PROMPTS = SHARED_DIR / "data" / "mt_bench_questions.jsonl"
BUILTIN_PROMPT_TOKENS = REPO / "models" / "builtin" / "prompt_tokens"


# ------------------------------------------------------------------ shared with `planner accept`


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="preset name, a local Hugging Face model directory, or a config.json "
                        "(default: 'builtin' if models/builtin exists, else 'tiny')")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"], help="default: bf16 on GPU, fp32 on CPU")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt-tokens", metavar="DIR", default=None,
                   help="trained prompt tokens (prompt_tokens.safetensors + .json; default for --model builtin: "
                        "models/builtin/prompt_tokens when present)")
    g.add_argument("--random-prompt-tokens", type=int, metavar="P", default=None,
                   help="untrained prompt tokens: P random vocabulary embeddings (output is still exact; few accepted)")
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


def load_everything(args, need_tree_depth: int | None = None):
    """-> (loaded model, tokenizer or None, guesser). Random prompt tokens default to `need_tree_depth`."""
    import torch

    from decoder.prompt_tokens import PromptTokens
    from profiler.models import default_model_spec, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise UserError("--num-prompts: expected a positive integer")
    if args.ensemble < 1 or args.top_k_guesses < 1:
        raise UserError("--ensemble and --top-k-guesses: expected positive integers")
    spec = args.model or default_model_spec()
    loaded = load_model(spec, device=args.device, dtype=args.dtype)
    model = loaded.model
    pt_dir = args.prompt_tokens
    if pt_dir is None and args.random_prompt_tokens is None and spec == "builtin" and (BUILTIN_PROMPT_TOKENS / "prompt_tokens.json").is_file():
        pt_dir = str(BUILTIN_PROMPT_TOKENS)
    if pt_dir is not None:
        guesser = PromptTokens.load(pt_dir, model=model, top_k=args.top_k_guesses)
    else:
        P = args.random_prompt_tokens or need_tree_depth
        if not P or P < 1:
            raise UserError("--prompt-tokens DIR or --random-prompt-tokens P: the guesser is needed")
        guesser = PromptTokens.random(model, P, ensemble=args.ensemble, top_k=args.top_k_guesses)
    guesser.source_dir = pt_dir  # None: random, untrained
    tokenizer = None
    if loaded.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    return loaded, tokenizer, guesser


def encode(tokenizer, texts: list[str], vocab_size: int) -> list:
    """Chat-formatted token ids (the autotune's format); without a tokenizer, UTF-8 bytes mod vocab."""
    import torch

    if tokenizer is not None:
        from planner.autotune import encode_prompts

        return encode_prompts(tokenizer, texts)
    return [torch.tensor([b % vocab_size for b in t.encode()] or [0], dtype=torch.long) for t in texts]


# ------------------------------------------------------------------ planner decode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, metavar="TREE", help="tree file from `planner plan` (or autotune)")
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", default=None, help="a prompt text (repeatable); overrides --prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: off)")
    p.add_argument("--verify", default="auto", choices=["auto", "greedy", "typical", "lossless"],
                   help="auto: greedy at temperature 0, lossless sampling above")
    p.add_argument("--eps", type=float, default=0.09, help="typical acceptance: hard threshold")
    p.add_argument("--delta", type=float, default=0.3, help="typical acceptance: entropy-scaled threshold")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-plain", action="store_true", help="also decode plainly (same cache path) and compare")
    p.add_argument("--print", dest="print_text", action="store_true", help="print each decoded text")
    p.add_argument("-o", "--output", default=None, help="results JSON (default: print a summary only)")


def _check(args) -> None:
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens: expected a positive integer")
    if args.temperature < 0:
        raise UserError("--temperature: expected a number >= 0")
    if not 0 < args.top_p <= 1:
        raise UserError("--top-p: expected a number in (0, 1]")
    if args.top_k < 0:
        raise UserError("--top-k: expected an integer >= 0")


def run(args) -> int:
    _check(args)
    from planner.jsonio import atomic_write_json
    from planner.tree import load_tree

    tree = load_tree(args.plan)  # bad plans fail before the model loads
    texts = args.prompt or read_prompts(args.prompts or DEFAULT_PROMPTS, args.num_prompts)
    if args.prompt and args.num_prompts:
        texts = texts[: args.num_prompts]

    import torch
    from tqdm import tqdm

    from decoder.buffers import build_plan_buffers
    from decoder.step import generate, generate_plain

    need = tree.prompt_tokens_max if tree.method == "ppd" else tree.depth
    loaded, tokenizer, guesser = load_everything(args, need_tree_depth=need)
    model = loaded.model
    w = model.get_input_embeddings().weight
    buffers = build_plan_buffers(tree, guesser, w.dtype, w.device, args.plan)
    prompts = encode(tokenizer, texts, w.shape[0])
    gen_kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed)
    results = []
    interrupted = False
    t_start = time.time()
    try:
        for text, ids in tqdm(list(zip(texts, prompts)), desc="decode", unit="prompt", disable=args.no_progress):
            out = generate(model, ids, plan=tree, guesser=guesser, verify_rule=args.verify, eps=args.eps,
                           delta=args.delta, buffers=buffers, **gen_kw)
            row = {"prompt": text, "prompt_length": int(ids.numel()), "tokens": out.tokens.tolist(),
                   "steps": out.steps, "stats": out.stats.to_json()}
            if tokenizer is not None:
                row["text"] = tokenizer.decode(out.tokens.tolist(), skip_special_tokens=True)
            if args.compare_plain:
                plain = generate_plain(model, ids, **gen_kw)
                row["plain"] = {"tokens": plain.tokens.tolist(), "steps": plain.steps, "summary": plain.stats.summary()}
                row["identical_to_plain"] = plain.tokens.tolist() == row["tokens"]
            if args.print_text:
                print(f"--- {text[:60]!r}\n{row.get('text', row['tokens'])}")
            results.append(row)
    except KeyboardInterrupt:
        interrupted = True  # keep what is done; report and write it
    summary = _summary(results, args.compare_plain)
    doc = {
        "model": loaded.name, "config_hash": loaded.config_hash, "device": str(w.device),
        "plan": str(args.plan), "method": tree.method,
        "prompt_tokens": {"dir": guesser.source_dir, "P": guesser.num_prompt_tokens, "E": guesser.ensemble,
                          "top_k": guesser.top_k, "random": guesser.source_dir is None},
        "settings": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "verify": args.verify,
                     "max_new_tokens": args.max_new_tokens, "seed": args.seed},
        "real_input_length_by_state": {str(s): b.input_length for s, b in buffers.states.items()},
        "planned_input_length_by_state": {str(s): b.planned_input_length for s, b in buffers.states.items()},
        "summary": summary, "results": results, "interrupted": interrupted, "wall_s": time.time() - t_start,
    }
    print(_format(summary, tree.method))
    if args.output:
        atomic_write_json(args.output, doc)
        print(f"wrote {args.output}")
    if interrupted:
        print("planner decode: interrupted; results so far kept", file=sys.stderr)
        return 130
    return 0


def _summary(results: list[dict], plain: bool) -> dict:
    tokens = sum(len(r["tokens"]) for r in results)
    steps = sum(r["steps"] for r in results)
    seconds = sum(r["stats"]["summary"]["total_s"] for r in results)
    s = {"prompts": len(results), "tokens": tokens, "steps": steps,
         "tokens_per_step": tokens / steps if steps else 0.0,
         "tokens_per_s": tokens / seconds if seconds > 0 else None}
    if plain and results:
        p_tokens = sum(len(r["plain"]["tokens"]) for r in results)
        p_seconds = sum(r["plain"]["summary"]["total_s"] for r in results)
        s["plain_tokens_per_s"] = p_tokens / p_seconds if p_seconds > 0 else None
        s["speedup"] = (s["tokens_per_s"] / s["plain_tokens_per_s"]) if s["tokens_per_s"] and s["plain_tokens_per_s"] else None
        s["identical_to_plain"] = all(r["identical_to_plain"] for r in results)
    return s


def _format(s: dict, method: str) -> str:
    line = (f"{method}: {s['prompts']} prompts, {s['tokens']} tokens in {s['steps']} steps "
            f"({s['tokens_per_step']:.2f} tokens/step")
    if s.get("tokens_per_s"):
        line += f", {s['tokens_per_s']:.1f} tokens/s"
    if "speedup" in s and s["speedup"]:
        line += f"; plain {s['plain_tokens_per_s']:.1f} tokens/s, speedup {s['speedup']:.2f}x, identical: {s['identical_to_plain']}"
    return line + ")"
