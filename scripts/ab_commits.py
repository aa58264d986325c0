"""Two checkouts of this repo side by side on one engine: the same prompts, interleaved per prompt.

    .venv/bin/python scripts/ab_commits.py OLD_DIR NEW_DIR [--engine mlx|transformers]
        [--dataset embedded] [--samples 30] [--only ID,ID] [--repeats N] [--max-tokens 128]
        [--trace DIR] [--out docs/records/NAME.json]

Each checkout runs in a worker process of its own (PYTHONPATH=DIR), which loads the embedded
target and NEW_DIR's drafter once (one drafter path: the calibration cache's key names it),
calibrates as the CLI does, then decodes each prompt greedily with block size auto when asked.
The second worker reads the first one's calibration when both measure the same way, so both
plan rounds from the same costs and the comparison is of the code alone. The order of the two alternates from prompt to prompt, so a machine's drift hits both
alike. Every run must equal the other checkout's token for token. Reports decode tokens/s of
each (total tokens over total decode time) and new/old; make a checkout with
`git worktree add --detach DIR COMMIT`.
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

PINS = ("DFLASH_BLAS_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")  # recorded in the command

# the worker runs in the checkout's own code: only what both the old and the new API offer
WORKER = r"""
import json, sys
from dflash_local import events
from dflash_local.engines import load_engine
import importlib.util
if importlib.util.find_spec("dflash_local.pairs"):  # the layout with method/, pairs/, typed options
    from dflash_local.engines.options import EngineOptions
    from dflash_local.pairs.default_pair import pair_names
    options, trace_module = {"options": EngineOptions(dtype="auto")}, "dflash_local.method.round_trace"
else:  # before it: modules at the package's root, options as keywords
    from dflash_local.cli import pair_names
    options, trace_module = {"dtype": "auto"}, "dflash_local.round_trace"
auto = events.AUTO if hasattr(events, "AUTO") else "auto"
target, _ = pair_names(None, None, speculative=True)
engine = load_engine(sys.argv[1], target, sys.argv[2], **options)
engine.prepare(auto)
if len(sys.argv) > 3:  # a round trace, where the checkout has one
    import importlib
    engine.round_trace = importlib.import_module(trace_module).RoundTrace(sys.argv[3])
print(json.dumps({"ready": engine.name}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if engine.__dict__.get("round_trace") is not None:
        engine.round_trace.label = request["label"]
    ids = engine.encode_chat([{"role": "user", "content": request["prompt"]}])
    params = events.GenerationParams(max_tokens=request["max_tokens"], block_size=auto)
    stats, tokens = events.GenerationStats(), []
    for event in engine.stream(ids, params):
        stats.add(event)
        tokens.extend(event.token_ids)
    print(json.dumps({"tokens": tokens, "decode_s": stats.decode_s, "tau": stats.tau}), flush=True)
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

    def run(self, prompt: str, max_tokens: int, label: str = "") -> dict:
        request = {"prompt": prompt, "max_tokens": max_tokens, "label": label}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def _machine() -> str:
    """The CPU model and core count: a cross-day comparison needs the machine named."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    return f"{os.cpu_count()} cores, {model}; load {os.getloadavg()[0]:.1f} at the end"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--engine", choices=["mlx", "transformers"], default="mlx")
    parser.add_argument("--dataset", default="embedded", help="a bench dataset (default: embedded)")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compares", default="", metavar="TEXT",
                        help="what the two checkouts are, one line for the records' index")
    parser.add_argument("--only", metavar="ID[,ID]", help="only these prompts of the dataset")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each prompt (each recorded)")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="a round trace per side, DIR/old.jsonl and DIR/new.jsonl "
                             "(checkouts with round_trace.py; `dflash-local trace` sums each up)")
    args = parser.parse_args()
    if args.repeats < 1:  # before two checkouts load: 0 would end in a division by zero
        sys.exit(f"--repeats must be >= 1, got {args.repeats}")
    from dflash_local.bench.datasets import load_prompts

    prompts = load_prompts(args.dataset, args.samples)
    if args.only:
        wanted = args.only.split(",")
        prompts = [p for p in prompts if p.prompt_id in wanted]
        if len(prompts) != len(wanted):
            sys.exit(f"--only {args.only}: not all among the first {args.samples} of {args.dataset}")
    prompts = prompts * args.repeats
    drafter = args.new.resolve() / "models" / "smollm2-135m-dflash"
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
    workers = {side: Worker(path.resolve(), args.engine, drafter,
                            args.trace / f"{side}.jsonl" if args.trace else None)
               for side, path in (("old", args.old), ("new", args.new))}
    totals = {side: {"tokens": 0, "decode_s": 0.0, "taus": []} for side in workers}
    for index, prompt in enumerate(prompts):
        order = ["old", "new"] if index % 2 == 0 else ["new", "old"]
        runs = {side: workers[side].run(prompt.turns[0], args.max_tokens, f"{prompt.prompt_id} | {side}")
                for side in order}
        if runs["old"]["tokens"] != runs["new"]["tokens"]:
            sys.exit(f"{prompt.prompt_id}: the two checkouts' outputs differ")
        for side, run in runs.items():
            totals[side]["tokens"] += len(run["tokens"]) - 1
            totals[side]["decode_s"] += run["decode_s"]
            totals[side]["taus"].append(run["tau"])
        print(f"[{index + 1}/{len(prompts)}] {prompt.prompt_id}: "
              + ", ".join(f"{side} {(len(r['tokens']) - 1) / r['decode_s']:.1f} tok/s" for side, r in runs.items()),
              flush=True)
    for worker in workers.values():
        worker.close()
    speeds = {side: t["tokens"] / t["decode_s"] for side, t in totals.items()}
    record = {
        "title": f"Before and after a change, {args.engine}, block size auto",
        "compares": args.compares or f"{args.old.name} against {args.new.name} ({args.engine}, {args.dataset})",
        "machine": _machine(),
        "command": " ".join([*(f"{name}={os.environ[name]}" for name in PINS if name in os.environ),
                             "scripts/ab_commits.py", *map(shlex.quote, sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"), "engine": args.engine, "dataset": args.dataset,
        "samples": len(prompts),
        "max_tokens": args.max_tokens, "identical": len(prompts),
        "tokens_per_s": {side: round(speed, 2) for side, speed in speeds.items()},
        "mean_tau": {side: round(sum(t["taus"]) / len(t["taus"]), 3) for side, t in totals.items()},
        "new_over_old": round(speeds["new"] / speeds["old"], 4),
    }
    print(json.dumps(record, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
