"""What the Transformers engine's packed linears (accel/torch_linear.py, oneDNN) keep after a
batch drains: every distinct row count a linear shape sees leaves a primitive in oneDNN's cache
and in ideep's (PyTorch's oneDNN wrapper), each capped at 1024 entries unless
ONEDNN_PRIMITIVE_CACHE_CAPACITY / LRU_CACHE_CAPACITY say otherwise. Ragged batches of lanes see
many row counts; one generation alone sees 1-16.

    .venv/bin/python scripts/experiments/onednn_cache_memory.py [--rows 17-64]
        [--record docs/records/NAME.json]

Per cache setting, in a fresh process (the settings are read when oneDNN starts): the embedded
target's linear shapes (576x1536, 1536x576, 576x576, 576x192) packed as the engine packs them,
each called once with every row count of --rows, glibc's free heap then handed back
(service/heap.py): the resident memory that stays. Then the cost of a cache too small to hold
them: 400 calls of every shape at row counts drawn from --rows, twice, the second pass timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"default (1024 each)": {}, "both 64": {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"},
            "both 8": {"LRU_CACHE_CAPACITY": "8", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8"},
            "oneDNN's 8, ideep's default": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8"},
            "ideep's 8, oneDNN's default": {"LRU_CACHE_CAPACITY": "8"}}
SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192))

CHILD = r"""
import json, random, sys, time, torch
from torch import nn
from dflash_local.accel.torch_linear import PackedLinear
from dflash_local.service.heap import trim_heap
low, high = map(int, sys.argv[1:3])
shapes = json.loads(sys.argv[3])
def resident_mib():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
torch.manual_seed(0)
layers = [PackedLinear(nn.Linear(i, o, bias=False), 16) for i, o in shapes]
with torch.inference_mode():
    for layer in layers:
        layer(torch.randn(1, 1, layer.in_features))
    trim_heap()
    before = resident_mib()
    for rows in range(low, high + 1):
        for layer in layers:
            layer(torch.randn(1, rows, layer.in_features))
    trim_heap()
    kept = resident_mib() - before
    draws = [random.Random(0).randint(low, high) for _ in range(400)]
    for timed in (False, True):
        start = time.perf_counter()
        for rows in draws:
            for layer in layers:
                layer(torch.randn(1, rows, layer.in_features))
        seconds = time.perf_counter() - start
print(json.dumps({"kept_mib": round(kept, 1), "ms_per_call_set": round(seconds / len(draws) * 1e3, 2)}))
"""


def measure(env: dict, low: int, high: int) -> dict:
    root = Path(__file__).resolve().parents[2]
    child_env = {key: value for key, value in os.environ.items()
                 if key not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    child_env.update(env, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", CHILD, str(low), str(high), json.dumps(SHAPES)],
                         env=child_env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="17-64", help="the row counts, LOW-HIGH")
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()
    low, high = map(int, args.rows.split("-"))
    rows = []
    for label, env in SETTINGS.items():
        rows.append({"label": label, **measure(env, low, high)})
        print(json.dumps(rows[-1]), flush=True)
    if args.record:
        from dflash_local.bench.report import write_record

        write_record(args.record, {
            "title": "oneDNN's and ideep's primitive caches: memory kept per distinct row count",
            "compares": "cache capacities of the packed linears", "measured": " ".join(__doc__.split("\n\n")[2].split()),
            "command": " ".join(["scripts/experiments/onednn_cache_memory.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d"), "engine": "transformers",
            "dataset": f"the embedded target's linear shapes, {high - low + 1} row counts ({args.rows})",
            "settings": {"shapes": [f"{i}x{o}" for i, o in SHAPES], "rows": args.rows},
            "row_header": "cache capacities", "rows": rows,
            "source": "scripts/experiments/onednn_cache_memory.py",
            "columns": [{"key": "kept_mib", "label": "kept after trim (MiB)", "decimals": 1},
                        {"key": "ms_per_call_set", "label": "ms per call of the 4 shapes, varied rows", "decimals": 2}]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
