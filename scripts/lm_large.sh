#!/usr/bin/env bash
# The paper's language-model claim beyond early training, on corpus-large: EFLA and DeltaNet trained
# side by side on one GPU on the same tokens in the same order with the same schedule, from the data
# that scripts/prep_lm_large.py makes (LM_DATA, default .devdata/lm, carried); then each model scored
# on the held-out authors (the validation loss of training, --val-data), WikiText-2 test and LAMBADA
# (efla eval), and the comparison written (efla lm-report: runs.jsonl, summary.md, the loss curves;
# efla compare: table.md, eval.json). Everything but weights, checkpoints and the token cache comes
# back as one archive, $OUT/lm-s<seed>.tgz (a call returns at most 8 files).
#
#   LIMIT=560 bash scripts/device.sh lm            # on a lent GPU (see docs/experiments.md)
#
# Training stops after LM_TRAIN_LIMIT seconds (efla train --time-limit) with a checkpoint under
# LM_WORK; the same call again, on the same warm machine, resumes the runs where they stopped, and
# the call that finishes them evaluates them. A run killed harder than that resumes from its last
# checkpoint (every LM_SAVE_EVERY steps).
# tests/lab/test_lm_large.py runs this script on the CPU at the tiny size, with the LM_* below.
set -uo pipefail
DATA=${LM_DATA:-.devdata/lm}
WORK=${LM_WORK:-runs/lm-large}
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
SEED=${LM_SEED:-0}
VARIANTS=${LM_VARIANTS:-"efla deltanet"}
SIZE=${LM_SIZE:-340m}
SEQ_LEN=${LM_SEQ_LEN:-2048}
BATCH_TOKENS=${LM_BATCH_TOKENS:-65536}
MICRO_BATCH=${LM_MICRO_BATCH:-16}  # sequences per forward; 8 where two runs do not fit one GPU (an H100)
TOKENS=${LM_TOKENS:-25100288}  # 383 steps of 65,536 tokens: one epoch of the carried 100 MB (25,101,466 tokens)
VAL_SEQUENCES=${LM_VAL_SEQUENCES:-200}  # of the 246 the held-out slice fills
VAL_EVERY=${LM_VAL_EVERY:-50}
SAVE_EVERY=${LM_SAVE_EVERY:-128}
TRAIN_LIMIT=${LM_TRAIN_LIMIT:-360}  # seconds of each training process in this call
DEVICE=${LM_DEVICE:-cuda}
EVAL_ARGS=${LM_EVAL_ARGS:-"--dtype bfloat16 --batch-size 16"}

"$PY" scripts/prep_lm_large.py --check "$DATA" || exit 2
mkdir -p "$WORK" "$OUT"
runs=()
for v in $VARIANTS; do runs+=("$WORK/$v-s$SEED"); done

train_args=(--data "$DATA/train.jsonl.xz" --val-data "$DATA/valid.jsonl.xz" --val-sequences "$VAL_SEQUENCES"
  --tokenizer "$DATA/tokenizer" --cache-dir "$WORK/cache" --seq-len "$SEQ_LEN" --batch-tokens "$BATCH_TOKENS"
  --micro-batch-size "$MICRO_BATCH" --max-tokens "$TOKENS" --seed "$SEED" --data-seed 0 --val-every "$VAL_EVERY"
  --save-every "$SAVE_EVERY" --keep-checkpoints 1 --log-every 1 --device "$DEVICE" --no-progress --resume-or-start)
echo "lm: efla train --preset $SIZE-<variant> ${train_args[*]} --out $WORK/<variant>-s$SEED"

# tokenized once into the shared cache before the runs start, so they do not both tokenize
"$PY" - "$DATA" "$WORK/cache" <<'EOF' || exit 1
import sys
from efla.data.text import load_token_stream
from efla.data.tokenizer import load_tokenizer
data, cache = sys.argv[1:]
tok = load_tokenizer(f"{data}/tokenizer")
for name in ("train", "valid"):
    tokens = load_token_stream([f"{data}/{name}.jsonl.xz"], tok, tok.eos_token_id, cache)
    print(f"lm: {name}: {len(tokens):,} tokens")
EOF

pack() {  # the records and logs of every run here, without weights, checkpoints or the token cache
  tar -czf "$OUT/lm-s$SEED.tgz" -C "$WORK" --exclude=checkpoints --exclude=cache --exclude='*.safetensors' \
    --exclude='*.pt' --exclude='tokenizer*' --exclude='special_tokens_map.json' . \
    && echo "lm: packed $OUT/lm-s$SEED.tgz (${#done_runs[@]} of ${#runs[@]} runs finished)"
}
done_runs=()
# interrupted (the phase's time limit): the runs stop at their last checkpoint, the records are packed
trap 'echo "lm: interrupted"; kill -INT $(jobs -p) 2>/dev/null; pack; exit 130' INT TERM

finished() {  # run: trained to the end of its schedule
  "$PY" -c "import json, sys; s = json.load(open(sys.argv[1] + '/train_summary.json')); sys.exit(s['steps'] != s['max_steps'])" "$1" 2>/dev/null
}

for run in "${runs[@]}"; do
  v=$(basename "$run"); v=${v%-s"$SEED"}
  timeout -s INT -k 30 $((${TRAIN_LIMIT%.*} + 120)) "$PY" -m efla train --preset "$SIZE-$v" "${train_args[@]}" \
    --time-limit "$TRAIN_LIMIT" --out "$run" >> "$run.train.log" 2>&1 &
done
wait
for run in "${runs[@]}"; do
  echo "lm: $(basename "$run"): $(tail -n 2 "$run.train.log" | tr '\n' ' ')"
  if finished "$run" && [ ! -f "$run/eval/eval.json" ]; then
    # shellcheck disable=SC2086  # EVAL_ARGS is a list of options
    "$PY" -m efla eval --model "$run" --wikitext "$DATA/wiki.test.raw" --lambada "$DATA/lambada_test.jsonl" \
      --device "$DEVICE" $EVAL_ARGS --out "$run/eval" > "$run.eval.log" 2>&1 &
  fi
done
wait

done_runs=()
for run in "${runs[@]}"; do finished "$run" && done_runs+=("$run"); done
reported=()  # every finished run of every seed trained here so far: the report spans the seeds
for run in "$WORK"/*-s*/; do finished "${run%/}" && reported+=("${run%/}"); done
if [ "${#reported[@]}" -gt 0 ]; then
  {
    args_text="${train_args[*]}"
    echo "Runs: \`LM_SEED=<seed> LM_TOKENS=$TOKENS bash scripts/lm_large.sh\`; training: \`efla train --preset $SIZE-<variant> ${args_text/--seed $SEED /--seed <seed> }\`;"
    echo "evaluation: \`efla eval --model <run> --wikitext wiki.test.raw --lambada lambada_test.jsonl --device $DEVICE $EVAL_ARGS\`."
    echo "Data: \`$DATA/manifest.json\` (scripts/prep_lm_large.py). The runs trained side by side on one device."
    echo "Commit: $(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)."
    "$PY" -c "from efla.records import versions; print('Versions:', versions('transformers', 'triton', 'tokenizers'))"
  } > "$WORK/notes.md"
  "$PY" -m efla lm-report --runs "${reported[@]}" --out "$WORK/report" --notes "$WORK/notes.md" \
    --title "Language modelling on corpus-large, $SIZE" > "$WORK/report.log" 2>&1
  evals=()
  for run in "${reported[@]}"; do [ -f "$run/eval/eval.json" ] && evals+=("$run/eval/eval.json"); done
  [ "${#evals[@]}" -gt 0 ] && "$PY" -m efla compare "${evals[@]}" --out "$WORK/compare" > "$WORK/compare.log" 2>&1
  cat "$WORK/report/summary.md" 2>/dev/null | head -n 12
fi
pack
[ "${#done_runs[@]}" -eq "${#runs[@]}" ]
