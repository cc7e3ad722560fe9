"""What `planner decode` and `planner accept` write and print, shared by both engines' paths
(workflows/cli/cmd_decode.py, cmd_accept.py, llama_runs.py): the guesser's record, the run summary and
its one-line form, the prompt texts, per-prompt acceptance counts merged, and acceptance under
sampling (`planner accept --temperature ...`) measured and written on either engine."""
from __future__ import annotations

from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from workflows.cli.inputs import DEFAULT_PROMPTS, parse_guesser, read_prompts


def guesser_record(spec: str, guesser) -> dict:
    kind, _ = parse_guesser(spec)
    k = guesser_kind(kind)
    rec = {"kind": kind, "dir": getattr(guesser, "source_dir", None), "top_k": getattr(guesser, "top_k", None)}
    if k.hybrid:  # lookup and the drafter
        return {"kind": kind, "dir": getattr(guesser, "source_dir", None)}
    if k.needs_embeddings:  # prompt tokens
        rec.update(P=guesser.num_prompt_tokens, E=guesser.ensemble, random=guesser.source_dir is None)
    if hasattr(guesser, "num_masks"):  # the ParallelSpec drafter, in one of its modes
        rec.update(num_masks=guesser.num_masks, mode=guesser.mode)
    elif k.needs_hidden and hasattr(guesser, "drafter"):  # a head (EAGLE): the features it reads
        feats = guesser.drafter.features
        rec.update(features="last hidden state" if feats is True else list(feats))
    return rec


def strategy_record(args, run_cfg, engine, guesser, results: list[dict]) -> tuple[str | None, dict, dict]:
    """A plain decision's, PEARL's and MTAD's own part of `planner decode`'s document: (the method it names,
    None for a plan's steps; fields of the summary; fields of the document, merged into its objects)."""
    if run_cfg.pearl is not None:
        p = run_cfg.pearl
        return "pearl", _pearl_summary(results), {"pearl": {"gamma": p.gamma, "concurrent": not p.serial}}
    if run_cfg.mtad is not None:
        m, s = run_cfg.mtad, run_cfg.decode.sampling
        lossless = s.temperature == 0 and m.tau_acc > 0  # greedy there
        fields = {"mtad": {"width": m.width, "gamma": m.gamma, "tau_acc": m.tau_acc, "beams": "tree",  # all W beams, one tree
                           "lossless": lossless}, "settings": {"distribution_exact": lossless}}
        return "mtad", _mtad_quality(args, engine, guesser, results), fields
    return (parse_guesser(run_cfg.guesser)[0] if run_cfg.plain else None), {}, {}  # a plain decision: its kind's name


def _pearl_summary(results: list[dict]) -> dict:
    """Rounds (one target forward each: decode's steps), modes A / B, mean tokens per round."""
    rounds = sum(r["stats"]["summary"]["rounds"] for r in results)
    tokens = sum(len(r["tokens"]) for r in results)
    return {"rounds": rounds, "mode_a": sum(r["stats"]["summary"]["mode_a"] for r in results),
            "mode_b": sum(r["stats"]["summary"]["mode_b"] for r in results),
            "mean_tokens_per_round": tokens / rounds if rounds else 0.0}


def _mtad_quality(args, engine, guesser, results: list[dict]) -> dict:
    """Perplexity (under the target and the drafter, raw distributions) and distinct-n of the MTAD
    texts and, with --compare-plain, of plain sampling's over the same prompts."""
    import torch

    from profiler.text_quality import text_quality

    prompts = [torch.tensor(r["prompt_ids"]) for r in results]
    out = text_quality(engine, prompts, [r["tokens"] for r in results], guesser.drafter).to_json()
    if args.compare_plain and results:
        plain = text_quality(engine, prompts, [r["plain"]["tokens"] for r in results], guesser.drafter).to_json()
        out.update({f"plain_{k}": v for k, v in plain.items() if k != "tokens"})
        if out["perplexity"] and plain["perplexity"]:
            out["perplexity_ratio"] = out["perplexity"] / plain["perplexity"]
            if args.max_perplexity_ratio is not None:
                out["within_perplexity_cap"] = out["perplexity_ratio"] <= args.max_perplexity_ratio
    return out


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
        same = [r["identical_to_plain"] for r in results]
        s["identical_to_plain"] = None if None in same else all(same)  # None: sampled, not compared
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
    from workflows.cli.inputs import held_out_questions

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


def check_sampled_accept(args) -> None:
    """`planner accept --temperature ...`'s own flags, before any model loads."""
    if not 1 <= args.width <= 64 or not 0 <= args.samples <= 10000:
        raise UserError(f"--width: expected 1..64, got {args.width}; --samples: expected 0..10000, got {args.samples}")
    if args.plan:
        raise UserError("--plan: state transitions are measured greedily; drop --temperature")


def sampled_acceptance(engine, guesser, prompts: list, args, s) -> dict:
    """The guesser's acceptance record under s on any engine (profiler/sampled.py): the target samples
    each prompt once (prompt i with --seed + i); a deterministic guesser's guesses are scored with the
    target's warped p, a draft LM's sampled children with sum min(p, q) and the sibling procedure.
    With --calibrate, its live signal's calibration on a second sampled pass, each guess scored p(x)."""
    from decoder.guessers.registry import kind_of
    from profiler import sampled as sp

    spec = kind_of(guesser)
    if spec.hybrid or spec.loop is not None or spec.signal == "none" and not spec.needs_embeddings:
        raise UserError(f"--guesser {spec.name}: acceptance is measured per guesser (lookup, ppd, draft, parallelspec, "
                        "chain)")
    cont = sp.sampled_continuations(engine, prompts, args.max_new_tokens, s, seed=args.seed,
                                    ppd=guesser if spec.needs_embeddings else None)
    if spec.needs_embeddings:
        acc = cont.ppd
    elif spec.samples:
        acc = sp.draft_sampled_accuracy(engine, guesser, cont, guesser.num_distances, args.width, args.samples,
                                        args.seed)
    else:
        depth, width = spec.measure_shape or (guesser.num_distances, getattr(guesser, "top_k", 1))
        acc = sp.replay_sampled_accuracy(engine, guesser, cont, depth, width)
    acc["guesser"].update(dir=guesser.source_dir, kind=spec.name)
    if args.calibrate:
        import numpy as np

        from profiler.calibration import measure_calibration

        acc["calibration"] = measure_calibration(engine, guesser, prompts, np.array(acc["accuracy"]),
                                                 max_new_tokens=args.max_new_tokens, progress=not args.no_progress,
                                                 sampling=s, seed=args.seed + len(prompts))
    return acc


def write_sampled_acceptance(args, acc: dict, s, where: str = "") -> None:
    """The record checked as `planner plan` will read it, written to --output, and its one line."""
    from planner.accept import from_entry
    from planner.jsonio import atomic_write_json
    from planner.sampling import record

    from_entry({"accuracy": acc["accuracy"]}, label=args.output)
    atomic_write_json(args.output, acc)
    top = ", ".join(f"d{d + 1}: {row[0]:.3f}" for d, row in enumerate(acc["accuracy"]))
    print(f"rank-0 acceptance under {record(s)}: {top} over {acc['positions']} positions{where}; wrote {args.output}")


def step_lengths(guesser, tree, engine) -> dict:
    """Forward lengths per state: the decoder's real ones and the plan's count."""
    if tree is not None and tree.dynamic is not None:  # chosen every step: the sizes it may choose
        n = min(tree.dynamic.max_size + 1, len(tree.dynamic.step_cost_s))
        return {"real": {"0": n}, "planned": {"0": n}}
    if hasattr(guesser, "layouts") and getattr(guesser, "input_embeddings", lambda: None)() is not None:
        layouts = guesser.layouts(tree, engine.dtype, engine.device)
        return {"real": {str(s): b.input_length for s, b in layouts.states.items()},
                "planned": {str(s): b.planned_input_length for s, b in layouts.states.items()}}
    n = 1 + (len(tree.states[0].nodes) if tree is not None else getattr(guesser, "num_distances", 4))
    return {"real": {"0": n}, "planned": {"0": n}}
