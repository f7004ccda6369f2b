#!/usr/bin/env bash
# H200 calls for the robustness and learning-rate claims. Every (setting, seed) runs as its own
# process, all in parallel on the GPU (the models are small), each under the call's DEADLINE, and
# the records that finished come back as one archive (a call returns at most 8 files), so a call
# cut short keeps what it finished. One PART per call:
#   rob1e-3  both rules at lr 1e-3, seeds 0-4, our model and the authors' (--authors-model)
#   rob3e-3  the same at lr 3e-3
#   sweep    both rules, lrs 1e-4 ... 1e-1 (7), seeds 0 1 2, one process per (rule, seed)
# Carry: .whl and .devmnist (mnist/: a copy of ../shared/data/mnist; git-ignored).
#   PART=rob1e-3 PACK=$OUT/rob1e-3.tgz bash scripts/device_claims.sh
# Here: unpack the archives, then `python scripts/merge_claims.py robustness|lr-sweep OUT PARTS...`.
set -uo pipefail
PART=${PART:?set PART to rob1e-3, rob3e-3 or sweep}
DEADLINE=${DEADLINE:-540}
R=${R:-/tmp/claims}/$PART
mkdir -p "$R"
source scripts/device_env.sh
MNIST=(--data-dir .devmnist/mnist --device cuda)
run() {  # name, then the efla command's arguments
  local name=$1; shift
  timeout "$DEADLINE" python3 -m efla "$@" --out "$R/$name" > "$R/$name.txt" 2>&1
  echo "$name exit $?"
}
case $PART in
  rob*)
    lr=${PART#rob}
    for s in 0 1 2 3 4; do
      run "ours-s$s" robustness "${MNIST[@]}" --seeds $s --lr "$lr" &
      run "authors-s$s" robustness "${MNIST[@]}" --seeds $s --lr "$lr" --authors-model &
    done ;;
  sweep)
    for rule in exact euler; do for s in 0 1 2; do
      run "$rule-s$s" lr-sweep "${MNIST[@]}" --rules $rule --seeds $s --lrs 1e-4 3e-4 1e-3 3e-3 1e-2 3e-2 1e-1 &
    done; done ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
wait
echo "part $PART done in ${SECONDS}s"
[ -n "${PACK:-}" ] && tar -czf "$PACK" -C "$(dirname "$R")" "$PART" && echo "packed into $PACK"
