#!/usr/bin/env bash
# One visit to a 2-GPU H200 machine (nvidia-h200-x2), in two phases.
#   Phase "single": the two GPUs work apart on the single-GPU model-speed records:
#     GPU 0: benchmarks/gpu_model.py at 340M, every model, the four shapes;
#     GPU 1: the GPU tests of the fused modules and ops, then 1.3B at 8Kx2 and 16Kx1, then the op timings.
#   Phase "two": `efla train` across both GPUs: DDP scaling and loss agreement with one GPU at the same
#     global batch, a run whose rank 1 is killed and resumed, FSDP2 at 1.3B, the bf16 context-parallel
#     check, and one 340M step at long sequences on one GPU against two GPUs with --context-parallel 2.
# Carry: .whl (fla wheels) and .devdata (text/: a few Gutenberg books, tok/: a 32k BPE tokenizer
# trained on them, gutenberg_ids.npy). Results: $RESULTS/<run>/ (log.jsonl, train_summary.json,
# train_args.json, console logs) and $RESULTS/<benchmark>/; scripts/device_collect.sh packs them.
#   PHASES="single two" bash scripts/device_model_speed_and_distributed.sh     (PHASES=single also runs on one GPU)
set -uo pipefail
RESULTS=${RESULTS:-/tmp/results}
WORK=${WORK:-/tmp/work}
PHASES=${PHASES-"single two"}  # empty: define the functions only
mkdir -p "$RESULTS" "$WORK"
source scripts/device_env.sh
export TRITON_CACHE_AUTOTUNING=1  # runs of one shape in later processes reuse the autotuning
TRAIN=(-m efla train --data .devdata/text --tokenizer .devdata/tok --no-progress --log-every 1 --val-sequences 4)
SMALL=(--preset 340m-efla --seq-len 2048 --batch-tokens 32768 --max-steps 30 --save-every 10 --val-every 0)
stamp() { echo "== $* at ${SECONDS}s"; }

keep_run() {  # keep what a run directory says about the run (not its weights)
  local name=$1 dir=$2
  mkdir -p "$RESULTS/$name"
  cp "$dir"/{log.jsonl,train_summary.json,train_args.json} "$RESULTS/$name/" 2>/dev/null
}

train1() {  # train1 NAME ARGS...: one GPU
  local name=$1; shift
  stamp "train $name"
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 "${TRAIN[@]}" --out "$WORK/$name" "$@" > "$WORK/$name.log" 2>&1
  echo "exit $?" >> "$WORK/$name.log"; tail -3 "$WORK/$name.log"; keep_run "$name" "$WORK/$name"
  cp "$WORK/$name.log" "$RESULTS/$name/console.txt"
}

train2() {  # train2 NAME ARGS...: two GPUs under torchrun
  local name=$1; shift
  stamp "torchrun $name"
  timeout 300 torchrun --standalone --nproc_per_node 2 "${TRAIN[@]}" --out "$WORK/$name" "$@" > "$WORK/$name.log" 2>&1
  echo "exit $?" >> "$WORK/$name.log"; tail -3 "$WORK/$name.log"; keep_run "$name" "$WORK/$name"
  cp "$WORK/$name.log" "$RESULTS/$name/console.txt"
}

rank_pid() {  # the process of the given torchrun rank
  local p
  for p in $(pgrep -f "[e]fla train"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$1" && { echo "$p"; return; }
  done
}

kill_and_resume() {
  local name=ddp-killed dir=$WORK/ddp-killed
  stamp "torchrun $name (rank 1 killed after step 15)"
  torchrun --standalone --nproc_per_node 2 "${TRAIN[@]}" --out "$dir" "${SMALL[@]}" > "$WORK/$name.log" 2>&1 &
  local launcher=$! waited=0
  until [ "$(wc -l < "$dir/log.jsonl" 2>/dev/null || echo 0)" -ge 15 ] || [ $waited -ge 240 ]; do
    sleep 1; waited=$((waited + 1))
  done
  local victim; victim=$(rank_pid 1)
  echo "killing rank 1 (pid ${victim:-none}) at log line $(wc -l < "$dir/log.jsonl" 2>/dev/null)"
  [ -n "$victim" ] && kill -9 "$victim"
  wait $launcher; echo "launcher exit $?" >> "$WORK/$name.log"
  cp "$dir/log.jsonl" "$WORK/$name.before-resume.jsonl" 2>/dev/null
  timeout 300 torchrun --standalone --nproc_per_node 2 -m efla train --out "$dir" --resume --no-progress \
    >> "$WORK/$name.log" 2>&1
  echo "resume exit $?" >> "$WORK/$name.log"; tail -3 "$WORK/$name.log"
  keep_run "$name" "$dir"
  cp "$WORK/$name.log" "$RESULTS/$name/console.txt"
  cp "$WORK/$name.before-resume.jsonl" "$RESULTS/$name/log.before-resume.jsonl" 2>/dev/null
}

phase_single() {
  stamp "phase single"
  ( export CUDA_VISIBLE_DEVICES=0
    timeout 540 python3 benchmarks/gpu_model.py --sizes 340m --shapes 2048x8,4096x4,8192x2,16384x1 \
      --models fla,efla,deltanet,gated-efla,gated-deltanet --out "$RESULTS/model-340m" > "$WORK/gpu0.log" 2>&1
  ) &
  local gpu0=$!
  # on a one-GPU machine the second job waits for the first, so that neither disturbs the other's timings
  [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && { wait $gpu0; SECOND_GPU=0; }
  ( export CUDA_VISIBLE_DEVICES=${SECOND_GPU:-1}
    timeout 150 python3 -m pytest -q --timeout 120 tests/layers/test_fused.py tests/ops/test_cuda.py \
      -p no:cacheprovider > "$WORK/gpu1-tests.log" 2>&1
    timeout 220 python3 benchmarks/gpu_model.py --sizes 1.3b --shapes 8192x2,16384x1 \
      --models fla,efla,deltanet,gated-efla,gated-deltanet --out "$RESULTS/model-1.3b" > "$WORK/gpu1.log" 2>&1
    timeout 160 python3 benchmarks/gpu_ops.py --skip-correctness --skip-decode --skip-model --budget 120 \
      --out "$RESULTS/ops" >> "$WORK/gpu1.log" 2>&1
  ) &
  wait $gpu0 $!
  mkdir -p "$RESULTS/console"
  cp "$WORK"/gpu*.log "$RESULTS/console/"
  tail -25 "$WORK/gpu1-tests.log"; grep -v Warning "$WORK/gpu0.log" | tail -30; grep -v Warning "$WORK/gpu1.log" | tail -40
}

phase_two() {
  stamp "phase two"
  train1 one-gpu "${SMALL[@]}"
  train2 ddp "${SMALL[@]}"
  kill_and_resume
  train2 fsdp-1.3b --preset 1.3b-efla --fsdp --seq-len 2048 --batch-tokens 32768 --max-steps 10 --save-every 0 --val-every 0
  stamp "context-parallel check"
  timeout 120 torchrun --standalone --nproc_per_node 2 benchmarks/context_parallel_check.py --dtype bfloat16 \
    --tokens 16384 > "$RESULTS/cp_check.jsonl" 2> "$WORK/cp_check.err"; tail -8 "$RESULTS/cp_check.jsonl"
  local long=(--preset 340m-efla --max-steps 3 --save-every 0 --val-every 0 --val-sequences 1)
  for T in 131072 262144; do
    train1 "long-1gpu-$T" "${long[@]}" --seq-len $T --batch-tokens $T
    train2 "long-cp2-$T" "${long[@]}" --seq-len $T --batch-tokens $T --context-parallel 2
  done
}

for phase in $PHASES; do "phase_$phase"; done
stamp "visit done"
touch "$RESULTS/visit.done"
