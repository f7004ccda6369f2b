#!/usr/bin/env bash
# The recorded CPU comparison (issue 7, acceptance 4): tiny EFLA / DeltaNet / Gated EFLA / Gated DeltaNet
# on the Gutenberg part of ../shared/data/corpus, same tokenizer, same tokens in the same order
# (--data-seed 0), same recipe; model seeds 0 1 2. Two runs at a time, one thread each.
# Run from the repository root: bash docs/results/lm/run_comparison.sh
set -euo pipefail
DATA=${DATA:-../shared/data/corpus/gutenberg}
RUNS=${RUNS:-runs/lm}
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-400}
mkdir -p "$RUNS"
# 1. one byte-level BPE (4096 tokens) trained on the Gutenberg books, shared by every run
if [ ! -f "$RUNS/tokenizer/tokenizer.json" ]; then
  python -c "
from efla.data.text import read_documents
from efla.data.tokenizer import train_bpe_tokenizer
train_bpe_tokenizer(read_documents(['$DATA']), vocab_size=4096, save_dir='$RUNS/tokenizer')"
fi
run() {  # variant seed
  python -m efla train --preset "tiny-$1" --data "$DATA" --tokenizer "$RUNS/tokenizer" --cache-dir "$RUNS/cache" \
    --seq-len 256 --batch-tokens 4096 --max-steps "$STEPS" --seed "$2" --data-seed 0 \
    --val-sequences 64 --val-every 50 --save-every 100 --keep-checkpoints 1 --threads 1 --no-progress \
    --out "$RUNS/$1-s$2" --overwrite > "$RUNS/$1-s$2.log" 2>&1
}
# tokenize once (fills the cache) before running in parallel
python -c "
from efla.data.text import load_token_stream
from efla.data.tokenizer import load_tokenizer
tok = load_tokenizer('$RUNS/tokenizer'); t = load_token_stream(['$DATA'], tok, tok.eos_token_id, '$RUNS/cache')
print(len(t), 'tokens')"
for s in $SEEDS; do
  run efla "$s" & run deltanet "$s" & wait
  run gated-efla "$s" & run gated-deltanet "$s" & wait
done
python -m efla lm-report --runs "$RUNS"/{efla,deltanet,gated-efla,gated-deltanet}-s* --out docs/results/lm \
  --notes docs/results/lm/notes.md || true
