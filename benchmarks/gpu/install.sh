#!/usr/bin/env bash
# Install loraflow from an offline wheelhouse (scripts/wheelhouse.sh) on a machine without internet: exactly the
# wheels in DIR, no resolution (a --only-missing-on-gpu wheelhouse relies on what the machine already holds).
#     benchmarks/gpu/install.sh DIR [PYTHON]
set -euo pipefail
dir=${1:?usage: benchmarks/gpu/install.sh WHEELHOUSE_DIR [PYTHON] (build one with scripts/wheelhouse.sh)}
python=${2:-python3}
ls "$dir"/*.whl >/dev/null || { echo "install.sh: no wheels in $dir: build them with scripts/wheelhouse.sh" >&2; exit 2; }
"$python" -m pip install --quiet --no-index --no-deps --find-links "$dir" "$dir"/*.whl
"$python" -c "import loraflow.config, diffusers, transformers, peft, dagster_pipes" \
  || { echo "install.sh: loraflow's dependencies do not all import: the wheelhouse lacks one (see above)" >&2; exit 1; }
