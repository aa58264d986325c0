"""A batched verify against the same verifies one by one on the MLX engine, by batch size.

Loads the embedded pair through the engine (its accelerations, thread count and the drafter's
taps, as served), prefills one runner per generation with its own prompt of --context tokens,
then at each batch size B times, in turn, B verifies of a --width-row chain one after another
and one `MLXTargetRunner.verify_batch` of the same B chains (engines/mlx_batch.py). Every
verify is rolled back after it is timed, so each pass runs on the same contexts; the batched
logits' argmax is checked against the one-by-one verifies' on every pass. Medians.

    .venv/bin/python scripts/experiments/mlx_verify_batch.py [--batches 1,2,4,8] [--context 512]
        [--width 16] [--repeats 6] [--record docs/records/mlx-verify-batch.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import numpy as np

from dflash_local.method.draft_tree import DraftTree


def load_runners(count: int, context: int):
    """The embedded pair's engine and `count` runners, each with a prompt of its own."""
    from dflash_local.engines import engine_class_for  # our BLAS before mlx loads
    from dflash_local.pairs.default_pair import pair_names

    target, drafter = pair_names(None, None, speculative=True)
    engine = engine_class_for("mlx")(Path(target), Path(drafter) if drafter else None)
    rng = np.random.default_rng(0)
    runners = []
    for _ in range(count):
        runner = engine.make_runner(collect_taps=engine.drafter is not None)
        runner.prefill([int(token) for token in rng.integers(100, 40_000, context)])
        runners.append(runner)
    return engine, runners


def one_by_one(runners, anchors, trees) -> list[np.ndarray]:
    return [runner.verify(anchor, tree) for runner, anchor, tree in zip(runners, anchors, trees)]


def timed(verify, runners, anchors, trees) -> tuple[float, list[np.ndarray]]:
    """(seconds, logits) of one verify of every runner, rolled back afterwards."""
    start = time.perf_counter()
    logits = verify(runners, anchors, trees)
    seconds = time.perf_counter() - start
    for runner in runners:
        runner.commit([])  # keep nothing: the context is as before
    return seconds, logits


def measure(runners, batches: list[int], width: int, repeats: int, batched) -> list[dict]:
    rng = np.random.default_rng(1)
    chains = [DraftTree.chain(rng.integers(100, 40_000, width - 1).tolist()) for _ in runners]
    anchors = rng.integers(100, 40_000, len(runners)).tolist()
    times = {(size, kind): [] for size in batches for kind in ("one", "batch")}
    agree = True
    for repeat in range(repeats + 1):  # the first pass warms up
        for size in batches:
            args = (runners[:size], anchors[:size], chains[:size])
            if repeat % 2:  # each goes first in every other pass: no order effect
                batch_s, batch_logits = timed(batched, *args)
                one_s, one_logits = timed(one_by_one, *args)
            else:
                one_s, one_logits = timed(one_by_one, *args)
                batch_s, batch_logits = timed(batched, *args)
            agree &= all(np.array_equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(one_logits, batch_logits))
            if repeat:
                times[size, "one"].append(one_s)
                times[size, "batch"].append(batch_s)
    rows = []
    for size in batches:
        one_s, batch_s = statistics.median(times[size, "one"]), statistics.median(times[size, "batch"])
        rows.append({"label": f"B = {size}", "one_by_one_ms": round(one_s * 1e3, 1),
                     "batched_ms": round(batch_s * 1e3, 1), "speedup": round(one_s / batch_s, 2),
                     "batched_per_generation_ms": round(batch_s * 1e3 / size, 1),
                     "argmax_identical": "yes" if agree else "NO"})
    return rows


def record(rows: list[dict], args) -> dict:
    columns = [("one_by_one_ms", "B verifies one by one (ms)", 1),
               ("batched_ms", "one verify_batch (ms)", 1), ("speedup", "one by one / batched", 2),
               ("batched_per_generation_ms", "batched, per generation (ms)", 1),
               ("argmax_identical", "argmax identical", None)]
    return {
        "title": "MLX batched verify: B generations' verifies in one forward",
        "compares": "B verifies one by one against one MLXTargetRunner.verify_batch of the same B chains",
        "measured": f"Median wall time of B {args.width}-row chain verifies, one runner after another, "
                    f"and of one batched verify of the same chains (engines/mlx_batch.py), every "
                    f"runner at its own {args.context}-token context, in turn in one process (each first in every other pass); the "
                    f"argmax of every row checked equal on every pass.",
        "dataset": f"random token ids: one {args.context}-token prompt per runner, {args.width}-row chains",
        "date": datetime.date.today().isoformat(),
        "engine": "mlx (CPU)",
        "settings": {"pair": "embedded (SmolLM2-135M-Instruct, float32, the drafter's taps collected)",
                     "context": args.context, "width": args.width, "repeats": args.repeats},
        "command": "scripts/experiments/mlx_verify_batch.py " + " ".join(
            f"--{name} {value}" for name, value in (("batches", args.batches), ("context", args.context),
                                                    ("width", args.width), ("repeats", args.repeats))),
        "source": "scripts/experiments/mlx_verify_batch.py, dflash_local/engines/mlx_batch.py, "
                  "dflash_local/accel/mlx_lanes.py",
        "row_header": "batch",
        "columns": [{"key": key, "label": label, **({"decimals": places} if places is not None else {})}
                    for key, label, places in columns],
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--width", type=int, default=16, help="rows per verify: the anchor and width-1 drafts")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--record", type=Path, help="write the record here (docs/records/NAME.json)")
    args = parser.parse_args()
    batches = [int(size) for size in args.batches.split(",")]
    engine, runners = load_runners(max(batches), args.context)
    rows = measure(runners, batches, args.width, args.repeats, type(runners[0]).verify_batch)
    print(json.dumps(rows, indent=1))
    if args.record:
        from dflash_local.bench.report import write_record

        write_record(args.record, record(rows, args), threads=engine.compute_threads())
    engine.close()


if __name__ == "__main__":
    main()
