"""Kernel benchmark (needs a CUDA GPU): tree attention and KV compaction against their baselines.

  python bench/bench_kernels.py [--repeats 30] [--no-flex] [--out bench/results]
  python bench/bench_kernels.py --smoke      # CPU, Triton interpreter, tiny shapes: checks the code paths only
  python bench/bench_kernels.py --compile-check   # no GPU: compile all variants for sm_80/sm_90 with ptxas

Tree attention, Llama-2-7B shapes (32 heads, head dim 128, fp16, batch 1), n tree tokens over a
cache of C tokens, n in {16, 32, 64, 128, 256}, C in {256, 2048, 8192}, all in the same run:
- triton: kernels.tree_attention (ancestor bitmasks, built once per tree shape, not timed);
- sdpa_dense: torch SDPA with the dense additive float mask [1, 1, n, C + n] the decoder builds
  today (mask built once, not timed; `sdpa_dense_with_mask_us` adds building it, as the decoder does every step);
- flex: torch.compile'd FlexAttention with a block mask from the same tree (block mask built
  once per shape; its build time is reported separately).
KV compaction, 32 layers, C = 2048, tree of 64 tokens, m accepted rows: kernels.kv_compact (one
launch) against the per-layer PyTorch gather + copy loop. Verification floor: argmax over the
tree's logits [n, 32000] plus the device-to-host copy, to judge whether a fused verification
kernel is worth writing (issue item 3).
Decoder step, Llama-2-7B with random weights (fp16, 32 layers), C in {256, 2048}, the same n: the
part of a decoding step that the kernels change, timed as the decoder runs it: tree inputs + one
forward + KV compaction. dense = the decoder's plain path (SDPA model, dense mask built on the
device each step, per-layer gather compaction); kernels = "tree_triton" (parents prepared once
per plan, no mask, one kv_compact launch). The two alternate within every repeat, and the first
pass checks that both give the same logits and the same compacted cache.

Medians over repeats of CUDA-event timings (each timing covers `inner` calls). Writes
bench/results/kernels.json and kernels.md. Without CUDA it prints a message and exits 0.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30, help="timings per case (median reported)")
    p.add_argument("--inner", type=int, default=10, help="calls per timing")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take minutes)")
    p.add_argument("--no-step", action="store_true", help="skip the decoder-step comparison (builds Llama-2-7B)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes, writes nothing")
    p.add_argument("--compile-check", action="store_true",
                   help="no GPU needed: compile every kernel variant for sm_80 and sm_90 with ptxas, "
                        "write bench/results/kernels_compile.json (shared memory per variant)")
    return p


def random_tree(n: int, seed: int = 0) -> list[int]:
    """A bushy random tree (parent among the previous 8 nodes), roughly the shape planners produce."""
    import random

    rng = random.Random(seed)
    return [-1] + [rng.randrange(max(0, i - 8), i) for i in range(1, n)]


def elapsed_us(device: str, fn, inner: int = 1) -> float:
    """Microseconds per call of `inner` back-to-back calls: CUDA events on the GPU (after draining
    whatever was queued before, so untimed work does not leak in), perf_counter on the CPU."""
    import torch

    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) * 1e6 / inner
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / inner


def timer(device: str, repeats: int, inner: int):
    def measure(fn) -> float:
        """Median microseconds per call."""
        for _ in range(3):
            fn()
        return statistics.median(elapsed_us(device, fn, inner) for _ in range(repeats))

    return measure


def alternating_timer(device: str, repeats: int):
    """Time several variants in turn within each repeat, so drift hits them alike.

    variants: name -> setup(); setup runs untimed (resets state) and returns the call to time once.
    Returns name -> median microseconds.
    """

    def measure_many(variants: dict) -> dict[str, float]:
        for setup in variants.values():  # warm-up (compiles, allocator)
            for _ in range(2):
                setup()()
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(repeats):
            names = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for name in names:
                fn = variants[name]()
                times[name].append(elapsed_us(device, fn))
        return {name: statistics.median(t) for name, t in times.items()}

    return measure_many


def bench_tree_attention(cfg, measure, use_flex: bool, progress):
    import torch
    import torch.nn.functional as F

    from decoder.torch_ops.forward import tree_attention_mask
    from planner.tree import ancestor_matrix
    from kernels import tree_attention, tree_attention_ref, tree_mask

    dev, dtype, H, H_kv, D = cfg["device"], cfg["dtype"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    flex = None
    if use_flex:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        dynamo_config.cache_size_limit = 64  # one compiled graph per (C, n) shape
    rows = []
    for C in cfg["prefix"]:
        for n in cfg["tree"]:
            parents = random_tree(n, seed=n)
            g = torch.Generator(device="cpu").manual_seed(n + C)
            q = torch.randn(1, H, n, D, generator=g).to(dev, dtype)
            k = torch.randn(1, H_kv, C + n, D, generator=g).to(dev, dtype)
            v = torch.randn(1, H_kv, C + n, D, generator=g).to(dev, dtype)
            tm = tree_mask(parents, device=dev)
            anc = ancestor_matrix(parents)
            dense = tree_attention_mask(anc, C, dtype, dev)  # [1, 1, n, C + n]
            ref = tree_attention_ref(q, k, v, parents, C).float()
            row = {"n": n, "C": C}

            out = tree_attention(q, k, v, tm, C, backend="triton")
            row["triton_max_err"] = float((out.float() - ref).abs().max())
            row["triton_us"] = measure(lambda: tree_attention(q, k, v, tm, C, backend="triton"))

            gqa = H != H_kv
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)  # noqa: E731
            row["sdpa_dense_max_err"] = float((sdpa().float() - ref).abs().max())
            row["sdpa_dense_us"] = measure(sdpa)
            row["sdpa_dense_with_mask_us"] = measure(
                lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=tree_attention_mask(anc, C, dtype, dev), enable_gqa=gqa
                )
            )

            if flex is not None:
                try:
                    anc_dev = anc.to(dev)

                    def mask_mod(b, h, qi, kv):
                        return (kv < C) | anc_dev[qi, (kv - C).clamp(min=0)]

                    t0 = time.perf_counter()
                    block_mask = create_block_mask(mask_mod, None, None, n, C + n, device=dev)
                    row["flex_block_mask_build_us"] = (time.perf_counter() - t0) * 1e6
                    fx = lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)  # noqa: E731
                    row["flex_max_err"] = float((fx().float() - ref).abs().max())
                    row["flex_us"] = measure(fx)
                except Exception as e:  # a FlexAttention limit must not lose the other columns
                    row["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            row["speedup_vs_sdpa_dense"] = row["sdpa_dense_us"] / row["triton_us"]
            rows.append(row)
            progress.update(1)
    return rows


def bench_kv_compact(cfg, measure, progress):
    import torch

    from kernels import kv_compact

    dev, dtype, H_kv, D = cfg["device"], cfg["dtype"], cfg["kv_heads"], cfg["head_dim"]
    layers, C, n = cfg["layers"], cfg["compact_prefix"], cfg["compact_tree"]
    ks = [torch.randn(1, H_kv, C + n, D, device=dev, dtype=dtype) for _ in range(layers)]
    vs = [torch.randn(1, H_kv, C + n, D, device=dev, dtype=dtype) for _ in range(layers)]
    rows = []
    for m in cfg["accepted"]:
        idx = torch.linspace(0, n - 1, m).round().long().unique().to(dev)  # a strictly increasing path

        def torch_loop():
            src = idx + C
            for t in ks + vs:
                t[:, :, C : C + idx.numel()] = t[:, :, src]

        rows.append({
            "layers": layers, "C": C, "n": n, "m": int(idx.numel()),
            "triton_us": measure(lambda: kv_compact(ks, vs, C, idx, backend="triton", validate=False)),
            "torch_loop_us": measure(torch_loop),
        })
        rows[-1]["speedup"] = rows[-1]["torch_loop_us"] / rows[-1]["triton_us"]
        progress.update(1)
    return rows


def bench_verify_floor(cfg, measure, progress):
    import torch

    rows = []
    for n in cfg["tree"]:
        logits = torch.randn(n, cfg["vocab"], device=cfg["device"], dtype=cfg["dtype"])
        rows.append({"n": n, "argmax_to_host_us": measure(lambda: logits.argmax(-1).cpu())})
        progress.update(1)
    return rows


def _attention(model, name: str) -> None:
    """Switch the model's attention between "sdpa" (the decoder's dense path) and "tree_triton" (the
    kernels, their backend set once by enable_tree_attention), through the hf engine's own switch."""
    from decoder.engines.hf.engine import select_attention

    select_attention(model, "dense" if name == "sdpa" else "kernels")


def bench_step(cfg, measure_many, progress):
    """One decoder step (tree inputs, forward, KV compaction) on a real model, dense mask vs kernels: the
    hf engine's own functions on its torch model, since a step's parts are what this section times."""
    import torch

    from common import open_hf
    from decoder.engines.hf.attention import enable_tree_attention, prepare_tree
    from decoder.torch_ops.cache import compact_cache
    from decoder.torch_ops.forward import prefill, step_mask, tree_attention_mask, tree_forward
    from planner.tree import ancestor_matrix, tree_depths

    dev = cfg["device"]
    engine = open_hf(cfg["step_model"], cfg["step_dtype"], device=dev)
    model = engine.torch_model()
    enable_tree_attention(model, backend="triton")  # registers "tree_triton"; each mode sets its own below
    vocab, dtype = engine.vocab_size, engine.dtype
    g = torch.Generator().manual_seed(0)
    rows = []
    for C in cfg["step_prefix"]:
        _attention(model, "sdpa")
        cache = prefill(model, torch.randint(0, vocab, (1, C), generator=g).to(dev)).cache
        prefix = [(layer.keys, layer.values) for layer in cache.layers]  # [1, H_kv, C, d] each, never written

        def reset():
            for layer, (k, v) in zip(cache.layers, prefix):
                layer.keys, layer.values = k, v

        for n in cfg["tree"]:
            parents = random_tree(n, seed=n)
            ids = torch.randint(0, vocab, (1, n), generator=g).to(dev)
            depths = tree_depths(parents)
            pos = (C + torch.tensor(depths))[None].to(dev)  # [1, n]
            anc = torch.from_numpy(ancestor_matrix(parents))  # [n, n]
            block = tree_attention_mask(anc, 0, dtype, dev)[0, 0]  # [n, n] additive
            tm = prepare_tree(parents, dev)  # once per plan in the decoder
            deepest = max(range(n), key=depths.__getitem__)
            path = anc[deepest].nonzero()[:, 0].to(dev)  # [m] accepted root-to-leaf path, in order

            def dense_step():
                _attention(model, "sdpa")
                reset()
                mask = step_mask(block, C)  # built every step, as decoder/loop.py does
                return lambda: (tree_forward(model, ids, pos, mask, cache).logits, compact_cache(cache, C, path))[0]

            def kernel_step():
                _attention(model, "tree_triton")
                reset()
                return lambda: (tree_forward(model, ids, pos, None, cache, tree=tm).logits,
                                compact_cache(cache, C, path, kernel=True, validate=False))[0]

            out_d = dense_step()()
            keys_d = [layer.keys.clone() for layer in cache.layers]
            out_k = kernel_step()()
            row = {"C": C, "n": n, "accepted": int(path.numel()),
                   "logits_max_err": float((out_d.float() - out_k.float()).abs().max()),
                   "cache_max_err": max(float((a.float() - layer.keys.float()).abs().max())
                                        for a, layer in zip(keys_d, cache.layers))}
            times = measure_many({"dense": dense_step, "kernels": kernel_step})
            row["dense_us"], row["kernels_us"] = times["dense"], times["kernels"]
            row["speedup"] = row["dense_us"] / row["kernels_us"]
            rows.append(row)
            progress.update(1)
        reset()
    _attention(model, "sdpa")
    return rows


def compile_check(out_dir: Path):
    """Ahead-of-time compile of each kernel variant the wrappers can launch, for A100 and H100.

    Catches what the CPU interpreter cannot: lowering errors, tl.dot shape limits, and tiles that
    need more shared memory than the SM has (164 KiB on sm_80, 227 KiB on sm_90).
    """
    import importlib

    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ta = importlib.import_module("kernels.tree_attention")  # the package re-exports a function of the same name
    kc = importlib.import_module("kernels.kv_compact")
    limits = {80: 164 * 1024, 90: 227 * 1024}
    tnames = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

    def build(fn, types, consts, options, arch):
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                              options=options)

    rows_out, failed = [], 0
    cases = [(dt, d, rows, split) for dt in tnames for d in (64, 128) for rows in (16, 64, 300) for split in (False, True)]
    from tqdm import tqdm

    for arch in limits:
        for dt, d, rows, split in tqdm(cases, desc=f"sm_{arch}"):
            cfg = ta.launch_config(dt, d, rows)
            options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
            t = tnames[dt]
            types = {"Q": f"*{t}", "K": f"*{t}", "V": f"*{t}", "Out": f"*{t}", "Bits": "*i32", "Mid": "*fp32",
                     "Lse": "*fp32", "qk_scale": "fp32"}
            row = {"arch": arch, "kernel": "tree_attention", "dtype": t, "head_dim": d, "rows": rows, "split": split,
                   **{k: v for k, v in cfg.items() if k.startswith("BLOCK")}, **options}
            try:
                k = build(ta._tree_attn_fwd, types, {**cfg, "SPLIT": split, "GROUP": 1, "HEAD_DIM": d}, options, arch)
                row["shared_bytes"] = k.metadata.shared
                row["fits"] = k.metadata.shared <= limits[arch]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                row["fits"] = False
            failed += not row["fits"]
            rows_out.append(row)
        for t, tdt in (("fp16", tl.float16), ("bf16", tl.bfloat16), ("fp32", tl.float32)):
            k = build(kc._kv_compact, {"Ptrs": "*i64", "Idx": "*i64"},
                      {"HEAD_DIM": 128, "BLOCK_T": 32, "BLOCK_D": 128, "DTYPE": tdt}, {"num_warps": 4}, arch)
            rows_out.append({"arch": arch, "kernel": "kv_compact", "dtype": t, "shared_bytes": k.metadata.shared, "fits": True})
        k = build(ta._split_combine, {"Mid": "*fp32", "Lse": "*fp32", "Out": "*fp16"},
                  {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_R": 16}, {"num_warps": 4}, arch)
        rows_out.append({"arch": arch, "kernel": "split_combine", "dtype": "fp16", "shared_bytes": k.metadata.shared, "fits": True})
    from common import Results

    said = [f"does not fit or failed: {r}" for r in rows_out if not r["fits"]]
    said.append(f"{len(rows_out) - failed}/{len(rows_out)} variants compile and fit")
    return Results({out_dir / "kernels_compile.json": {"triton": triton.__version__, "variants": rows_out}},
                   "\n".join(said), 1 if failed else 0)


def write_markdown(res) -> str:
    lines = [
        "# Kernel benchmark", "",
        f"Machine: {res['machine']}; torch {res['torch']}, triton {res['triton']}. "
        f"Medians over {res['repeats']} timings of {res['inner']} calls, microseconds per call.", "",
        f"## Tree attention ({res['config']['heads']} heads, {res['config']['kv_heads']} KV heads, "
        f"d = {res['config']['head_dim']}, {res['config']['dtype']}, batch 1)", "",
        "| C | n | triton | SDPA dense mask | SDPA + mask build | flex | speedup vs SDPA |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["tree_attention"]:
        flex = f"{r['flex_us']:.1f}" if "flex_us" in r else ("error" if "flex_error" in r else "-")
        lines.append(
            f"| {r['C']} | {r['n']} | {r['triton_us']:.1f} | {r['sdpa_dense_us']:.1f} | "
            f"{r['sdpa_dense_with_mask_us']:.1f} | {flex} | {r['speedup_vs_sdpa_dense']:.2f} |"
        )
    lines += ["", "## KV compaction (one launch vs a per-layer PyTorch loop; tree of "
              f"{res['config']['compact_tree']} tokens)", "",
              "| layers | C | m | triton | torch loop | speedup |", "|---|---|---|---|---|---|"]
    for r in res["kv_compact"]:
        lines.append(f"| {r['layers']} | {r['C']} | {r['m']} | {r['triton_us']:.1f} | {r['torch_loop_us']:.1f} | {r['speedup']:.2f} |")
    if res.get("step"):
        lines += ["", f"## Decoder step: tree inputs + forward + KV compaction ({res['config']['step_model']}, "
                  f"{res['config']['step_dtype']}, random weights)", "",
                  "| C | n | accepted | dense mask | kernels | speedup | max logit diff |", "|---|---|---|---|---|---|---|"]
        for r in res["step"]:
            lines.append(f"| {r['C']} | {r['n']} | {r['accepted']} | {r['dense_us']:.1f} | {r['kernels_us']:.1f} | "
                         f"{r['speedup']:.2f} | {r['logits_max_err']:.2g} |")
    lines += ["", "## Verification floor (argmax over [n, vocab] logits + copy to host)", "",
              "| n | us |", "|---|---|"]
    for r in res["verify_floor"]:
        lines.append(f"| {r['n']} | {r['argmax_to_host_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from common import bench_main

    return bench_main("bench_kernels", parser(), run, argv, writes=lambda a: not a.smoke and not a.compile_check)


def run(args):
    from common import Results, machine, sample_load

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    if args.compile_check:  # static: no timing, no load to judge
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_check(args.out)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        return Results({}, "bench_kernels: no CUDA device; GPU timings skipped (use --smoke to check the code paths on "
                           "the CPU)")
    import triton
    from tqdm import tqdm

    if args.smoke:
        cfg = dict(device="cpu", dtype=torch.float32, heads=4, kv_heads=2, head_dim=64, prefix=[0, 70], tree=[16, 33],
                   layers=3, compact_prefix=40, compact_tree=16, accepted=[1, 4], vocab=1000,
                   step_model="tiny", step_dtype="fp32", step_prefix=[40])
        repeats, inner = 1, 1
    else:
        cfg = dict(device="cuda", dtype=torch.float16, heads=32, kv_heads=32, head_dim=128,
                   prefix=[256, 2048, 8192], tree=[16, 32, 64, 128, 256],
                   layers=32, compact_prefix=2048, compact_tree=64, accepted=[1, 2, 4, 8, 16], vocab=32000,
                   step_model="llama-2-7b", step_dtype="fp16", step_prefix=[256, 2048])
        repeats, inner = args.repeats, args.inner
    measure = timer(cfg["device"], repeats, inner)
    use_flex = not args.no_flex and not args.smoke
    total = (len(cfg["prefix"]) + (0 if args.no_step else len(cfg["step_prefix"]))) * len(cfg["tree"]) \
        + len(cfg["accepted"]) + len(cfg["tree"])
    res = {
        "machine": torch.cuda.get_device_name() if cfg["device"] == "cuda" else f"{platform.machine()} CPU (interpreter)",
        "host": machine(), "torch": torch.__version__, "triton": triton.__version__, "repeats": repeats, "inner": inner,
        "config": {k: (str(v) if k == "dtype" else v) for k, v in cfg.items()},
    }
    with tqdm(total=total, desc="bench_kernels") as progress:
        try:
            res["tree_attention"] = bench_tree_attention(cfg, measure, use_flex, progress)
            sample_load()
            res["kv_compact"] = bench_kv_compact(cfg, measure, progress)
            res["verify_floor"] = bench_verify_floor(cfg, measure, progress)
            sample_load()
            if not args.no_step:
                res["step"] = bench_step(cfg, alternating_timer(cfg["device"], repeats), progress)
        except KeyboardInterrupt:
            print("bench_kernels: interrupted, nothing written", file=sys.stderr)
            return Results({}, "", 130)
    md = write_markdown(res)
    if args.smoke:
        bad = [r for r in res["tree_attention"] if r["triton_max_err"] > 1e-4]
        bad += [r for r in res.get("step", []) if r["logits_max_err"] > 1e-3 or r["cache_max_err"] > 1e-4]
        said = "smoke: " + ("FAILED" if bad else "ok (kernels match references and the dense step; CPU timings are "
                                                 "meaningless)")
        return Results({}, md + said, 1 if bad else 0)  # smoke writes nothing
    return Results({args.out / "kernels.json": res, args.out / "kernels.md": md}, md)


if __name__ == "__main__":
    sys.exit(main())
