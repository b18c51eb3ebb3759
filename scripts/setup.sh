#!/usr/bin/env bash
# Idempotent setup: a virtual environment with the project installed. torch is installed only when it is
# not importable, as the pinned CPU wheel, so a GPU-less machine never resolves to CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# pip without the machine's noise: an index location that does not exist on this host is not our problem
pip_install() {
  .venv/bin/pip install --quiet "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip_install "torch==${TORCH_VERSION:-2.13.0}"
fi
stamp=.venv/.loraflow-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  pip_install -e ".[test]"
  touch "$stamp"
fi
