#!/usr/bin/env bash
# Set up (see setup.sh), then run the whole test suite. Used by CI (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# z-lab's reference package is a test-only oracle: --no-deps, it pins exact versions otherwise
.venv/bin/python -m pip install -q --no-deps "dflash==0.1.0"
export DFLASH_EMBEDDED_TARGET="$(.venv/bin/python -c 'from dflash_local.embedded import embedded_target_dir; print(embedded_target_dir())')"
export OMP_WAIT_POLICY=PASSIVE
exec .venv/bin/python -m pytest -q "$@"
