#!/usr/bin/env bash
# One H200 visit for the robustness and learning-rate claims, every run in parallel on the GPU
# (the models are small): both rules at equal lr 1e-3 and 3e-3 with 5 seeds, each with our model
# and with the authors' (--authors-model), and the lr sweep with 3 seeds from 1e-4 to 1e-1.
# Carry: .whl and .devdata (mnist/: a copy of ../shared/data/mnist). Results: $OUT/claims.tar.gz.
#   bash scripts/device_claims.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
R=/tmp/claims
mkdir -p "$OUT" "$R"
source scripts/device_env.sh
MNIST=(--data-dir .devdata/mnist --device cuda)
SEEDS=(--seeds 0 1 2 3 4)
pids=()
for lr in 1e-3 3e-3; do
  python3 -m efla robustness "${MNIST[@]}" "${SEEDS[@]}" --lr $lr --out "$R/robustness-lr$lr" > "$R/rob-$lr.txt" 2>&1 &
  pids+=($!)
  python3 -m efla robustness "${MNIST[@]}" "${SEEDS[@]}" --lr $lr --authors-model --out "$R/robustness-authors-lr$lr" \
    > "$R/rob-authors-$lr.txt" 2>&1 &
  pids+=($!)
done
python3 -m efla lr-sweep "${MNIST[@]}" --seeds 0 1 2 --lrs 1e-4 3e-4 1e-3 3e-3 1e-2 3e-2 1e-1 --out "$R/lr-sweep" \
  > "$R/sweep.txt" 2>&1 &
pids+=($!)
for p in "${pids[@]}"; do wait "$p"; echo "run $p exit $?"; done
tail -n 3 "$R"/*.txt
tar -czf "$OUT/claims.tar.gz" -C /tmp claims
echo "visit done in ${SECONDS}s"
