#!/usr/bin/env bash
# On one H200, in one device call: the recorded MAD run (scripts/device_mad.sh, issue 6) and the 340M
# training-throughput runs (scripts/device_lm_throughput.sh, issue 7).
# Carry: .whl and .devdata (gutenberg/ + lm_tokenizer/). Writes $OUT/mad.tar.gz, lm_throughput.json, logs.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source scripts/device_env.sh
BUDGET=${MAD_BUDGET:-330} bash scripts/device_mad.sh
LEFT=$(( ${TOTAL:-575} - SECONDS ))
echo "MAD done at ${SECONDS}s; ${LEFT}s left for the LM throughput runs"
STEPS=${STEPS:-25} timeout "$LEFT" bash scripts/device_lm_throughput.sh
echo "MAD and LM throughput done in ${SECONDS}s"
