#!/usr/bin/env bash
# The GPU measurements the issues ask for, in stages that each fit a 10-minute command.
#
#   bash scripts/gpu_measure.sh STAGE [OUT_DIR]      (OUT_DIR defaults to $OUT, else gpu-results/)
#
# Stages:
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
# profiles/ and bench/results/ and quote it in the README.
set -euo pipefail
stage=${1:?usage: gpu_measure.sh kernels|flex|profiles|repeat|smollm2|batch|autotune|pearl|mtad [OUT_DIR]}
out=${2:-${OUT:-gpu-results}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "-").lower() if torch.cuda.is_available() else "")')
if [ -z "$gpu" ]; then echo "gpu_measure.sh: no CUDA device here" >&2; exit 2; fi
lengths=1:32,36:128:4,136:256:8,272:512:16

case "$stage" in
  kernels)  python3 bench/bench_kernels.py --no-flex --out "$out" ;;
  flex)     python3 bench/bench_kernels.py --no-step --out "$out" ;;
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
  *) echo "gpu_measure.sh: unknown stage '$stage' (kernels, flex, profiles, repeat, smollm2, batch, autotune, pearl, mtad)" >&2; exit 2 ;;
esac
