#!/usr/bin/env bash
# On one H200, in one device call: the recorded robustness run and lr sweep (in parallel), then the GPU check of
# `efla convert` against fla's own models. Carry: .whl (fla wheels) and .devdata (MNIST).
set -uo pipefail
OUT=${OUT:-/tmp/out}
source scripts/device_env.sh
R=/tmp/results/robustness; mkdir -p "$R"
timeout 420 python3 -m efla robustness --data-dir .devdata/mnist --seeds 0 1 2 --paper-lr --device cuda --out "$R" \
  > /tmp/rob.log 2>&1 &
P1=$!
timeout 420 python3 -m efla lr-sweep --data-dir .devdata/mnist --seeds 0 --device cuda --out "$R" \
  > /tmp/lr.log 2>&1 &
P2=$!
timeout 240 python3 benchmarks/convert_check.py --out "$OUT" 2>&1 | grep -v Warning
wait $P1; echo "robustness exit $?"; wait $P2; echo "lr-sweep exit $?"
tr '\r' '\n' < /tmp/rob.log | grep -v '%|' | tail -30
tr '\r' '\n' < /tmp/lr.log | grep -v '%|' | tail -15
tar -czf "$OUT/robustness.tar.gz" -C /tmp/results robustness
tr '\r' '\n' < /tmp/rob.log | tail -c 200000 > "$OUT/rob_log.txt"
tr '\r' '\n' < /tmp/lr.log | tail -c 200000 > "$OUT/lr_log.txt"
