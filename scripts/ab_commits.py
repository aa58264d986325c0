"""Two checkouts of this repo side by side on one engine: the same prompts, interleaved per prompt.

    .venv/bin/python scripts/ab_commits.py OLD_DIR NEW_DIR [--engine mlx|transformers]
        [--dataset embedded] [--samples 30] [--only ID,ID] [--repeats N] [--max-tokens 128]
        [--block-size auto|N] [--drafter new|old|own] [--trace DIR] [--log FILE] [--out RUN.json]
        [--record docs/records/NAME.json]
    .venv/bin/python scripts/ab_commits.py --from-run RUN.json [...] --record docs/records/NAME.json

Each checkout runs in a worker process of its own (PYTHONPATH=DIR), which loads the embedded
target and one drafter once: the shipped drafter of NEW_DIR (--drafter new, the default) or of
OLD_DIR (old: an older checkout may not read a newer drafter) for both, or each checkout its own
(own: what a user of each got; outputs then differ, τ says by how much). With one drafter path
(the calibration cache's key names it) the second worker reads the first one's calibration
when both measure the same way, so both plan rounds from the same costs and the comparison is
of the code alone. Each worker calibrates as the CLI does, then decodes each prompt greedily
with block size auto. The order of the two alternates from prompt to prompt (old new, new old:
ABBA), so a machine's drift hits both alike. With one drafter every run must equal the other
checkout's token for token. Reports decode tokens/s of each (total tokens over total decode
time) and new/old, the machine (bench/machine.py) and its load average over the run; --log
appends each prompt's figures as it goes, --record adds the run as a row of a docs/records/
record (--from-run: runs already made). Make a checkout with `git worktree add --detach DIR COMMIT`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from dflash_local import machine_load
from dflash_local.bench.machine import describe_engine

PINS = ("DFLASH_BLAS_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")  # recorded in the command
DRAFTER = Path("models") / "smollm2-135m-dflash"  # a checkout's shipped drafter
DRAFTER_CHOICES = ("new", "old", "own")

# the worker runs in the checkout's own code: only what both the old and the new API offer
WORKER = r"""
import json, sys
from dflash_local import events
from dflash_local.engines import load_engine
import dflash_local
from pathlib import Path
checkout = Path(dflash_local.__file__).parent
# probe the checkout's own files: an editable install elsewhere would answer find_spec
if (checkout / "pairs").is_dir():  # the layout with method/, pairs/, typed options
    from dflash_local.engines.options import EngineOptions
    from dflash_local.pairs.default_pair import pair_names
    options, trace_module = {"options": EngineOptions(dtype="auto")}, "dflash_local.method.round_trace"
else:  # before it: modules at the package's root, options as keywords
    from dflash_local.cli import pair_names
    options, trace_module = {"dtype": "auto"}, "dflash_local.round_trace"
auto = events.AUTO if hasattr(events, "AUTO") else "auto"
if hasattr(events, "parse_block_size"):  # typed block sizes
    def block_size(text):
        return events.parse_block_size(text if text == "auto" else int(text))
else:  # before them: the CLI's int-or-"auto" form
    block_size = events.block_size_arg
target, _ = pair_names(None, None, speculative=True)
engine = load_engine(sys.argv[1], target, sys.argv[2], **options)
engine.prepare(auto)
if len(sys.argv) > 3 and (checkout.parent / (trace_module.replace(".", "/") + ".py")).is_file():
    import importlib  # a round trace, where the checkout has one
    engine.round_trace = importlib.import_module(trace_module).RoundTrace(sys.argv[3])
def round_fields(event):  # what every checkout's events say of a round, under either's names
    return [event.mode, getattr(event, "width", getattr(event, "block_size", 1)), event.drafted,
            event.draft_depth, event.accepted, getattr(event, "lookup_accepted", getattr(event, "copied", 0))]
def check_origin():  # an old checkout lacking a module must fail, not borrow another checkout's
    strays = sorted(name for name, module in sys.modules.items() if name.startswith("dflash_local")
                    and getattr(module, "__file__", None) and not module.__file__.startswith(str(checkout)))
    if strays:
        sys.exit(f"modules from outside {checkout}: {strays}")
check_origin()
print(json.dumps({"ready": engine.name}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if engine.__dict__.get("round_trace") is not None:
        engine.round_trace.label = request["label"]
    ids = engine.encode_chat([{"role": "user", "content": request["prompt"]}])
    params = events.GenerationParams(max_tokens=request["max_tokens"],
                                     block_size=block_size(request["block_size"]))
    stats, tokens, rounds = events.GenerationStats(), [], []
    for event in engine.stream(ids, params):
        stats.add(event)
        tokens.extend(event.token_ids)
        if event.round_index > 0:
            rounds.append(round_fields(event))
    check_origin()
    print(json.dumps({"tokens": tokens, "decode_s": stats.decode_s, "tau": stats.tau, "rounds": rounds}),
          flush=True)
"""


class Worker:
    def __init__(self, checkout: Path, engine: str, drafter: Path, trace: Path | None = None):
        env = {**os.environ, "PYTHONPATH": f"{checkout}:{checkout / 'tui'}", "OMP_WAIT_POLICY": "PASSIVE"}
        command = [sys.executable, "-c", WORKER, engine, str(drafter), *([str(trace)] if trace else [])]
        self.process = subprocess.Popen(command, cwd=checkout, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()  # loaded and calibrated

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"a worker stopped (exit {self.process.wait()})")
        return json.loads(line)

    def run(self, prompt: str, max_tokens: int, block_size: str, label: str = "") -> dict:
        request = {"prompt": prompt, "max_tokens": max_tokens, "block_size": block_size, "label": label}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, nargs="?")
    parser.add_argument("new", type=Path, nargs="?")
    parser.add_argument("--engine", choices=["mlx", "transformers"], default="mlx")
    parser.add_argument("--dataset", default="embedded", help="a bench dataset (default: embedded)")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", default="auto",
                        help="auto (the default), or a fixed width: 1 times plain decoding")
    parser.add_argument("--drafter", choices=DRAFTER_CHOICES, default="new",
                        help="whose shipped drafter both sides load (old, new), or each its own (own)")
    parser.add_argument("--out", type=Path, help="this run's figures as JSON")
    parser.add_argument("--record", type=Path, metavar="PATH",
                        help="add the run as a row of this docs/records/ record (made if absent)")
    parser.add_argument("--from-run", type=Path, nargs="+", metavar="RUN",
                        help="no run: add these --out files to --record")
    parser.add_argument("--analysis", metavar="TEXT", help="what the record's figures say, kept in it")
    parser.add_argument("--log", type=Path, metavar="FILE",
                        help="append each prompt's figures as a JSON line while the run goes on")
    parser.add_argument("--compares", default="", metavar="TEXT",
                        help="what the two checkouts are, one line for the records' index")
    parser.add_argument("--only", metavar="ID[,ID]", help="only these prompts of the dataset")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each prompt (each recorded)")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="each side's rounds as its events say (DIR/old-rounds.jsonl, "
                             "new-rounds.jsonl, summed up at the end) and, in checkouts with "
                             "round_trace.py, a round trace (DIR/old.jsonl: `dflash-local trace`)")
    args = parser.parse_args()
    if args.repeats < 1:  # before two checkouts load: 0 would end in a division by zero
        sys.exit(f"--repeats must be >= 1, got {args.repeats}")
    if args.block_size != "auto" and not (args.block_size.isdigit() and int(args.block_size) >= 1):
        sys.exit(f"--block-size must be auto or an integer >= 1, got {args.block_size!r}")
    if args.from_run and args.record is None:
        sys.exit("--from-run adds runs to a record: name it with --record")
    if not args.from_run and (args.old is None or args.new is None):
        sys.exit("name the two checkouts OLD NEW (or --from-run RUN.json with --record)")
    return args


def _prompts(args: argparse.Namespace) -> list:
    from dflash_local.bench.datasets import load_prompts

    prompts = load_prompts(args.dataset, args.samples)
    if args.only:
        wanted = args.only.split(",")
        prompts = [p for p in prompts if p.prompt_id in wanted]
        if len(prompts) != len(wanted):
            sys.exit(f"--only {args.only}: not all among the first {args.samples} of {args.dataset}")
    return prompts * args.repeats


def _drafters(args: argparse.Namespace) -> dict[str, Path]:
    """Each side's drafter: one checkout's shipped drafter for both, or each its own."""
    checkouts = {"old": args.old.resolve(), "new": args.new.resolve()}
    owner = {side: side if args.drafter == "own" else args.drafter for side in checkouts}
    return {side: checkouts[owner[side]] / DRAFTER for side in checkouts}


def _interleave(workers: dict, prompts: list, args: argparse.Namespace) -> list[dict]:
    """Every prompt on both sides, the first side alternating (old new, new old, ...)."""
    rows = []
    for index, prompt in enumerate(prompts):
        order = ["old", "new"] if index % 2 == 0 else ["new", "old"]
        runs = {side: workers[side].run(prompt.turns[0], args.max_tokens, args.block_size,
                                        f"{prompt.prompt_id} | {side}")
                for side in order}
        if args.drafter != "own" and runs["old"]["tokens"] != runs["new"]["tokens"]:
            sys.exit(f"{prompt.prompt_id}: the two checkouts' outputs differ")
        row = {"prompt": prompt.prompt_id, "first": order[0], "load_average": machine_load.load_average(),
               **{side: {"tokens": len(run["tokens"]) - 1, "decode_s": round(run["decode_s"], 4),
                         "tau": run["tau"]} for side, run in runs.items()}}
        rows.append(row)
        if args.trace is not None:
            _keep_rounds(args.trace, prompt.prompt_id, runs)
        if args.log is not None:
            with args.log.open("a") as log:
                log.write(json.dumps({"dataset": args.dataset, "engine": args.engine,
                                      "drafter": args.drafter, "block_size": args.block_size,
                                      **row}) + "\n")
        print(f"[{index + 1}/{len(prompts)}] {prompt.prompt_id}: "
              + ", ".join(f"{side} {row[side]['tokens'] / row[side]['decode_s']:.1f} tok/s" for side in order),
              flush=True)
    return rows


ROUND_FIELDS = ("mode", "width", "drafted", "draft_depth", "accepted", "lookup_accepted")


def _keep_rounds(trace: Path, prompt_id: str, runs: dict) -> None:
    """Each side's rounds as its events told them (any checkout's): DIR/<side>-rounds.jsonl."""
    for side, run in runs.items():
        with (trace / f"{side}-rounds.jsonl").open("a") as out:
            out.write(json.dumps({"prompt": prompt_id, "rounds": run["rounds"]}) + "\n")


def round_kinds(lines: list[dict]) -> dict[str, dict]:
    """Rounds by kind, "mode xWIDTH" (+ " tree" where more was drafted than one path holds): how
    many, and the drafts kept per round, over a side's -rounds.jsonl lines."""
    kinds: dict[str, list[int]] = {}
    for line in lines:
        for fields in line["rounds"]:
            event = dict(zip(ROUND_FIELDS, fields))
            tree = " tree" if event["drafted"] > event["draft_depth"] else ""
            kinds.setdefault(f"{event['mode']} x{event['width']}{tree}", []).append(event["accepted"])
    return {kind: {"rounds": len(kept), "kept": round(sum(kept) / len(kept), 2)}
            for kind, kept in sorted(kinds.items())}


def _record(args: argparse.Namespace, rows: list[dict], machine: dict) -> dict:
    sides = ("old", "new")
    speeds = {side: sum(r[side]["tokens"] for r in rows) / sum(r[side]["decode_s"] for r in rows)
              for side in sides}
    loads = [r["load_average"] for r in rows if r["load_average"] is not None]
    return {
        "title": f"Before and after a change, {args.engine}, block size {args.block_size}",
        "compares": args.compares or f"{args.old.name} against {args.new.name} ({args.engine}, {args.dataset})",
        "machine": {**machine, "load_average_during": [min(loads), max(loads)] if loads else None},
        "command": " ".join([*(f"{name}={os.environ[name]}" for name in PINS if name in os.environ),
                             "scripts/ab_commits.py", *map(shlex.quote, sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"), "engine": args.engine, "dataset": args.dataset,
        "drafter": args.drafter, "block_size": args.block_size, "samples": len(rows),
        "max_tokens": args.max_tokens,
        "identical": len(rows) if args.drafter != "own" else None,
        "tokens_per_s": {side: round(speed, 2) for side, speed in speeds.items()},
        "mean_tau": {side: round(sum(r[side]["tau"] for r in rows) / len(rows), 3) for side in sides},
        "new_over_old": round(speeds["new"] / speeds["old"], 4),
        "new_over_old_95": ratio_interval(rows), "prompts": rows,
    }


def ratio_interval(rows: list[dict], resamples: int = 2000) -> list[float]:
    """A 95% bootstrap interval of new/old over these prompts (resampled with replacement): on a
    busy machine one prompt's ratio swings widely, and this says how far the total may."""
    import random

    chooser = random.Random(0)  # the same interval for the same figures
    ratios = []
    for _ in range(resamples):
        picked = chooser.choices(rows, k=len(rows))
        speed = {side: sum(r[side]["tokens"] for r in picked) / sum(r[side]["decode_s"] for r in picked)
                 for side in ("old", "new")}
        ratios.append(speed["new"] / speed["old"])
    ratios.sort()
    return [round(ratios[int(0.025 * resamples)], 3), round(ratios[int(0.975 * resamples) - 1], 3)]


ENGINE_LABELS = {"mlx": "MLX", "transformers": "Transformers"}
DRAFTER_WORDS = {"new": "the newer checkout's drafter", "old": "the older checkout's drafter",
                 "own": "each its own drafter"}
COLUMNS = [("old", "older (tok/s)", 1), ("new", "newer (tok/s)", 1), ("ratio", "newer / older", 3),
           ("interval", "95% interval", 0),
           ("tau_old", "τ older", 2), ("tau_new", "τ newer", 2), ("identical", "identical", 0),
           ("load", "load average", 0)]


def add_to_record(path: Path, run: dict, compares: str = "", analysis: str | None = None) -> dict:
    """Put one run (an --out file's figures) into the docs/records/ record at `path` (made if
    absent, saying it `compares` that, else what the run compared) as the row of its engine,
    dataset and drafter, replacing that row if present."""
    from dflash_local.bench.report import write_record

    record = json.loads(path.read_text()) if path.exists() else {
        "title": f"Before and after, interleaved: {compares or run['compares']}",
        "compares": compares or run["compares"],
        "measured": " ".join(__doc__.split("\n\n")[2].split()),
        "command": [], "date": run["date"], "settings": {
            "pair": "embedded target + a shipped drafter", "temperature": 0,
            "block_size": "auto", "max_tokens": run["max_tokens"]},
        "row_header": "engine, set, drafter", "source": "scripts/ab_commits.py", "rows": [],
        "columns": [{"key": key, "label": label, "decimals": decimals}
                    for key, label, decimals in COLUMNS]}
    loads = run["machine"].get("load_average_during")
    drafter = ("plain decoding" if run.get("block_size") == "1" else DRAFTER_WORDS[run["drafter"]])
    label = f"{ENGINE_LABELS[run['engine']]}, {run['dataset']}, {drafter}"
    row = {"label": label, "old": run["tokens_per_s"]["old"], "new": run["tokens_per_s"]["new"],
           "ratio": round(run["new_over_old"], 3),
           "interval": "{:.3f}-{:.3f}".format(*run["new_over_old_95"]) if "new_over_old_95" in run else "",
           "tau_old": round(run["mean_tau"]["old"], 2),
           "tau_new": round(run["mean_tau"]["new"], 2),
           "identical": f"{run['identical']}/{run['samples']}" if run["identical"] else "not compared",
           "load": f"{loads[0]:.1f}-{loads[1]:.1f}" if loads else ""}
    record["rows"] = sorted([r for r in record["rows"] if r["label"] != label] + [row],
                            key=lambda r: r["label"])
    record["command"] = sorted({*record["command"], run["command"]})
    record["engine"] = ", ".join(sorted({r["label"].split(",")[0] for r in record["rows"]}))
    record["dataset"] = ", ".join(sorted({r["label"].split(", ")[1] for r in record["rows"]}))
    record["date"] = max(record["date"], run["date"])
    if analysis:
        record["analysis"] = analysis
    machine = {key: value for key, value in run["machine"].items() if key != "load_average_during"}
    return write_record(path, record, machine=machine, setting="load average per row")


def main() -> int:
    args = _parse_args()
    if args.from_run:
        for run in args.from_run:
            add_to_record(args.record, json.loads(run.read_text()), args.compares, args.analysis)
        return 0
    prompts = _prompts(args)
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
    drafters = _drafters(args)
    workers = {side: Worker(path.resolve(), args.engine, drafters[side],
                            args.trace / f"{side}.jsonl" if args.trace else None)
               for side, path in (("old", args.old), ("new", args.new))}
    machine = describe_engine(args.engine)  # at the start: the end's load average would include the last prompt only
    rows = _interleave(workers, prompts, args)
    for worker in workers.values():
        worker.close()
    record = _record(args, rows, machine)
    print(json.dumps(record, indent=1))
    if args.trace is not None:
        for side in ("old", "new"):
            lines = [json.loads(line) for line in (args.trace / f"{side}-rounds.jsonl").open()]
            print(side, json.dumps(round_kinds(lines)))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    if args.record is not None:
        add_to_record(args.record, record, args.compares, args.analysis)
    return 0


if __name__ == "__main__":
    sys.exit(main())
