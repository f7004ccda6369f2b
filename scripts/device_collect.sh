#!/usr/bin/env bash
# Waits (at most WAIT seconds) for a background device visit to finish, then packs its results into
# $OUT/results.tar.gz, so every call brings back what is done so far. Start a visit in its own session
# so that it outlives the call that started it:
#   setsid nohup bash scripts/device_model_speed_and_distributed.sh > /tmp/visit.log 2>&1 < /dev/null &
#   WAIT=560 bash scripts/device_collect.sh      # in this call and, for a long visit, in the next
RESULTS=${RESULTS:-/tmp/results}
WAIT=${WAIT:-560}
for ((i = 0; i < WAIT; i += 5)); do
  [ -e "$RESULTS/visit.done" ] && break
  sleep 5
done
grep -v Warning /tmp/visit.log | tail -60
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
tar -czf "$OUT/results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
cp /tmp/visit.log "$OUT/visit.log"
