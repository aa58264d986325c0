#!/usr/bin/env bash
# The Python clients people point at a local server, in a venv of their own (their pins never
# touch .venv): llm, litellm, langchain-openai, langchain-anthropic, openai-agents, pydantic-ai
# (slim, OpenAI + Anthropic models) and instructor. tests/test_clients_*.py run snippets in it
# against a served pair (tests/client_harness.py). Idempotent.
#
#   scripts/setup_clients.sh [VENV_DIR]   (default .venv-clients; PYTHON=python3.11 to choose)
#   DFLASH_CLIENTS_PYTHON=VENV_DIR/bin/python pytest tests/test_clients_round_trip.py
#
# Left out: aider-chat 0.86 pins all of its 108 requirements exactly (its own litellm and openai,
# numpy 1.26, scipy, tree-sitter grammars): scripts/setup_aider.sh, a venv of its own. lm-eval pulls
# datasets, scikit-learn, evaluate, and its tasks fetch their data from the hub at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-clients}"
PYTHON="${PYTHON:-python3}"
CLIENTS=("llm==0.36" "litellm==1.110.2" "langchain-openai==1.8.1" "langchain-anthropic==1.7.10"
         "openai-agents==0.24.0" "pydantic-ai-slim[openai,anthropic]==2.78.0")
# instructor 1.17 caps jiter below 0.15, which every openai >= 3.50 (pydantic-ai's floor) outgrew:
# it goes in without its own pins, onto the jiter the others chose, its other needs named here
INSTRUCTOR=("instructor==1.17.0")
INSTRUCTOR_NEEDS=("docstring-parser>=0.16,<1.0" "typer>=0.9,<1.0" "rich>=13.7,<15" "tenacity>=8.2.3,<10"
                  "jinja2>=3.1.4,<4" "aiohttp>=3.14.3,<4")
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
export LITELLM_LOCAL_MODEL_COST_MAP=True  # litellm fetches its price list at import otherwise
if ! "$VENV/bin/python" -c 'import llm, litellm, langchain_openai, langchain_anthropic, agents, pydantic_ai, instructor' 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "${CLIENTS[@]}" "${INSTRUCTOR_NEEDS[@]}"
  "$VENV/bin/python" -m pip install -q --no-deps "${INSTRUCTOR[@]}"
  "$VENV/bin/python" -c 'import llm, litellm, langchain_openai, langchain_anthropic, agents, pydantic_ai, instructor'
fi
echo "client environment ready: export DFLASH_CLIENTS_PYTHON=$(cd "$VENV" && pwd)/bin/python"
