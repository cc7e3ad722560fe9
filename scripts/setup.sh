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
