#!/usr/bin/env bash
# Idempotent setup: a virtual environment with the project installed; `scripts/setup.sh test` adds what the tests
# need (the extras `test` and `scale`, and the real Qwen2 tokenizer), which `make demo` and `make dev` do not: on a
# fresh clone of 2 cores the extras were most of the setup's time (998 of ~1480 s measured at load 9). torch and torchvision are installed only
# when they are not importable, as one pinned pair: Kandinsky 5 i2i's Qwen2-VL processor needs torchvision, which
# loads only beside the torch it was built for, and PyPI's pair (a CUDA build; it runs on a CPU-only machine too)
# is the one this machine's package mirror holds. TORCH_VERSION / TORCHVISION_VERSION pick another pair.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# pip without the machine's noise: an index location that does not exist on this host is not our problem
pip_install() {
  .venv/bin/pip install --quiet "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  pip_install "torch==${TORCH_VERSION:-2.14.1}" "torchvision==${TORCHVISION_VERSION:-0.29.1}"
fi
for_tests=${1:-}
target="." stamp=.venv/.loraflow-installed
if [ "$for_tests" = test ]; then target=".[test,scale]" stamp=.venv/.loraflow-installed-test; fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  pip_install -e "$target"
  touch "$stamp"
fi
[ "$for_tests" = test ] || exit 0
# The real Qwen2 tokenizer for the template-crop tests (tests/pipelines/test_qwen_templates.py), built from Qwen's
# vocabulary in the dashscope wheel into the git-ignored .loraflow/; offline, those tests skip (under CI they fail).
[ -f .loraflow/qwen2-tokenizer/tokenizer.json ] || .venv/bin/python -m loraflow.demo.qwen_vocab
