#!/usr/bin/env bash
# GPU smoke test of the served engines, end to end through dflash_local's own code: launch vLLM or
# SGLang with DFlash on a small pair (engines/launch.py + server_flags.py), stream one request
# with speculation (engines/openai_engine.py), print tau and tokens/s, stop the server.
#
# Needs a CUDA machine, this repo's venv, and vLLM (>= 0.20) or SGLang (>= 0.5.11) installed,
# either in that venv or in a venv of its own given as SERVER_PYTHON (z-lab advises one per server).
# Models are hub ids (the server downloads them) or local directories (for an offline machine).
#
#   scripts/gpu_smoke.sh                                  # vLLM if installed, else SGLang
#   ENGINE=sglang scripts/gpu_smoke.sh
#   PLAIN_TWIN=1 scripts/gpu_smoke.sh                     # also a plain server: prints the speedup
#   TARGET=/models/Qwen3-4B DRAFTER=/models/Qwen3-4B-DFlash-b16 \
#     SERVER_PYTHON=/opt/vllm-venv/bin/python scripts/gpu_smoke.sh
#
# Exit status: 0 when the server came up, streamed, and reported acceptance with tau > 1.
set -euo pipefail
cd "$(dirname "$0")/.."

export PY="${PYTHON:-.venv/bin/python}"
export ENGINE="${ENGINE:-auto}"
export TARGET="${TARGET:-Qwen/Qwen3-4B}"
export DRAFTER="${DRAFTER:-z-lab/Qwen3-4B-DFlash-b16}"
export SERVER_PYTHON="${SERVER_PYTHON:-}"
export PLAIN_TWIN="${PLAIN_TWIN:-0}"
export MAX_TOKENS="${MAX_TOKENS:-256}"
export STARTUP_TIMEOUT_S="${STARTUP_TIMEOUT_S:-1800}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || {
  echo "gpu_smoke: no NVIDIA GPU visible (nvidia-smi failed)" >&2; exit 2; }

exec "$PY" - <<'PYTHON'
import os
import sys
import time

from dflash_local.engines.launch import installed_distribution
from dflash_local.errors import DFlashError
from dflash_local.events import GenerationParams, GenerationStats

python = os.environ["SERVER_PYTHON"] or None
engine_name = os.environ["ENGINE"]
if engine_name == "auto":
    engine_name = "sglang"
    try:
        installed_distribution("vllm", python)
        engine_name = "vllm"
    except DFlashError:
        pass
if engine_name == "vllm":
    from dflash_local.engines.vllm_engine import VLLMEngine as Engine
else:
    from dflash_local.engines.sglang_engine import SGLangEngine as Engine

dist, version = installed_distribution(engine_name, python)
print(f"gpu_smoke: {dist} {version}; target {os.environ['TARGET']}; drafter {os.environ['DRAFTER']}")
started = time.monotonic()
engine = Engine(os.environ["TARGET"], os.environ["DRAFTER"], server_python=python,
                plain_twin=os.environ["PLAIN_TWIN"] == "1",
                startup_timeout_s=float(os.environ["STARTUP_TIMEOUT_S"]))
print(f"gpu_smoke: up in {time.monotonic() - started:.0f} s: {' '.join(engine.servers[0].argv)}")
messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then "
             "she sold half as many clips in May. How many clips did Natalia sell altogether in "
             "April and May? Reason step by step."}]
results = {}
try:
    for speculative in (True, False) if engine.plain else (True,):
        params = GenerationParams(max_tokens=int(os.environ["MAX_TOKENS"]), speculative=speculative)
        events = list(engine.stream_chat(messages, params, thinking=False))
        local = GenerationStats()
        for event in events:
            local.add(event)
        stats = engine.last_stats
        results[speculative] = stats
        text = "".join(event.text for event in events)
        print(f"\n--- speculative={speculative} ---\n{text[:400]}{'...' if len(text) > 400 else ''}")
        print(f"tokens {stats.completion_tokens}, chunks {len(events)}, ttft {stats.ttft_s:.3f} s, "
              f"decode {stats.decode_tokens_per_s:.1f} tok/s")
        if speculative:
            print(f"tau {stats.tau:.2f} ({stats.source}: {stats.rounds} rounds, {stats.accepted}/"
                  f"{stats.drafted} drafted tokens accepted; per chunk tau {local.tau:.2f}, "
                  f"rounds exact: {stats.per_round_exact})")
            if stats.accepted_per_position:
                rates = [f"{n / stats.rounds:.2f}" for n in stats.accepted_per_position] if stats.rounds else []
                print(f"acceptance by draft position: {' '.join(rates)}")
finally:
    engine.close()
spec = results[True]
if False in results and results[False].decode_tokens_per_s > 0:
    print(f"\nspeedup over the plain twin: {spec.decode_tokens_per_s / results[False].decode_tokens_per_s:.2f}x")
ok = spec.completion_tokens > 0 and spec.source != "none" and spec.tau > 1.0
print(f"\ngpu_smoke: {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PYTHON
