#!/usr/bin/env bash
# The whole suite under each CPU variant that changes a kernel's summation order: the suite must mean the same on
# any x86 CPU and thread count. ATEN_CPU_CAPABILITY picks ATen's vector kernels (avx2 on an AVX-512 machine), OMP_NUM_THREADS
# the thread count, and MKL_ENABLE_INSTRUCTIONS=AVX2 MKL's AVX2 kernels, the ones MKL runs on AMD CPUs (the closest
# an Intel machine gets to an AMD one: it reproduced the AMD failures of issue 15 exactly). ATen's AVX2 variants also cap
# oneDNN at AVX2, as a CPU without AVX-512 has both: on a host with AMX, ATen capped alone still sends bf16 attention
# down oneDNN's AMX packing, which torch 2.14 compiles out under the cap ("pack_vnni2 is only supported when avx512
# is supported", 4 bf16/fp8 tests).
# Usage: scripts/test_variants.sh [pytest args]; prints one line per variant (exit code, seconds) and fails if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
export DAGSTER_HOME=${DAGSTER_HOME:-$PWD/.dagster}
variants=(
  "default:"
  "aten-avx2:ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"
  "one-thread:OMP_NUM_THREADS=1"
  "aten-avx2+one-thread:ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1"
  "mkl-avx2:MKL_ENABLE_INSTRUCTIONS=AVX2"
)
mkdir -p benchmarks/out
failed=0

for variant in "${variants[@]}"; do
  name=${variant%%:*}
  settings=${variant#*:}
  start=$(date +%s)
  env $settings .venv/bin/python -m pytest -q -p no:cacheprovider "$@" >"benchmarks/out/variant-$name.log" 2>&1
  code=$?
  line="$name ($settings): exit $code, $(( $(date +%s) - start )) s, $(tail -n 1 "benchmarks/out/variant-$name.log")"
  echo "$line"

  [ "$code" -eq 0 ] || failed=1
done
echo "logs: benchmarks/out/variant-*.log"
exit $failed
