#!/usr/bin/env bash
# Installs a target engine's heavy dependency into the current Python environment, once.
#
#   bash scripts/install_engine.sh ENGINE        (ENGINE: llama.cpp, hf, all)
#
# hf (transformers, the default engine) needs nothing beyond scripts/setup.sh's default install.
# llama.cpp (--engine llama.cpp) runs through llama-cpp-python 0.3.36. The registry has it as
# source only; it is compiled here with the llamafile matmul path OFF: with it on (llama.cpp's
# default) a multi-token evaluation rounds differently from a one-token one, so speculative decoding
# would not give plain decoding's tokens (docs/llama-cpp.md). About 8 minutes on 2 cores, once: the
# wheel is kept in $TREE_PLANNER_CACHE/wheels (pip's own cache would hand back a wheel built with
# other flags), so later environments on this machine install it in seconds. Skipped when an adequate
# build is installed. The build's progress is printed; its whole log goes to a file, kept on failure.
# AMX is compiled out (-mno-amx-*): on a 2-core Intel Xeon VM that lists amx_tile, amx_int8 and the
# kernel's permission, ggml's AMX matmul died at its first tileloadd (SIGILL) on a prefill of a few
# dozen tokens; AVX-512 stays. The cached wheel's name carries BUILD, so a wheel built otherwise is
# never reused.
# Idempotent; on failure it exits non-zero with one line saying what failed.
# vLLM is not installed here: it lives in its own environment (scripts/setup_vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ENGINES="hf, llama.cpp"
LLAMA_VERSION=0.3.36
BUILD=noamx  # the build's flags, in the cached wheel's folder name: llamafile off, AMX off
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

fail() { echo "install_engine.sh: $*" >&2; exit 1; }

llama_cpp_ok() {  # the pinned version, built without llamafile and without AMX
  "$PY" -c "
import sys, llama_cpp
llama_cpp.llama_backend_init()
info = llama_cpp.llama_print_system_info()
sys.exit(llama_cpp.__version__ != '$LLAMA_VERSION' or b'LLAMAFILE = 1' in info or b'AMX' in info)
" >/dev/null 2>&1
}

build_llama_wheel() {  # pip wheel with the build's output in $log, its progress (cmake's %, ninja's n/N) shown
  local wheels=$1 log=$2 start rc
  start=$(date +%s)
  echo "install_engine.sh: building llama-cpp-python $LLAMA_VERSION from source (llamafile off) on $(nproc) cores;" \
       "about 8 minutes on 2 cores, once per machine (log: $log)" >&2
  set +e
  # GCC keeps an explicit -mno-* whatever -march=native turns on
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_LLAMAFILE=OFF -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip wheel -v --no-deps --no-cache-dir --no-binary llama-cpp-python -w "$wheels" \
    "llama-cpp-python==$LLAMA_VERSION" 2>&1 | tee "$log" | awk -v start="$start" '
      function show(pct,   now) {  # a line every 10 % of the build
        if (pct < last + 10 && pct < 100) return
        last = pct; "date +%s" | getline now; close("date +%s"); now -= start
        printf "  llama-cpp-python build: %3d%% (%dm%02ds)\n", pct, int(now / 60), now % 60; fflush()
      }
      BEGIN { last = -10 }
      /^ *\[ *[0-9]+%\]/ { match($0, /[0-9]+%/); show(substr($0, RSTART, RLENGTH - 1) + 0); next }
      /^ *\[[0-9]+\/[0-9]+\]/ { match($0, /[0-9]+\/[0-9]+/); split(substr($0, RSTART, RLENGTH), a, "/")
                                if (a[2] > 0) show(int(100 * a[1] / a[2])); next }
      /^ *(Collecting|Installing build dependencies|Building wheel|Created wheel|Stored in)/ {
        sub(/^ +/, ""); print "  " substr($0, 1, 120); fflush()
      }' >&2
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then
    local err
    err=$(grep -m1 -iE '(^|[^a-z])error([: ]|$)' "$log" | sed 's/^[[:space:]]*//' | cut -c1-160 || true)
    fail "building llama-cpp-python $LLAMA_VERSION failed (pip exit $rc${err:+: $err}); full log: $log"
  fi
  rm -f "$log"  # kept only when the build fails
  local el=$(( $(date +%s) - start ))
  echo "install_engine.sh: built llama-cpp-python $LLAMA_VERSION in $((el / 60))m$(printf %02d $((el % 60)))s" >&2
}

install_llama_cpp() {
  if llama_cpp_ok; then
    echo "install_engine.sh: llama.cpp: llama-cpp-python $LLAMA_VERSION (llamafile off) is installed" >&2
    return
  fi
  local wheels wheel log
  wheels="${TREE_PLANNER_CACHE:-$HOME/.cache/tree-planner}/wheels/$BUILD"
  mkdir -p "$wheels" || fail "cannot create $wheels"
  wheel=$(ls "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    log=$(mktemp -t llama-cpp-python-build-XXXXXX.log) || fail "cannot create a build log"
    build_llama_wheel "$wheels" "$log"
    wheel=$(ls "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl 2>/dev/null | head -1 || true)
    [ -n "$wheel" ] || fail "the llama-cpp-python build left no wheel in $wheels; full log: $log"
  else
    echo "install_engine.sh: llama.cpp: installing the cached wheel $wheel" >&2
  fi
  "$PY" -m pip install -q --force-reinstall --no-deps "$wheel" || fail "pip could not install $wheel"
  "$PY" -m pip install -q "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0" \
    || fail "pip could not install llama-cpp-python's dependencies (diskcache, jinja2, typing-extensions)"
  llama_cpp_ok || fail "llama-cpp-python $LLAMA_VERSION from $wheel does not import, or was built with llamafile or" \
                       "AMX on (delete the wheel and rerun)"
  echo "install_engine.sh: llama.cpp: llama-cpp-python $LLAMA_VERSION (llamafile off) installed" >&2
}

[ $# -eq 1 ] || { echo "usage: install_engine.sh ENGINE (one of: $ENGINES, all)" >&2; exit 2; }
case "$1" in
  hf) ;;  # the project's own dependencies (scripts/setup.sh)
  llama.cpp) install_llama_cpp ;;
  all) install_llama_cpp ;;
  *) echo "install_engine.sh: unknown engine '$1' (one of: $ENGINES, all)" >&2; exit 2 ;;
esac
