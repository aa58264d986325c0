"""One ragged verify over B generations (TorchTargetRunner.verify_batch) against B verifies one
after another, on the Transformers engine with the embedded pair, in one run; with --drafter,
one ragged drafter pass (DraftSession.propose_batch) against B proposals instead.

    .venv/bin/python scripts/experiments/torch_verify_batch_cost.py [--batches 1 2 4 8]
        [--context 512] [--rows 16] [--repeats 9] [--device cpu] [--drafter]
        [--record docs/records/NAME.json]

Each of max(B) generations holds its own `--context`-token prompt (held-out prompts repeated);
a round verifies a chain of `--rows` rows per generation and rolls them all back (`commit([])`),
so both ways verify on the same contexts. Sequential and batched rounds alternate on the same runners (this machine
may be shared); each figure is the median over `--repeats`. The first round of each B also
checks that both give every generation the same argmax, and the largest logit difference.
--drafter: two sets of drafter sessions start from the same prompt taps and take the same 4 new
rows each round, one set proposing one by one, the other in one batch (blocks of `--rows`); the
first round compares their drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

from dflash_local import paths
from dflash_local.bench.datasets import load_prompts
from dflash_local.drafter.model_torch import DraftSession
from dflash_local.engines.torch_engine import TorchEngine, TorchTargetRunner
from dflash_local.method.draft_tree import DraftTree
from dflash_local.pairs.embedded import embedded_target_dir


def prefilled_runners(engine: TorchEngine, count: int, context: int):
    """`count` runners, each prefilled with its own prompt, and each prompt's taps."""
    runners, taps = [], []
    for prompt in load_prompts("embedded", count):
        ids = engine.encode_chat([{"role": "user", "content": prompt.turns[0]}])
        runner = engine.make_runner(collect_taps=True)
        taps.append(runner.prefill((ids * (context // len(ids) + 1))[:context])[1])
        runners.append(runner)
    return runners, taps


def measure_drafter(engine: TorchEngine, prompt_taps, rows: int, repeats: int) -> dict:
    count = len(prompt_taps)
    alone = [engine.make_drafter() for _ in range(count)]
    together = [engine.make_drafter() for _ in range(count)]
    for first, second, taps in zip(alone, together, prompt_taps):  # the prompts' context rows
        first.propose(1, taps, 2)
        second.propose(1, taps, 2)
    anchors, widths = [100 + lane for lane in range(count)], [rows] * count
    sequential, batched = [], []
    for repeat in range(repeats + 1):
        new_taps = [taps[:, 4 * repeat : 4 * repeat + 4] for taps in prompt_taps]
        seconds_one, drafts_one = timed(propose_each, alone, anchors, new_taps, widths)
        seconds_all, drafts_all = timed(DraftSession.propose_batch, together, anchors, new_taps, widths)
        if repeat == 0:
            same = drafts_one == drafts_all
            continue
        sequential.append(seconds_one)
        batched.append(seconds_all)
    return _row(count, statistics.median(sequential), statistics.median(batched), same, None)


def propose_each(sessions, anchors, new_taps, widths) -> list[list[int]]:
    return [session.propose(anchor, taps, width)
            for session, anchor, taps, width in zip(sessions, anchors, new_taps, widths)]


def _row(count: int, one: float, together: float, same: bool, max_diff: float | None) -> dict:
    row = {"label": f"B = {count}", "sequential_ms": round(one * 1000, 1),
           "batched_ms": round(together * 1000, 1), "speedup": round(one / together, 2),
           "per_generation_ms": round(together * 1000 / count, 1), "same_argmax": "yes" if same else "no"}
    return row if max_diff is None else {**row, "max_logit_diff": max_diff}


def sequential_round(runners, anchors, chains):
    logits = [runner.verify(anchor, chain) for runner, anchor, chain in zip(runners, anchors, chains)]
    for runner in runners:
        runner.commit([])
    return logits


def batched_round(runners, anchors, chains):
    logits = TorchTargetRunner.verify_batch(runners, anchors, chains)
    for runner in runners:
        runner.commit([])
    return logits


def timed(round_fn, *args) -> tuple[float, list[np.ndarray]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    logits = round_fn(*args)
    return time.perf_counter() - start, logits


def measure(runners, rows: int, repeats: int) -> dict:
    count = len(runners)
    anchors = [100 + lane for lane in range(count)]
    chains = [DraftTree.chain([200 + lane + j for j in range(rows - 1)]) for lane in range(count)]
    sequential, batched = [], []
    for repeat in range(repeats + 1):  # the first round of each warms up and is compared
        seconds_one, logits_one = timed(sequential_round, runners, anchors, chains)
        seconds_all, logits_all = timed(batched_round, runners, anchors, chains)
        if repeat == 0:
            same = all(np.array_equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(logits_one, logits_all))
            max_diff = max(float(np.abs(a - b).max()) for a, b in zip(logits_one, logits_all))
            continue
        sequential.append(seconds_one)
        batched.append(seconds_all)
    return _row(count, statistics.median(sequential), statistics.median(batched), same, max_diff)


def record(args, rows: list[dict]) -> dict:
    columns = [("sequential_ms", "B verifies one by one, ms", 1), ("batched_ms", "verify_batch, ms", 1),
               ("speedup", "one by one / batch", 2), ("per_generation_ms", "batch ms per generation", 1),
               ("same_argmax", "same argmax", 0), ("max_logit_diff", "max abs logit diff", 6)]
    return {
        "title": "One ragged verify over B generations against B verifies one by one (Transformers engine)",
        "measured": (f"Each of B generations holds its own {args.context}-token prompt (held-out "
                     f"prompts repeated); a round verifies a {args.rows}-row chain per generation "
                     "and rolls them back. Rounds of B verifies one after another and of one "
                     "verify_batch alternate on the same runners; medians over "
                     f"{args.repeats} rounds. The first round of each B also compares the two ways' "
                     "logits: whether every row's argmax is the same, and the largest difference."),
        "command": (f"PYTHONPATH=. nice .venv/bin/python scripts/experiments/torch_verify_batch_cost.py "
                    f"--batches {' '.join(map(str, args.batches))} --context {args.context} "
                    f"--rows {args.rows} --repeats {args.repeats} --device {args.device} "
                    f"{'--drafter ' if args.drafter else ''}--record {args.record}"),
        "date": date.today().isoformat(),
        "engine": "transformers",
        "dataset": "embedded held-out prompts, repeated to the context",
        "settings": {"dtype": "float32", "rows per generation": args.rows, "context": args.context,
                     "torch threads": torch.get_num_threads()},
        "compares": "a batched ragged verify (TorchTargetRunner.verify_batch) against one verify per generation",
        "source": "scripts/experiments/torch_verify_batch_cost.py, dflash_local/engines/torch_batch.py",
        "row_header": "generations",
        "columns": [{"key": key, "label": label, "decimals": decimals} for key, label, decimals in columns],
        "rows": rows,
    } | (drafter_fields(args) if args.drafter else {})


def drafter_fields(args) -> dict:
    """What a --drafter record says instead of the verify's."""
    columns = [("sequential_ms", "B proposals one by one, ms", 1), ("batched_ms", "propose_batch, ms", 1),
               ("speedup", "one by one / batch", 2), ("per_generation_ms", "batch ms per generation", 1),
               ("same_argmax", "same drafts", 0)]
    return {
        "title": "One ragged drafter pass over B generations against B proposals one by one (Transformers engine)",
        "measured": (f"Each of B generations' drafter sessions holds its own {args.context}-row context "
                     "(the taps of a held-out prompt repeated); a round appends 4 new rows and drafts "
                     f"a {args.rows}-row block per session. Two sets of sessions fed alike, one proposing "
                     f"one by one, one in one propose_batch, alternate; medians over {args.repeats} rounds; "
                     "the first round compares their drafts."),
        "compares": "a batched ragged drafter pass (DraftSession.propose_batch) against one proposal per generation",
        "source": "scripts/experiments/torch_verify_batch_cost.py, dflash_local/drafter/batch_torch.py",
        "columns": [{"key": key, "label": label, "decimals": decimals} for key, label, decimals in columns],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--drafter", action="store_true", help="time propose_batch instead")
    parser.add_argument("--machine", default=None, help="the accelerator, as the record names it beside the CPU")
    parser.add_argument("--record", type=Path, default=None, help="write the figures as a record")
    args = parser.parse_args()
    engine = TorchEngine(embedded_target_dir(), paths.shipped_models_dir() / "smollm2-135m-dflash",
                         dtype="float32", device=args.device)
    runners, taps = prefilled_runners(engine, max(args.batches), args.context)
    rows = []
    for count in args.batches:
        row = (measure_drafter(engine, taps[:count], args.rows, args.repeats) if args.drafter
               else measure(runners[:count], args.rows, args.repeats))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.record is not None:
        from dflash_local.bench.report import write_record

        accelerator = args.machine or ("" if args.device == "cpu" else f"device {args.device}")
        write_record(args.record, record(args, rows), threads=torch.get_num_threads(), setting=accelerator)


if __name__ == "__main__":
    main()
