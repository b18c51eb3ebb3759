#!/usr/bin/env bash
# One GPU run on a lent machine without internet (this project's device tool): install the carried wheels beside
# the image's torch, say what the machine is, then benchmarks/gpu/run.py with its precomputed estimates
# (benchmarks/results/gpu_estimates.json, `run.py --estimate-only` on the CPU), writing into OUT as it goes.
#     benchmarks/gpu/device.sh WHEELS_DIR OUT_DIR [BUDGET_S]
# The wheels: scripts/wheelhouse.sh --only-missing-on-gpu, less decord and the loraflow wheel (this checkout is run).
set -uo pipefail
wheels=${1:?usage: benchmarks/gpu/device.sh WHEELS_DIR OUT_DIR [BUDGET_S]}
out=${2:?usage: benchmarks/gpu/device.sh WHEELS_DIR OUT_DIR [BUDGET_S]}
budget=${3:-470}
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$wheels"/*.whl \
  || { echo "device.sh: the wheels in $wheels did not install" >&2; exit 3; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/machine.txt" 2>&1
python3 -c "import torch, diffusers, transformers, peft, av; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" >>"$out/machine.txt" 2>&1
df -BG /dev/shm /tmp >>"$out/machine.txt" 2>&1
cat "$out/machine.txt"
work=/tmp/loraflow-gpu  # the checkpoints (one at a time, up to 38 GB): tmpfs when it holds them, else the disk
if [ "$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)" -gt 60 ]; then work=/dev/shm/loraflow-gpu; fi
python3 benchmarks/gpu/run.py --budget "$budget" --work "$work" --out "$out/gpu.json" 2>&1 | tee "$out/log.txt"
