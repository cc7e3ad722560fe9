"""What `planner decode` and `planner accept` write and print, shared by both engines' paths
(workflows/cmd_decode.py, cmd_accept.py, llama_runs.py): the guesser's record, the run summary and
its one-line form, the prompt texts, and per-prompt acceptance counts merged."""
from __future__ import annotations

from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from workflows.inputs import DEFAULT_PROMPTS, parse_guesser, read_prompts


def guesser_record(spec: str, guesser) -> dict:
    kind, _ = parse_guesser(spec)
    k = guesser_kind(kind)
    rec = {"kind": kind, "dir": getattr(guesser, "source_dir", None), "top_k": getattr(guesser, "top_k", None)}
    if k.hybrid:  # lookup and the drafter
        return {"kind": kind, "dir": getattr(guesser, "source_dir", None)}
    if k.needs_embeddings:  # prompt tokens
        rec.update(P=guesser.num_prompt_tokens, E=guesser.ensemble, random=guesser.source_dir is None)
    if k.needs_hidden:  # the ParallelSpec drafter, in one of its modes
        rec.update(num_masks=guesser.num_masks, mode=guesser.mode)
    return rec


def dynamic_summary(reports: list[dict | None], results: list[dict]) -> dict:
    """Sizes chosen per step, the share of plain steps, the decision's cost against the forward."""
    import statistics

    sizes = [s for r in reports if r for s in r["sizes"]]
    decide = sum(r["decide_s_mean"] * len(r["sizes"]) for r in reports if r)
    forward = sum(sum(x["stats"]["times"]["forward"]) for x in results)
    return {"dynamic_sizes_mean": statistics.fmean(sizes) if sizes else 0.0,
            "dynamic_plain_steps": sum(s == 0 for s in sizes) / len(sizes) if sizes else 0.0,
            "dynamic_decide_s": decide, "dynamic_decide_vs_forward": decide / forward if forward > 0 else None}


def summarize_runs(results: list[dict], plain: bool) -> dict:
    tokens = sum(len(r["tokens"]) for r in results)
    steps = sum(r["steps"] for r in results)
    seconds = sum(r["wall_share_s"] for r in results)
    s = {"prompts": len(results), "tokens": tokens, "steps": steps,
         "tokens_per_step": tokens / steps if steps else 0.0,
         "tokens_per_s": tokens / seconds if seconds > 0 else None}
    if plain and results:
        p_tokens = sum(len(r["plain"]["tokens"]) for r in results)
        p_seconds = sum(r["plain"]["wall_share_s"] for r in results)
        s["plain_tokens_per_s"] = p_tokens / p_seconds if p_seconds > 0 else None
        s["speedup"] = (s["tokens_per_s"] / s["plain_tokens_per_s"]) if s["tokens_per_s"] and s["plain_tokens_per_s"] else None
        s["identical_to_plain"] = all(r["identical_to_plain"] for r in results)
        from profiler.compare import summarize

        s.update(summarize([r["comparison"]["status"] for r in results]))  # near ties (bf16 rounding) apart from mismatches
    return s


def format_summary(s: dict, method: str) -> str:
    line = (f"{method}: {s['prompts']} prompts, {s['tokens']} tokens in {s['steps']} steps "
            f"({s['tokens_per_step']:.2f} tokens/step")
    if s.get("tokens_per_s"):
        line += f", {s['tokens_per_s']:.1f} tokens/s"
    if s.get("speedup"):
        line += f"; plain {s['plain_tokens_per_s']:.1f} tokens/s, speedup {s['speedup']:.2f}x, identical: {s['identical_to_plain']}"
    if s.get("perplexity") is not None:
        line += f"; perplexity {s['perplexity']:.2f}"
        if s.get("plain_perplexity") is not None:
            line += f" (plain {s['plain_perplexity']:.2f})"
    return line + ")"


def prompt_texts(args) -> list[str]:
    """--prompts (or the MT-bench default), the held-out questions only with --held-out."""
    if not getattr(args, "held_out", False):
        return read_prompts(args.prompts or DEFAULT_PROMPTS, args.num_prompts)
    from workflows.inputs import held_out_questions

    texts = held_out_questions(str(args.prompts or DEFAULT_PROMPTS))
    if not texts:
        raise UserError(f"--held-out: {args.prompts or DEFAULT_PROMPTS} has no held-out question (question_id % 5 == 0)")
    return texts[: args.num_prompts] if args.num_prompts else texts


def merge_accuracy(parts: list[dict]) -> dict:
    import statistics

    import numpy as np

    counts = sum(np.array(p["counts"]) for p in parts)
    totals = sum(np.array(p["totals"]) for p in parts)
    if totals[0] == 0:
        raise UserError("too few positions decoded to measure distance 1; raise --max-new-tokens")
    out = dict(parts[0])
    out.update({"accuracy": np.divide(counts, totals[:, None], out=np.zeros(counts.shape), where=totals[:, None] > 0).tolist(), "counts": counts.tolist(), "totals": totals.tolist(),
                "positions": sum(p["positions"] for p in parts)})
    if "draft_s" in out["guesser"]:  # the drafter's pass time: the median over prompts
        out["guesser"] = dict(out["guesser"], draft_s=statistics.median(p["guesser"]["draft_s"] for p in parts))
    return out
