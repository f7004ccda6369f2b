#!/usr/bin/env bash
# benchmarks/gpu_ops.py on one H200 without the correctness and decode stages: the 340M model-level
# fwd+bwd timings and the chunk timings of the (1, 8192, 96) shape (docs/results/gpu_ops/run4_*).
# Carry: .whl (fla wheels). Writes $OUT/results_gpu.md, gpu_ops.log.
# The `efla convert` check ran in its own call (it needs ~400 s, mostly fla's autotuning):
#   source scripts/device_env.sh; python3 benchmarks/convert_check.py --out $OUT   (carry .whl, .devdata/convert)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source scripts/device_env.sh
timeout $(( ${LEFT:-560} - SECONDS )) python3 benchmarks/gpu_ops.py --skip-correctness --skip-decode --shapes "1,8192,96" \
  --budget 330 --out "$OUT" 2>&1 | tee "$OUT/gpu_ops.log" | grep -v -i warn | tail -40
echo "gpu_ops model level and (1, 8192, 96) done in ${SECONDS}s"
