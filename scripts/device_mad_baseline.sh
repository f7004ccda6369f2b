#!/usr/bin/env bash
# One H200 call for MAD's baseline lr x wd grid (TASKS, default selective copying, fuzzy recall and
# compression; both rules): first the GPU tests of MAD's graphed and side-by-side training, then
# every run not stored yet in one process, TOGETHER runs side by side (each in its own CUDA stream,
# each step replayed from a CUDA graph), the whole call under DEADLINE seconds. A watchdog stops
# the process at the deadline or when its log stands still for STALL seconds (the GPU tests two
# minutes before the deadline) with SIGABRT, so that Python's fault handler writes every thread's
# stack into the log.
# Finished runs are stored in R and never repeated (the runs recorded in RECORD count as stored); a
# run cut short keeps its state in R/partial/ for the next call while the machine is warm, and comes
# back in tar parts beside the archive, the most trained first, as many as a call returns (5 MB a
# state: about 12). The carry there is limited to 64 MiB with the checkout (about 9 states; MAD_ARGS
# can pick a subset).
#   here:   mkdir -p .devmad/baseline   (git-ignored; the stored runs and states, carried; unpack each
#           archive and part into it, and move its logs/ out, to .devmad/baseline-logs: they need not travel)
#   device: PACK=$OUT/mad_baseline.tgz bash scripts/device_mad_baseline.sh   (carry .whl .devmad/baseline)
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export CUDA_DEVICE_MAX_CONNECTIONS=32  # a hardware queue per stream (default 8: streams beyond share and wait)
DEADLINE=${DEADLINE:-500}
SEED=${SEED:-.devmad/baseline}  # the stored runs and partial states, carried here
RECORD=${RECORD:-docs/results/mad/baseline-grid/runs}  # the recorded runs, in the checkout: a fresh checkout's seed
R=${R:-/tmp/mad-baseline}  # outside the checkout: partial states stay for the next call to a warm machine
TASKS=${TASKS:-"SC FR C"}  # groups split by ';' train one after the other (so that a group can finish in time)
TOGETHER=${TOGETHER:-32}
MAD_ARGS=${MAD_ARGS:-}  # more `efla mad` options for training and report, e.g. `--rules exact` (a subset, when all states do not fit one carry) or `--seed 1`
TESTS=${TESTS:-1}
STALL=${STALL:-180}
mkdir -p "$R/logs" "$R/runs"
for f in "$RECORD"/*.json; do [ -e "$f" ] && [ ! -e "$R/runs/$(basename "$f")" ] && cp "$f" "$R/runs/"; done
# the files the machine lacks (its own stay), but no partial state of a run stored since
[ -d "$SEED" ] && (cd "$SEED" && find . -type f) | while read -r f; do
  stored="$R/runs/$(basename "$f" .pt).json"
  [ -e "$R/$f" ] || { [[ $f == ./partial/* ]] && [ -e "$stored" ]; } || { mkdir -p "$(dirname "$R/$f")" && cp "$SEED/$f" "$R/$f"; }
done
source scripts/device_env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} TRITON_CACHE_AUTOTUNING=1
END=$(($(date +%s) + DEADLINE - SECONDS - 30))
ulimit -c 0
left() { echo $((END - $(date +%s))); }
stop() {  # stop PID: SIGABRT (the fault handler prints the stacks), SIGKILL if it lives on
  kill -ABRT "$1" 2>/dev/null
  for _ in 1 2 3 4; do sleep 5; kill -0 "$1" 2>/dev/null || return 0; done
  kill -KILL "$1" 2>/dev/null
}
train() {  # the remaining runs of the tasks in $1, all in one process, stopped at the deadline or a still log
  local log pid idle
  log="$R/logs/mad-$(date +%H%M%S).log"
  echo "tasks $1: $TOGETHER runs side by side, until $(left)s from now; log $log"
  python3 -X faulthandler -m efla mad --preset baseline --tasks $1 --device cuda --threads 1 --cuda-graph \
    --together "$TOGETHER" $MAD_ARGS --out "$R" > "$log" 2>&1 &
  pid=$!
  while sleep 5 && kill -0 "$pid" 2>/dev/null; do
    idle=$(($(date +%s) - $(stat -c %Y "$log" 2>/dev/null || date +%s)))
    if [ "$(left)" -le 0 ] || [ "$idle" -ge "$STALL" ]; then
      echo "stopping the run: $([ "$idle" -ge "$STALL" ] && echo "log still for ${idle}s" || echo deadline)"
      stop "$pid"
      break
    fi
  done
  wait "$pid"
  echo "mad exit $?"
  tr '\r' '\n' < "$log" | grep -v '^\s*$' | grep -v '%|' | tail -n 40 | cut -c1-220  # all but the bar (a stopped run: its stacks)
  tr '\r' '\n' < "$log" | grep '%|' | tail -n 1 | cut -c1-220  # the bar's last state
}
TRAIN=1
if [ "$TESTS" = 1 ]; then  # the runs are kept for good: no training unless the tests pass
  TRAIN=0
  [ "$(left)" -gt 180 ] && timeout -s ABRT -k 20 $(($(left) - 120)) python3 -X faulthandler -m pytest -q -x -m gpu \
    -p no:cacheprovider -rfs tests/experiments/test_mad.py 2>&1 | tail -n 40 && TRAIN=1
  [ "$TRAIN" = 1 ] || echo "GPU tests failed or did not run: no training"
fi
IFS=';' read -ra TASK_GROUPS <<< "$TASKS"
for group in "${TASK_GROUPS[@]}"; do
  if [ "$TRAIN" = 1 ] && [ "$(left)" -ge 60 ]; then train "$group"; else echo "tasks $group: no training this call"; fi
done
python3 -m efla mad --preset baseline $MAD_ARGS --report-only --out "$R" > "$R/logs/report.log" 2>&1
echo "report exit $?; $(ls "$R/runs" | wc -l) runs stored; done in ${SECONDS}s"
for f in "$R"/partial/*.pt; do [ -e "$f" ] && echo "partial: $(basename "$f")"; done
[ -n "${PACK:-}" ] || exit 0
tar -czf "$PACK" --exclude=./partial -C "$R" . && echo "packed into $PACK (unpack into $SEED)"
# the partial states too, beside the archive: a call returns 8 files of up to 16 MiB, 64 MiB in all,
# so the states with the most training (the costliest to lose) come first, in tar parts of up to 16 MiB
python3 - "$R/partial" "$PACK" <<'PY'
import os, sys, tarfile
import torch
src, archive = sys.argv[1], sys.argv[2]
PART = 16 * 2**20 - 2**16  # a returned file's limit, less room for tar's own blocks
ROOM = 64 * 2**20 - 2**16 - os.path.getsize(archive)  # what the returned files may hold besides the archive


def steps(name):
    try:
        return int(torch.load(os.path.join(src, name), map_location="cpu", weights_only=True)["progress"]["steps"])
    except Exception:  # noqa: BLE001  an unreadable state is the first to leave behind
        return -1


names = sorted((f for f in os.listdir(src) if f.endswith(".pt")) if os.path.isdir(src) else [], key=steps, reverse=True)
parts, size, total, left = [[]], 0, 0, []
for name in names:
    n = os.path.getsize(os.path.join(src, name)) + 2048  # its tar header and padding
    fits_part = size + n <= PART
    if total + n > ROOM or (not fits_part and len(parts) == 7):
        left.append(name)
        continue
    if not fits_part:
        parts.append([])
        size = 0
    parts[-1].append(name)
    size, total = size + n, total + n
for i, part in enumerate(p for p in parts if p):
    with tarfile.open(os.path.join(os.path.dirname(archive), f"partial-{i + 1}.tar"), "w") as tar:
        for name in part:
            tar.add(os.path.join(src, name), arcname=name)
    print(f"partial-{i + 1}.tar: {len(part)} states (unpack into .devmad/baseline/partial)")
for name in left:
    print(f"left on the machine (over what a call returns): {name}")
PY
