#!/usr/bin/env bash
# One H200 call for MAD's memorization task at the protocol's settings (vocabularies 256 ... 8192,
# the paper preset's 3 lr x 2 wd grid, 200 epochs): 72 runs, one process per run, JOBS at a
# time on the GPU (the model is tiny), the whole call (warm-up included) under DEADLINE seconds;
# then the report over what finished. Finished runs are stored in the output folder and never repeated, so a call resumes
# where the last one stopped when its output comes back as the folder carried next time (a run cut
# short also keeps its state in partial/, but at 5-30 MB a run those files stay on the machine:
# a call returns at most 16 MiB a file, so the archive leaves them out):
#   here:   mkdir -p .devmad   (git-ignored; unpack the last call's archive into it)
#   device: PACK=$OUT/mad_memorization.tgz bash scripts/device_mad_memorization.sh   (carry .devmad)
# Local smoke test on the CPU: DEVICE=cpu EXTRA="--epochs 1" R=/tmp/madm bash scripts/device_mad_memorization.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
DEVICE=${DEVICE:-cuda}
DEADLINE=${DEADLINE:-500}
R=${R:-.devmad/memorization}
EXTRA=${EXTRA:-}
JOBS=${JOBS:-16}  # processes at once: one CPU core each (16 on the H200 machine), all on one GPU
mkdir -p "$R/logs"
if [ "$DEVICE" = cuda ]; then source scripts/device_env.sh; else export PYTHONPATH=$PWD; fi
if [ "$DEVICE" = cuda ]; then
  # fla's fused modules compile and autotune their Triton kernels on first use. On 2026-12-01 each
  # of the 12 processes, started together, spent about 240 s on its first step (later steps 0.3 s),
  # most likely doing that side by side. One short run of every setting first fills a shared cache
  # (kernels and autotuning results) for the others to load.
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} TRITON_CACHE_AUTOTUNING=1
  timeout $((DEADLINE / 3)) python3 -m efla mad --preset paper --tasks memorization --rules exact --lrs 1e-3 --wds 0.0 \
    --epochs 1 --device cuda --threads 1 --out /tmp/mad-warmup > "$R/logs/warmup.log" 2>&1
  echo "warm-up exit $? at ${SECONDS}s"
fi
END=$(($(date +%s) + DEADLINE - SECONDS - 30))  # DEADLINE bounds the whole call: warm-up, runs, report and packing
# One job per run not stored yet (rule, lr, wd, setting), JOBS at a time, the largest vocabularies last.
python3 - "$R" > "$R/logs/todo.txt" <<'PY'
import sys
from efla.experiments.mad.run import MADOptions, load_run, plan
for c in plan(MADOptions(preset="paper", tasks=["memorization"])):
    if load_run(sys.argv[1], c) is None:
        print(c.rule, repr(c.lr), repr(c.weight_decay), c.setting.id)
PY
echo "$(wc -l < "$R/logs/todo.txt") runs to go, $JOBS at a time, until $((END - $(date +%s)))s from now"
run_one() {  # run_one RULE LR WD SETTING, stopped at END (its state kept in partial/)
  local limit=$((END - $(date +%s)))
  [ "$limit" -ge 30 ] || return 0
  timeout "$limit" python3 -m efla mad --preset paper --tasks memorization --rules "$1" --lrs "$2" --wds "$3" \
    --settings "$4" --device "$DEVICE" --threads 1 --out "$R" $EXTRA > "$R/logs/$4-$1-$2-$3.log" 2>&1
}
export -f run_one
export R END DEVICE EXTRA
xargs -P "$JOBS" -L 1 bash -c 'run_one "$@"' _ < "$R/logs/todo.txt"
python3 -m efla mad --preset paper --tasks memorization --report-only --out "$R" $EXTRA > "$R/logs/report.log" 2>&1
echo "report exit $?; $(find "$R" -name '*.json' | wc -l) JSON files; done in ${SECONDS}s"
[ -n "${PACK:-}" ] && tar -czf "$PACK" --exclude=partial -C "$(dirname "$R")" "$(basename "$R")" && echo "packed into $PACK"
