#!/usr/bin/env bash
# The recorded robustness run on the lent H200 (issue: robustness experiment).
# Run from the repository root with MNIST copied to .devdata/mnist (git-ignored, carried).
# Writes $OUT/robustness.tar.gz (docs/results/robustness/ contents) and $OUT/log.txt.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
R=/tmp/results/robustness
mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# same learning rate for both rules + the authors' per-rule lrs, 3 seeds, full MNIST, one epoch
python3 -m efla robustness --data-dir .devdata/mnist --seeds 0 1 2 --paper-lr --device cuda --out "$R" \
  --command-line "efla robustness --data-dir ../shared/data/mnist --seeds 0 1 2 --paper-lr --device cuda --out docs/results/robustness" \
  > /tmp/rob.log 2>&1 &
P1=$!
# learning-rate sweep, one seed
python3 -m efla lr-sweep --data-dir .devdata/mnist --seeds 0 --device cuda --out "$R" \
  --command-line "efla lr-sweep --data-dir ../shared/data/mnist --seeds 0 --device cuda --out docs/results/robustness" \
  > /tmp/lr.log 2>&1 &
P2=$!
wait $P1; echo "robustness exit $?"; wait $P2; echo "lr-sweep exit $?"
tr '\r' '\n' < /tmp/rob.log | grep -v '%|' | tail -40
tr '\r' '\n' < /tmp/lr.log | grep -v '%|' | tail -20
tar -czf "$OUT/robustness.tar.gz" -C /tmp/results robustness
cp /tmp/rob.log "$OUT/rob_log.txt"; cp /tmp/lr.log "$OUT/lr_log.txt"
