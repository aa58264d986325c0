#!/usr/bin/env bash
# A peer environment for `dflash-local bench --peers`: the Mac peers dflash-mlx and mlx-dspark in
# a venv of their own (mlx-dspark pulls mlx-vlm, opencv, pandas: kept out of ours), on the same
# mlx as ours, so the bench's OpenBLAS binding takes in their processes too. Idempotent.
# Usage: scripts/setup_peers.sh [VENV_DIR]   (default .venv-peers; PYTHON=python3.11 to choose)
# Then:  dflash-local bench --peers --peer-python VENV_DIR/bin/python   (or DFLASH_PEER_PYTHON)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-peers}"
PYTHON="${PYTHON:-python3}"
PEERS=("dflash-mlx==0.1.8" "mlx-dspark==0.20.3")
# the mlx our own venv computes with (the BLAS binding needs the same bundled library)
OURS=".venv/bin/python"
MLX_VERSION="${MLX_VERSION:-$([ -x "$OURS" ] && "$OURS" -c 'from importlib.metadata import version; print(version("mlx"))' 2>/dev/null || echo 0.32.4)}"
if [ "$(uname -s)" = "Linux" ]; then MLX="mlx[cpu]==$MLX_VERSION"; else MLX="mlx==$MLX_VERSION"; fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${PEERS[@]}" "$MLX"
"$VENV/bin/python" -c 'import dflash_mlx, mlx_dspark, mlx.core' >/dev/null
echo "peer environment ready: --peer-python $(cd "$VENV" && pwd)/bin/python"
echo "  (or export DFLASH_PEER_PYTHON=$(cd "$VENV" && pwd)/bin/python)"
