#!/usr/bin/env bash
# aider in a venv of its own: aider-chat 0.86 pins all of its 108 requirements exactly (its own
# litellm and openai, numpy 1.26, scipy, tree-sitter grammars), so it shares no venv with ours or
# with scripts/setup_clients.sh's. tests/test_aider_round_trip.py runs its command line against a
# served pair; it skips unless this venv exists. Not in scripts/run-tests.sh (CI's time is spent).
# Idempotent.
#
#   scripts/setup_aider.sh [VENV_DIR]   (default .venv-aider; PYTHON=python3.12 to choose, 3.10-3.12)
#   pytest tests/test_aider_round_trip.py   (DFLASH_AIDER=VENV_DIR/bin/aider for another venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-aider}"
PYTHON="${PYTHON:-python3}"
AIDER="aider-chat==0.86.1"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/aider" --version >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip install -q "$AIDER"
  "$VENV/bin/aider" --version
fi
echo "aider ready: $(cd "$VENV" && pwd)/bin/aider"
