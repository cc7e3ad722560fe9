#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the source vendored in llama-cpp-python 0.3.36 (the same llama.cpp
# as the --engine llama.cpp engine), with the same flags (native CPU, llamafile matmul path off), into
# $TREE_PLANNER_CACHE/llama-server/bin/llama-server. About 5-10 minutes on 2 cores, once; skipped when
# the binary is there. bench/bench_llama_server.py and `planner export --engine llama-server` use it.
set -euo pipefail
PY=${PYTHON:-python3}
VERSION=0.3.36
CACHE="${TREE_PLANNER_CACHE:-$HOME/.cache/tree-planner}"
OUT="$CACHE/llama-server"
if [ -x "$OUT/bin/llama-server" ]; then
  echo "$OUT/bin/llama-server (already built)"
  exit 0
fi
WORK=$(mktemp -d "$CACHE/.llama-server-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$VERSION"
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_LLAMAFILE=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF >"$WORK/cmake.log" 2>&1 || { tail -20 "$WORK/cmake.log" >&2; exit 1; }
cmake --build "$WORK/build" --target llama-server -j "$(nproc)"
mkdir -p "$OUT.tmp/bin"
cp "$WORK/build/bin/llama-server" "$OUT.tmp/bin/"
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "$OUT/bin/llama-server"
