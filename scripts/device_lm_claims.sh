#!/usr/bin/env bash
# One H200 visit for the language-model claim at GPU scale: EFLA, DeltaNet, Gated EFLA and Gated
# DeltaNet at about 100M parameters (hidden 640, 12 layers (gated: 11, for the same count), 5 heads of
# 128, 32k vocabulary; 61M without the embeddings), one epoch of the Gutenberg corpus each, model seeds 0 1 2 on the same
# tokens in the same order; the four variants of a seed train side by side on the GPU. Then WikiText-2
# test (word perplexity, bits per byte) and LAMBADA for every run, and the loss-curve report.
# Prepare here (git-ignored, carried):
#   mkdir -p .devdata/lm && cp -r ../shared/data/corpus/gutenberg .devdata/lm/ \
#     && cp ../shared/data/wikitext-2-raw/wiki.test.raw ../shared/data/lambada/lambada_test.jsonl .devdata/lm/
# Carry: .whl and .devdata (tok/: the 32k BPE tokenizer; lm/: the corpus and the two test sets).
# Results: $RESULTS/<variant>-s<seed>/ (log.jsonl, train_summary.json, train_args.json, eval JSON) and
# $RESULTS/report/; scripts/device_collect.sh packs them. Runs resume where a visit stopped.
#   SEEDS="0 1 2" bash scripts/device_lm_claims.sh
# A machine can be taken back between calls (an idle gap of 30 s ends the loan, and a new machine
# starts bare), so run one seed per call, in the foreground, and bring its results back with it as
# one archive (a call returns at most 8 files, two folders down):
#   SEEDS=0 RESULTS=/tmp/res PACK=$OUT/lm_s0.tgz bash scripts/device_lm_claims.sh
# then unpack the archives here and `efla lm-report --runs <the runs of every seed>`
# (docs/results/lm_gpu_100m/ was made that way).
set -uo pipefail
RESULTS=${RESULTS:-/tmp/results}
WORK=${WORK:-/tmp/lm}
SEEDS=${SEEDS:-"0 1 2"}
MAX_TOKENS=${MAX_TOKENS:-6225920}  # 95 steps of 65,536: one epoch of the corpus (6.28M tokens with this tokenizer, 33K held out)
DATA=.devdata/lm/gutenberg
mkdir -p "$RESULTS" "$WORK/configs"
source scripts/device_env.sh
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
VARIANTS="efla deltanet gated-efla gated-deltanet"

python3 - "$WORK/configs" <<'EOF'
import sys
from efla.models import get_preset_config
for variant in ("efla", "deltanet", "gated-efla", "gated-deltanet"):
    depth = 11 if variant.startswith("gated") else 12  # same parameter count: 101.5M gated, 102.1M plain
    cfg = get_preset_config(f"340m-{variant}", hidden_size=640, num_hidden_layers=depth, num_heads=5)
    cfg.to_json_file(f"{sys.argv[1]}/{variant}.json")
EOF

train() {  # variant seed
  local run=$WORK/$1-s$2
  python3 -m efla train --config "$WORK/configs/$1.json" --data "$DATA" --tokenizer .devdata/tok \
    --cache-dir "$WORK/cache" --seq-len 2048 --batch-tokens 65536 --micro-batch-size 16 --max-tokens "$MAX_TOKENS" --seed "$2" \
    --data-seed 0 --val-sequences 16 --val-every 20 --save-every 20 --log-every 1 --no-progress \
    --out "$run" --resume-or-start > "$run.log" 2>&1
  echo "$1-s$2 train exit $?"
  python3 -m efla eval --model "$run" --wikitext .devdata/lm/wiki.test.raw --lambada .devdata/lm/lambada_test.jsonl \
     --device cuda --dtype bfloat16 --batch-size 16 --out "$run/eval" > "$run.eval.log" 2>&1
  echo "$1-s$2 eval exit $?"
  mkdir -p "$RESULTS/$1-s$2"
  cp -r "$run"/{log.jsonl,train_summary.json,train_args.json,eval} "$RESULTS/$1-s$2/" 2>/dev/null
}

# tokenize once (fills the cache) before the parallel runs
python3 -c "
from efla.data.text import load_token_stream
from efla.data.tokenizer import load_tokenizer
tok = load_tokenizer('.devdata/tok'); t = load_token_stream(['$DATA'], tok, tok.eos_token_id, '$WORK/cache')
print(len(t), 'tokens')"
for s in $SEEDS; do
  echo "== seed $s at ${SECONDS}s"
  for v in $VARIANTS; do train "$v" "$s" & done
  wait
done
runs=$(for v in $VARIANTS; do for s in $SEEDS; do echo "$WORK/$v-s$s"; done; done)
{
  echo "Runs: \`SEEDS=\"$SEEDS\" MAX_TOKENS=$MAX_TOKENS bash scripts/device_lm_claims.sh\` (training: \`efla train --config"
  echo "<variant>.json --data $DATA --tokenizer .devdata/tok --seq-len 2048 --batch-tokens 65536 --micro-batch-size 16 --seed <seed> --data-seed 0"
  echo "...\`; evaluation: \`efla eval --model <run> --wikitext wiki.test.raw --lambada lambada_test.jsonl --device cuda --dtype bfloat16 --batch-size 16\`)."
  echo "Device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1);"
  python3 -c "import torch, triton, transformers; print(f'torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__};')"
  echo "wall time of the visit so far: ${SECONDS} s (the four variants of a seed train side by side on the one GPU)."
} > "$WORK/notes.md"
python3 -m efla lm-report --runs $runs --out "$RESULTS/report" --notes "$WORK/notes.md" \
  --title "Language modelling at about 100M parameters, one epoch of the Gutenberg corpus" || true
echo "visit done in ${SECONDS}s"
touch "$RESULTS/visit.done"
if [ -n "${PACK:-}" ]; then  # the runs' records and logs, without checkpoints, weights or the token cache
  tar -czf "$PACK" -C "$WORK" --exclude='*/checkpoints' --exclude=cache --exclude='*.safetensors' --exclude='*.pt' . \
    && echo "packed into $PACK"
fi
