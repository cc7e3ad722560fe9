"""Timing riders for a GPU session: PEARL's overlap on two CUDA streams (issue 15) and MTAD's beam
drafting at W up to 8 (issue 17), on SmolLM2's architecture. Random weights are enough for timing
(the registry package need not be installed there); acceptance numbers from this script mean
nothing, and it says so in its output.

    python scripts/gpu_riders.py pearl --out DIR            # default device cuda, bf16
    python scripts/gpu_riders.py mtad --out DIR
    python scripts/gpu_riders.py pearl --smoke --out DIR    # tiny model on the CPU, seconds (tests run it)

pearl: per gamma, plain decoding, speculative decoding with the same 2-layer drafter (a chain of
gamma), and PEARL concurrent (two streams) and serial (the same jobs one after the other); per
round the drafter's and the target's busy time, so the overlap eta = 1 - (concurrent round -
max) / min is measured where it matters. mtad: per W in 1, 2, 4, 8 at gamma 4, the drafter's
time per step (beam drafting at batch W) and the whole step. Writes DIR/gpu-riders-KIND.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from planner.errors import UserError  # noqa: E402


def _models(args):
    from decoder.engines.hf.load import load_model
    from decoder.torch_ops.draft_lm import build_draft_lm

    spec = "tiny" if args.smoke else args.model
    loaded = load_model(spec, device=args.device, dtype=args.dtype, weights=False)
    torch.manual_seed(0)
    draft = build_draft_lm(loaded.model, 1 if args.smoke else 2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, loaded.model.config.vocab_size - 1, (args.context,), generator=g).to(loaded.model.device)
    return loaded, draft, ids


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def pearl(args) -> dict:
    from decoder import DraftModelGuesser, Pearl, generate

    loaded, draft, ids = _models(args)
    target, dev = loaded.model, loaded.model.device
    n = args.tokens
    rows = []
    _timed(lambda: generate(target, ids, max_new_tokens=4), dev)  # warm-up
    plain = statistics.median(_timed(lambda: generate(target, ids, max_new_tokens=n), dev)[1]
                              for _ in range(args.repeats))
    for gamma in args.gammas:
        row = {"gamma": gamma}
        for kind in ("sd", "pearl", "pearl_serial"):
            def run(kind=kind):
                if kind == "sd":
                    return generate(target, ids, None, DraftModelGuesser(draft, top_k=1, depth=gamma), max_new_tokens=n)
                return generate(target, ids, Pearl(draft, gamma, concurrent=kind == "pearl"), max_new_tokens=n)
            run()  # warm-up of this shape
            outs = [_timed(run, dev) for _ in range(args.repeats)]
            secs = statistics.median(t for _, t in outs)
            out = outs[0][0]
            row[kind] = {"tokens_per_s": len(out.tokens) / secs, "speedup": plain / secs * len(out.tokens) / n}
            if kind != "sd":
                rounds = out.stats.rounds
                row[kind].update({"rounds": len(rounds),
                                  "draft_s": statistics.median(r.draft_s for r in rounds),
                                  "target_s": statistics.median(r.target_s for r in rounds),
                                  "decide_s": statistics.median(r.decide_s for r in rounds),
                                  "round_s": (out.stats.total_s - out.stats.prefill_s) / max(len(rounds), 1)})
        c, s = row["pearl"], row["pearl_serial"]
        a, b = c["draft_s"], c["target_s"]
        # 1: the concurrent round lasts as long as its longer side; 0: as long as both one after the other
        row["eta"] = 1 - (c["round_s"] - c["decide_s"] - max(a, b)) / min(a, b) if min(a, b) > 0 else None
        rows.append(row)
        print(json.dumps({"gamma": gamma, "eta": row["eta"], "pearl": round(c["speedup"], 3),
                          "serial": round(s["speedup"], 3), "sd": round(row["sd"]["speedup"], 3)}), file=sys.stderr)
    return {"kind": "pearl", "plain_s": plain, "rows": rows}


def mtad(args) -> dict:
    from decoder import MTADGuesser, generate
    from decoder.guessers.mtad import MTAD_SAMPLING

    loaded, draft, ids = _models(args)
    target, dev = loaded.model, loaded.model.device
    rows = []
    for w in args.widths:
        def run(w=w):
            s = MTAD_SAMPLING  # the paper's warp
            return generate(target, ids, None, MTADGuesser(draft, width=w, gamma=args.gamma, tau_acc=0.1), args.tokens,
                            seed=0, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        run()  # warm-up
        outs = [_timed(run, dev) for _ in range(args.repeats)]
        out, secs = outs[0][0], statistics.median(t for _, t in outs)
        times = out.stats.times
        # the beam draft runs in the session's propose, timed with the step's input preparation
        draft_ms = 1e3 * statistics.median(times["prepare"]) if times["prepare"] else None
        rows.append({"width": w, "gamma": args.gamma, "steps": out.steps, "tokens": len(out.tokens), "seconds": secs,
                     "ms_per_step": 1e3 * secs / max(out.steps, 1), "draft_ms_per_step": draft_ms})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return {"kind": "mtad", "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["pearl", "mtad"])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m", help="a preset or model (random weights are used)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gammas", default="2,3,4,5,6")
    p.add_argument("--widths", default="1,2,4,8")
    p.add_argument("--gamma", type=int, default=4, help="mtad: draft tokens per step")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, seconds")
    args = p.parse_args(argv)
    args.gammas = [int(x) for x in args.gammas.split(",")]
    args.widths = [int(x) for x in args.widths.split(",")]
    if args.smoke:
        args.device, args.dtype, args.context, args.tokens, args.repeats = "cpu", "fp32", 12, 8, 1
        args.gammas, args.widths = [2], [1, 2]
    try:
        result = pearl(args) if args.kind == "pearl" else mtad(args)
    except UserError as e:
        print(f"gpu_riders: error: {e}", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    result.update({"device": dev, "model": "tiny (smoke)" if args.smoke else args.model, "dtype": args.dtype,
                   "weights": "random (timing only; acceptance is meaningless)", "tokens": args.tokens,
                   "context": args.context, "repeats": args.repeats, "torch": torch.__version__})
    from planner.jsonio import atomic_write_json

    path = atomic_write_json(Path(args.out) / f"gpu-riders-{args.kind}.json", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
