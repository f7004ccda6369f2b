#!/usr/bin/env bash
# One H200 call for MAD's baseline lr x wd grid (TASKS, default selective copying, fuzzy recall and
# compression; both rules): first the GPU tests of the CUDA-graph steps and one epoch of one run
# eagerly and graphed (seconds per step of each), then every run not stored yet: one process per
# task (JOBS at once), each training TOGETHER runs of its task side by side in their own CUDA
# streams, each step replayed from a CUDA graph, the whole call under DEADLINE seconds.
# Finished runs are stored in R and never repeated; a run cut short keeps its state in R/partial/
# on the machine only (the archive leaves partial states out), for the next call while it is warm.
#   here:   mkdir -p .devmad/baseline   (git-ignored; the stored runs, carried; unpack each archive into it)
#   device: PACK=$OUT/mad_baseline.tgz bash scripts/device_mad_baseline.sh   (carry .whl .devmad)
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
DEADLINE=${DEADLINE:-500}
SEED=${SEED:-.devmad/baseline}  # the stored runs, carried here
R=${R:-/tmp/mad-baseline}  # outside the checkout: partial states stay for the next call to a warm machine
TASKS=${TASKS:-"SC FR C"}
JOBS=${JOBS:-3}
TOGETHER=${TOGETHER:-12}
PROBE=${PROBE:-1}
mkdir -p "$R/logs"
[ -d "$SEED" ] && cp -rn "$SEED"/. "$R"/  # stored runs the machine lacks; its own are kept
source scripts/device_env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} TRITON_CACHE_AUTOTUNING=1
END=$(($(date +%s) + DEADLINE - SECONDS - 30))
if [ "$PROBE" = 1 ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfs tests/experiments/test_mad.py -k cuda_graph 2>&1 | tail -3
  rm -rf /tmp/mad-probe /tmp/mad-probe--cuda-graph  # a warm machine's earlier probe would be reused
  for graph in "" "--cuda-graph"; do  # also fills the kernel cache for the pool
    timeout 150 python3 -m efla mad --preset baseline --tasks FR --rules exact --lrs 1e-3 --wds 0 --epochs 2 \
      --device cuda --threads 1 $graph --out "/tmp/mad-probe$graph" > "$R/logs/probe$graph.log" 2>&1
    python3 - "/tmp/mad-probe$graph" "${graph:-eager}" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/runs/*.json"):
    r = json.load(open(f))
    h = r["history"]
    if len(h) < 2:
        print(f"probe {sys.argv[2]}: stopped after {len(h)} epoch(s)")
        continue
    per_step = (h[-1]["seconds"] - h[-2]["seconds"]) / (r["steps"] / len(h))
    print(f"probe {sys.argv[2]}: {r['steps']} steps in {r['seconds']:.1f} s; last epoch {1e3 * per_step:.1f} ms/step "
          f"(its evaluation included); losses {[round(x['train_loss'], 5) for x in h]}")
PY
  done
fi
printf '%s\n' $TASKS > "$R/logs/todo.txt"
echo "tasks $TASKS: $JOBS processes at once, $TOGETHER runs side by side in each, until $((END - $(date +%s)))s from now"
run_one() {  # run_one TASK: its runs not stored yet, stopped at END (their states kept in partial/)
  local limit=$((END - $(date +%s)))
  [ "$limit" -ge 30 ] || return 0
  timeout "$limit" python3 -m efla mad --preset baseline --tasks "$1" --device cuda --threads 1 --cuda-graph \
    --together "$TOGETHER" --out "$R" > "$R/logs/$1.log" 2>&1
}
export -f run_one
export R END TOGETHER
xargs -P "$JOBS" -L 1 bash -c 'run_one "$@"' _ < "$R/logs/todo.txt"
python3 -m efla mad --preset baseline --report-only --out "$R" > "$R/logs/report.log" 2>&1
echo "report exit $?; $(ls "$R/runs" | wc -l) runs stored; done in ${SECONDS}s"
for f in "$R"/partial/*.pt; do [ -e "$f" ] && echo "partial: $(basename "$f")"; done
[ -n "${PACK:-}" ] && tar -czf "$PACK" --exclude=./partial -C "$R" . && echo "packed into $PACK (unpack into $SEED)"
