#!/usr/bin/env bash
# The GPU measurements the issues ask for, in stages that each fit a 10-minute command.
#
#   bash scripts/gpu_measure.sh STAGE [OUT_DIR]      (OUT_DIR defaults to $OUT, else gpu-results/)
#
# Stages:
#   smoke      run it first (under 4 min): the user's whole journey on CUDA with the built-in toy
#              model (fp32): planner profile (kernel path) and a SmolLM2-architecture profile,
#              planner accept --guesser lookup, planner plan medusa from both, planner decode
#              --compare-plain with the plan; fails unless the output equals plain decoding's and
#              transformers' generate, and the Triton tree kernels ran compiled (their cubins in a
#              fresh Triton cache) and match their references in fp32/fp16/bf16. One line per step with
#              its time, then "smoke: PASS|FAIL ..."; files OUT_DIR/<gpu>-smoke-*, summary
#              OUT_DIR/<gpu>-smoke.json
#   kernels    bench/bench_kernels.py without FlexAttention: tree attention vs SDPA with the dense
#              mask, KV compaction, verification floor, decoder step dense vs kernels (~3-5 min)
#   flex       the same with FlexAttention (one torch.compile per shape; can take 10 min)
#   profiles   planner profile, Llama-2-7B fp16 random weights, contexts 256 and 1024,
#              input lengths 1..512, dense mask and kernel path (4 x 90 s budget)
#   repeat     the context-256 dense profile again, to see how stable a profile is
#   smollm2    planner profile, SmolLM2-135M's architecture (random weights: latency only) bf16,
#              context 256, input lengths 1..512, with and without CUDA graphs, then the
#              planner's choice on it with the CPU-measured acceptance of every guesser
#   batch      planner profile at batch sizes 1..64, padded and packed, SmolLM2's architecture and
#              Llama-2-7B bf16, and the per-batch-size schedule and exports from them
#   autotune   planner autotune on the GPU (built-in model: SmolLM2's 93 MB package does not fit a call)
#   pearl      PEARL on two CUDA streams vs serial vs SD vs plain, SmolLM2 architecture (scripts/gpu_riders.py)
#   mtad       MTAD beam drafting at W = 1, 2, 4, 8, SmolLM2 architecture (scripts/gpu_riders.py)
# Everything lands in OUT_DIR with the device name in the file names; copy what you keep into
# profiles/ and bench/results/ and quote it in the README. Without a CUDA device every stage exits 2
# with one line, before anything is written (tests/test_gpu_measure.py).
set -euo pipefail
stages="smoke kernels flex profiles repeat smollm2 batch autotune pearl mtad"
stage=${1:-}
if [ -z "$stage" ]; then
  echo "usage: gpu_measure.sh STAGE [OUT_DIR] (stages: ${stages// /, })" >&2; exit 2
fi
case " $stages " in
  *" $stage "*) ;;
  *) echo "gpu_measure.sh: unknown stage '$stage' (${stages// /, })" >&2; exit 2 ;;
esac
out=${2:-${OUT:-gpu-results}}
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
cd "$(dirname "$0")/.."
# The CUDA check comes before anything is created: without a device nothing is written.
gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "-").lower() if torch.cuda.is_available() else "")' 2>/dev/null || true)
if [ -z "$gpu" ]; then echo "gpu_measure.sh: no CUDA device here" >&2; exit 2; fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
lengths=1:32,36:128:4,136:256:8,272:512:16

# ------------------------------------------------------------------ smoke
# Every step's output goes to $p-STEP.log; the checks read the files the steps wrote.
smoke_step() {  # NAME CMD...: one line with the step's time (and its last line of output); stops at a failure
  local name=$1 t0 rc=0 dt last
  shift
  t0=$(date +%s.%N)
  timeout 200 "$@" >"$p-$name.log" 2>&1 || rc=$?
  dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  smoke_steps+=("$name:$dt:$rc")
  # the step's key line (a profile's L(n), accept's accuracy, plan's and decode's summaries), else its last one
  last=$(tr '\r' '\n' <"$p-$name.log" | grep -v '^[[:space:]]*$' | grep -E 'L\(1\)|accuracy|tokens/step' | tail -n 1 || true)
  [ -n "$last" ] || last=$(tr '\r' '\n' <"$p-$name.log" | grep -v '^[[:space:]]*$' | tail -n 1 || true)
  last=${last//"$out/"/}; last=${last:0:120}
  if [ "$rc" -eq 0 ]; then
    printf 'smoke: %-17s %6s s  %s\n' "$name" "$dt" "$last"
    return
  fi
  printf 'smoke: %-17s %6s s  FAILED (exit %s%s); the end of %s:\n' "$name" "$dt" "$rc" \
    "$([ "$rc" -eq 124 ] && echo ', timed out')" "$p-$name.log"
  tr '\r' '\n' <"$p-$name.log" | grep -v '^[[:space:]]*$' | tail -n 15 | sed 's/^/    /'
  smoke_finish FAIL "$name"
}

smoke_finish() {  # RESULT [FAILED_STEP]: the JSON summary and the one-line verdict; exits
  local total
  total=$(awk -v a="$smoke_t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if python3 - "$p" "$gpu" "$1" "${2:-}" "$total" ${smoke_steps[@]+"${smoke_steps[@]}"} <<'EOF'
import json, sys

prefix, gpu, result, failed, total, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), sys.argv[6:]


def read(name):
    try:
        with open(f"{prefix}-{name}.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


doc = {"stage": "smoke", "gpu": gpu, "result": result, "failed_step": failed or None, "total_s": total,
       "steps": [{"name": n, "seconds": float(t), "exit": int(rc)} for n, t, rc in (s.rsplit(":", 2) for s in steps)]}
decode, check, kernels, plan = read("decode"), read("check"), read("kernels"), read("plan")
if plan:
    doc["plan"] = {k: plan.get(k) for k in ("method", "expected_tokens_per_step", "predicted_speedup")}
if decode:
    doc["decode"] = {k: decode["summary"].get(k) for k in ("prompts", "tokens", "tokens_per_step", "tokens_per_s",
                                                           "plain_tokens_per_s", "speedup", "identical_to_plain",
                                                           "identical", "near_ties", "mismatches")}
if check:
    doc["check"] = check
if kernels:
    doc["kernels"] = kernels
if result == "PASS":
    d = doc.get("decode", {})
    line = (f"smoke: PASS on {gpu} in {total:.0f} s: the plan's output equals plain decoding's and generate's on "
            f"{d.get('prompts')} prompts ({d.get('tokens_per_step') or 0:.2f} tokens/step, "
            f"{d.get('speedup') or 0:.2f}x plain), Triton kernels compiled and match their references")
else:
    line = f"smoke: FAIL at step {failed} after {total:.0f} s on {gpu} (its log: {prefix}-{failed}.log)"
line += f"; summary {prefix}.json"
doc["line"] = line
with open(f"{prefix}.json", "w") as f:
    json.dump(doc, f, indent=1)
print(line)
EOF
  then :; else echo "smoke: $1${2:+ at step $2} (the summary $p.json could not be written)"; fi
  [ "$1" = PASS ] && exit 0
  exit 1
}

smoke() {
  p="$out/$gpu-smoke"
  smoke_steps=()
  smoke_t0=$(date +%s.%N)
  smoke_tmp=$(mktemp -d -t gpu-smoke-XXXXXX)
  trap 'rm -rf "$smoke_tmp"' EXIT
  unset TRITON_INTERPRET  # the kernels must run compiled, not under Triton's interpreter
  export SMOKE_PREFIX="$p" SMOKE_TMP="$smoke_tmp"
  rm -f "$p".json "$p"-*
  printf '%s\n' "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog." \
    "Write a short story about a cat who learns to cook." "What are three tips for staying healthy?" \
    "Correct the grammar of this sentence: she go to school every days and she like it." \
    "Explain what a computer is to a child." "List the days of the week, then list them again in reverse order." \
    >"$p-prompts-accept.txt"
  printf '%s\n' "Summarise this: the meeting moved from Monday to Tuesday because the room was booked." \
    "Give me a recipe for pancakes." "Rewrite this sentence in the past tense: I walk to the park and I see a dog." \
    "What is the capital of France, and why is it famous?" >"$p-prompts-decode.txt"
  local toy=(--model builtin --device cuda --dtype fp32)  # the 2.4 M toy model with its weights and tokenizer
  smoke_step env python3 -c '
import torch, transformers, triton
major, minor = torch.cuda.get_device_capability()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"triton {triton.__version__}, {torch.cuda.get_device_name()} (sm_{major}{minor})")'
  smoke_step profile-builtin python3 -m planner profile "${toy[@]}" --attention tree --context-length 256 \
    --input-lengths 1:16,20:64:4 --time-budget 20 --no-progress -o "$p-profile-builtin.json"
  smoke_step profile-smollm2 python3 -m planner profile --model smollm2-135m --device cuda --dtype bf16 \
    --context-length 256 --input-lengths 1:16,20:64:4 --time-budget 15 --no-progress -o "$p-profile-smollm2-135m.json"
  smoke_step accept python3 -m planner accept "${toy[@]}" --guesser lookup --prompts "$p-prompts-accept.txt" \
    --max-new-tokens 64 --no-progress -o "$p-accept-lookup.json"
  smoke_step plan python3 -m planner plan medusa --accept "$p-accept-lookup.json" --profile "$p-profile-builtin.json" \
    -o "$p-plan.json"
  smoke_step decode env TRITON_CACHE_DIR="$smoke_tmp/triton-decode" python3 -m planner decode "${toy[@]}" \
    --plan "$p-plan.json" --guesser lookup --prompts "$p-prompts-decode.txt" --max-new-tokens 64 --compare-plain \
    --no-progress -o "$p-decode.json"
  # The plan's tokens against plain decoding's (decode --compare-plain) and transformers' generate, and the
  # decode's Triton kernels compiled: their cubins in the fresh cache it was given (the interpreter writes none).
  smoke_step check-decode python3 - <<'EOF'
import glob, json, os, sys

import torch
from transformers import AutoModelForCausalLM

prefix, tmp = os.environ["SMOKE_PREFIX"], os.environ["SMOKE_TMP"]
with open(prefix + "-decode.json") as f:
    doc = json.load(f)
s, dev, problems = doc["summary"], doc["device"], []
if not str(dev).startswith("cuda"):
    problems.append(f"decoded on {dev}, not CUDA")
if s.get("identical_to_plain") is not True:
    problems.append(f"the plan's output differs from plain decoding's: {s.get('identical')} identical, "
                    f"{s.get('near_ties')} near ties, {s.get('mismatches')} mismatches")
model = AutoModelForCausalLM.from_pretrained("models/builtin").to(device=dev, dtype=torch.float32).eval()
same, differences = 0, []
for k, r in enumerate(doc["results"]):
    ids = torch.tensor([r["prompt_ids"]], device=dev)
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=doc["settings"]["max_new_tokens"],
                             eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
        ref = ref[0, ids.shape[1]:].tolist()
        if ref == r["tokens"]:
            same += 1
            continue
        i = next((j for j, (a, b) in enumerate(zip(ref, r["tokens"])) if a != b), min(len(ref), len(r["tokens"])))
        top = model(torch.tensor([r["prompt_ids"] + ref[:i]], device=dev)).logits[0, -1].float().topk(2).values
        differences.append({"prompt": k, "position": i, "top2_logit_gap": float(top[0] - top[1])})  # tiny: a near tie
if same != len(doc["results"]):
    problems.append(f"generate's tokens equal the plan's on {same} of {len(doc['results'])} prompts "
                    f"(first differences: {differences})")
cubins = sorted({os.path.basename(f)[: -len(".cubin")]
                 for f in glob.glob(os.path.join(tmp, "triton-decode", "**", "*.cubin"), recursive=True)})
if "_tree_attn_fwd" not in cubins:
    problems.append(f"the decode compiled no Triton tree-attention kernel (cubins: {cubins or 'none'})")
with open(prefix + "-check.json", "w") as f:
    json.dump({"identical_to_plain": s.get("identical_to_plain"), "equal_to_generate": same,
               "prompts": len(doc["results"]), "generate_differences": differences, "decode_cubins": cubins,
               "problems": problems}, f, indent=1)
print("; ".join(problems) if problems else
      f"plan = plain = generate on {same} prompts; decode compiled {', '.join(cubins)}")
sys.exit(1 if problems else 0)
EOF
  # The kernels themselves, compiled (TRITON_INTERPRET unset, cubins in a fresh cache), against their
  # PyTorch references in fp32/fp16/bf16 (the tolerances of tests/test_kernels.py).
  smoke_step kernels env TRITON_CACHE_DIR="$smoke_tmp/triton-kernels" python3 - <<'EOF'
import glob, json, os, sys

import torch

import kernels
from kernels.reference import kv_compact_ref, tree_attention_ref

prefix, tmp = os.environ["SMOKE_PREFIX"], os.environ["SMOKE_TMP"]
problems = [] if not os.environ.get("TRITON_INTERPRET") else ["TRITON_INTERPRET is set"]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
g = torch.Generator().manual_seed(0)
errors = {}
for dtype, tol in TOL.items():
    worst = 0.0
    for n, prefix_len, h, h_kv, d in ((1, 0, 4, 4, 64), (7, 50, 4, 2, 48), (33, 200, 8, 2, 128), (64, 1000, 32, 8, 128)):
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
        q = torch.randn(1, h, n, d, generator=g).to("cuda", dtype)
        k, v = (torch.randn(1, h_kv, prefix_len + n, d, generator=g).to("cuda", dtype) for _ in range(2))
        got = kernels.tree_attention(q, k, v, parents, prefix_len, backend="triton").float()
        want = tree_attention_ref(q, k, v, parents, prefix_len).float()
        worst = max(worst, (got - want).abs().max().item())
        if not torch.allclose(got, want, atol=tol, rtol=tol):
            problems.append(f"tree_attention {str(dtype)[6:]} n={n} prefix={prefix_len} d={d}: max error "
                            f"{(got - want).abs().max().item():.2e} (tolerance {tol:g})")
    layers = [torch.randn(1, 2, 300, 64, generator=g).to("cuda", dtype) for _ in range(8)]
    ref = [t.clone() for t in layers]
    accepted = torch.tensor([0, 3, 7, 12, 20], device="cuda")
    kv_compact_ref(ref[:4], ref[4:], 250, accepted)
    new_len = kernels.kv_compact(layers[:4], layers[4:], 250, accepted, backend="triton")
    if new_len != 255 or not all(torch.equal(a[:, :, :new_len], b[:, :, :new_len]) for a, b in zip(layers, ref)):
        problems.append(f"kv_compact {str(dtype)[6:]}: rows differ from the reference (new length {new_len})")
    errors[str(dtype)[6:]] = worst
torch.cuda.synchronize()
cubins = sorted({os.path.basename(f)[: -len(".cubin")]
                 for f in glob.glob(os.path.join(tmp, "triton-kernels", "**", "*.cubin"), recursive=True)})
missing = {"_tree_attn_fwd", "_kv_compact"} - set(cubins)
if missing:
    problems.append(f"no compiled cubin for {', '.join(sorted(missing))} (cubins: {cubins or 'none'}): not compiled?")
with open(prefix + "-kernels.json", "w") as f:
    json.dump({"tree_attention_max_error": errors, "cubins": cubins, "problems": problems}, f, indent=1)
print("; ".join(problems) if problems else
      "compiled " + ", ".join(cubins) + "; max error " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
sys.exit(1 if problems else 0)
EOF
  smoke_finish PASS
}

case "$stage" in
  smoke)    smoke ;;
  # --loaded-ok: these time the GPU with CUDA events, and the CPU's load average after the earlier
  # stages (or the machine's own services) says nothing about them
  kernels)  python3 bench/bench_kernels.py --no-flex --loaded-ok --out "$out" ;;
  flex)     python3 bench/bench_kernels.py --no-step --loaded-ok --out "$out" ;;
  profiles)
    for ctx in 256 1024; do
      for attn in sdpa tree; do
        python3 -m planner profile --model llama-2-7b --dtype fp16 --context-length "$ctx" \
          --input-lengths "$lengths" --attention "$attn" --time-budget 90 --no-progress \
          -o "$out/$gpu-llama-2-7b-ctx$ctx-$attn.json" --plot "$out/$gpu-llama-2-7b-ctx$ctx-$attn.png"
      done
    done ;;
  repeat)
    python3 -m planner profile --model llama-2-7b --dtype fp16 --context-length 256 \
      --input-lengths "$lengths" --time-budget 90 --no-progress -o "$out/$gpu-llama-2-7b-ctx256-sdpa-repeat.json" ;;
  smollm2)
    for graphs in "" "--cuda-graphs"; do
      tag=$([ -n "$graphs" ] && echo graphs || echo eager)
      python3 -m planner profile --model smollm2-135m --dtype bf16 --context-length 256 --input-lengths "$lengths" \
        --time-budget 90 --no-progress $graphs -o "$out/$gpu-smollm2-135m-ctx256-$tag.json"
    done
    for acc in reports/autotune-cpu-smollm2-135m/accept-*.json; do
      [ -f "$acc" ] || continue
      kind=$(basename "$acc" .json | sed 's/^accept-//')
      method=$([ "$kind" = ppd ] && echo ppd || echo medusa)
      python3 -m planner plan "$method" --accept "$acc" --profile "$out/$gpu-smollm2-135m-ctx256-eager.json" -q \
        -o "$out/$gpu-smollm2-135m-$kind.json" || true
    done ;;
  batch)
    for model in smollm2-135m llama-2-7b; do
      for layout in padded packed; do
        python3 -m planner profile --model "$model" --dtype bf16 --context-length 256 --input-lengths 1:16,20:64:4 \
          --batch-sizes 1,2,4,8,16,32,64 --layout "$layout" --time-budget 120 --no-progress \
          -o "$out/$gpu-$model-batch-$layout.json"
      done
    done ;;
  autotune) python3 -m planner autotune --model builtin --out "$out/autotune-$gpu-builtin" --quiet ;;
  pearl)    python3 scripts/gpu_riders.py pearl --out "$out" ;;
  mtad)     python3 scripts/gpu_riders.py mtad --out "$out" ;;
esac
