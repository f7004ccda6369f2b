#!/usr/bin/env bash
# H200 visit A (second session): the `efla convert` check against fla's own models (random-init and
# trained checkpoints, bf16, with a float32 reference), then the GPU timings still missing from
# issue 4: the 340M model-level stacks and the (1, 8192, 96) chunk shape.
# Carry: .whl (fla wheels) and .devdata (convert/ checkpoints + ids.pt). Writes $OUT/*.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout 150 python3 benchmarks/convert_check.py --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/convert_check.log"
timeout $(( ${LEFT:-560} - SECONDS )) python3 benchmarks/gpu_ops.py --skip-correctness --skip-decode --shapes "1,8192,96" \
  --budget 330 --out "$OUT" 2>&1 | tee "$OUT/gpu_ops.log" | grep -v -i warn | tail -40
echo "visit A done in ${SECONDS}s"
