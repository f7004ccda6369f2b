#!/usr/bin/env bash
# One H200 visit for the model-level speed work: the GPU tests of the fused modules and the in-op
# q/k normalisation, then benchmarks/gpu_model.py (training tokens/s and peak memory against
# flash-linear-attention's DeltaNetForCausalLM) and, if time is left, the layer-level op timings.
# Carry: .whl (fla wheels) and .devdata (gutenberg_ids.npy: real tokens for the loss curves).
#   SIZES=1.3b,340m SHAPES=2048x8,4096x4,8192x2,16384x1 STAGES="tests model curve ops" bash scripts/device_model_speed.sh
# A visit longer than one call's 10 minutes runs it in the background (setsid) with OUT on the
# machine's disk and collects OUT in a later call.
set -uo pipefail
OUT=${OUT:-/tmp/out}
SIZES=${SIZES:-340m}
SHAPES=${SHAPES:-2048x8,4096x4,8192x2,16384x1}
STAGES=${STAGES:-"tests model curve ops"}
MODELS=${MODELS:-fla,efla,deltanet,gated-efla,gated-deltanet}
WARMUP=${WARMUP:-3}
TOTAL=${TOTAL:-570}
mkdir -p "$OUT"
source scripts/device_env.sh
left() { echo $(( TOTAL - SECONDS )); }
for stage in $STAGES; do
  echo "== $stage at ${SECONDS}s"
  case $stage in
    tests) timeout "$(left)" python3 -m pytest -q -x --timeout 240 tests/layers/test_fused.py tests/ops/test_cuda.py \
             -p no:cacheprovider 2>&1 | tail -25 ;;
    model) for size in ${SIZES//,/ }; do
             timeout "$(left)" python3 benchmarks/gpu_model.py --sizes "$size" --shapes "$SHAPES" \
               --models "$MODELS" --warmup "$WARMUP" --out "$OUT/model-$size" 2>&1 | grep -v Warning
           done ;;
    curve) timeout "$(left)" python3 benchmarks/gpu_model.py --sizes "${SIZES%%,*}" --models none \
             --loss-curve .devdata/gutenberg_ids.npy --out "$OUT/curve" 2>&1 | grep -v Warning ;;
    ops) timeout "$(left)" python3 benchmarks/gpu_ops.py --skip-correctness --skip-decode --skip-model \
           --budget $(( $(left) - 60 )) --out "$OUT/ops" 2>&1 | grep -v Warning ;;
  esac
done
echo "visit done in ${SECONDS}s"
