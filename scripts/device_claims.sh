#!/usr/bin/env bash
# H200 call for the robustness and learning-rate claims. Every (setting, seed) runs as its own
# process, at most JOBS at once on the GPU (the models are small; one CPU core each), each under
# the call's DEADLINE, and the records that finished come back as one archive (a call returns at
# most 8 files), so a call cut short keeps what it finished. PARTS, one or more, started in order:
#   rob1e-3  both rules at lr 1e-3, seeds 0-4, our model and the authors' (--authors-model)
#   rob3e-3  the same at lr 3e-3
#   sweep    both rules, lrs 1e-4 ... 1e-1 (7), seeds 0 1 2, one process per (rule, seed, lr)
# Carry: .whl and .devmnist (mnist/: a copy of ../shared/data/mnist; git-ignored).
#   PARTS="rob1e-3 rob3e-3 sweep" PACK=$OUT/claims.tgz bash scripts/device_claims.sh
# Local smoke test: DEVICE=cpu JOBS=2 DEADLINE=90 EXTRA="--train-limit 256" R=/tmp/claims bash scripts/device_claims.sh
# Here: unpack the archive, then `python scripts/merge_claims.py robustness|lr-sweep OUT PARTS...`.
set -uo pipefail
PARTS=${PARTS:-${PART:?set PARTS to one or more of rob1e-3, rob3e-3, sweep}}
DEADLINE=${DEADLINE:-540}
JOBS=${JOBS:-16}
ROOT=${R:-/tmp/claims}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cuda ]; then source scripts/device_env.sh; else export PYTHONPATH=$PWD; fi
MNIST=(--data-dir .devmnist/mnist --device "$DEVICE" ${EXTRA:-})
run() {  # part, name, then the efla command's arguments
  local dir=$ROOT/$1 name=$2; shift 2
  mkdir -p "$dir"
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt 30 ] && { echo "$name skipped (deadline)"; return; }
  ( timeout "$left" python3 -m efla "$@" --out "$dir/$name" > "$dir/$name.txt" 2>&1
    echo "$name exit $? at ${SECONDS}s" ) &
}
for part in $PARTS; do
  case $part in
    rob*)
      lr=${part#rob}
      for s in 0 1 2 3 4; do
        run "$part" "ours-s$s" robustness "${MNIST[@]}" --seeds $s --lr "$lr"
        run "$part" "authors-s$s" robustness "${MNIST[@]}" --seeds $s --lr "$lr" --authors-model
      done ;;
    sweep)
      for lr in 1e-1 3e-2 1e-2 3e-3 1e-3 3e-4 1e-4; do for rule in exact euler; do for s in 0 1 2; do
        run "$part" "$rule-s$s-lr$lr" lr-sweep "${MNIST[@]}" --rules $rule --seeds $s --lrs "$lr"
      done; done; done ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
wait
echo "parts $PARTS done in ${SECONDS}s"
[ -n "${PACK:-}" ] && tar -czf "$PACK" -C "$ROOT" $PARTS && echo "packed into $PACK"
