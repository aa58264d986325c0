"""What a tree verify costs against a chain of the same rows on the MLX engine, by context.

Runs the engine's own MLXTargetRunner on the embedded target: at each context it times, in
turn, a 1-token step, a chain verify of W rows and a tree verify of W rows (a branching tree of
the shape auto's rounds verify), each followed by the commit a round that kept one row makes
(that row then trimmed too, so every pass runs on the same context).
Medians; the ratios tree/chain and tree/step are what the tree layout decides. --attention
both times every pass with mlx-lm's stock attention and with
dflash_local/accel/mlx_attention.py, in turn (the engine's choice on a CPU; --attention
shipped times that alone).

    .venv/bin/python scripts/experiments/mlx_tree_verify_cost.py [--contexts 300,1000,1500] [--width 16]
        [--repeats 15] [--attention shipped|both] [--out runs/mlx-tree-verify.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dflash_local.method.draft_tree import DraftTree


def branching_tree(token_ids: list[int]) -> DraftTree:
    """Two candidates at each of the first levels, then a chain: rows spread as a sized tree's."""
    parents, depth_nodes = [], [0]
    for node in range(1, len(token_ids) + 1):
        parent = depth_nodes[-1] if node % 3 else depth_nodes[-2] if len(depth_nodes) > 1 else 0
        parents.append(parent)
        depth_nodes.append(node)
    return DraftTree(tuple(token_ids), tuple(parents))


def attention_kernels(both: bool) -> dict[str, object]:
    """label -> the attention to set before each pass (None: the engine's own choice)."""
    if not both:
        return {"": None}
    from mlx_lm.models.base import scaled_dot_product_attention as stock

    from dflash_local.accel.mlx_attention import cpu_attention

    return {"stock_": stock, "cpu_": cpu_attention}


def measure(target_dir: Path, contexts: list[int], width: int, repeats: int, both: bool) -> list[dict]:
    from dflash_local.engines import engine_class_for
    from dflash_local.pairs.embedded import embedded_target_dir

    MLXEngine = engine_class_for("mlx")  # the fast BLAS first, as load_engine does
    from dflash_local.accel.mlx_attention import set_attention

    engine = MLXEngine(target_dir or embedded_target_dir(), None)
    kernels = attention_kernels(both)
    text = engine.encode_chat([{"role": "user", "content": "Tell me about the history of maps. " * 200}])
    results = []
    for context in contexts:
        runner = engine.make_runner(collect_taps=False)
        ids = (text * (context // len(text) + 1))[:context]
        runner.prefill(ids)
        filler = ids[-width:]
        tree = branching_tree(filler[1:])
        timings = {(label, kind): [] for label in kernels for kind in ("step", "chain", "tree")}
        for repeat in range(repeats + 1):
            for (label, kind), seconds in timings.items():
                if kernels[label] is not None:
                    set_attention(engine.model, kernels[label])
                start = time.perf_counter()
                if kind == "tree":
                    runner.verify_tree(filler[0], tree)
                    runner.commit([0])
                else:
                    runner.verify_chain(filler[: 1 if kind == "step" else width])
                    runner.commit([0])
                if repeat:  # the first round of each is a warm-up
                    seconds.append(time.perf_counter() - start)
                for layer_cache in runner.cache:  # the kept row too: every pass on `context` tokens
                    layer_cache.trim(1)
        ms = {key: statistics.median(values) * 1e3 for key, values in timings.items()}
        result = {"context": context, "width": width,
                  **{f"{label}{kind}_ms": round(value, 2) for (label, kind), value in ms.items()}}
        for label in kernels:
            for a, b in (("tree", "chain"), ("tree", "step"), ("chain", "step")):
                result[f"{label}{a}_over_{b}"] = round(ms[label, a] / ms[label, b], 3)
        results.append(result)
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=None, help="an mlx-lm target directory (default: embedded)")
    parser.add_argument("--contexts", default="300,1000,1500")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--attention", choices=["shipped", "both"], default="shipped")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = measure(args.target, [int(c) for c in args.contexts.split(",")], args.width, args.repeats,
                      args.attention == "both")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
