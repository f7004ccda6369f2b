#!/usr/bin/env bash
# Runs named phases of GPU work on a lent machine, one after the other, each under its own time limit,
# and writes what they produce under $OUT (default /tmp/out). Carry .whl/ (flash-linear-attention's
# pure-Python wheels): they are installed into /tmp/site first.
#
#   bash scripts/device.sh tests generate serve            # from the repository root
#   LIMIT=300 bash scripts/device.sh ops
#
# Phases:
#   tests     the GPU tests (pytest -m gpu; PYTEST_K picks some; PYTEST_WORKERS=8 runs them in 8 processes
#             with pytest-xdist, which compile Triton's kernels side by side), results in $OUT/gpu-tests.xml;
#             with EFLA_TEST_FIRST_CONFIG=1 (no autotuning) give them their own cache: TRITON_CACHE_DIR=/tmp/tc
#   optests   the GPU tests of the ops alone (tests/ops, pytest -m gpu; PYTEST_K picks some)
#   gentests  the generation and serving GPU tests only (tokens against transformers, no allocation
#             after capture, 8K tokens at the memory of 128, the scheduler on the GPU); PYTEST_K picks
#             some (pytest -k): on a fresh machine Triton compiles and tunes fla's kernels for each
#             variant and dtype first (the Gated EFLA bf16 test alone took over 110 s), so the whole
#             set may need two calls on one warm machine
#   ops       benchmarks/gpu_ops.py: correctness, then the decode and chunk ops against fla
#             (OPS_ARGS: more of its options, e.g. "--skip-decode --skip-model"); our ops are timed
#             both ways, with EFLA_DIRECT_LAUNCH as set and with it 0 (every launch through Triton), alternated
#   stages    benchmarks/gpu_stages.py: where an op's time goes (STAGES_ARGS: more of its options)
#   model     benchmarks/gpu_model.py: 340M and 1.3B training steps against fla's models (MODEL_ARGS
#             replaces its options, e.g. "--sizes 1.3b --models fla,efla,efla+triton")
#   generate  benchmarks/gpu_generate.py: generation speed (340M), then the kernel and profile stages
#   speculate benchmarks/gpu_generate.py's speculative stage (340M, batch 1 and 8): prompt lookup against
#             plain generate on copying, code editing and free text, a verification pass in plain steps,
#             the batch-1 step against its floor; the record is $OUT/speculate/gpu_generate_speculative.json
#   serve     benchmarks/serve_load.py, 340M, 512 requests at 256 streams, 3 rounds: static batching in arrival
#             order and sorted by output length (every batch run once untimed first; prefill timed apart),
#             the scheduler in process, efla serve over HTTP with streaming client processes (fastapi,
#             starlette, pydantic, uvicorn: carry their wheels in .whl/; without them the phase runs the other
#             stages), the rates stage (64/s, all at once) and the profile stage; SERVE_ARGS: more of its options.
#             Run it with LIMIT=420: about 200 s estimated (a round's static runs about 7 s warm, the first
#             round's warm-up up to 30 s of compiling and tuning, each server stage's capture a few seconds);
#             it writes its files after every round, so a run stopped at the limit keeps the rounds it ended
#   distributed  benchmarks/gpu_distributed.py over every GPU of the machine (nvidia-h200-x2 or more):
#             DIST_ARGS picks stages and sizes (e.g. "--stages ddp,resume,cp --budget 420"; LIMIT=560);
#             it trains on .devdata/corpus, git-ignored: carry it after
#             mkdir -p .devdata && cp -r ../shared/data/corpus/gutenberg .devdata/corpus
#   lm        scripts/lm_large.sh: the language-model claim on corpus-large, EFLA and DeltaNet at 340M
#             side by side on the same tokens, then efla eval and the comparison, packed as
#             $OUT/lm-s<seed>.tgz; it reads .devdata/lm, git-ignored: carry it after
#             python scripts/prep_lm_large.py    (LM_SEED, LM_TOKENS, ...: see the script; LIMIT=560)
#
# Triton's compiled kernels and tuning results: a fresh machine compiles and tunes every kernel again
# (minutes for fla's gated kernels). Carry .triton-cache/ (git-ignored) as well and they are reused;
# each run leaves the cache it ended with in $OUT/triton-cache.tar.gz when it is under 16 MB (the most
# a file from $OUT may weigh to come back), to unpack into .triton-cache/ for the next visit. A visit
# that tunes fla's kernels for several variants leaves more than that (2026-12-03: every visit did);
# its tuning results alone come back as $OUT/triton-autotune.tar.gz.
#
# The records' commit: a device's copy has no .git, so before a visit run
#   git rev-parse --short HEAD > .commit   (git-ignored) and carry .commit with .whl.
#
# The one-visit scripts that recorded earlier results (scripts/device_*.sh, named in docs/results)
# are in git history up to commit a97566f.
set -uo pipefail
OUT=${OUT:-/tmp/out}
LIMIT=${LIMIT:-280}  # seconds per phase; LIMIT_<phase> (LIMIT_tests=330) for one phase
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device.sh: cannot install the carried wheels (.whl/)"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
mkdir -p .triton-cache
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"

run_phase() {
  case $1 in
    tests) python3 -m pytest -q -rfEs -m gpu -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} \
             ${PYTEST_WORKERS:+-n "$PYTEST_WORKERS"} --junitxml="$OUT/gpu-tests.xml" tests ;;
    gentests) python3 -m pytest -q -rfE -p no:cacheprovider --durations=0 ${PYTEST_K:+-k "$PYTEST_K"} \
                tests/serving/test_scheduler_gpu.py tests/generation/test_generate_gpu.py ;;
    optests) python3 -m pytest -q -rfE -m gpu -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} tests/ops ;;
    ops) python3 benchmarks/gpu_ops.py --out "$OUT/ops" ${OPS_ARGS:-} ;;
    stages) python3 benchmarks/gpu_stages.py --out "$OUT/stages" ${STAGES_ARGS:-} ;;
    model) python3 benchmarks/gpu_model.py ${MODEL_ARGS:---sizes 340m,1.3b} --out "$OUT/model" ;;
    generate) python3 benchmarks/gpu_generate.py --sizes 340m --stages speed,kernel,profile --out "$OUT/generate" ;;
    speculate) python3 benchmarks/gpu_generate.py --sizes 340m --stages speculative --rounds 5 --out "$OUT/speculate" ;;
    serve) stages=static,server,http,rates,profile
           python3 -c "import fastapi, uvicorn, httpx, prometheus_client, jinja2" 2>/dev/null || {
             echo "device.sh: no HTTP stack (carry the wheels of fastapi, starlette, pydantic, uvicorn): serve runs without its http stage"
             stages=static,server,rates,profile
           }
           python3 benchmarks/serve_load.py --concurrency 256 --waves 2 --requests 512 --rates 64,inf --rounds 3 \
             --stages "$stages" --out "$OUT/serve" ${SERVE_ARGS:-} ;;
    distributed) python3 benchmarks/gpu_distributed.py --data .devdata/corpus --out "$OUT/distributed" \
                   --nproc "$(nvidia-smi -L | wc -l)" ${DIST_ARGS:-} ;;
    lm) bash scripts/lm_large.sh ;;
    *) echo "device.sh: unknown phase $1 (tests, gentests, optests, ops, stages, model, generate, speculate, serve, distributed, lm)"; return 2 ;;
  esac
}

export OUT
export -f run_phase
for phase in "$@"; do
  echo "== $phase at ${SECONDS}s"
  # SIGINT first: pytest then still prints which tests failed and how far it got
  # the whole output in $OUT/<phase>.log, its end here
  limit_var="LIMIT_$phase"
  timeout -s INT -k 20 "${!limit_var:-$LIMIT}" bash -c 'run_phase "$0"' "$phase" 2>&1 | tee "$OUT/$phase.log" | grep -v Warning | tail -60
done
# the tuning results alone are small and spare the next machine the timing of every setting (only the
# chosen one compiles there): unpack triton-autotune.tar.gz into .triton-cache/ and carry it
(cd .triton-cache && find . -name '*.autotune.json' -print0 | tar -czf "$OUT/triton-autotune.tar.gz" --null -T -) 2>/dev/null
tar -czf "$OUT/triton-cache.tar.gz" -C .triton-cache . 2>/dev/null
if [ "$(stat -c %s "$OUT/triton-cache.tar.gz" 2>/dev/null || echo 0)" -gt 16000000 ]; then
  rm -f "$OUT/triton-cache.tar.gz"
  echo "device.sh: the Triton cache is over 16 MB compressed; not returned"
fi
echo "== done in ${SECONDS}s"
