#!/usr/bin/env bash
# An offline wheelhouse of loraflow and its dependencies for one Python version and platform, for machines
# without internet (air-gapped GPU clusters, this project's lent GPU machines). Install from it there with
#     benchmarks/gpu/install.sh DIR        # pip install --no-index --no-deps DIR/*.whl
#
#     scripts/wheelhouse.sh [--python 3.12] [--platform manylinux_2_28_x86_64] [--out DIR] [--only-missing-on-gpu]
#
# Dependencies come from pyproject.toml, binary wheels only. torch (and its CUDA wheels) is left out: it is not a
# declared dependency, and a GPU machine has its own. --only-missing-on-gpu builds the small set a GPU machine needs
# to run benchmarks/gpu/run.py: no Dagster orchestrator (training there reports through dagster-pipes alone), no
# matplotlib (loss plots), and no package the machine's image already holds (scripts/gpu_image_packages.txt), except
# the ones pyproject.toml pins with ==, whose version the image may not have.
set -euo pipefail
cd "$(dirname "$0")/.."

python_version=3.12
platform=manylinux_2_28_x86_64
out=
minimal=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python_version=$2; shift 2 ;;
    --platform) platform=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --only-missing-on-gpu) minimal=1; shift ;;
    *) echo "wheelhouse.sh: unknown argument '$1' (see the header of scripts/wheelhouse.sh)" >&2; exit 2 ;;
  esac
done
suffix=; if [ $minimal = 1 ]; then suffix=-gpu; fi
out=${out:-wheelhouse/py${python_version}-${platform}${suffix}}
python=${PYTHON:-.venv/bin/python}

# pip matches a manylinux_2_N tag exactly: name every older glibc too, so wheels built for those are taken
case "$platform" in
  manylinux_2_*_x86_64)
    glibc=${platform#manylinux_2_}; glibc=${glibc%_x86_64}
    platforms=(); for n in $(seq "$glibc" -1 5); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64) ;;
  *) platforms=(--platform "$platform") ;;
esac

requirements=$(mktemp)
trap 'rm -rf "$requirements" "$requirements".*' EXIT
"$python" - "$minimal" >"$requirements" <<'EOF'
import sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
if sys.argv[1] == "1":  # benchmarks/gpu/run.py needs no orchestrator (dagster-pipes stays) and draws no plots
    deps = [d for d in deps if d.split("==")[0].split(">=")[0] not in ("dagster", "dagster-webserver", "matplotlib")]
print("\n".join(deps))
EOF

mkdir -p "$out" "$requirements.all"
# 1. resolve for the target (metadata only); 2. download what was resolved, but torch and its CUDA stack
#    (peft and accelerate require torch: a plain pip download would fetch gigabytes of it)
"$python" -m pip install --quiet --dry-run --ignore-installed --report "$requirements.json" \
  --target "$requirements.all" --only-binary=:all: --python-version "$python_version" --implementation cp \
  "${platforms[@]}" -r "$requirements"
"$python" - "$requirements.json" >"$requirements.pinned" <<'EOF'
import json, re, sys
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if not re.match(r"(torch|triton|nvidia-|cuda-)", name.lower()):
        print(f"{name}=={version}")
EOF
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
  --implementation cp "${platforms[@]}" --dest "$requirements.all" -r "$requirements.pinned"
"$python" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$requirements.all" .

# keep: every wheel, or (minimal) those the GPU image lacks or pyproject pins with ==
"$python" - "$minimal" "$requirements.all" "$out" "$requirements" <<'EOF'
import re, shutil, sys
from pathlib import Path
minimal, src, dest, reqs = sys.argv[1] == "1", Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = {norm(w) for line in Path("scripts/gpu_image_packages.txt").read_text().splitlines()
         if not line.startswith("#") for w in line.split()}
pinned = {norm(line.split("==")[0]) for line in reqs.read_text().splitlines() if "==" in line}
for wheel in sorted(src.glob("*.whl")):
    name = norm(wheel.name.split("-")[0])
    if not minimal or name not in image or name in pinned:
        shutil.copy2(wheel, dest / wheel.name)
EOF
echo "$(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1) in $out"
