#!/usr/bin/env bash
# One H200 visit: where the GPU op and model time goes, then the records that need a GPU.
# Phases (PHASES, in order; each stops at its own time limit and the visit at DEADLINE seconds):
#   stages   benchmarks/gpu_stages.py: every stage of the EFLA and Gated EFLA ops alone, the gated
#            dqkwg stage autotuned vs its old fixed launch vs fla's kernel, the coefficient kernels'
#            launch settings swept (stages2: two shapes, no sweep);
#   model13  1.3B fla DeltaNet vs efla (MODELS13) at 8K x 2 and 16K x 1 (SHAPES13), 16 steps (STEPS13),
#            plus one profiled step each (PROFILE13="" leaves it out);
#   ops      the layer-level op table (benchmarks/gpu_ops.py) at the five H = 16 shapes;
#   tests    the GPU tests (-m gpu) of ops, head dims, grouped values, hybrids, compile, fused
#            modules, first launch setting of each autotuned kernel (own Triton cache); tests2: the
#            hybrid, compile and fused-module ones, the coefficient gradients and the ops' reference check;
#   model340 340M fla DeltaNet, efla, gated-efla and gated-efla without its output gate (MODELS340) at
#            SHAPES340, STEPS340 steps, PROFILE340="--profile 25" adds a profiled step each;
#   host340  340M fla DeltaNet, efla and gated-efla at 512 x 1, where the GPU work is small and a
#            step's time is about its host time (launches, Python), with a profiled step each;
#   compile340  340M efla eager against efla under torch.compile;
#   ops96    the op table at (1, 8192, 96);
#   dims     the op table at (4, 4096, 16) with head dims DIMS (default 64x64,32x32,256x256);
#   faults   every gated dqkwg launch setting as written, at head dims 32, 64 x 96 and 64, one process each;
#   launch   tests/ops/test_launch_settings.py: every launch setting of our autotuned kernels at
#            every head size, against the first;
#   keytests the GPU tests of keys whose ||k||^2 overflows float32 (refused, or exact in the scan);
#            time what the check's sync costs with MODELS13 / MODELS340 including efla+nokeycheck;
#   gatetests the GPU tests of raw gates activated inside the Gated EFLA op, and the gated ops' GPU tests;
#   qnormtests the GPU tests of the chunk ops (queries normalised in the coefficient pass), the fused
#            modules and model training through them, the coefficient gradients and the raw gates;
#   headdims the GPU head-dim tests (32 to 256, K and V apart) against the float64 reference, first launch
#            setting of each autotuned kernel (autotuning them all took more than 300 s for 3 of 10 cases).
# Carry: .whl (fla wheels); optionally .devcache/autotune.tgz (the autotuning results of an earlier
# visit: fla's and our kernels then skip their autotuning). Results in $RESULTS/<phase>/ and
# $RESULTS/autotune.tgz; scripts/device_collect.sh packs them.
#   PHASES="stages model13 ops tests" PACK=$OUT/speed.tgz bash scripts/device_speed_diagnosis.sh
set -uo pipefail
RESULTS=${RESULTS:-/tmp/results}
PHASES=${PHASES-"stages2 ops model340 compile340 dims ops96"}
DEADLINE=${DEADLINE:-1500}
mkdir -p "$RESULTS"
source scripts/device_env.sh
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .devcache/autotune.tgz ] && tar -xzf .devcache/autotune.tgz -C "$TRITON_CACHE_DIR" && echo "autotuning results restored"
stamp() { echo "== $* at ${SECONDS}s"; }

left() {  # seconds left before the deadline, at most $1
  local rest=$((DEADLINE - SECONDS))
  [ "$rest" -lt "$1" ] && echo "$rest" || echo "$1"
}

run_phase() {  # run_phase NAME LIMIT COMMAND...
  local name=$1 limit; limit=$(left "$2"); shift 2
  if [ "$limit" -lt 30 ]; then echo "== $name skipped (deadline)"; return; fi
  stamp "$name (limit ${limit}s)"
  mkdir -p "$RESULTS/$name"
  timeout "$limit" "$@" > "$RESULTS/$name/console.txt" 2>&1
  echo "exit $?" >> "$RESULTS/$name/console.txt"
  grep -v Warning "$RESULTS/$name/console.txt" | tail -40
}

for phase in $PHASES; do
  case $phase in
    stages) run_phase stages 300 python3 benchmarks/gpu_stages.py --shapes "8,2048,16;2,16384,16;1,16384,16" \
              --rounds 3 --out "$RESULTS/stages" ;;
    stages2) run_phase stages2 150 python3 benchmarks/gpu_stages.py --shapes "8,2048,16;2,16384,16" --no-sweep \
               --rounds 3 --out "$RESULTS/stages2" ;;
    model13) run_phase model13 330 python3 benchmarks/gpu_model.py --sizes 1.3b --shapes "${SHAPES13:-8192x2,16384x1}" \
               --models "${MODELS13:-fla,efla}" --warmup 3 --steps "${STEPS13:-16}" ${PROFILE13---profile 25} --out "$RESULTS/model13" ;;
    ops) run_phase ops 240 python3 benchmarks/gpu_ops.py --skip-correctness --skip-decode --skip-model \
           --shapes "8,2048,16;4,4096,16;2,8192,16;1,16384,16;2,16384,16" --rounds 5 --budget 220 \
           --out "$RESULTS/ops" ;;
    tests) run_phase tests 420 env EFLA_TEST_FIRST_CONFIG=1 TRITON_CACHE_DIR=/tmp/triton-cache-tests \
             python3 -m pytest -v -m gpu -p no:cacheprovider -rfs tests/ops/test_cuda.py \
             tests/ops/test_grouped_values.py tests/models/test_hybrid.py tests/models/test_compile.py \
             tests/layers/test_fused.py $(python3 -c "import hypothesis" 2>/dev/null && echo tests/test_properties.py) ;;
    tests2) run_phase tests2 240 env EFLA_TEST_FIRST_CONFIG=1 TRITON_CACHE_DIR=/tmp/triton-cache-tests \
              python3 -m pytest -v -m gpu -p no:cacheprovider -rfs tests/models/test_hybrid.py \
              tests/models/test_compile.py tests/layers/test_fused.py \
              "tests/ops/test_cuda.py::test_coefficient_gradients_float32_accurate_on_gpu" \
              "tests/ops/test_cuda.py::test_gpu_matches_reference" ;;
    model340) run_phase model340 330 python3 benchmarks/gpu_model.py --sizes 340m --shapes "${SHAPES340:-2048x8,16384x1}" \
                --models "${MODELS340:-fla,efla,gated-efla,gated-efla-no-output-gate}" --warmup 3 --steps "${STEPS340:-8}" \
                ${PROFILE340:-} \
                --out "$RESULTS/model340" ;;
    host340) run_phase host340 240 python3 benchmarks/gpu_model.py --sizes 340m --shapes 512x1 \
               --models "${MODELS_HOST:-fla,efla,gated-efla}" --warmup 3 --steps 16 --profile 25 ${HOSTARGS:-} \
               --out "$RESULTS/host340" ;;
    compile340) run_phase compile340 330 python3 benchmarks/gpu_model.py --sizes 340m --shapes 2048x8 \
                  --models efla,efla+compile --warmup 3 --steps 8 --out "$RESULTS/compile340" ;;
    ops96) run_phase ops96 260 python3 benchmarks/gpu_ops.py --skip-correctness --skip-decode --skip-model \
             --shapes "1,8192,96" --rounds 3 --budget 240 --out "$RESULTS/ops96" ;;
    dims) run_phase dims 300 python3 benchmarks/gpu_ops.py --skip-correctness --skip-decode --skip-model \
            --shapes "4,4096,16" --head-dims "${DIMS:-64x64,32x32,256x256}" --rounds 3 --budget 280 --out "$RESULTS/dims" ;;
    faults) run_phase faults 120 python3 benchmarks/gpu_launch_faults.py --dims 32x32,64x96,64x64 --out "$RESULTS/faults" ;;
    launch) run_phase launch 300 env TRITON_CACHE_DIR=/tmp/triton-cache-tests python3 -m pytest -q -m gpu \
              -p no:cacheprovider -rfs tests/ops/test_launch_settings.py ;;
    keytests) run_phase keytests 240 env EFLA_TEST_FIRST_CONFIG=1 TRITON_CACHE_DIR=/tmp/triton-cache-tests python3 -m pytest -v \
                -m gpu -p no:cacheprovider -rfs tests/ops/test_cuda.py -k "overflow" ;;
    gatetests) run_phase gatetests 240 env EFLA_TEST_FIRST_CONFIG=1 TRITON_CACHE_DIR=/tmp/triton-cache-tests python3 -m pytest \
                 -v -m gpu -p no:cacheprovider -rfs tests/ops/test_raw_gates.py tests/ops/test_cuda.py \
                 -k "raw or (matches_reference and gated) or coefficient_gradients or (overflow and gated)" ;;
    qnormtests) run_phase qnormtests 150 env EFLA_TEST_FIRST_CONFIG=1 TRITON_CACHE_DIR=/tmp/triton-cache-tests python3 -m pytest \
                  -q -m gpu -p no:cacheprovider -rfs tests/layers/test_fused.py tests/ops/test_raw_gates.py \
                  "tests/ops/test_cuda.py::test_gpu_matches_reference" \
                  "tests/ops/test_cuda.py::test_coefficient_gradients_float32_accurate_on_gpu" ;;
    headdims) run_phase headdims 300 env EFLA_TEST_FIRST_CONFIG=1 TRITON_CACHE_DIR=/tmp/triton-cache-tests python3 -m pytest -v -m gpu \
                -p no:cacheprovider -rfs "tests/ops/test_cuda.py::test_gpu_head_dims" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$RESULTS/autotune.tgz" -T -)
echo "visit done in ${SECONDS}s"
touch "$RESULTS/visit.done"
# a call returns at most 8 files, two folders deep: PACK=$OUT/speed.tgz brings everything back as one
[ -n "${PACK:-}" ] && tar -czf "$PACK" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" && echo "packed into $PACK"
