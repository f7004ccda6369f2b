#!/usr/bin/env bash
# One H200 visit for what only a GPU can check and has not been checked there yet: the GPU tests of
# grouped value heads, head dims 32-256, hybrid models and torch.compile through the custom ops;
# then the compiled 340M preset's training speed against eager, and the op timing at (1, 8192, 96).
# Carry: .whl (fla wheels).
#   bash scripts/device_gpu_checks.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source scripts/device_env.sh
export TRITON_CACHE_AUTOTUNING=1
echo "== tests at ${SECONDS}s"
timeout 300 python3 -m pytest -q -m gpu --timeout 200 -p no:cacheprovider tests/ops/test_grouped_values.py \
  tests/ops/test_cuda.py tests/models/test_hybrid.py tests/models/test_compile.py tests/layers/test_fused.py \
  2>&1 | grep -v Warning | tail -30
echo "== compile at ${SECONDS}s"
timeout 200 python3 benchmarks/gpu_model.py --sizes 340m --shapes 2048x8 --models fla,efla,efla+compile \
  --out "$OUT/compile" 2>&1 | grep -v Warning | tail -12
echo "== ops at ${SECONDS}s"
timeout 150 python3 benchmarks/gpu_ops.py --skip-correctness --skip-decode --skip-model --shapes 1,8192,96 \
  --budget 120 --out "$OUT/ops" 2>&1 | grep -v Warning | tail -8
echo "visit done in ${SECONDS}s"
