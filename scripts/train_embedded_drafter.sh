#!/usr/bin/env bash
# Reproduce the embedded drafter (models/smollm2-135m-dflash) from scratch on this machine's CPU:
# regenerate responses with SmolLM2-135M-Instruct itself, then train a 2-layer DFlash drafter.
# About 115 minutes on 2 cores (50 min bf16 regeneration at batch 128 + 60 min bf16 training +
# loading); resumable: rerun the same command after a kill and it continues where it stopped.
# The shipped drafter took thirteen v1 steps, the first of this size, then a DFlash 2 step (models/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="$(.venv/bin/python -c 'from dflash_local.pairs.embedded import embedded_target_dir; print(embedded_target_dir())')"
OMP_WAIT_POLICY=PASSIVE .venv/bin/dflash-local train \
  --target "$TARGET" \
  --out runs/smollm2-135m-dflash \
  --data runs/smol-regen \
  --layers 2 --block-size 16 --taps 1,10,18,27 --mask-token "<empty_output>" \
  --prompt-variants 2 --batch-size 128 \
  --regen-minutes "${REGEN_MINUTES:-50}" --train-minutes "${TRAIN_MINUTES:-60}" --bf16 "$@"
echo "trained drafter: runs/smollm2-135m-dflash (copy to models/ to ship it)"
