#!/usr/bin/env bash
# The embedded pair's figures, side by side in one run per engine: plain, DFlash (auto with and
# without prompt-lookup rounds, fixed block sizes, each with tree drafts and with chains) and the
# peers (Transformers generate / prompt lookup / assisted with the AR draft;
# mlx-lm generate / draft model), on the held-out prompts, offline HumanEval and the adversarial
# prompts. Writes JSON + PNG per engine under runs/bench/ and prints the tables.
#
#   scripts/bench_embedded.sh                  # both engines, 4 samples per dataset, 128 tokens
#   ENGINES=transformers SAMPLES=10 scripts/bench_embedded.sh
#   REPEATS=3 scripts/bench_embedded.sh      # every method 3 times per sample, fastest kept
#   TREE=on LOOKUP=on scripts/bench_embedded.sh  # fewer methods: trees only, auto with lookup only
#   TEMPERATURE=0.7 scripts/bench_embedded.sh   # sampling (outputs then differ run to run)
#   DATASETS=embedded,humaneval TOKENS=256 scripts/bench_embedded.sh   # fewer datasets, longer outputs
#
# The AR draft peer is runs/smollm2-135m-ar when it exists (made by `dflash-local train --kind ar`,
# see models/README.md); without it the table says the peer could not run.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINES="${ENGINES:-transformers mlx}"
SAMPLES="${SAMPLES:-4}"
TOKENS="${TOKENS:-128}"
BLOCKS="${BLOCKS:-auto,2,4,8}"
LOOKUP="${LOOKUP:-both}"
REPEATS="${REPEATS:-1}"
TREE="${TREE:-both}"
TEMPERATURE="${TEMPERATURE:-0}"
DATASETS="${DATASETS:-embedded,humaneval,adversarial}"
AR_DRAFT="${AR_DRAFT:-runs/smollm2-135m-ar}"
peer_args=(--peers)
[ -d "$AR_DRAFT" ] && peer_args+=(--ar-draft "$AR_DRAFT")
for engine in $ENGINES; do
  OMP_WAIT_POLICY=PASSIVE .venv/bin/dflash-local bench --engine "$engine" \
    --dataset "$DATASETS" --max-samples "$SAMPLES" --max-tokens "$TOKENS" \
    --block-size "$BLOCKS" --lookup "$LOOKUP" --tree "$TREE" --temperature "$TEMPERATURE" --repeats "$REPEATS" --recalibrate "${peer_args[@]}" --out runs/bench
done
