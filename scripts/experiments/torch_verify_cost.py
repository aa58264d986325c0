"""What a verify pass of width k costs over a 1-token step on the Transformers engine, and
whether bfloat16 keeps speculative == plain (the figures behind cpu_linear, cpu_attention and
dtype auto).

    .venv/bin/python scripts/experiments/torch_verify_cost.py [--dtype float32 bfloat16] [--check-bf16 N] [--gqa]

Target: the imported embedded SmolLM2-135M. For float32 it alternates two loads of the target in
the same run, the engine's (oneDNN-packed linears) and stock nn.Linear, median of 4 repetitions
of 6 verify+commit pairs.
--check-bf16 N: N held-out prompts, 96 tokens, plain vs B = 4 and 16 in bfloat16: identical count.
--gqa: tree verifies at 300 and 1,500 tokens of context, the engine's attention (accel/torch_attention.py)
against Transformers' "sdpa" in the same process, alternated, and whether their logits are equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dflash_local import paths
from dflash_local.bench.datasets import load_prompts
from dflash_local.engines.torch_engine import TorchEngine
from dflash_local.events import GenerationParams
from dflash_local.method.draft_tree import DraftTree
from dflash_local.pairs.embedded import embedded_target_dir

WIDTHS = (1, 2, 4, 8, 16)
PROMPT = "Explain how a hash table works in detail, with an example in Python."


def verify_costs(engine: TorchEngine) -> dict[int, float]:
    prompt = engine.encode_chat([{"role": "user", "content": PROMPT}])
    costs = {}
    for width in WIDTHS:
        runs = []
        for _ in range(4):
            runner = engine.make_runner(False)
            runner.prefill(prompt)
            start = time.perf_counter()
            for _ in range(6):
                runner.verify_chain([100 + j for j in range(width)])
                runner.commit([0])
            runs.append((time.perf_counter() - start) / 6)
        costs[width] = statistics.median(runs)
    return costs


def tree_verify_costs(engine: TorchEngine, context: int) -> tuple[dict[int, float], dict]:
    """Median seconds of a chain-shaped tree verify + commit per width on `context` prompt tokens, and
    the logits of each width's first verify (to compare implementations)."""
    chat = engine.encode_chat([{"role": "user", "content": PROMPT}])
    prompt = (chat * (context // len(chat) + 1))[:context]
    costs, logits = {}, {}
    for width in WIDTHS[1:]:
        tree = DraftTree.chain([100 + j for j in range(width - 1)])
        runner = engine.make_runner(False)
        runner.prefill(prompt)
        runs = []
        for _ in range(8):
            start = time.perf_counter()
            out = runner.verify_tree(100, tree)
            runner.commit([0])
            runs.append(time.perf_counter() - start)
            logits.setdefault(width, out)
        costs[width] = statistics.median(runs)
    return costs, logits


def gqa_comparison() -> None:
    import numpy as np

    ours = TorchEngine(embedded_target_dir(), None, dtype="float32")
    stock = TorchEngine(embedded_target_dir(), None, dtype="float32")
    stock.model.set_attn_implementation("sdpa")
    for context in (300, 1500):
        for _ in range(2):  # alternate: this machine may be shared
            for label, engine in (("sdpa (repeat_kv)", stock), (ours.model.config._attn_implementation, ours)):
                costs, logits = tree_verify_costs(engine, context)
                print(f"context {context} {label:16}",
                      " ".join(f"w{w}={c * 1000:.1f}ms" for w, c in costs.items()), flush=True)
                if engine is stock:
                    reference = logits
                else:
                    same = all(np.array_equal(reference[w], logits[w]) for w in logits)
                    print(f"  logits equal to sdpa's at every width: {same}", flush=True)


def report(label: str, costs: dict[int, float]) -> None:
    print(label, " ".join(f"w{w}={c * 1000:.1f}ms({c / costs[1]:.2f}x)" for w, c in costs.items()),
          flush=True)


def _tokens(engine: TorchEngine, ids: list[int], **params) -> list[int]:
    events = engine.stream(ids, GenerationParams(max_tokens=96, **params))
    return [t for e in events for t in e.token_ids]


def bf16_identity(count: int) -> None:
    engine = TorchEngine(embedded_target_dir(), paths.shipped_models_dir() / "smollm2-135m-dflash",
                         dtype="bfloat16")
    same = total = 0
    for prompt in load_prompts("embedded", count):
        ids = engine.encode_chat([{"role": "user", "content": prompt.turns[0]}])

        plain = _tokens(engine, ids, speculative=False)
        for block_size in (4, 16):
            total += 1
            same += _tokens(engine, ids, block_size=block_size) == plain
    print(f"bfloat16: speculative identical to plain in {same}/{total} generations")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--check-bf16", type=int, default=0, metavar="N")
    parser.add_argument("--gqa", action="store_true", help="only the attention comparison")
    args = parser.parse_args()
    if args.gqa:
        gqa_comparison()
        return
    for dtype in args.dtype:
        engine = TorchEngine(embedded_target_dir(), None, dtype=dtype)
        if dtype != "float32":
            report(dtype, verify_costs(engine))
            continue
        stock = TorchEngine(embedded_target_dir(), None, dtype="float32", pack_cpu_linears=False)
        for _ in range(2):  # alternate: this machine may be shared
            report("float32 stock nn.Linear", verify_costs(stock))
            report("float32 oneDNN-packed  ", verify_costs(engine))
    if args.check_bf16:
        bf16_identity(args.check_bf16)


if __name__ == "__main__":
    main()
