#!/usr/bin/env bash
# DFlash 2 against v1 on the embedded pair at equal data and compute: both start from the shipped
# v1 drafter and train the same steps on the same sequences (every EVERY-th of the shipped token
# archive, retapped once), v2 with `--version 2` (identity convolutions, a neutral selector at
# first), v1 continued as it is. Then teacher-forced on the held-out prompts, and end to end on
# 30 held-out prompts, each against plain decoding in its own run.
#   STEPS=1200 EVERY=10 OUT=runs/compare-v2 V1=DIR scripts/experiments/compare_embedded_drafters.sh
# V1: the v1 drafter both start from; the embedded drafter's step 13 (models/smollm2-135m-dflash
# before DFlash 2 shipped there: `git log -- models/smollm2-135m-dflash/model.safetensors`).
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS="${STEPS:-1200}"
EVERY="${EVERY:-10}"
OUT="${OUT:-runs/compare-v2}"
PY=.venv/bin/python
T="$($PY -c 'from dflash_local.pairs.embedded import embedded_target_dir; print(embedded_target_dir())')"
SHIPPED="${V1:-models/smollm2-135m-dflash}"
mkdir -p "$OUT"
if [ ! -f "$OUT/subset.npz" ]; then
  $PY - "$T" "$OUT/subset.npz" "$EVERY" <<'PY'
import sys
from pathlib import Path

from transformers import AutoTokenizer

from dflash_local.drafter.config import load_target_info
from dflash_local.train.token_archive import load_tokens, save_tokens, target_fingerprint

target, out, every = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(target)
fingerprint = target_fingerprint(load_target_info(target))
sequences = load_tokens(Path("models/training-data/smollm2-135m-step13.npz"), tokenizer, fingerprint)
save_tokens(sequences[::every], out, tokenizer, fingerprint)
print(f"{len(sequences[::every])} of {len(sequences)} sequences")
PY
fi
common=(--target "$T" --data "$OUT/data" --regen-minutes 0 --init-from "$SHIPPED" --steps "$STEPS"
        --bf16 --lr 2.5e-4 --seed 14)
$PY -m dflash_local.cli.main train --out "$OUT/v1" --tokens "$OUT/subset.npz" "${common[@]}"
$PY -m dflash_local.cli.main train --out "$OUT/v2" --version 2 "${common[@]}"
$PY scripts/eval_drafter_heldout.py "$SHIPPED" "$OUT/v1" "$OUT/v2" | tee "$OUT/heldout.txt"
for version in v1 v2; do
  $PY -m dflash_local.cli.main bench --engine transformers --drafter "$OUT/$version" --dataset embedded \
    --max-samples 30 --max-tokens 128 --block-size auto --recalibrate --out "$OUT/bench-$version"
done
