#!/usr/bin/env bash
# The recorded MAD run on the lent H200 (issue 6): EFLA vs DeltaNet on all six tasks, fp32,
# PyTorch chunk ops on CUDA. Run from the repository root; nothing to carry.
#
#   phase 1  the quick preset exactly (baseline setting of each task, lr 1e-3, wd 0, 300 steps per
#            run: 3 epochs, memorization 150)                      -> docs/results/mad/quick
#   phase 2  the same runs with a 2,000-step budget (20 epochs, memorization 200), every run
#            time-limited so that the script ends within BUDGET seconds  -> docs/results/mad/quick-2000
#
# Each phase starts the 12 (task, rule) runs as 12 single-threaded processes sharing the GPU
# (the model is tiny: a step is bound by kernel launches, not by the GPU), then aggregates them
# with --report-only. Runs cut by the time limit are marked "truncated" in the outputs.
# Writes $OUT/mad.tar.gz (both result folders + per-run logs) and $OUT/log.txt.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TQDM_MININTERVAL=5
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-450}          # seconds for the whole script (device call limit: 600)
STEPS2=${STEPS2:-2000}         # phase-2 step budget per run
DEVICE=${DEVICE:-cuda}
EXTRA=${EXTRA:-}               # extra efla mad arguments (a local smoke test: DEVICE=cpu EXTRA="--preset tiny")
R=/tmp/results/mad
LOGS=$R/logs
mkdir -p "$R" "$LOGS" "$OUT"
START=$(date +%s)
log() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/log.txt"; }

nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader | tee -a "$OUT/log.txt"
python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())" \
  | tee -a "$OUT/log.txt"

phase() {  # phase NAME DOC_CMD [extra efla mad args...]
  local name=$1 doc=$2; shift 2
  local dir=$R/$name pids=()
  for t in CR FR NR SC C M; do
    for r in exact euler; do
      python3 -m efla mad --preset quick --tasks $t --rules $r --device "$DEVICE" --threads 1 --out "$dir" "$@" $EXTRA \
        > "$LOGS/$name-$t-$r.log" 2>&1 &
      pids+=($!)
    done
  done
  local fails=0
  for p in "${pids[@]}"; do wait "$p" || fails=$((fails + 1)); done
  log "$name: training processes done ($fails failed)"
  python3 -m efla mad --preset quick --device "$DEVICE" --out "$dir" --report-only "$@" $EXTRA \
    > "$LOGS/$name-report.log" 2>&1
  tr '\r' '\n' < "$LOGS/$name-report.log" | grep -v 'it/s\]' | tail -25 | tee -a "$OUT/log.txt"
}

log "phase 1: quick preset (300 steps per run)"
phase quick "efla mad --quick --device cuda --out docs/results/mad/quick"

LEFT=$(( BUDGET - ($(date +%s) - START) - 45 ))   # 45 s for start-up, the report and the tar
if [ "$LEFT" -gt 90 ]; then
  log "phase 2: quick preset with a ${STEPS2}-step budget, time limit ${LEFT}s per run"
  phase "quick-$STEPS2" "efla mad --preset quick --max-steps $STEPS2 --time-limit $LEFT --device cuda --out docs/results/mad/quick-$STEPS2" \
    --max-steps "$STEPS2" --time-limit "$LEFT"
else
  log "phase 2 skipped: only ${LEFT}s left"
fi

for f in "$LOGS"/*.log; do tr '\r' '\n' < "$f" | grep -E 'test acc|Error|error|Traceback' | tail -3 | sed "s|^|$(basename "$f"): |"; done \
  >> "$OUT/log.txt"
tar -czf "$OUT/mad.tar.gz" -C /tmp/results mad
log "done; wrote $OUT/mad.tar.gz"
