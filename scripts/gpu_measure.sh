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
#   autotune   planner autotune on the GPU (built-in model)
# Everything lands in OUT_DIR with the device name in the file names; copy what you keep into
# profiles/ and bench/results/ and quote it in the README.
set -euo pipefail
stage=${1:?usage: gpu_measure.sh kernels|flex|profiles|repeat|autotune [OUT_DIR]}
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
  autotune) python3 -m planner autotune --out "$out/autotune-$gpu-builtin" --quiet ;;
  *) echo "gpu_measure.sh: unknown stage '$stage' (kernels, flex, profiles, repeat, autotune)" >&2; exit 2 ;;
esac
