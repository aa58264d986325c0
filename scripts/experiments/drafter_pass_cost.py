"""Where a round's drafter time goes, for two drafters of the embedded target on the Transformers
engine, alternating in one run: the drafter's pass at each width, the pick of its drafts (v1:
argmax; DFlash 2: its candidate selector), a tree proposal, and the target's verify of a chain
of that width, each against one plain step (a verify of the anchor alone) of the same run.

    .venv/bin/python scripts/experiments/drafter_pass_cost.py DRAFTER_A DRAFTER_B
        [--widths 2 4 8 16] [--repeats 15] [--context 256] [--record docs/records/NAME.json]

DFlash 2's pass is also timed with its convolutions switched off (the same weights otherwise):
the pass's time beyond that is what the convolutions cost. Each repeat runs every measurement
of both drafters, the order of the two alternating; the figures are medians in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from dflash_local.bench.datasets import load_prompts
from dflash_local.drafter.selector import greedy_chain
from dflash_local.engines.torch_engine import TorchEngine
from dflash_local.method.draft_tree import DraftTree
from dflash_local.pairs.embedded import embedded_target_dir

ARCHITECTURES = {"DFlashDraftModel": "v1", "DFlash2DraftModel": "DFlash 2"}
NEW_ROWS = 4  # context rows each proposal brings, as a round that committed 3 drafts and a bonus


@contextmanager
def convolutions_off(model):
    """The DFlash 2 layers without their convolutions (a v1 layer's path), restored after."""
    saved = [(layer.attention_conv, layer.mlp_conv) for layer in model.layers]
    for layer in model.layers:
        layer.attention_conv = layer.mlp_conv = None
    try:
        yield
    finally:
        for layer, (attention, mlp) in zip(model.layers, saved):
            layer.attention_conv, layer.mlp_conv = attention, mlp


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def drafter_steps(engine: TorchEngine, taps: torch.Tensor, width: int, offset: int) -> dict:
    """One of each drafter measurement at `width`, each in a fresh session on the prompt's taps."""
    new_taps = taps[:, offset:offset + NEW_ROWS]
    steps, model = {}, engine.drafter

    def session():
        fresh = engine.make_drafter()
        fresh.propose(1, taps[:, :offset], 2)  # the prompt's context rows, cached
        return fresh

    pass_session, chain_session, tree_session = session(), session(), session()
    hidden = []
    steps["pass"] = timed(lambda: hidden.append(pass_session._draft(100, new_taps, width)))
    if model.candidate_selector is not None:
        steps["pick"] = timed(lambda: greedy_chain(pass_session._selector_inputs(100, hidden[0])))
        with convolutions_off(model):
            off_session = session()
            steps["pass_no_conv"] = timed(lambda: off_session._draft(100, new_taps, width))
    else:
        steps["pick"] = timed(lambda: model.draft_token_ids(hidden[0])[0].tolist())
    steps["propose"] = timed(lambda: chain_session.propose(100, new_taps, width))
    steps["propose_tree"] = timed(lambda: tree_session.propose_tree(100, new_taps, width - 1))
    return steps


def verify_steps(engine: TorchEngine, runner, width: int) -> dict:
    def verify(rows: int):
        runner.verify(100, DraftTree.chain(list(range(200, 200 + rows - 1))))
        runner.commit([])
    return {"plain_step": timed(lambda: verify(1)), "verify": timed(lambda: verify(width))}


def measure(engines: dict[str, TorchEngine], widths: list[int], repeats: int, context: int) -> list[dict]:
    first = next(iter(engines.values()))
    prompt = load_prompts("embedded", 1)[0]
    ids = first.encode_chat([{"role": "user", "content": prompt.turns[0]}])
    runner = first.make_runner(collect_taps=True)
    taps = runner.prefill((ids * (context // len(ids) + 1))[:context])[1]
    taps = torch.cat([taps, taps[:, : NEW_ROWS * 4]], dim=1)  # rows past the context for new_taps
    samples: dict[tuple[str, int], dict[str, list[float]]] = {}
    with torch.inference_mode():
        for repeat in range(repeats + 1):  # the first warms up
            names = list(engines) if repeat % 2 == 0 else list(reversed(engines))
            for width in widths:
                for name in names:
                    steps = {**drafter_steps(engines[name], taps, width, context),
                             **verify_steps(first, runner, width)}
                    if repeat:
                        for step, seconds in steps.items():
                            samples.setdefault((name, width), {}).setdefault(step, []).append(seconds)
    return [{"label": f"{name}, width {width}", "drafter": name, "width": width,
             **{f"{step}_ms": round(statistics.median(values) * 1000, 2) for step, values in steps.items()}}
            for (name, width), steps in samples.items()]


def make_record(args, names: list[str], rows: list[dict]) -> dict:
    """The docs/records/ record of a run (write_record adds the machine)."""
    times = dict.fromkeys(key for row in rows for key in row if key.endswith("_ms"))
    return {
        "title": "A round's parts per drafter: pass, pick, proposal, verify (Transformers)",
        "compares": " against ".join(names), "measured": " ".join(__doc__.split("\n\n")[0].split()),
        "command": " ".join(["scripts/experiments/drafter_pass_cost.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"), "engine": "transformers",
        "dataset": f"one embedded held-out prompt, {args.context} tokens of context",
        "settings": {"widths": args.widths, "repeats": args.repeats, "context": args.context,
                     "dtype": args.dtype, "new rows per proposal": NEW_ROWS},
        "row_header": "drafter, width", "rows": rows, "source": "scripts/experiments/drafter_pass_cost.py",
        "columns": [{"key": key, "label": key.removesuffix("_ms").replace("_", " ") + " (ms)", "decimals": 1}
                    for key in times]}


def drafter_name(path: Path) -> str:
    """The checkpoint's kind (v1 or DFlash 2, from its architecture) and its checkout's folder."""
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    return f"{ARCHITECTURES.get(architecture, architecture)} ({path.parent.parent.name})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafters", type=Path, nargs=2, help="two drafter directories")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--record", type=Path, help="write the figures as a docs/records/ record")
    args = parser.parse_args()
    engines = {drafter_name(path): TorchEngine(embedded_target_dir(), path, dtype=args.dtype)
               for path in args.drafters}
    rows = measure(engines, args.widths, args.repeats, args.context)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.record is not None:
        from dflash_local.bench.report import write_record

        write_record(args.record, make_record(args, list(engines), rows), threads=torch.get_num_threads())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
