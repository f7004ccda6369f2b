#!/usr/bin/env bash
# Training throughput of the 340M presets on one H200 (issue 7, acceptance 5): a short `efla train`
# run per variant, bf16 autocast, the paper's Fig. 4 shape 2K x 8 (16,384 tokens per step, one
# micro-batch, no accumulation).
#
# Run from the repository root on the device machine with some Gutenberg books copied to
# .devdata/gutenberg (git-ignored; pass it in `carry`) and, to save device time, a 32000-token
# tokenizer trained on them beforehand in .devdata/lm_tokenizer (else it is trained there); the GPU kernels need triton and
# flash-linear-attention installed there (efla[cuda]). Writes $OUT/lm_throughput.json and the logs.
#   OUT=/tmp/out bash scripts/device_lm_throughput.sh
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.devdata/gutenberg}
STEPS=${STEPS:-30}        # the first 10 steps (kernel compilation / autotuning) are not counted
SEQ=${SEQ:-2048}
BATCH=${BATCH:-8}
SIZE=${SIZE:-340m}     # preset size (tiny for a local smoke test)
DEVICE=${DEVICE:-cuda}
PRECISION=${PRECISION:-bf16}
VARIANTS=${VARIANTS:-"efla deltanet gated-efla gated-deltanet"}
W=/tmp/lm_tp
TOK=${TOK:-.devdata/lm_tokenizer}
mkdir -p "$OUT" "$W"
if [ -f "$TOK/tokenizer.json" ]; then mkdir -p "$W/tokenizer" && cp "$TOK"/* "$W/tokenizer/"; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import efla.ops.api as a; print('efla GPU backend:', a._cuda() is not None)"
# a 32000-token byte-level BPE (the 340M presets' vocabulary size; the paper uses Mistral's tokenizer)
if [ ! -f "$W/tokenizer/tokenizer.json" ]; then
  python3 -c "
from efla.data.text import read_documents
from efla.data.tokenizer import train_bpe_tokenizer
train_bpe_tokenizer(read_documents(['$DATA']), vocab_size=32000, save_dir='$W/tokenizer')"
fi
for v in $VARIANTS; do
  python3 -m efla train --preset "$SIZE-$v" --data "$DATA" --tokenizer "$W/tokenizer" --cache-dir "$W/cache" \
    --seq-len "$SEQ" --batch-tokens $((SEQ * BATCH)) --micro-batch-size "$BATCH" --max-steps "$STEPS" \
    --warmup-steps 2 --val-sequences 8 --device "$DEVICE" --precision "$PRECISION" --no-progress --overwrite \
    --out "$W/$SIZE-$v" > "$OUT/$SIZE-$v.log" 2>&1
  echo "$SIZE-$v exit $?"; tail -2 "$OUT/$SIZE-$v.log"
done
python3 - "$W" "$OUT" "$STEPS" "$SEQ" "$BATCH" "$SIZE" <<'PY'
import json, os, statistics, sys
w, out, steps, seq, batch, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
res = {}
for d in sorted(os.listdir(w)):
    log = os.path.join(w, d, "log.jsonl")
    if not d.startswith(size + "-") or not os.path.exists(log):
        continue
    rows = [json.loads(l) for l in open(log)]
    timed = [r for r in rows if r["step"] > 10 and "step_s" in r]
    if not timed:
        continue
    tps = [seq * batch / r["step_s"] for r in timed]
    res[d] = dict(tokens_per_s_median=statistics.median(tps), tokens_per_s_mean=statistics.mean(tps),
                  steps_timed=len(timed), seq_len=seq, batch=batch, final_loss=rows[-1]["loss"])
    print(f"{d}: {res[d]['tokens_per_s_median']:,.0f} tokens/s (median of {len(timed)} steps)")
json.dump(res, open(os.path.join(out, "lm_throughput.json"), "w"), indent=2)
PY
