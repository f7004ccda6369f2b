#!/usr/bin/env bash
# One H200 call for MAD's baseline lr x wd grid (TASKS, default selective copying, fuzzy recall and
# compression; both rules): first the GPU tests of the CUDA-graph steps and one epoch of one run
# eagerly and graphed (seconds per step of each), then every run not stored yet, JOBS processes at
# once on the GPU, each step replayed from a CUDA graph, the whole call under DEADLINE seconds.
# Finished runs are stored in R and never repeated; a run cut short keeps its state in R/partial/
# on the machine only (the archive leaves partial states out).
#   here:   mkdir -p .devmad/baseline   (git-ignored; the stored runs, carried)
#   device: PACK=$OUT/mad_baseline.tgz bash scripts/device_mad_baseline.sh   (carry .whl .devmad)
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
DEADLINE=${DEADLINE:-500}
R=${R:-.devmad/baseline}
TASKS=${TASKS:-"SC FR C"}
JOBS=${JOBS:-8}
PROBE=${PROBE:-1}
mkdir -p "$R/logs"
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
python3 - "$R" $TASKS > "$R/logs/todo.txt" <<'PY'
import sys
from efla.commands.mad import _resolve_tasks
from efla.experiments.mad.run import MADOptions, load_run, plan
tasks = _resolve_tasks(sys.argv[2:])
todo = [c for c in plan(MADOptions(preset="baseline", tasks=tasks)) if load_run(sys.argv[1], c) is None]
# in the order of TASKS, the largest lr first: the runs most likely to stop early come first
for c in sorted(todo, key=lambda c: (tasks.index(c.setting.task), -c.lr)):
    print(c.setting.task, c.rule, repr(c.lr), repr(c.weight_decay))
PY
echo "$(wc -l < "$R/logs/todo.txt") runs to go, $JOBS at a time, until $((END - $(date +%s)))s from now"
run_one() {  # run_one TASK RULE LR WD, stopped at END (its state kept in partial/)
  local limit=$((END - $(date +%s)))
  [ "$limit" -ge 30 ] || return 0
  timeout "$limit" python3 -m efla mad --preset baseline --tasks "$1" --rules "$2" --lrs "$3" --wds "$4" \
    --device cuda --threads 1 --cuda-graph --out "$R" > "$R/logs/$1-$2-$3-$4.log" 2>&1
}
export -f run_one
export R END
xargs -P "$JOBS" -L 1 bash -c 'run_one "$@"' _ < "$R/logs/todo.txt"
python3 -m efla mad --preset baseline --report-only --out "$R" > "$R/logs/report.log" 2>&1
echo "report exit $?; $(ls "$R/runs" | wc -l) runs stored; done in ${SECONDS}s"
for f in "$R"/partial/*.pt; do [ -e "$f" ] && echo "partial: $(basename "$f")"; done
[ -n "${PACK:-}" ] && tar -czf "$PACK" --exclude=partial -C "$(dirname "$R")" "$(basename "$R")" && echo "packed into $PACK"
